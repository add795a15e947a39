"""The full GPU validation in one command: kernel tests, kernel and save-path benchmarks, profile.

    scripts/gpu_validate.sh [--out DIR] [--quick] [--skip-tests] [--tests-k EXPR] [--with-sm90] [-k EXPR]
                            [--budget SECONDS]

(`scripts/gpu_validate.sh` installs the wheels of `.whl/` when the store's dependencies do not
import, then runs `python -m benchmarks.gpu_validate` with the same arguments.) Steps, each a
subprocess of this Python with a time limit drawn from one budget (default 420 s), so a hang
costs its limit, not the run; a step over its limit gets SIGINT, and pytest then still writes
the junit XML and benchmark JSON of what finished:

    tests      pytest tests/kernels: every kernel test, the full-size `test_large.py` included,
               bit-exact against the torch reference (in the Triton interpreter without CUDA)
    kernels    benchmarks/bench_kernels.py: ours vs a device-to-device copy of the same bytes,
               torch eager and torch.compile (run last: it compiles)
    save_path  benchmarks/bench_save_path.py: GPU -> pack -> pinned host -> store, vs a plain
               device-to-host copy of the packed (and of the raw) bytes
    load_path  benchmarks/bench_load_path.py: store -> pinned host arena -> GPU -> unpack, vs a
               plain host-to-device copy of the packed bytes (reported; issue 13 sets no target)
    store      benchmarks/bench_store.py's Kimi-Linear rows: the store's save and load on this
               host against plain files of the same bytes (the DESIGN's 0.8x), and its saves
               with their checksums on a chunk thread or the writing thread (`CHUNK_THREADS`)
    profile    python -m benchmarks.profile_kernels: host vs kernel time (CUDA only), then
               python -m benchmarks.launch_variants: a set call's host time piece by piece,
               python -m benchmarks.set_calls: set calls back to back, launch-path variants
               interleaved (tables by torch or the driver, ring sizes, unpack's launch), and
               python -m benchmarks.save_timeline: a save's host and GPU spans

Writes, all directly under `--out` (default benchmarks/results), `<machine>` as
`benchmarks.machine.machine_name()` names it (the GPU's name): `<machine>.json` (device,
versions, every step and result), `<machine>.md` (tables, targets), `<machine>.png` (GB/s vs
baselines), `<machine>-tests.xml` (junit) and `<machine>-validate.log` (every step's output).
A full run of `bench_kernels.py` also refreshes its own
`benchmarks/results/<machine>-kernels.json`, as it always does.
Exit status 1 when the kernel tests fail or do not finish, or a step fails or runs out of time.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata as _md
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: (step, most seconds it may take, least seconds worth starting it with), in run order.
STEPS = (("tests", 300, 60), ("kernels", 180, 60), ("save_path", 90, 30), ("load_path", 60, 20),
         ("store", 40, 10), ("profile", 120, 20))
#: a benchmark step's own selection, with `-k`'s (the store's: one request, no safetensors, which
#: the device need not have)
STEP_K = {"store": "kimi and not safetensors"}
GRACE_S = 20  # after SIGINT, before SIGKILL
REPORT_S = 15  # kept back for writing the report
#: module -> why the run needs it (checked before anything runs; wheels: scripts/fetch_gpu_wheels.sh)
NEEDS = {
    "torch": "everything", "triton": "the kernels on CUDA", "numpy": "the store",
    "pytest": "every step", "pytest_benchmark": "the benchmarks", "hypothesis": "tests/kernels/test_properties.py",
    "zarr": "the store (save path)", "numcodecs": "the store", "blake3": "the store's keys",
    "google_crc32c": "the store's checksums", "fastcrc": "the store's checksums at full speed (else a fallback)",
    "yaml": "zarr (through donfig)", "matplotlib": "the plot",
}
TARGETS = {"copy": 0.85, "eager": 3.0, "d2h": 0.8, "plain": 0.8}  # issue 13's GPU targets; DESIGN's store
#: bench_kernels providers that time anchorkv's kernels (`stream`: ten `set` calls, one synchronization)
OURS = ("ours", "set", "stream")


def pytest_collection_modifyitems(items):
    """As a pytest plugin (`-p benchmarks.gpu_validate`): torch.compile cases run last, so a step
    that runs out of time loses the compile baseline, not the measurements of the kernels."""
    items.sort(key=lambda item: "compile" in item.name)


# ----------------------------------------------------------------------------- environment


def environment() -> tuple[str, dict, list[str]]:
    """The machine name (`benchmarks.machine`), device and versions, and the missing modules."""
    from benchmarks.machine import device_info, machine_name

    device = device_info()
    machine = machine_name(device)
    versions = {}
    for dist in ("torch", "triton", "numpy", "pytest", "pytest-benchmark", "hypothesis", "zarr",
                 "numcodecs", "blake3", "google-crc32c", "fastcrc", "matplotlib"):
        try:
            versions[dist] = _md.version(dist)
        except _md.PackageNotFoundError:
            versions[dist] = None
    import torch

    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        device.update(cuda=torch.version.cuda, capability=f"{p.major}.{p.minor}",
                      memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if not torch.cuda.is_available():
        missing = [m for m in missing if m != "triton"]
    return machine, {**device, "versions": versions}, missing


# ----------------------------------------------------------------------------- steps


def _default_sigint() -> None:
    """In the child: SIGINT back to its default disposition. Why: a shell without job control
    starts background commands with SIGINT ignored, the child inherits that, and Python then
    never turns SIGINT into KeyboardInterrupt, so a step over its limit could only be killed,
    losing the reports pytest writes when interrupted (seen in a CI run started with `&`)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_step(name: str, cmd: list[str], limit: float, log: Path, env: dict) -> tuple[dict, str]:
    """Run `cmd` with its output appended to `log`; SIGINT at `limit` s, SIGKILL `GRACE_S` later.
    Returns the step's record (with the output's tail) and its whole output."""
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n===== {name}: {' '.join(cmd)}  (limit {limit:.0f} s)\n")
        f.flush()
        start = f.tell()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_default_sigint)
        timed_out = False
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGINT)  # pytest ends the session and writes its reports
            try:
                rc = proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
        try:  # leftovers of the step (torch.compile's workers), by its process group
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    secs = time.perf_counter() - t0
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    out = {"returncode": rc, "seconds": round(secs, 1), "limit_s": round(limit), "timed_out": timed_out,
           "command": " ".join(cmd[1:] if cmd[0] == sys.executable else cmd), "log_tail": text[-4000:]}
    print(f"  {name}: rc={rc}{' (TIMED OUT)' if timed_out else ''} in {secs:.0f} s", flush=True)
    return out, text


