"""The GPU validation command on a CPU: one quick run end to end, and its exit status, reports
and time limits with canned steps (fast)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_validate
from benchmarks.machine import machine_name

pytest.importorskip("matplotlib")
pytest.importorskip("pytest_benchmark")

ROOT = Path(__file__).resolve().parent.parent


def test_quick_cpu_run_end_to_end(tmp_path):
    """scripts/gpu_validate.sh on a CPU: a few kernel tests (interpreter), the kernel benchmark's
    copy baseline, the save path (raw codecs: its d2h baselines and the whole save into a store),
    the load path (raw: its h2d baseline and the whole restore from the store, every byte
    checked), the report; exit 0, and only its five files under --out."""
    out = tmp_path / "report"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_validate.sh"), "--quick", "--out", str(out),
         "--tests-k", "test_empty_block_list or test_bad_groups_are_refused",
         "-k", "copy-4 or raw-d2h or raw-save or raw-h2d or raw-restore or save-plain or save-store-raw"],
        capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    machine = machine_name()
    names = {f"{machine}{s}" for s in (".json", ".md", ".png", "-validate.log", "-tests.xml")}
    assert {p.name for p in out.iterdir()} == names
    res = json.loads((out / f"{machine}.json").read_text())
    assert res["machine"] == machine and res["device"]["versions"]["torch"]
    steps = res["steps"]
    assert steps["tests"]["status"] == "passed" and steps["tests"]["passed"] == 3, steps["tests"]
    # the sm_90 compile check is CPU work CI runs: left out of the device's time unless asked
    assert "--ignore=tests/kernels/test_sm90.py" in steps["tests"]["command"], steps["tests"]["command"]
    assert "--ignore=tests/kernels/test_quotient.py" in steps["tests"]["command"], steps["tests"]["command"]
    assert steps["kernels"]["status"] == "ok" and len(steps["kernels"]["benchmarks"]) == 2  # pack, unpack
    assert steps["save_path"]["status"] == "ok" and len(steps["save_path"]["benchmarks"]) == 3
    assert steps["load_path"]["status"] == "ok" and len(steps["load_path"]["benchmarks"]) == 2
    assert steps["store"]["status"] == "ok" and len(steps["store"]["benchmarks"]) == 2  # plain, store-raw saves
    assert steps["profile"]["status"] == "skipped"  # no CUDA
    rows = res["results"]
    assert {(r["suite"], r["provider"]) for r in rows} == {
        ("kernels", "copy"), ("save_path", "d2h-raw"), ("save_path", "d2h-packed"), ("save_path", "save"),
        ("load_path", "h2d-packed"), ("load_path", "restore"), ("store", "plain"), ("store", "store-raw")}
    assert all(r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["ratio"] > 0 for r in rows)
    save = next(r for r in rows if r["provider"] == "save")
    assert save["ratio_vs_slower"] > 0  # the whole save against the slower of d2h and plain file writes
    md = (out / f"{machine}.md").read_text()
    assert "**PASSED**: 3 passed" in md and "## Save path" in md and "## Kernels" in md and "## Load path" in md
    assert "## Store on this host" in md


def _canned(status: str):
    tests = {"status": status, "returncode": 0 if status == "passed" else 1, "seconds": 1.0,
             "limit_s": 10, "tests": 5, "passed": 4 + (status == "passed"),
             "failures": int(status != "passed"), "errors": 0, "skipped": 0, "junit": "x.xml",
             "failed": [] if status == "passed" else ["tests.kernels.test_x::test_y[int8]"]}

    def bench(name, *a):
        info = ({"op": "pack", "provider": "ours", "tp": 1, "backend": "triton", "source_bytes": 10**8,
                 "packed_bytes": 4 * 10**7, "gbps": 1800.0, "copy_gbps": 2000.0, "ratio_vs_copy": 0.9}
                if name == "kernels" else
                {"provider": "save", "codecs": "quant", "tokens": 7680, "bytes": 4 * 10**7,
                 "packed_bytes": 4 * 10**7, "gbps": 10.0, "state_gbps": 25.0, "ratio_vs_d2h_packed": 0.5,
                 "ratio_vs_d2h_raw": 1.2, "launch_s": 1e-4, "ratio_vs_slower": 0.9}
                if name == "save_path" else
                {"op": "save", "provider": "store-raw", "tokens": 7680, "raw_bytes": 10**8, "stored_bytes": 10**8,
                 "median_s": 0.05, "io_GBps": 2.0, "state_GBps": 2.0, "plain_median_s": 0.025, "ratio_vs_plain": 0.5}
                if name == "store" else
                {"provider": "restore", "codecs": "raw", "tokens": 7680, "bytes": 10**8, "packed_bytes": 10**8,
                 "gbps": 5.0, "state_gbps": 5.0, "ratio_vs_h2d_packed": 0.25})
        return {"status": "ok", "returncode": 0, "seconds": 1.0, "command": "pytest",
                "benchmarks": [{"name": "t", "median_s": {"save_path": 4e-3, "load_path": 2e-2}.get(name, 1e-4),
                                "extra_info": info}]}

    profile = {"status": "ok", "rows": [{"op": "pack", "tp": 1, "wall_ms": 2.0, "host_ms": 1.5,
                                         "kernel_ms": 0.1}],
               "save_stages": {"quant": {"_pack returns": 0.25, "save + flush": 3.5}},
               "launch_rows": [{"piece": "PackSet.pack (all of it)", "us": 52.1}]}
    return tests, bench, profile


@pytest.mark.parametrize("status", ["passed", "failed"])
def test_exit_status_and_report_follow_the_kernel_tests(status, tmp_path, monkeypatch):
    tests, bench, profile = _canned(status)
    machine, device, _ = gpu_validate.environment()
    device = {**device, "gpu": "Test GPU"}
    monkeypatch.setattr(gpu_validate, "environment", lambda: (machine, device, []))
    monkeypatch.setattr(gpu_validate, "run_tests", lambda *a: dict(tests))
    monkeypatch.setattr(gpu_validate, "run_bench", bench)
    monkeypatch.setattr(gpu_validate, "run_profile", lambda *a: dict(profile))
    rc = gpu_validate.main(["--out", str(tmp_path)])
    assert rc == (0 if status == "passed" else 1)
    res = json.loads((tmp_path / f"{machine}.json").read_text())
    targets = {t["target"]: t["met"] for t in res["targets"]}
    assert targets == {"pack tp=1: ours >= 0.85 x device copy": True,
                       "save path quant 7680 tokens, save: >= 0.8 x d2h copy of the packed bytes": False,
                       "save path quant 7680 tokens, save: >= 0.8 x the slower of the d2h copy and plain file "
                       "writes of the packed bytes (DESIGN)": True,
                       "store save 7680 tokens, store-raw: >= 0.8 x plain files": False}
    save = next(r for r in res["results"] if r["suite"] == "save_path")
    assert save["baseline_gbps"] == pytest.approx(4e7 / (0.5 * 4e-3) / 1e9)
    load = next(r for r in res["results"] if r["suite"] == "load_path")
    assert load["baseline_gbps"] == pytest.approx(1e8 / (0.25 * 2e-2) / 1e9) and load["ratio"] == 0.25
    md = (tmp_path / f"{machine}.md").read_text()
    assert ("**PASSED**" in md) == (status == "passed")
    assert ("tests.kernels.test_x::test_y[int8]" in md) == (status == "failed")
    assert "| pack | 1 | 2.000 | 1.500 | 0.100 | 0.05 |" in md  # host vs kernel time
    assert "| quant | 0.250 | 3.500 |" in md  # the save path's stages
    assert "| PackSet.pack (all of it) | 52.10 |" in md  # the set call's pieces
    assert "| raw 7680 tokens | restore | 100.0 | 20.000 | 5.00 | 5.00 | 0.250 |" in md  # the load path
    assert "| save 7680 tokens | store-raw | 100.0 | 50.00 | 2.00 | 2.00 | 0.500 |" in md  # the store
    store = next(r for r in res["results"] if r["suite"] == "store")
    assert store["baseline_gbps"] == pytest.approx(1e8 / 0.025 / 1e9)
    assert (tmp_path / f"{machine}.png").stat().st_size > 0


def test_a_step_over_its_limit_is_interrupted_and_keeps_its_output(tmp_path):
    """SIGINT at the limit (pytest then still writes its reports), not a silent kill."""
    code = ("import time\nprint('started', flush=True)\ntry:\n    time.sleep(60)\n"
            "except KeyboardInterrupt:\n    print('interrupted: reports written')\n    raise SystemExit(2)\n")
    res, text = gpu_validate.run_step("sleeper", [sys.executable, "-c", code], 8, tmp_path / "log",
                                      dict(os.environ))
    assert res["timed_out"] and res["returncode"] == 2  # interrupted, not killed (that is -9)
    assert "interrupted: reports written" in text and "===== sleeper" in (tmp_path / "log").read_text()


def test_save_stages_are_measured_parsed_and_reported(capsys):
    """`profile_save` times one save's stages (here the CPU path at the quick size) and the
    report parses its printed block into the profile step's table."""
    from benchmarks import profile_save

    assert profile_save.main(["--quick", "--rounds", "1", "--codecs", "raw", "--pack-profile"]) == 0
    assert profile_save.main(["--quick", "--rounds", "1"]) == 0
    text = capsys.readouterr().out
    # the raw run's `_pack` listing (on by default on a GPU): the pack's own call in it
    listing = text.split("-- WorkerSide._pack, raw codecs, 1 calls under cProfile")[1].split("== save stages")[0]
    assert "pack (api.py:" in listing and len(listing.strip().splitlines()) > 5, listing
    writes = text.split("-- WorkerSide._write, raw codecs, 1 calls under cProfile")[1].split("== save stages")[0]
    assert "_store (worker.py:" in writes and "_pack" not in writes, writes
    stages = gpu_validate.save_stages("noise\n" + text + "== pack tp=1: wall 1 ms/call\n")
    assert list(stages) == ["raw", "quant"]
    for ms in stages.values():
        assert list(ms) == ["_pack returns", "cache read", "host copies done", "writer", "flush (idle)",
                            "save + flush", "d2h copy", "_pack cold", "_pack hot",
                            "_pack cold, torch.cuda.stream", "_pack hot, torch.cuda.stream"]
        assert all(v > 0 for v in ms.values())
        assert ms["_pack returns"] <= ms["cache read"] <= ms["host copies done"]


