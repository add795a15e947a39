"""Where the time of one save goes, stage by stage: the step's launches, the pack on the GPU,
the copies to pinned host memory, the writer thread's views and checks, and the whole save.

    python -m benchmarks.profile_save [--codecs quant] [--rounds 10] [--quick]

`bench_save_path.py`'s `pack+d2h` row times the whole of a save against a plain copy of the
packed bytes to pinned memory (issue 13's target: >= 0.8 of it); this splits one save of the
same request (`bench_save_path.Request`, its worker with a store that keeps nothing) into what
runs one after the other, each the median of `--rounds` saves of new tokens, synchronized
before each:

    _pack returns        host time of the step's side: launches, copies queued, events
    cache read           until the pack has read the cache (`read`: what the next forward waits for)
    host copies done     until the packed bytes are in pinned memory (`ready`)
    writer               the writer thread's part for a completed save (views, NaN check, store)
    flush (idle)         a flush with nothing queued (what the benchmark's flush adds)
    save + flush         the whole, as `pack+d2h` times it
    d2h copy             the baseline: one copy of the packed bytes to pinned memory

and then `_pack` alone, in rounds of its own, with the side streams switched by `launch.on_stream`
(torch's C calls, the default) and by `torch.cuda.stream` (`launch.LEAN_STREAMS` off), the two
alternated within each round, which goes first alternating between rounds (medians of the
rounds):

    _pack cold           one call after a synchronization and `host_path.POLLUTE_BYTES` of other
                         memory traffic and Python (`host_path.cold_us`'s): the host's caches
                         cold, as a save finds them once a step (`_pack returns` above: after
                         the round's other work)
    _pack hot            the mean of `HOT` calls back to back (each call's host buffer given
                         back at once; with the copy stream each call's device batch waits for
                         its copy, so up to `HOT` are held: the warm-up round makes them): the
                         same code with the host's caches warm

(on this machine's CPU a `PackSet.pack` takes 4-6x its hot time after 64 MB of other memory
traffic, `python -m benchmarks.host_path`'s `cold` rows).

On a GPU (or with `--pack-profile`) it then lists where `_pack returns` and `writer` go: another
`--rounds` saves, their `WorkerSide._pack` and `_write` calls under cProfile, each function's own and
cumulative microseconds a call (the H200 spent ~0.35 ms there a save at stop 30, against ~0.05 ms
in `PackSet.pack`).

On a CPU the events are absent (the first three rows are one) and the pack runs the reference.
A diagnostic, not a gate (`gpu_validate`'s profile step prints it on a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profiling(profile: cProfile.Profile | None):
    """`profile` on for a `with` block (nothing without one)."""
    return profile if profile is not None else contextlib.nullcontext()


def breakdown(codecs: str = "quant", rounds: int = 10, quick: bool = False,
              pack_profile: cProfile.Profile | None = None,
              write_profile: cProfile.Profile | None = None, alone: bool = True) -> dict[str, float]:
    """Median milliseconds of each stage of one save (see the module docstring); with
    `pack_profile`, the measured rounds' `WorkerSide._pack` calls (the step's host time) are
    profiled into it, with `write_profile` their `WorkerSide._write` calls (the writer's part,
    after the host copies)."""
    from anchorkv.connector.plan import Metadata
    from benchmarks.bench_save_path import QUICK_TOKENS, TOKENS, Request, request_layout

    root = Path(tempfile.mkdtemp(prefix="anchorkv-profile-save-"))
    req = Request(request_layout(quick), QUICK_TOKENS if quick else TOKENS, codecs, root)
    worker = req.discard_worker
    times: dict[str, list[float]] = {k: [] for k in (
        "_pack returns", "cache read", "host copies done", "writer", "flush (idle)", "save + flush", "d2h copy")}
    try:
        for r in range(rounds + 1):  # the first round warms up
            spec = req.spec()
            _sync()
            t0 = time.perf_counter()
            with _profiling(pack_profile if r else None):
                packing = worker._pack(spec)
            t1 = time.perf_counter()
            if packing.read is not None:
                packing.read.synchronize()
            t2 = time.perf_counter()
            if packing.ready is not None:
                packing.ready.synchronize()
            t3 = time.perf_counter()
            with _profiling(write_profile if r else None):
                worker._write(spec, packing)
            t4 = time.perf_counter()
            worker.flush()
            t5 = time.perf_counter()
            spec = req.spec()
            _sync()
            t6 = time.perf_counter()
            worker.save(Metadata(saves=[spec]))
            worker.flush()
            t7 = time.perf_counter()
            req.copy("d2h-packed")
            t8 = time.perf_counter()
            if r:
                for k, v in zip(times, (t1 - t0, t2 - t0, t3 - t0, t4 - t3, t5 - t4, t7 - t6, t8 - t7), strict=True):
                    times[k].append(v * 1e3)
        failed = (worker.stats.take() or {}).get("save_failed")
        if failed:
            raise RuntimeError(f"{failed} saves were refused: the figures would time the refusals")
        out = {k: statistics.median(v) for k, v in times.items()}
        if alone:
            out.update(pack_alone(req, rounds))
        return out
    finally:
        req.close()  # (removes root)


#: `_pack` calls a `_pack hot` round times back to back
HOT = 20


def pack_alone(req, rounds: int) -> dict[str, float]:
    """Median ms of `WorkerSide._pack` of `req` (a `bench_save_path.Request`) cold and hot, with
    `launch.LEAN_STREAMS` on and off (see the module docstring). Each call's host buffer goes
    back to the pool at once (the hot calls' copies may overwrite one another's: nothing reads
    them)."""
    import numpy as np

    from anchorkv.kernels import launch
    from benchmarks.host_path import POLLUTE_BYTES, pollute

    worker = req.discard_worker
    junk = np.zeros(POLLUTE_BYTES, dtype=np.uint8)
    names = {True: "", False: ", torch.cuda.stream"}
    times: dict[str, list[float]] = {f"_pack {k}{n}": [] for n in names.values() for k in ("cold", "hot")}

    def call(spec) -> None:
        packing = worker._pack(spec)
        if packing.host is not None:
            worker._save_host.give(packing.host)

    lean = launch.LEAN_STREAMS
    try:
        for r in range(rounds + 1):  # the first round warms up
            for on in (True, False) if r % 2 else (False, True):
                launch.LEAN_STREAMS = on
                spec = req.spec()
                _sync()
                pollute(junk)  # (host_path.cold_us's other work)
                t0 = time.perf_counter()
                call(spec)
                t1 = time.perf_counter()
                _sync()
                specs = [req.spec() for _ in range(HOT)]
                t2 = time.perf_counter()
                for spec in specs:
                    call(spec)
                t3 = time.perf_counter()
                _sync()
                if r:
                    times[f"_pack cold{names[on]}"].append((t1 - t0) * 1e3)
                    times[f"_pack hot{names[on]}"].append((t3 - t2) / HOT * 1e3)
    finally:
        launch.LEAN_STREAMS = lean
    return {k: statistics.median(v) for k, v in times.items()}


def listing(profile: cProfile.Profile, calls: int, top: int = 25) -> list[tuple[str, float, float]]:
    """[(function, own us, us with callees)] per `calls`, the `top` by own time."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]  (pstats keeps them there)
    rows = [(f"{func} ({path.rsplit('/', 1)[-1]}:{line})" if line else func, tt / calls * 1e6, ct / calls * 1e6)
            for (path, line, func), (_, _, tt, ct, _) in stats.items()]
    return sorted(rows, key=lambda r: -r[1])[:top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codecs", choices=["raw", "quant"], default="quant")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="bench_save_path's quick request (8.7 MB)")
    ap.add_argument("--pack-profile", action="store_true",
                    help="list WorkerSide._pack's and _write's calls under cProfile (on by default on a GPU)")
    args = ap.parse_args(argv)
    # (on a GPU: where `_pack returns` goes, the step's host time; the stage timings above it
    # are taken in other rounds' calls, so the profiler's overhead is only in this listing)
    profiled = torch.cuda.is_available() or args.pack_profile
    ms = breakdown(args.codecs, args.rounds, args.quick)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"== save stages, {args.codecs} codecs, {device}: median ms of {args.rounds} saves")
    for k, v in ms.items():
        print(f"   {k:20s} {v:8.3f} ms")
    if profiled:
        profiles = {"_pack": cProfile.Profile(), "_write": cProfile.Profile()}
        breakdown(args.codecs, args.rounds, args.quick, profiles["_pack"], profiles["_write"], alone=False)
        for fn, profile in profiles.items():
            print(f"-- WorkerSide.{fn}, {args.codecs} codecs, {args.rounds} calls under cProfile: us a {fn} call, "
                  "own and with callees, by own time")
            for name, own, total in listing(profile, args.rounds):
                print(f"   {own:9.1f} {total:9.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