def junit_summary(path: Path) -> dict:
    """Counts, time and failing test ids of a junit XML (as pytest writes it)."""
    if not path.exists():
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["time_s"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed[:50]}


def run_tests(args, out: Path, machine: str, limit: float, log: Path, env: dict) -> dict:
    junit = out / f"{machine}-tests.xml"
    junit.unlink(missing_ok=True)
    # the kernel tests, and the connector worker's CUDA path (save through the Triton pack on the
    # side stream, restore with a fresh worker; CUDA only, so CI never runs it)
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "tests/connector/test_worker_cuda.py",
           "-q", "-rfEs", "-p", "no:cacheprovider",
           f"--rootdir={ROOT}", f"--junitxml={junit}", "-o", "junit_suite_name=anchorkv-kernels"]
    # the sm_90 compile check compiles on the CPU (CI runs it): device time better spent elsewhere
    cmd += [] if args.with_sm90 else ["--ignore=tests/kernels/test_sm90.py"]
    # numpy arithmetic (bits.quotient's, against fp32 division): nothing of it runs on the device
    cmd += ["--ignore=tests/kernels/test_quotient.py"]
    cmd += ["-k", args.tests_k] if args.tests_k else []
    res, _ = run_step("tests", cmd, limit, log, env)
    res["junit"] = junit.name
    res.update(junit_summary(junit))
    rc = res["returncode"]
    res["status"] = ("timeout" if res["timed_out"] else "passed" if rc == 0 else "failed" if rc == 1
                     else "empty" if rc == 5 else "error")
    return res


def run_bench(name: str, args, limit: float, log: Path, env: dict, tmp: Path) -> dict:
    from benchmarks.reporting import condense

    js = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "pytest", f"benchmarks/bench_{name}.py", "-q", "-p", "no:cacheprovider",
           "-p", "benchmarks.gpu_validate", f"--rootdir={ROOT}", f"--benchmark-json={js}",
           "--benchmark-disable-gc"]
    cmd += ["--quick"] if args.quick else []
    k = " and ".join(f"({e})" for e in (args.k, STEP_K.get(name)) if e)
    cmd += ["-k", k] if k else []
    res, _ = run_step(name, cmd, limit, log, env)
    if js.exists():
        res["benchmarks"] = condense(json.loads(js.read_text()))
    rc = res["returncode"]
    res["status"] = ("timeout" if res["timed_out"] else "empty" if rc == 5
                     else "ok" if rc == 0 and res.get("benchmarks") else "failed")
    return res