def test_a_stream_rows_time_is_per_call():
    """`bench_kernels`' `stream` provider times ten `set` calls a round: its row takes the
    per-call median the benchmark recorded, and is held to the targets like `set`."""
    base = {"op": "pack", "tp": 1, "backend": "triton", "source_bytes": 10**8, "packed_bytes": 4 * 10**7,
            "copy_gbps": 2000.0}
    steps = {"kernels": {"benchmarks": [
        {"name": "set", "median_s": 2e-4, "extra_info": base | {"provider": "set", "median_s": 2e-4,
                                                               "gbps": 700.0, "ratio_vs_copy": 0.35}},
        {"name": "stream", "median_s": 1e-3, "extra_info": base | {"provider": "stream", "median_s": 1e-4,
                                                                  "gbps": 1400.0, "ratio_vs_copy": 0.7}},
    ]}}
    rows = {r["provider"]: r for r in gpu_validate.results(steps)}
    assert rows["stream"]["median_s"] == 1e-4 and rows["set"]["median_s"] == 2e-4
    met = {t["target"]: t["met"] for t in gpu_validate.targets(list(rows.values()), on_gpu=True)}
    assert met == {"pack tp=1: set >= 0.85 x device copy": False, "pack tp=1: stream >= 0.85 x device copy": False}


