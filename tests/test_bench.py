"""The report machinery of `anchorkv bench` and the math of the fidelity study (fast, CPU)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from anchorkv import bench
from benchmarks.fidelity import choose_default, data, kda
from benchmarks.fidelity.study import StudyConfig, finite, round_trip, run_study

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
    """The whole study at toy sizes (every codec and field still goes through it)."""
    cfg = StudyConfig(kda_heads=1, head_dim=32, kda_prefix=24, steps=6, mla_prefix=40, mla_heads=1,
                      synthetic_rows=2, synthetic_cols=64)
    return finite(run_study(cfg))


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
    for name, f in result["fidelity"]["fields"].items():
        for r in f["rows"]:
            assert any(line.startswith(f"| {name} | ") and r["codec"] in line for line in rows), (name, r["codec"])
    assert sum(line.startswith("| latent | 1 | ") for line in rows) == 4  # codec throughput rows
    assert sum(line.startswith(("| 1920 |", "| 3840 |", "| 7680 |")) for line in rows) == 6
    assert sum(line.startswith(("| pack | 4 |", "| unpack | 4 |")) for line in rows) == 4
    assert "Suite `store` MISSING" in md
    assert "- pack: t = " in md  # the linear fit of the scaling runs
    assert "| `store` | **MISSING** |" in md


def test_missing_suite_is_reported_not_raised(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    out = bench.run_suites(tmp_path, quick=True, k=None, suites=("store",))
    assert out["store"]["status"] == "missing"


# ----------------------------------------------------------------------------- fidelity math


def _inputs(T=7, H=2, D=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(T, H, D, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(T, H, D, generator=g), dim=-1)
    v = torch.randn(T, H, D, generator=g)
    gate = -torch.rand(T, H, D, generator=g)  # log decay < 0
    beta = torch.rand(T, H, generator=g)
    S0 = torch.randn(H, D, D, generator=g)
    return S0, q, k, v, gate, beta


def test_delta_rule_matches_the_published_formula():
    S0, q, k, v, gate, beta = _inputs()
    out, S = kda.delta_rule(S0, q, k, v, gate, beta)
    ref_out, ref_S = kda.delta_rule_matrix_form(S0, q, k, v, gate, beta)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S.double(), ref_S, rtol=1e-5, atol=1e-5)


def test_delta_rule_splits_at_any_step():
    S0, q, k, v, gate, beta = _inputs(T=9)
    full, S_full = kda.delta_rule(S0, q, k, v, gate, beta)
    a, S_a = kda.delta_rule(S0, q[:4], k[:4], v[:4], gate[:4], beta[:4])
    b, S_b = kda.delta_rule(S_a, q[4:], k[4:], v[4:], gate[4:], beta[4:])
    assert torch.equal(torch.cat([a, b]), full) and torch.equal(S_b, S_full)


def test_short_conv_state_continues_the_sequence():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(10, 3, 6, generator=g), torch.randn(3, 6, kda.CONV_KERNEL, generator=g)
    zero = torch.zeros(kda.CONV_KERNEL - 1, 3, 6)
    full, _ = kda.short_conv(x, zero, w)
    a, state = kda.short_conv(x[:6], zero, w)
    b, _ = kda.short_conv(x[6:], state, w)
    torch.testing.assert_close(torch.cat([a, b]), full)
    assert torch.equal(state, x[3:6])


def test_gates_and_beta_are_in_the_open_unit_interval():
    g = torch.Generator().manual_seed(0)
    p = kda.KDAParams.random(4, 16, g)
    inp = data.kda_projections(64, 4, 16, g)
    a = kda.kda_gate(inp["gate_in"], p).exp()
    assert 0 < a.min() and a.max() < 1
    beta = torch.sigmoid(inp["beta_in"])
    assert 0 < beta.min() and beta.max() < 1


def test_raw_codec_is_exact_and_lossy_codecs_are_not(fidelity):
    for name, f in fidelity["fields"].items():
        raw = next(r for r in f["rows"] if r["codec"] == "raw")
        assert raw["cont_err_max"] == 0.0 and raw["max_rel_err"] == 0.0 and raw["sqnr_db"] == "inf", name
        lossy = [r for r in f["rows"] if r["codec"] != "raw"]
        assert lossy and all(r["cont_err_max"] > 0 for r in lossy), name


def test_round_trip_counts_payload_and_scales():
    x = torch.randn(4, 128)
    _, nbytes = round_trip(x, "int8:64")
    assert nbytes == 4 * 128 + 4 * 2 * 4  # one byte per value + one fp32 scale per group
    y, nbytes = round_trip(x, "raw")
    assert torch.equal(x, y) and nbytes == x.numel() * 4


def test_choose_default_is_the_smallest_passing_codec():
    rows = [
        {"codec": "raw", "bits_per_value": 16.0, "cont_err_mean": 0.0, "cont_err_max": 0.0},
        {"codec": "fp8:64", "bits_per_value": 8.5, "cont_err_mean": 5e-3, "cont_err_max": 2e-2},
        {"codec": "int8:64", "bits_per_value": 8.5, "cont_err_mean": 4e-3, "cont_err_max": 2e-2},
        {"codec": "int4:64", "bits_per_value": 5.0, "cont_err_mean": 5e-3, "cont_err_max": 0.2},
    ]
    assert choose_default(rows)["codec"] == "int8:64"  # int4 fails the max bound; tie -> lower error
    assert choose_default(rows[:1])["codec"] == "raw"
    assert math.isfinite(choose_default(rows)["bits_per_value"])