#: `profile_kernels`' line per op (names with spaces: "unpack set", "unpack set unfused")
_PROFILE_LINE = re.compile(r"== (\w[\w ]*?) tp=(\d+): wall ([\d.]+) ms/call, host-only ([\d.]+) ms, "
                           r"kernels ([\d.]+) ms/call")


_STAGES = re.compile(r"== save stages, (\w+) codecs, [^\n]*\n((?:   [^\n]+ ms\n?)+)")
_STAGE = re.compile(r"^   (.+?)\s+([\d.]+) ms$", re.M)


def save_stages(text: str) -> dict[str, dict[str, float]]:
    """{codecs: {stage: ms}} from `benchmarks.profile_save`'s blocks in a step's output."""
    return {m[1]: {name: float(ms) for name, ms in _STAGE.findall(m[2])} for m in _STAGES.finditer(text)}


#: `launch_variants`' line per piece: its name, then microseconds a call
_PIECE = re.compile(r"^ +(\S.*?) +([\d.]+) us$", re.M)


#: `save_timeline`'s line per (codecs, provider): its columns' ms, " | " between
_TIMELINE = re.compile(r"^   (raw|quant) \| (\S+) \| ([\d.nan| ]+)$", re.M)


def save_timeline_rows(text: str) -> list[dict]:
    """[{codecs, provider, <column>: ms}] from `benchmarks.save_timeline`'s output."""
    from benchmarks.save_timeline import COLUMNS

    rows = []
    for m in _TIMELINE.finditer(text):
        values = [float(v) for v in m[3].split(" | ")]
        if len(values) == len(COLUMNS):
            rows.append({"codecs": m[1], "provider": m[2], **dict(zip(COLUMNS, values, strict=True))})
    return rows


#: `set_calls`' line per variant: its name, microseconds a call, GB/s, the ratio to the copy
_SET_CALL = re.compile(r"^  (\S.*?) +([\d.]+) us a call +([\d.]+) GB/s +ratio ([\d.]+)$", re.M)


def set_call_rows(text: str) -> list[dict]:
    """[{variant, us, gbps, ratio}] from `benchmarks.set_calls`' output, in its order."""
    return [{"variant": m[1], "us": float(m[2]), "gbps": float(m[3]), "ratio": float(m[4])}
            for m in _SET_CALL.finditer(text)]


def launch_pieces(text: str) -> list[dict]:
    """[{piece, us}] from `benchmarks.launch_variants`' output, in its order (a piece timed
    twice keeps both lines: the machine's drift between them)."""
    return [{"piece": m[1], "us": float(m[2])} for m in _PIECE.finditer(text)]


def _follow_up(res: dict, name: str, cmd: list[str], limit: float, log: Path, env: dict,
               parse: Callable[[str], list[dict]], rows: str, failure: str) -> float:
    """Run one of the profile step's follow-up commands: its parsed rows into `res[rows]`; the
    step failed (and `res[failure]` says how) if it did or printed no row. Returns its seconds."""
    step, text = run_step(name, cmd, limit, log, env)
    res[rows] = parse(text)
    if step["timed_out"] or step["returncode"] != 0 or not res[rows]:
        res["status"] = "failed" if res["status"] == "ok" else res["status"]
        res[failure] = {k: step[k] for k in ("returncode", "seconds", "timed_out", "log_tail")}
    return step["seconds"]


def run_profile(args, limit: float, log: Path, env: dict) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "reason": "no CUDA (profile_kernels times the CUDA kernels)"}
    cmd = [sys.executable, "-m", "benchmarks.profile_kernels", "--tp", "1", "--iters", "5" if args.quick else "20"]
    res, text = run_step("profile", cmd, limit, log, env)
    rows = [{"op": m[1], "tp": int(m[2]), "wall_ms": float(m[3]), "host_ms": float(m[4]),
             "kernel_ms": float(m[5])} for m in _PROFILE_LINE.finditer(text)]
    res["rows"] = rows
    res["save_stages"] = save_stages(text)
    res["status"] = ("timeout" if res["timed_out"] else "ok" if res["returncode"] == 0 and rows
                     else "failed")
    left = limit - res["seconds"]
    if left >= 10:  # the set call's pieces (~10 s on an H200), in what the step has left
        cmd = [sys.executable, "-m", "benchmarks.launch_variants", "--tp", "1",
               "--iters", "50" if args.quick else "300"]
        left -= _follow_up(res, "launch pieces", cmd, left, log, env, launch_pieces, "launch_rows", "launch")
    if left >= 10:  # set calls back to back, variant against variant (~15 s on an H200)
        cmd = [sys.executable, "-m", "benchmarks.set_calls", "--rounds", "3" if args.quick else "10"]
        left -= _follow_up(res, "set calls", cmd, left, log, env, set_call_rows, "set_call_rows", "set_calls")
    if left >= 10:  # a save's timeline on the GPU (~10 s on an H100), in what is left
        cmd = [sys.executable, "-m", "benchmarks.save_timeline", "--rounds", "3" if args.quick else "10"]
        _follow_up(res, "save timeline", cmd, left, log, env, save_timeline_rows, "timeline_rows", "timeline")
    return res