def test_profile_lines_are_read_for_every_op():
    """Every op `profile_kernels` prints, names with spaces included ("unpack set unfused": the
    A/B of the set kernels), reaches the report's profile rows."""
    from benchmarks import gpu_validate

    ops = ("pack", "set", "set_unfused", "set_div", "unpack", "unpack set", "unpack set unfused", "copy")
    text = "\n".join(f"== {op} tp=1: wall 0.{k}12 ms/call, host-only 0.100 ms, kernels 0.050 ms/call, source 105.3 MB"
                     for k, op in enumerate(ops))
    rows = [m.groups() for m in gpu_validate._PROFILE_LINE.finditer(text)]
    assert [r[0] for r in rows] == list(ops) and rows[6][2] == "0.612"


def test_launch_pieces_are_read_from_launch_variants_output():
    """`launch_pieces` reads each `launch_variants` line of a piece (its name, microseconds a
    call), the same name twice kept twice, and skips the header and the parenthesized notes."""
    text = ("triton 3.6.0, torch 2.11.0+cu130, NVIDIA H200\n"
            "  PackSet.pack (all of it)                                      80.10 us\n"
            "    np.copyto into the pinned slot                               0.48 us\n"
            "  (driver launcher CudaLauncher; .launch <built-in function launch>)\n"
            "  PackSet.pack (all of it)                                      78.59 us\n"
            "  (its bytes equal the staged table's: True)\n")
    assert gpu_validate.launch_pieces(text) == [
        {"piece": "PackSet.pack (all of it)", "us": 80.10}, {"piece": "np.copyto into the pinned slot", "us": 0.48},
        {"piece": "PackSet.pack (all of it)", "us": 78.59}]


