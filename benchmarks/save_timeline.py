"""A save's timeline on the GPU: when, from the start of one save, its pack kernels and its copy
to pinned host memory run, and when the host is done (CUDA only).

    python -m benchmarks.save_timeline [--rounds 10] [--quick]

`bench_save_path.py` times a save whole (`pack+d2h`: `WorkerSide.save` + `flush`, against a plain
copy of the packed bytes to pinned memory, issue 13's target >= 0.8 of it) and its GPU part alone
(`set+d2h`: the worker's `PackSet.pack`, then one copy; `chunks+d2h`: the copies overlapping the
pack). Their gap to the copy is host time, GPU time or idle time between them; this tells which.
Each round runs under `torch.profiler` (CPU and CUDA activities, one clock), synchronized before;
for each provider and codec set it prints the median over `--rounds` rounds (after one warm-up)
of, in ms from the round's start:

    round        the round's end (pack+d2h: after `flush`, the writer thread done)
    _pack        when `WorkerSide._pack` returned (pack+d2h: the step's host time)
    kernel       the first pack kernel's start and the last one's end
    d2h          the first device-to-host copy's start and the last one's end
    gpu idle     the round's time with neither a kernel nor a copy running, before the last copy ends

The profiler adds its own host cost to each op (a few us), so host marks run late by that; the
GPU spans are the GPU's. A diagnostic, not a gate (`gpu_validate`'s profile step runs it on a
GPU).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

#: (codecs, provider) order of the printed lines
PROVIDERS = ("set+d2h", "chunks+d2h", "pack+d2h")
#: names of CUDA runtime and driver API calls (cudaLaunchKernel, cuLaunchKernelEx, ...) and of
#: the synchronizations CUPTI records as device activities ("Device Synchronize", "Stream Wait
#: Event", ...: from the host's call to the wait's end), none of them GPU work
_RUNTIME = re.compile(r"cu(da)?[A-Z]|.*(Synchronize|Sync\b|Wait Event)")
COLUMNS = ("round", "_pack", "kernel start", "kernel end", "d2h start", "d2h end", "gpu idle")


def _spans(events, t0: int, t1: int) -> dict[str, list[tuple[int, int]]]:
    """The CUDA kernels' and device-to-host copies' (start, end) ns that start in [t0, t1]."""
    out: dict[str, list[tuple[int, int]]] = {"kernel": [], "d2h": [], "other": []}
    for e in events:
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        s = e.start_ns()
        if not t0 <= s <= t1:
            continue
        name = e.name()
        if _RUNTIME.match(name):  # the host's CUDA runtime and driver calls (launches, syncs)
            continue
        kind = "d2h" if name.startswith("Memcpy DtoH") else "other" if name.startswith("Mem") else "kernel"
        out[kind].append((s, s + e.duration_ns()))
    return out


def _idle(spans: list[tuple[int, int]], t0: int, until: int) -> int:
    """ns of [t0, until] that no span covers."""
    busy, at = 0, t0
    for s, e in sorted(spans):
        s, e = max(s, at), min(e, until)
        if e > s:
            busy += e - s
            at = e
    return (until - t0) - busy


def timeline(fn, rounds: int, marks: list[str]) -> dict[str, float]:
    """Median ms of each column over `rounds` profiled calls of `fn` (after a warm-up call);
    `marks` names the host ranges (`record_function`) whose end is a column."""
    rows: dict[str, list[float]] = {c: [] for c in COLUMNS}
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for r in range(rounds + 1):
            sync()
            with torch.profiler.record_function(f"anchorkv round {r}"):
                fn()
                sync()
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    cpu = [e for e in events if e.device_type() == torch.autograd.DeviceType.CPU]
    for r in range(1, rounds + 1):
        (rnd,) = [e for e in cpu if e.name() == f"anchorkv round {r}"]
        t0, t1 = rnd.start_ns(), rnd.start_ns() + rnd.duration_ns()
        spans = _spans(events, t0, t1)

        def ms(t: int, t0: int = t0) -> float:
            return (t - t0) / 1e6

        rows["round"].append(ms(t1))
        ends = [e.start_ns() + e.duration_ns() for e in cpu if e.name() in marks and t0 <= e.start_ns() <= t1]
        rows["_pack"].append(ms(min(ends)) if ends else float("nan"))
        ks, ds = spans["kernel"], spans["d2h"]
        rows["kernel start"].append(ms(min(s for s, _ in ks)) if ks else float("nan"))
        rows["kernel end"].append(ms(max(e for _, e in ks)) if ks else float("nan"))
        rows["d2h start"].append(ms(min(s for s, _ in ds)) if ds else float("nan"))
        last = max(e for _, e in ds) if ds else t1
        rows["d2h end"].append(ms(last))
        rows["gpu idle"].append(_idle(ks + ds + spans["other"], t0, last) / 1e6)
    return {c: statistics.median(v) for c, v in rows.items()}


def _round(req, provider: str, rounds: int):
    """One round of `provider` on `req` (a `bench_save_path.Request`); for `pack+d2h`, each of
    `rounds` calls saves a spec made beforehand (a 7680-token spec takes the host ~0.1 ms to
    build: the scheduler's work, outside a save, as in `bench_save_path`)."""
    from anchorkv.connector.plan import Metadata
    from benchmarks.bench_save_path import CHUNKS

    if provider == "pack+d2h":
        specs = [Metadata(saves=[req.spec()]) for _ in range(rounds)]

        def save() -> None:
            req.discard_worker.save(specs.pop())
            req.discard_worker.flush()
        return save
    return lambda: req.set_then_copy(CHUNKS if provider == "chunks+d2h" else 0)  # (synchronized)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="bench_save_path's quick request (8.7 MB)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("save_timeline: no CUDA device (it times the GPU's kernels and copies)", file=sys.stderr)
        return 2
    from benchmarks.bench_save_path import QUICK_TOKENS, TOKENS, Request, request_layout

    print(f"== save timeline, {torch.cuda.get_device_name()}: median ms from a round's start, {args.rounds} rounds")
    print("   " + " | ".join(["codecs", "provider", *COLUMNS]))
    for codecs in ("raw", "quant"):
        root = Path(tempfile.mkdtemp(prefix="anchorkv-save-timeline-"))
        req = Request(request_layout(args.quick), QUICK_TOKENS if args.quick else TOKENS, codecs, root)
        worker = req.discard_worker
        pack = worker._pack

        def traced_pack(spec, _pack=pack):
            with torch.profiler.record_function("anchorkv _pack"):
                return _pack(spec)

        worker._pack = traced_pack  # type: ignore[method-assign]
        try:
            for provider in PROVIDERS:
                marks = ["anchorkv _pack"] if provider == "pack+d2h" else []
                row = timeline(_round(req, provider, args.rounds + 1), args.rounds, marks)  # (+1: the warm-up)
                print("   " + " | ".join([codecs, provider, *(f"{row[c]:.3f}" for c in COLUMNS)]))
            failed = (worker.stats.take() or {}).get("save_failed")
            if failed:
                raise RuntimeError(f"{failed} saves were refused: the timeline would time the refusals")
        finally:
            req.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