# ----------------------------------------------------------------------------- results


def results(steps: dict) -> list[dict]:
    """Every benchmark result as one row: GB/s, its baseline (same run) and the ratio to it."""
    rows = []
    # (a `stream` row's median_s in extra_info is per call: its round is ten calls)
    kern = [{"median_s": b["median_s"]} | b["extra_info"] for b in steps.get("kernels", {}).get("benchmarks", [])
            if "provider" in b.get("extra_info", {})]
    eager = {(e["op"], e["tp"]): e["median_s"] for e in kern if e["provider"] == "eager"}
    for e in sorted(kern, key=lambda e: (e["op"], e["tp"], e["provider"])):
        row = {"suite": "kernels", "case": f"{e['op']} tp={e['tp']}", "provider": e["provider"],
               "backend": e.get("backend"), "bytes": e["source_bytes"], "median_s": e["median_s"],
               "gbps": e["gbps"], "baseline": "device copy", "baseline_gbps": e["copy_gbps"],
               "ratio": e["ratio_vs_copy"]}
        if e["provider"] in (*OURS, "compile") and (e["op"], e["tp"]) in eager:
            row["speedup_vs_eager"] = eager[(e["op"], e["tp"])] / e["median_s"]
        rows.append(row)
    for b in steps.get("save_path", {}).get("benchmarks", []):
        if "provider" not in b.get("extra_info", {}):
            continue
        e = {"median_s": b["median_s"]} | b["extra_info"]  # (a `stream` row's median_s is per save)
        base = e["ratio_vs_d2h_packed"] * e["median_s"]  # the d2h-packed median of the same run
        row = {"suite": "save_path", "case": f"{e['codecs']} {e['tokens']} tokens", "provider": e["provider"],
               "bytes": e["bytes"], "median_s": e["median_s"], "gbps": e["gbps"], "state_gbps": e["state_gbps"],
               "baseline": "d2h copy of the packed bytes", "baseline_gbps": e["packed_bytes"] / base / 1e9,
               "ratio": e["ratio_vs_d2h_packed"], "ratio_vs_d2h_raw": e["ratio_vs_d2h_raw"]}
        if "launch_s" in e:
            row["launch_s"] = e["launch_s"]
        if "ratio_vs_slower" in e:
            row["ratio_vs_slower"] = e["ratio_vs_slower"]
        rows.append(row)
    for b in steps.get("load_path", {}).get("benchmarks", []):
        if "provider" not in b.get("extra_info", {}):
            continue
        e = b["extra_info"] | {"median_s": b["median_s"]}
        base = e["ratio_vs_h2d_packed"] * e["median_s"]  # the h2d-packed median of the same run
        rows.append({"suite": "load_path", "case": f"{e['codecs']} {e['tokens']} tokens", "provider": e["provider"],
                     "bytes": e["bytes"], "median_s": e["median_s"], "gbps": e["gbps"],
                     "state_gbps": e["state_gbps"], "baseline": "h2d copy of the packed bytes",
                     "baseline_gbps": e["packed_bytes"] / base / 1e9, "ratio": e["ratio_vs_h2d_packed"]})
    for b in steps.get("store", {}).get("benchmarks", []):
        e = b.get("extra_info", {})
        if "ratio_vs_plain" not in e:
            continue
        rows.append({"suite": "store", "case": f"{e['op']} {e['tokens']} tokens", "provider": e["provider"],
                     "bytes": e["stored_bytes"], "median_s": e["median_s"], "gbps": e["io_GBps"],
                     "state_gbps": e["state_GBps"], "baseline": "plain files of the raw bytes",
                     "baseline_gbps": e["raw_bytes"] / e["plain_median_s"] / 1e9, "ratio": e["ratio_vs_plain"]})
    return rows


#: the store's rows held to the DESIGN's 0.8 x plain files (`bench_store.py`'s providers): the
#: defaults, and the warm loads (reused memory on `READ_THREADS` threads: how a restore reads),
#: a new worker's (`:warm`) and a serving worker's first restore of an entry (`:warm-first`)
STORE_TARGETS = ("store-raw", "store-quant", "store-raw:warm", "store-quant:warm", "store-raw:warm-first",
                 "store-quant:warm-first")