def test_set_call_rows_are_read_from_set_calls_output():
    """`set_call_rows` reads each `set_calls` line of a variant (name, us a call, GB/s, ratio)
    and skips the header and the fallback note."""
    text = ("NVIDIA H200, torch 2.11.0+cu130; tp=1, 47 parts, 105.3 MB source, 44.5 MB packed; 10 calls back to\n"
            "  pack   torch, 8 slots                                58.5 us a call     2562 GB/s  ratio 0.784\n"
            "  unpack driver, 8 slots, key launch                   55.5 us a call     2700 GB/s  ratio 0.826\n"
            "  copy of the source                                   53.3 us a call     3954 GB/s  ratio 1.210\n"
            "  (ring fallbacks pack/unpack by rings: {'torch,8': [0, 0]}; driver calls {'copy': 9})\n")
    assert gpu_validate.set_call_rows(text) == [
        {"variant": "pack   torch, 8 slots", "us": 58.5, "gbps": 2562.0, "ratio": 0.784},
        {"variant": "unpack driver, 8 slots, key launch", "us": 55.5, "gbps": 2700.0, "ratio": 0.826},
        {"variant": "copy of the source", "us": 53.3, "gbps": 3954.0, "ratio": 1.21}]


def test_save_timeline_reads_rounds_marks_and_gpu_spans():
    """`save_timeline.timeline` finds each profiled round and its host mark on the profiler's
    clock (here on a CPU: no GPU span, so those columns are NaN); `_idle` counts the time no
    kernel or copy covers, overlaps once."""
    import math

    from benchmarks import save_timeline

    def fn():
        with torch.profiler.record_function("anchorkv _pack"):
            torch.ones(256, 256) @ torch.ones(256, 256)
        time.sleep(0.002)

    row = save_timeline.timeline(fn, 3, ["anchorkv _pack"])
    assert list(row) == list(save_timeline.COLUMNS)
    assert 0 < row["_pack"] < row["round"] and row["round"] >= 2.0
    assert math.isnan(row["kernel start"]) and math.isnan(row["d2h start"])
    assert save_timeline._idle([(10, 20), (15, 30), (40, 50)], 0, 60) == 10 + 10 + 10
    assert save_timeline._idle([], 0, 60) == 60 and save_timeline._idle([(0, 100)], 0, 60) == 0


def test_save_timeline_lines_are_read_and_reported():
    """`save_timeline_rows` reads each (codecs, provider) line of `save_timeline`'s table (NaN
    columns included) and skips the header and a line of another width (an older table's); the
    report shows them as a table."""
    from benchmarks.save_timeline import COLUMNS

    text = ("== save timeline, NVIDIA H100 80GB HBM3: median ms from a round's start, 10 rounds\n"
            "   " + " | ".join(["codecs", "provider", *COLUMNS]) + "\n"
            "   raw | set+d2h | 2.200 | nan | 0.050 | 0.110 | 0.120 | 2.050 | 0.100\n"
            "   quant | pack+d2h | 1.800 | 0.270 | 0.150 | 0.205 | 0.290 | 1.110 | 0.200\n"
            "   quant | stream | 1.800 | 0.270 | 0.150 | 0.205 | 0.290 | 1.110 | 1.800 | 0.200\n")
    rows = gpu_validate.save_timeline_rows(text)
    assert [(r["codecs"], r["provider"]) for r in rows] == [("raw", "set+d2h"), ("quant", "pack+d2h")]
    assert rows[1]["_pack"] == 0.27 and rows[1]["d2h end"] == 1.11 and rows[1]["gpu idle"] == 0.2
    # a real run's results (an H200's, stop 30), this table added
    res = json.loads((ROOT / "benchmarks" / "results" / "nvidia-h200-8697ac2.json").read_text())
    res["steps"]["profile"]["timeline_rows"] = rows
    md = gpu_validate.render_markdown(res)
    assert "## Save timeline on the GPU" in md and "| quant | pack+d2h | 1.800 | 0.270 |" in md, md


