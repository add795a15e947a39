"""The report machinery of `anchorkv bench` (`benchmarks.run`) and the math of the fidelity
study (fast, CPU)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import anchorkv.bench
from benchmarks import run as bench
from benchmarks.fidelity import DECAYS, LOGIT_STDS, choose, choose_presets, data, fla_ref, layers, presets
from benchmarks.fidelity.presets import FIELDS, condition
from benchmarks.fidelity.study import StudyConfig, round_trip, run_study
from benchmarks.machine import session_env
from benchmarks.reporting import finite

pytest.importorskip("matplotlib")


# ----------------------------------------------------------------------------- report


def _bench(name: str, median: float, **info) -> dict:
    return {"name": name, "group": None, "params": None, "median_s": median, "mean_s": median,
            "stddev_s": 0.0, "min_s": median, "rounds": 1, "extra_info": info}


def _field(field: str, codec: str, op: str) -> dict:
    return _bench(f"test_field[{op}-{field}-{codec}-1]", 0.002, field=field, codec=codec, op=op,
                  tp=1, bytes_raw=2_000_000, bytes_packed=1_000_000, gbs=1.5, copy_gbs=30.0,
                  ratio_to_copy=0.05)


def _scaling(tokens: int, op: str) -> dict:
    return _bench(f"test_scaling[{op}-{tokens}]", 0.01 + tokens * 1e-6, op=op, tokens=tokens,
                  bytes_raw=tokens * 8000, gbs=2.0, copy_gbs=30.0, ratio_to_copy=0.07)


def _kernel(op: str, provider: str) -> dict:
    return _bench(f"test_kimi_request[{op}-{provider}-4]", 0.05, op=op, provider=provider, tp=4,
                  backend="reference", source_bytes=27_000_000, packed_bytes=11_000_000,
                  gbps=0.7, copy_gbps=30.0, ratio_vs_copy=0.023)


@pytest.fixture(scope="module")
def fidelity() -> dict:
    """The whole study at toy sizes (every condition, codec and field still goes through it)."""
    return finite(run_study(StudyConfig.tiny()))


@pytest.fixture
def result(fidelity) -> dict:
    codec = [_field("latent", c, op) for c in ("raw", "fp8:64") for op in ("pack", "unpack")]
    codec += [_scaling(t, op) for t in (1920, 3840, 7680) for op in ("pack", "unpack")]
    return {
        "machine": "test-machine", "device": {"cores": 2, "torch": torch.__version__},
        "mode": "tiny", "created": "2000-01-01T00:00:00+00:00", "command": "anchorkv bench --tiny",
        "seconds": 1.0, "fidelity": fidelity, "defaults": fidelity["defaults"],
        "suites": {
            "codec": {"status": "ok", "returncode": 0, "seconds": 1.0, "benchmarks": codec},
            "kernels": {"status": "ok", "returncode": 0, "seconds": 1.0,
                        "benchmarks": [_kernel(op, p) for op in ("pack", "unpack") for p in ("ours", "copy")]},
            "store": {"status": "missing", "returncode": None, "seconds": 0.0,
                      "file": "benchmarks/bench_store.py"},
        },
    }


def test_write_report_makes_json_md_png(tmp_path, result):
    result["suites"]["codec"]["benchmarks"][0]["extra_info"]["sqnr_db"] = math.inf  # raw: exact
    result["fidelity"]["runtime_s"] = math.nan
    paths = bench.write_report(result, tmp_path)
    assert {p.name for p in paths.values()} == {"test-machine.json", "test-machine.md", "test-machine.png"}
    data = json.loads(paths["json"].read_text())  # strict JSON: no NaN/inf literals
    assert data["suites"]["store"]["status"] == "missing"
    assert set(data["scaling_fit"]) == {"pack", "unpack"}
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["png"].stat().st_size > 10_000


def test_markdown_has_every_row(result):
    result["scaling_fit"] = bench.scaling_fit(result["suites"]["codec"]["benchmarks"])
    md = bench.render_markdown(result)
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    fid = result["fidelity"]
    computed = {(r["field"], r["codec"], condition(r)) for r in fid["rows"] if r["field"] in FIELDS}
    assert len(computed) > 200  # every field x codec x condition of the study
    for field, codec, cond in computed:
        assert any(line.startswith(f"| {field} | {codec} | {cond} | ") for line in rows), (field, codec, cond)
    for name, summary in fid["summary"].items():  # the worst case per field and codec
        for r in summary:
            where = r["where_max"] if r["cont_err_max"] else "| - |"
            assert any(line.startswith(f"| {name} | ") and r["codec"] in line and where in line for line in rows)
    for e in fid["preset_eval"]:  # each shipped lossy preset in each condition
        assert any(line.startswith(f"| `{e['preset']}` | {e['fields']} | {e['condition']} | ") for line in rows)
    assert {e["preset"] for e in fid["preset_eval"]} == set(fid["preset_groups"])  # "compact = smallest"
    assert "equalized queries" in md and "logit std 6" in md and "slow decay" in md and "gdn" in md
    assert sum(line.startswith("| latent | 1 | ") for line in rows) == 4  # codec throughput rows
    assert sum(line.startswith(("| 1920 |", "| 3840 |", "| 7680 |")) for line in rows) == 6
    assert sum(line.startswith(("| pack | 4 |", "| unpack | 4 |")) for line in rows) == 4
    assert "Suite `store` MISSING" in md
    assert "- pack: t = " in md  # the linear fit of the scaling runs
    assert "| `store` | **MISSING** |" in md


def test_run_fidelity_brings_back_the_study_s_markdown():
    """`anchorkv bench` runs the study in a subprocess and embeds its markdown in the report."""
    res = bench.run_fidelity(Path(__file__).resolve().parents[1], quick=False, tiny=True)
    assert res["returncode"] == 0, res.get("log_tail")
    assert res["markdown"][0] == "## Fidelity" and res["presets"]["exact"]["recurrent"] == "raw"
    md = bench.render_markdown({"machine": "m", "created": "-", "mode": "tiny", "device": {}, "command": "c",
                                "seconds": 1.0, "suites": {}, "fidelity": res})
    assert "### Every row" in md and "Reproduce: `python -m benchmarks.fidelity --tiny`" in md


def test_missing_suite_is_reported_not_raised(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    out = bench.run_suites(tmp_path, quick=True, k=None, suites=("store",))
    assert out["store"]["status"] == "missing"


def test_a_suite_started_from_an_xdist_worker_still_benchmarks(monkeypatch):
    """Run from a test under `pytest -n` (`test_gpu_validate`'s quick run, `anchorkv bench` in a
    test), a suite's pytest would inherit the worker's PYTEST_XDIST_* variables, and
    pytest-benchmark then disables every benchmark of it: no results, the suite failed."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    env = session_env(PYTHONPATH="x")
    assert not [k for k in env if k.startswith("PYTEST_XDIST_")] and env["PYTHONPATH"] == "x"
    out = bench.run_suites(Path(__file__).resolve().parents[1], quick=True, k="test_field and 1-conv-raw-pack",
                           suites=("codec",))
    assert out["codec"]["status"] == "ok" and len(out["codec"]["benchmarks"]) == 1, out["codec"].get("log_tail")