#: the save path's rows held to the 0.8 x D2H target (`bench_save_path.py`'s providers)
SAVE_TARGETS = ("pack+d2h", "stream", "pack+d2h+cs", "stream+cs", "set+d2h", "chunks+d2h", "save")


def targets(rows: list[dict], on_gpu: bool) -> list[dict]:
    """Issue 13's GPU targets, read off the rows (tp=1 kernels; save path per codec set); none
    without a GPU (the CPU rows time the torch reference, which the targets are not about)."""
    out = []
    if not on_gpu:
        return out
    for r in rows:
        if r["suite"] == "kernels" and r["provider"] in OURS and r["case"].endswith("tp=1"):
            who = r["provider"]
            out.append({"target": f"{r['case']}: {who} >= {TARGETS['copy']} x device copy",
                        "value": r["ratio"], "met": r["ratio"] >= TARGETS["copy"]})
            if "speedup_vs_eager" in r:
                out.append({"target": f"{r['case']}: {who} >= {TARGETS['eager']:g}x torch eager",
                            "value": r["speedup_vs_eager"], "met": r["speedup_vs_eager"] >= TARGETS["eager"]})
        if r["suite"] == "store" and r["provider"] in STORE_TARGETS:
            out.append({"target": f"store {r['case']}, {r['provider']}: >= {TARGETS['plain']} x plain files",
                        "value": r["ratio"], "met": r["ratio"] >= TARGETS["plain"]})
        if r["suite"] == "save_path" and r["provider"] in SAVE_TARGETS:
            out.append({"target": f"save path {r['case']}, {r['provider']}: >= {TARGETS['d2h']} x d2h copy "
                                  f"of the packed bytes", "value": r["ratio"], "met": r["ratio"] >= TARGETS["d2h"]})
        if r["suite"] == "save_path" and "ratio_vs_slower" in r:
            out.append({"target": f"save path {r['case']}, {r['provider']}: >= {TARGETS['d2h']} x the slower of "
                                  "the d2h copy and plain file writes of the packed bytes (DESIGN)",
                        "value": r["ratio_vs_slower"], "met": r["ratio_vs_slower"] >= TARGETS["d2h"]})
    return out


# ----------------------------------------------------------------------------- report