def test_save_timeline_files_kernels_copies_and_skips_runtime_calls():
    """`_spans` keeps the CUDA events that start in the round, files copies to the host as
    `d2h` and other memory operations apart, and skips the runtime's and driver's calls and
    the synchronizations CUPTI files as device activities (on an H100 something filed as a
    kernel still made the kernels "end" with the copy after the runtime calls were skipped)."""
    from benchmarks import save_timeline

    class Ev:
        def __init__(self, name, start, dur, cuda=True):
            self._n, self._s, self._d, self._c = name, start, dur, cuda

        def name(self):
            return self._n

        def start_ns(self):
            return self._s

        def duration_ns(self):
            return self._d

        def device_type(self):
            return torch.autograd.DeviceType.CUDA if self._c else torch.autograd.DeviceType.CPU

    events = [Ev("_pack_set_kernel", 100, 50), Ev("Memcpy DtoH (Device -> Pinned)", 160, 900),
              Ev("Memset (Device)", 90, 5), Ev("cudaStreamSynchronize", 150, 910), Ev("cuLaunchKernelEx", 95, 3),
              Ev("Device Synchronize", 150, 910), Ev("Stream Wait Event", 90, 2), Ev("Event Sync", 150, 900),
              Ev("_pack_set_kernel", 5000, 50), Ev("cpu op", 120, 10, cuda=False)]
    spans = save_timeline._spans(events, 0, 2000)
    assert spans == {"kernel": [(100, 150)], "d2h": [(160, 1060)], "other": [(90, 95)]}


def test_a_profile_follow_up_keeps_its_rows_and_fails_the_step_without_any(tmp_path):
    """`_follow_up` (launch pieces, save timeline): the rows its command prints go into the
    step's result; a command that fails, or prints no row, marks the step failed and keeps its
    exit status and log tail; a step that failed already stays as it was."""
    log, env = tmp_path / "log", dict(os.environ)
    line = "  PackSet.pack (all of it)                                      52.10 us"
    res = {"status": "ok"}
    seconds = gpu_validate._follow_up(res, "pieces", [sys.executable, "-c", f"print({line!r})"], 30, log, env,
                                      gpu_validate.launch_pieces, "launch_rows", "launch")
    assert res == {"status": "ok", "launch_rows": [{"piece": "PackSet.pack (all of it)", "us": 52.1}]}
    assert 0 <= seconds < 30
    for code in ("print('nothing')", "import sys; print('  x   1.00 us'); sys.exit(3)"):
        res = {"status": "ok"}
        gpu_validate._follow_up(res, "pieces", [sys.executable, "-c", code], 30, log, env,
                                gpu_validate.launch_pieces, "launch_rows", "launch")
        assert res["status"] == "failed" and set(res["launch"]) == {"returncode", "seconds", "timed_out", "log_tail"}
    assert res["launch"]["returncode"] == 3
    res = {"status": "timeout"}
    gpu_validate._follow_up(res, "timeline", [sys.executable, "-c", "pass"], 30, log, env,
                            gpu_validate.save_timeline_rows, "timeline_rows", "timeline")
    assert res["status"] == "timeout" and res["timeline_rows"] == [] and "timeline" in res


def test_the_warm_store_loads_are_held_to_the_design_target():
    """The warm load rows (how a restore reads: reused memory, the worker's read threads) are
    targets next to the default store rows; the other variants are reported only."""
    rows = [{"suite": "store", "case": "load 7680 tokens", "provider": p, "ratio": 0.5}
            for p in ("store-raw", "store-raw:warm", "store-quant:warm", "store-raw:warm-kept", "store-raw:put-2",
                      "store-quant:warm-first")]
    got = {t["target"] for t in gpu_validate.targets(rows, on_gpu=True)}
    assert got == {f"store load 7680 tokens, {p}: >= 0.8 x plain files"
                   for p in ("store-raw", "store-raw:warm", "store-quant:warm", "store-quant:warm-first")}


def test_save_timeline_saves_specs_made_before_its_rounds(tmp_path):
    """`save_timeline`'s `pack+d2h` round saves a spec made before the rounds (building one is
    the scheduler's work, not the save's), a new one each call (a new entry each time)."""
    from benchmarks.bench_save_path import QUICK_TOKENS, Request, request_layout
    from benchmarks.save_timeline import _round

    req = Request(request_layout(True), QUICK_TOKENS, "raw", tmp_path)
    made = req.saves
    fn = _round(req, "pack+d2h", 3)
    assert req.saves == made + 3  # all three specs made up front
    for _ in range(3):
        fn()
    assert req.saves == made + 3 and req.discard.saved[-3:] == [req.packed_bytes] * 3
    with pytest.raises(IndexError):
        fn()