def test_anchorkv_bench_runs_benchmarks_run_under_its_name():
    """`anchorkv bench ARGS` is `python -m benchmarks.run ARGS` in the checkout, named `anchorkv bench`."""
    out = subprocess.run([sys.executable, "-m", "anchorkv", "bench", "--help"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: anchorkv bench [-h] [--quick] [--out OUT]") and "--no-fidelity" in out.stdout


def test_anchorkv_bench_without_a_checkout_says_what_to_do(tmp_path, monkeypatch):
    """Installed from a wheel (no benchmarks/ beside the package, none in the current directory)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(anchorkv.bench, "__file__", str(tmp_path / "site-packages" / "anchorkv" / "bench.py"))
    with pytest.raises(SystemExit) as e:
        anchorkv.bench.find_checkout()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("anchorkv bench needs a source checkout") and "pip install -e ." in msg


# ----------------------------------------------------------------------------- fidelity math


def _inputs(T=7, H=2, D=5, seed=0, per_channel=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(T, H, D, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, D, generator=g), dim=-1)
    v = torch.randn(T, H, D, generator=g)
    gate = -torch.rand((T, H, D) if per_channel else (T, H), generator=g)  # log decay < 0
    beta = torch.rand(T, H, generator=g)
    S0 = torch.randn(H, D, D, generator=g)
    return S0, q, k, v, gate, beta


@pytest.mark.parametrize("kind", layers.KINDS)
def test_fla_recurrence_matches_the_published_formula(kind):
    """fla-core's naive recurrences (what the study runs) against the gated delta rule taken
    literally: KDA with a decay per key channel, Gated DeltaNet with one per head."""
    S0, q, k, v, gate, beta = _inputs(per_channel=kind == "kda")
    if kind == "kda":
        out, S = fla_ref.naive_recurrent_kda(q[None], k[None], v[None], gate[None], beta[None],
                                             initial_state=S0[None], output_final_state=True)
    else:
        out, S = fla_ref.naive_recurrent_gated_delta_rule(q[None], k[None], v[None], beta[None], gate[None],
                                                          initial_state=S0[None], output_final_state=True)
    ref_out, ref_S = layers.delta_rule_matrix_form(S0, q, k, v, gate, beta)
    torch.testing.assert_close(out[0].double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S[0].double(), ref_S, rtol=1e-5, atol=1e-5)
    assert fla_ref.version() == fla_ref.FLA_VERSION


@pytest.mark.parametrize("kind", layers.KINDS)
@pytest.mark.parametrize("inputs", data.LAYER_INPUTS)
def test_layer_continues_from_its_state(kind, inputs):
    """Running 9 tokens equals running 5, taking the state (conv and recurrent), and running 4:
    the state the study round-trips is all a continuation needs."""
    g = torch.Generator().manual_seed(4)
    p = layers.LayerParams.random(kind, 2, 8, g)
    inp = data.layer_inputs(inputs, 9, 2, 8, kind, g)
    has_conv = "x" in inp
    full, S_full = layers.run(p, inp, layers.empty_state(2, 8, conv=has_conv))
    a, mid = layers.run(p, {k: v[:5] for k, v in inp.items()}, layers.empty_state(2, 8, conv=has_conv))
    b, S_b = layers.run(p, {k: v[5:] for k, v in inp.items()}, mid)
    torch.testing.assert_close(torch.cat([a, b], dim=1), full)
    torch.testing.assert_close(S_b.recurrent, S_full.recurrent)
    if has_conv:  # the conv state is the last 3 projections (bf16 already: held exactly)
        assert torch.equal(mid.conv[0].float(), inp["x"][2:5])


def test_batched_variants_equal_single_runs():
    """The study continues every codec's state in one batch: each must equal its own run."""
    g = torch.Generator().manual_seed(2)
    p = layers.LayerParams.random("kda", 2, 8, g)
    inp = data.layer_inputs("conv", 6, 2, 8, "kda", g)
    states = [layers.LayerState(torch.randn(1, 3, 3, 16, generator=g).bfloat16(), torch.randn(1, 2, 8, 8, generator=g))
              for _ in range(3)]
    batch = layers.LayerState(torch.cat([s.conv for s in states]), torch.cat([s.recurrent for s in states]))
    out, _ = layers.run(p, inp, batch)
    for i, s in enumerate(states):
        one, _ = layers.run(p, inp, s)
        torch.testing.assert_close(out[i], one[0], rtol=1e-6, atol=1e-6)


def test_short_conv_state_continues_the_sequence():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(10, 3, 6, generator=g), torch.randn(3, 6, layers.CONV_KERNEL, generator=g)
    zero = torch.zeros(1, layers.CONV_KERNEL - 1, 3, 6)
    full, _ = layers.short_conv(x, zero, w)
    a, state = layers.short_conv(x[:6], zero, w)
    b, _ = layers.short_conv(x[6:], state, w)
    torch.testing.assert_close(torch.cat([a, b], dim=1), full)
    assert torch.equal(state[0], x[3:6])


@pytest.mark.parametrize("kind", layers.KINDS)
@pytest.mark.parametrize("decay", sorted(DECAYS))
def test_decay_regimes_hit_their_median(kind, decay):
    g = torch.Generator().manual_seed(0)
    p = layers.LayerParams.random(kind, 4, 16, g)
    inp = data.layer_inputs("conv", 256, 4, 16, kind, g)
    p = p.calibrate(inp["gate_in"], DECAYS[decay])
    a = layers.gate(inp["gate_in"], p).exp()
    assert 0 < a.min() and a.max() < 1
    assert a.median().item() == pytest.approx(DECAYS[decay], abs=1e-4)
    assert 0 < torch.sigmoid(inp["beta_in"]).min() and torch.sigmoid(inp["beta_in"]).max() < 1


@pytest.mark.parametrize("kind,shape", [("kda", (5, 3, 8)), ("gdn", (5, 3))])
def test_gates_are_fla_s_gates_and_the_formula(kind, shape):
    """The study's gates are fla's `naive_kda_gate` / `naive_gdn_gate`, compiled from fla's
    source (`fla_ref.naive_gate`): they must be fla-core 0.6.0's and equal the published formula."""
    g = torch.Generator().manual_seed(8)
    p = layers.LayerParams.random(kind, 3, 8, g)
    x = torch.randn(shape, generator=g)
    want = -p.A_log.exp().reshape(3, *([1] * (len(shape) - 2))) * torch.nn.functional.softplus(x + p.dt_bias)
    torch.testing.assert_close(layers.gate(x, p), want)
    assert fla_ref.naive_gate(kind).__name__ == {"kda": "naive_kda_gate", "gdn": "naive_gdn_gate"}[kind]


def test_latent_models_with_and_without_outliers():
    g = torch.Generator().manual_seed(0)
    for model in data.LATENT_INPUTS:
        cache, gamma = data.mla_latent(64, g, model=model)
        assert cache.shape == (64, 576) and cache.dtype == torch.bfloat16
        assert (gamma.max() / gamma.median() > 8) == (model == "outliers"), model


def test_raw_codec_is_exact_and_lossy_codecs_are_not(fidelity):
    for name, rows in fidelity["summary"].items():
        raw = next(r for r in rows if r["codec"] == "raw")
        assert raw["cont_err_max"] == 0.0 and raw["max_rel_err"] == 0.0 and raw["sqnr_db"] == "inf", name
        assert raw["level"] == "exact"
        lossy = [r for r in rows if r["codec"] != "raw"]
        assert lossy and all(r["cont_err_max"] > 0 for r in lossy), name
    assert {r["codec"] for r in fidelity["summary"]["recurrent"]} >= {"raw", "bf16"}


def test_every_condition_and_first_step_is_reported(fidelity):
    rows = fidelity["rows"]
    kinds = {(r["kind"], r.get("decay"), r["inputs"]) for r in rows if r["field"] == "recurrent"}
    assert kinds == {(k, d, i) for k in layers.KINDS for d in DECAYS for i in data.LAYER_INPUTS}
    conv = {(r["kind"], r["inputs"]) for r in rows if r["field"] == "conv"}
    assert {i for _, i in conv} == {"conv", "outliers"}  # gaussian q/k/v bypass the conv
    latent = {(r["inputs"], r["logit_std"], r["queries"]) for r in rows if r["field"] == "latent"}
    assert latent == {(i, s, q) for i in data.LATENT_INPUTS for s in LOGIT_STDS for q in ("isotropic", "equalized")}
    assert all(0 <= r["cont_err_first"] <= r["cont_err_max"] for r in rows)


def test_round_trip_counts_payload_and_scales():
    x = torch.randn(4, 128)
    _, nbytes = round_trip(x, "int8:64")
    assert nbytes == 4 * 128 + 4 * 2 * 4  # one byte per value + one fp32 scale per group
    y, nbytes = round_trip(x, "raw")
    assert torch.equal(x, y) and nbytes == x.numel() * 4
    y, nbytes = round_trip(x, "bf16")
    assert torch.equal(y, x.bfloat16().float()) and nbytes == x.numel() * 2


def _summary_row(codec, bits, mean, step):
    return {"codec": codec, "bits_per_value": bits, "cont_err_mean": mean, "cont_err_max": step}


def test_choose_is_the_smallest_codec_within_the_bounds():
    rows = [
        _summary_row("raw", 16.0, 0.0, 0.0), _summary_row("fp8:64", 8.5, 5e-3, 2e-2),
        _summary_row("int8:64", 8.5, 4e-3, 2e-2), _summary_row("int4:64", 5.0, 5e-3, 0.2),
    ]
    assert choose(rows, 1e-2, 5e-2)["codec"] == "int8:64"  # int4 fails the step bound; tie -> lower error
    assert choose(rows, 1e-3, 5e-3)["codec"] == "raw"
    assert choose(rows[1:], 1e-3, 5e-3) is None


def test_presets_judge_the_worst_condition_not_one():
    """A codec that is fine in every condition but one (here one seed of one decay regime) is
    not chosen: the rule takes the worst case."""
    def row(codec, mean, step, seed, decay, bits):
        return {"kind": "kda", "decay": decay, "inputs": "conv", "seed": seed, "field": "recurrent",
                "codec": codec, "orientation": None, "bits_per_value": bits, "size_ratio": bits / 32,
                "sqnr_db": 30.0, "max_rel_err": 0.1, "cont_err_first": step, "cont_err_mean": mean,
                "cont_err_max": step}
    rows = [row("raw", 0.0, 0.0, s, d, 32) for s in (0, 1) for d in DECAYS]
    rows += [row("fp8:128", 1e-3, 1e-2, s, d, 8.25) for s in (0, 1) for d in DECAYS]
    rows[-1] = row("fp8:128", 2e-2, 9e-2, 1, "slow", 8.25)
    rows += [row("bf16", 5e-4, 1e-3, s, d, 16) for s in (0, 1) for d in DECAYS]
    summary = presets.summarize(rows)
    chosen = choose_presets(summary)
    assert chosen["smallest"]["recurrent"] == "bf16" and chosen["compact"]["recurrent"] == "bf16"
    fp8 = next(r for r in summary["recurrent"] if r["codec"] == "fp8:128")
    assert fp8["level"] == "fails" and "slow decay" in fp8["where_max"] and "seed 1" in fp8["where_max"]


def test_shipped_presets_are_the_rule_s_choice_on_the_recorded_study():
    """`anchorkv.connector.config.PRESETS` is what the rule picked on the full study recorded in
    benchmarks/results/fidelity.json (rerun `python -m benchmarks.fidelity --json ... --md ...`
    and update both together)."""
    from pathlib import Path

    from anchorkv.connector.config import DEFAULT_CODECS, PRESETS

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    recorded = json.loads((results / "fidelity.json").read_text())
    assert recorded["config"]["seeds"] == [0, 1, 2] and recorded["config"]["prefix"] >= 1024
    from anchorkv.connector.config import KIMI_FIELD_ROLES, field_codecs

    shipped = {name: field_codecs(p, KIMI_FIELD_ROLES) for name, p in PRESETS.items()}  # roles -> fields
    assert recorded["presets"] == shipped and recorded["presets_match_shipped"]
    assert PRESETS["exact"] == DEFAULT_CODECS and set(DEFAULT_CODECS.values()) == {"raw"}


def test_host_path_runs_on_a_cpu_and_names_every_step(tmp_path):
    """`python -m benchmarks.host_path` (the launch path's host time, kernels stubbed) runs
    without a GPU and writes every step's time under the machine's name."""
    res = subprocess.run([sys.executable, "-m", "benchmarks.host_path", "--iters", "2", "--out", str(tmp_path)],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    [path] = tmp_path.glob("*-host-path.json")
    data = json.loads(path.read_text())
    steps = data["host_us_per_call"]
    assert set(steps) == {
        "kernels.pack_many", "kernels.pack_many: check the block ids", "kernels.pack_many: find the cached plan",
        "kernels.pack_many: plan.run (outputs, tables)", "kernels.PackSet.pack (the same items as fixed targets)",
        "kernels.PackSet.pack, cold (after 64 MB of other memory traffic)", "kernels.UnpackSet.unpack, cold",
        "kernels.unpack_many", "kernels.UnpackSet.unpack (the same items as fixed targets)",
        "codec.pack_many (quant codecs)", "WorkerSide._pack (quant codecs)", "WorkerSide._pack (quant codecs), cold",
        "WorkerSide.save + flush (quant codecs, a store that keeps nothing)", "WorkerSide.flush (nothing queued)",
        "restore: read into the worker's arena, sent as it lies (now)",
        "restore: read into the batch's spans (batch)",
        "restore, launch side: part by part (codec.unpack_many + zeroing)",
        "restore, launch side: one batch (Unpacker.unpack)",
        "restore: read into new tensors + copy into a warm staging buffer (before)",
        "A/B: PackSet.pack, one set-kernel launch", "A/B: PackSet.pack, one launch per signature (FUSED off)",
        "A/B: UnpackSet.unpack, one set-kernel launch",
        "A/B: UnpackSet.unpack, one launch per signature (FUSED off)"}
    assert all(math.isfinite(us) and us > 0 for us in steps.values()), steps
    assert steps["kernels.pack_many"] > steps["kernels.pack_many: check the block ids"]


@pytest.mark.parametrize("kind", ["raw", "quant"])
def test_a_stores_files_written_plainly_are_the_same_tree(tmp_path, kind):
    """`bench_store`'s `files-*` rows: `store_files` holds every file a store save leaves (its
    shards, the arrays' and the group's zarr.json) and `files_save` writes the same tree, byte
    for byte, as plain files."""
    from benchmarks.bench_store import files_save, request, store_files

    req = request(1920, ("paged",))
    files = store_files(req, tmp_path / "store", kind)
    names = [p.name for p, _ in files]
    assert names.count("zarr.json") >= 3 and len(files) >= 7 + 3, names  # 7 latent layers' shards
    if kind == "quant":
        assert any("scales" in str(p) for p, _ in files), "the quantized latent's scales shards are missing"
    files_save(files, tmp_path / "plain")
    again = sorted((p.relative_to(tmp_path / "plain"), p.read_bytes()) for p in (tmp_path / "plain").rglob("*")
                   if p.is_file())
    assert again == files


def test_store_puts_saves_one_put_at_a_time_and_several_to_s3():
    """`python -m benchmarks.store_puts` (a save's shard writes to moto on loopback, one at a
    time against the object backend's concurrency) runs without a GPU and prints a time per
    round for each."""
    from anchorkv.store.backends._object import ObjectBackend

    res = subprocess.run([sys.executable, "-m", "benchmarks.store_puts", "--rounds", "1", "--tokens", "1920"],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert [line.split(":")[1].strip() for line in lines] == [
        f"{n} put(s) at a time" for n in sorted({1, ObjectBackend.write_concurrency})], lines
    assert all(float(line.rsplit(":", 1)[1].split()[0]) > 0 for line in lines), lines


def test_restore_reads_runs_both_ways_on_a_local_store():
    """`python -m benchmarks.restore_reads` (a restore's reads, one thread against several)
    runs without a GPU and prints a time per round for each."""
    res = subprocess.run([sys.executable, "-m", "benchmarks.restore_reads", "--rounds", "1", "--tokens", "1920"],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    from anchorkv.connector.worker import READ_THREADS

    lines = res.stdout.strip().splitlines()
    assert [line.split(":")[1].strip() for line in lines] == [
        f"{n} read thread(s)" for n in sorted({1, READ_THREADS, 8})], lines
    assert all(float(line.rsplit(":", 1)[1].split()[0]) > 0 for line in lines), lines


def test_lookups_runs_on_a_local_store(tmp_path):
    """`python -m benchmarks.lookups` (exact against shared lookups) runs without a GPU, prints
    its four rows and writes them where `--out` says."""
    res = subprocess.run([sys.executable, "-m", "benchmarks.lookups", "--entries", "9", "--rounds", "2",
                          "--out", str(tmp_path)],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split(": ", 1)[1].rsplit(":", 1)[0] for line in res.stdout.splitlines() if " entries: " in line]
    assert rows == ["fresh store, exact", "warm store, exact", "fresh store, shared", "warm store, shared"]
    [path] = tmp_path.glob("*-lookups-local.json")
    data = json.loads(path.read_text())
    assert data["entries"] == 9 and all(v > 0 for v in data["median_ms"].values())


def test_store_crc_runs_and_compares_the_libraries(tmp_path):
    """`python -m benchmarks.store_crc` (google-crc32c inline against fastcrc inline and on a
    thread, and the crc32c package on a thread where installed) runs without a GPU and writes a
    row per library, codec set and op."""
    import importlib.util

    res = subprocess.run([sys.executable, "-m", "benchmarks.store_crc", "--rounds", "1", "--loads",
                          "--out", str(tmp_path)],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    [path] = tmp_path.glob("*-store-crc.json")
    rows = json.loads(path.read_text())["results"]
    libs = ["google-crc32c inline", "fastcrc inline", "fastcrc thread"]
    libs += ["crc32c thread"] if importlib.util.find_spec("crc32c") is not None else []
    want = {"plain save", "plain load"} | {f"{c} {op}, {lib}" for c in ("raw", "quant") for op in ("save", "load")
                                           for lib in libs}
    assert set(rows) == want
    assert all(r["median_ms"] > 0 and r["ratio_vs_plain"] > 0 for r in rows.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_set_calls_says_it_needs_cuda_in_one_line():
    """`python -m benchmarks.set_calls` (set calls back to back, launch-path variants; GPU only)
    refuses a machine without CUDA in one line, exit status 2, no traceback."""
    res = subprocess.run([sys.executable, "-m", "benchmarks.set_calls", "--rounds", "1"],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.strip() == "set_calls needs CUDA" and not res.stdout, res


# ----------------------------------------------------------------------------- recorded results


_RECORDING_MODULE = '''
import pytest
from pathlib import Path
from benchmarks.machine import results_path

@pytest.fixture(scope="module", autouse=True)
def _record(request):
    yield
    path = results_path(request, Path("results"), "m-x")
    path.parent.mkdir(exist_ok=True)
    path.write_text("rows")

def test_a():
    import os
    assert os.environ.get("FAIL_A") != "1"

def test_b():
    pass
'''


@pytest.mark.parametrize("select,recorded", [
    ((), "m-x.json"),  # the whole module: the recorded file
    (("-k", "test_a"), "m-x.partial.json"),  # some rows (-k) never replace it
    (("::test_b",), "m-x.partial.json"),  # nor does a node id
    (("-x", "FAIL_A"), "m-x.partial.json"),  # nor a run cut short by a failure (-x: b never ran)
])
def test_a_run_of_some_benchmarks_records_apart(tmp_path, select, recorded):
    """`benchmarks.machine.results_path`, with the benchmarks' conftest hooks that see what a
    run collects and finishes, run by pytest as a benchmark module is: a run of some
    of a module's benchmarks, or one cut short, writes `<name>.partial.json` (git ignores it),
    not the recorded `<name>.json` (a `-k warm` run once replaced bench_store's whole recorded
    run; `gpu_validate` interrupts a step out of time)."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "conftest.py").write_text(
        "from benchmarks.conftest import pytest_configure, pytest_itemcollected, pytest_runtest_logreport  # noqa\n")
    (tmp_path / "bench_m.py").write_text(_RECORDING_MODULE)
    fail = "FAIL_A" in select
    args = [a if not a.startswith("::") else "bench_m.py" + a for a in select if a != "FAIL_A"]
    target = [] if args and args[0].startswith("bench_m.py") else ["bench_m.py"]
    env = {**session_env(), "PYTHONPATH": str(root), "FAIL_A": "1" if fail else "0"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *target, *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == (1 if fail else 0), done.stdout + done.stderr
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == [recorded]
    assert "benchmarks/results/*.partial.json" in (root / ".gitignore").read_text().splitlines()