def render_markdown(res: dict) -> str:
    from benchmarks.reporting import num, table

    d, v = res["device"], res["device"]["versions"]
    gpu = d.get("gpu")
    lines = [f"# anchorkv GPU validation: {res['machine']}", "",
             f"{res['created']}, mode {res['mode']}, "
             + (f"{gpu} (sm {d.get('capability')}, {d.get('memory_gib')} GiB, {d.get('sms')} SMs, CUDA "
                f"{d.get('cuda')})" if gpu else "no CUDA: the torch reference path and the Triton interpreter")
             + f"; torch {v.get('torch')}, triton {v.get('triton')}, python {d.get('python')}, "
             f"{d.get('cores')} CPU cores. Command `{res['command']}` ({res['seconds']:.0f} s of a "
             f"{res['budget_s']} s budget).", ""]
    if res["missing"]:
        lines += [f"**Missing modules:** {', '.join(res['missing'])} (wheels: `scripts/fetch_gpu_wheels.sh`).", ""]
    t = res["steps"].get("tests", {})
    verdict = {"passed": "**PASSED**", "skipped": "skipped (`--skip-tests`)"}.get(t.get("status"),
                                                                                 f"**{str(t.get('status')).upper()}**")
    lines += ["## Kernel tests", "", f"`tests/kernels` (full-size `test_large.py` included, bit-exact vs the "
              f"reference): {verdict}"
              + (f": {t['passed']} passed, {t['failures']} failed, {t['errors']} errors, {t['skipped']} "
                 f"skipped in {t['seconds']:.0f} s (junit `{t['junit']}`)" if "tests" in t else "") + "."]
    lines += [f"- failed: `{name}`" for name in t.get("failed", [])]
    lines += ["", "## Steps", ""]
    lines += table(["step", "status", "seconds", "limit s", "results", "command"],
                    [[n, s["status"], num(s.get("seconds"), ".0f"), s.get("limit_s", "-"),
                      s.get("tests", len(s.get("benchmarks", s.get("rows", [])))), f"`{s.get('command', '-')}`"]
                     for n, s in res["steps"].items()]) + [""]
    if res["targets"]:
        lines += ["## Targets (issue 13)", ""]
        lines += table(["target", "value", "met"], [[t["target"], num(t["value"], ".3f"),
                                                      "yes" if t["met"] else "**no**"] for t in res["targets"]])
        lines += [""]
    kern = [r for r in res["results"] if r["suite"] == "kernels"]
    if kern:
        lines += ["## Kernels: pack / unpack of one Kimi-Linear request (47 items)", "",
                  "GB/s counts bytes read + written; ratio = vs a device-to-device copy of the same source "
                  "bytes, same run.", ""]
        lines += table(["case", "provider", "source MB", "median ms", "GB/s", "copy GB/s", "ratio vs copy",
                         "speedup vs eager"],
                        [[r["case"], r["provider"] + (f" ({r['backend']})" if r["provider"] in OURS else ""),
                          num(r["bytes"] / 1e6, ".1f"), num(r["median_s"] * 1e3, ".3f"), num(r["gbps"], ".1f"),
                          num(r["baseline_gbps"], ".1f"), num(r["ratio"], ".3f"),
                          num(r.get("speedup_vs_eager"), ".2f")] for r in kern]) + [""]
    save = [r for r in res["results"] if r["suite"] == "save_path"]
    if save:
        lines += ["## Save path: GPU -> pack -> pinned host -> local store", "",
                  "GB/s = bytes delivered to the host / time (packed bytes; raw bytes for `d2h-raw`); "
                  "state GB/s = the request's raw bytes / time; ratios = baseline time / this time, same run.",
                  ""]
        lines += table(["case", "provider", "MB to host", "median ms", "GB/s", "state GB/s", "ratio vs d2h packed",
                         "ratio vs d2h raw", "launch ms"],
                        [[r["case"], r["provider"], num(r["bytes"] / 1e6, ".1f"), num(r["median_s"] * 1e3, ".3f"),
                          num(r["gbps"], ".2f"), num(r["state_gbps"], ".2f"), num(r["ratio"], ".3f"),
                          num(r["ratio_vs_d2h_raw"], ".3f"),
                          num(r["launch_s"] * 1e3, ".2f") if "launch_s" in r else "-"] for r in save]) + [""]
    load = [r for r in res["results"] if r["suite"] == "load_path"]
    if load:
        lines += ["## Load path: local store -> pinned host arena -> GPU -> unpack", "",
                  "GB/s = packed bytes / time; state GB/s = the request's raw bytes / time; ratio = the "
                  "h2d copy's time / this time, same run (no target: issue 13 sets none for loads).", ""]
        lines += table(["case", "provider", "MB from host", "median ms", "GB/s", "state GB/s", "ratio vs h2d packed"],
                        [[r["case"], r["provider"], num(r["bytes"] / 1e6, ".1f"), num(r["median_s"] * 1e3, ".3f"),
                          num(r["gbps"], ".2f"), num(r["state_gbps"], ".2f"), num(r["ratio"], ".3f")]
                         for r in load]) + [""]
    store = [r for r in res["results"] if r["suite"] == "store"]
    if store:
        lines += ["## Store on this host: save / load of the request against plain files", "",
                  "GB/s = bytes stored / time; state GB/s = the request's raw bytes / time; ratio = plain files' "
                  "time (the same raw bytes, one file per layer and field) / this time, same run; page cache, no "
                  "fsync. `:crc-thread` / `:crc-inline`: the saving thread writes, `CHUNK_THREADS` 2 / 1; "
                  "`:help` / `:help+crc-thread`: shards of `writer.HELP_BYTES` or more by the help thread "
                  "(`HELP_WRITES`), checksums on the saving / a chunk thread; "
                  "`:put-2` / `:put-4`: `LOCAL_PUT_THREADS` 2 / 4.", ""]
        lines += table(["case", "provider", "MB stored", "median ms", "GB/s", "state GB/s", "ratio vs plain"],
                       [[r["case"], r["provider"], num(r["bytes"] / 1e6, ".1f"), num(r["median_s"] * 1e3, ".2f"),
                         num(r["gbps"], ".2f"), num(r["state_gbps"], ".2f"), num(r["ratio"], ".3f")]
                        for r in store]) + [""]
    prof = res["steps"].get("profile", {}).get("rows", [])
    if prof:
        lines += ["## Profile: host vs kernel time per call (`python -m benchmarks.profile_kernels`)", ""]
        lines += table(["op", "tp", "wall ms", "host-only ms", "kernel ms", "kernel share of wall"],
                        [[p["op"], p["tp"], num(p["wall_ms"], ".3f"), num(p["host_ms"], ".3f"),
                          num(p["kernel_ms"], ".3f"), num(p["kernel_ms"] / p["wall_ms"], ".2f")]
                         for p in prof]) + [""]
    pieces = res["steps"].get("profile", {}).get("launch_rows", [])
    if pieces:
        lines += ["## Launch path: a set pack call's host time, piece by piece "
                  "(`python -m benchmarks.launch_variants`)", "",
                  "Microseconds a call of one Kimi-Linear request's `PackSet.pack` (tp=1) and of each of its "
                  "pieces and their alternatives; `back to back` lines time calls issued with one sync at the end "
                  "(the GPU's pace, where it is the bound).", ""]
        lines += table(["piece", "us a call"], [[p["piece"], num(p["us"], ".2f")] for p in pieces]) + [""]
    calls = res["steps"].get("profile", {}).get("set_call_rows", [])
    if calls:
        lines += ["## Set calls back to back, variant against variant (`python -m benchmarks.set_calls`)", "",
                  "Ten calls of one Kimi-Linear request's set pack / unpack (tp=1) issued back to back and one sync, "
                  "per call, median of interleaved rounds; ratio = bytes read + written per second over one "
                  "synchronized device copy's (as `bench_kernels`' `stream` rows).", ""]
        lines += table(["variant", "us a call", "GB/s", "ratio vs copy"],
                       [[r["variant"], num(r["us"], ".1f"), num(r["gbps"], ".0f"), num(r["ratio"], ".3f")]
                        for r in calls]) + [""]
    timeline = res["steps"].get("profile", {}).get("timeline_rows", [])
    if timeline:
        from benchmarks.save_timeline import COLUMNS

        lines += ["## Save timeline on the GPU (`python -m benchmarks.save_timeline`)", "",
                  "Median ms from the start of one save (torch.profiler, one clock for host and GPU): its end, `_pack` "
                  "returning (the worker's save), the pack kernels' and the device-to-host copies' first start and "
                  "last end, and the time before the last copy ends that the GPU ran neither.", ""]
        lines += table(["codecs", "provider", *(f"{c} ms" for c in COLUMNS)],
                       [[r["codecs"], r["provider"], *(num(r[c], ".3f") for c in COLUMNS)] for r in timeline])
        lines += [""]
    stages = res["steps"].get("profile", {}).get("save_stages", {})
    if stages:
        names = list(next(iter(stages.values())))
        lines += ["## Save path stages (`python -m benchmarks.profile_save`)", "",
                  "Median ms of one save of the save path's request (a store that keeps nothing), from its "
                  "start: `_pack` returning (the step's host time), the cache read, the host copies done; then "
                  "the writer's part, an idle flush, the whole save + flush, and a plain d2h copy of the packed "
                  "bytes.", ""]
        lines += table(["codecs", *names], [[c, *(num(v.get(k), ".3f") for k in names)] for c, v in stages.items()])
        lines += [""]
    for n, s in res["steps"].items():
        if s["status"] not in ("ok", "passed", "skipped"):
            lines += [f"**Step `{n}`: {s['status'].upper()}**; its output is in `{res['files']['log']}`.", ""]
    return "\n".join(lines)


def render_plot(res: dict, path: Path) -> None:
    """GB/s of every result (log scale) with its baseline as a black tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(s, [r for r in res["results"] if r["suite"] == s])
              for s in ("kernels", "save_path", "load_path", "store")]
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(8 * max(len(panels), 1), 6), squeeze=False)
    # one axis per panel, and one left empty (with its note) when there is no panel
    for ax, (suite, rows) in zip(axes[0], panels, strict=False):
        labels = [f"{r['case']}\n{r['provider']}" for r in rows]
        x = range(len(rows))
        providers = sorted({r["provider"] for r in rows})
        ax.bar(x, [r["gbps"] for r in rows], color=[f"C{providers.index(r['provider']) % 10}" for r in rows])
        ax.scatter(x, [r["baseline_gbps"] for r in rows], marker="_", s=300, c="k", zorder=3,
                   label=rows[0]["baseline"])
        for i, r in zip(x, rows, strict=True):  # the ratio to the baseline, over each bar
            ax.annotate(f"{r['ratio']:.2f}x", (i, r["gbps"]), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x), labels, rotation=90, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{suite}: GB/s (bars), baseline (ticks), ratio to it (labels)", fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if not panels:
        axes[0][0].text(0.5, 0.5, "no benchmark results", ha="center", transform=axes[0][0].transAxes)
    t = res["steps"].get("tests", {})
    fig.suptitle(f"anchorkv GPU validation, {res['machine']} ({res['mode']}); kernel tests: {t.get('status')}"
                 + (f" ({t['passed']} passed, {t['failures'] + t['errors']} failed)" if "tests" in t else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_report(res: dict, out: Path, plot: bool = True) -> None:
    from benchmarks.reporting import finite

    res["results"] = results(res["steps"])
    res["targets"] = targets(res["results"], bool(res["device"].get("gpu")))
    (out / res["files"]["json"]).write_text(json.dumps(finite(res), indent=1, allow_nan=False, default=str) + "\n")
    (out / res["files"]["md"]).write_text(render_markdown(res) + "\n")
    if plot and importlib.util.find_spec("matplotlib") is not None:
        render_plot(res, out / res["files"]["png"])


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    from benchmarks.machine import session_env

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results", help="report directory (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="benchmarks at small sizes, one round (smoke test)")
    ap.add_argument("--skip-tests", action="store_true", help="do not run tests/kernels")
    ap.add_argument("--tests-k", help="pytest -k expression selecting kernel tests")
    ap.add_argument("--with-sm90", action="store_true",
                    help="also run tests/kernels/test_sm90.py (a CPU-side compile check CI runs; ~30 s)")
    ap.add_argument("-k", help="pytest -k expression selecting benchmarks")
    ap.add_argument("--budget", type=float, default=420, help="seconds for all steps (default: %(default)s)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = Path(args.out) if os.path.isabs(args.out) else ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    machine, device, missing = environment()
    print(f"anchorkv GPU validation ({'quick' if args.quick else 'full'}) on {machine}, "
          f"budget {args.budget:.0f} s, report in {out}", flush=True)
    if missing:
        print("  MISSING modules: " + "; ".join(f"{m} ({NEEDS[m]})" for m in missing)
              + " -> run scripts/fetch_gpu_wheels.sh where there is network and bring .whl", flush=True)
    files = {"json": f"{machine}.json", "md": f"{machine}.md", "png": f"{machine}.png",
             "log": f"{machine}-validate.log", "junit": f"{machine}-tests.xml"}
    log = out / files["log"]
    log.write_text(f"anchorkv GPU validation on {machine}: {json.dumps(device)}\n")
    env = session_env(PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in
                      os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
                      ANCHORKV_BENCH_QUICK="1" if args.quick else "0")
    res = {"machine": machine, "device": device, "missing": missing, "mode": "quick" if args.quick else "full",
           "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": shlex.join(["scripts/gpu_validate.sh", *(argv if argv is not None else sys.argv[1:])]),
           "budget_s": args.budget, "files": files, "steps": {}, "seconds": 0.0}
    active = [s for s in STEPS if not (s[0] == "tests" and args.skip_tests)]
    if args.skip_tests:
        res["steps"]["tests"] = {"status": "skipped", "reason": "--skip-tests"}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, cap, least) in enumerate(active):
            left = args.budget - (time.perf_counter() - t0) - REPORT_S
            kept = sum(s[2] for s in active[i + 1:])
            limit = min(cap, left - GRACE_S - kept)
            if limit < least / 2:
                # say what it would take: a step is never given less than half its minimum
                short = least / 2 - limit
                reason = (f"{left:.0f} s of the budget left, {kept} s of it kept for the later steps: "
                          f"{limit:.0f} s for this one, which needs {least / 2:.0f}; pass --budget "
                          f"{args.budget + short:.0f} or more")
                print(f"  {name}: no time ({reason})", flush=True)
                res["steps"][name] = {"status": "no time", "reason": reason}
                continue
            if name == "tests":
                res["steps"][name] = run_tests(args, out, machine, limit, log, env)
            elif name == "profile":
                res["steps"][name] = run_profile(args, limit, log, env)
            else:
                res["steps"][name] = run_bench(name, args, limit, log, env, Path(tmp))
            res["seconds"] = time.perf_counter() - t0
            write_report(res, out, plot=False)  # after every step: a run cut short leaves its report
    res["seconds"] = time.perf_counter() - t0
    write_report(res, out)
    for f in files.values():
        if (out / f).exists():
            print(f"  wrote {out / f}")
    bad = [n for n, s in res["steps"].items() if s["status"] not in ("ok", "passed", "skipped")]
    t = res["steps"]["tests"]
    print(f"kernel tests: {t['status']}" + (f" ({t['passed']} passed, {t['failures']} failed, {t['errors']} "
                                            f"errors, {t['skipped']} skipped)" if "tests" in t else ""))
    if bad:
        listed = ", ".join(f"{n} ({res['steps'][n]['status']})" for n in bad)
        print(f"FAILED steps: {listed} (log: {log})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
