"""A Kimi-Linear request's `Store.save` with each thread setting of `bench_store.SAVE_THREADS`
against plain files, rounds interleaved in one process, with the spread a median hides.

    .venv/bin/python -m benchmarks.store_save_threads [--codecs raw|quant] [--rounds 40] [VARIANT ...]

Prints, per variant (`plain`, `default`: the store's own settings, a `SAVE_THREADS` key, or
`put-N`: N put threads),
the median, mean and 90th percentile ms and the median's ratio to plain. `bench_store.py`'s
save rows take the median of 5 rounds; where a variant stalls in some rounds (two busy threads
on two shared vCPUs: `store.HELP_WRITES`), that median moves run to run, and this does not.
Before each round (untimed) the directory is emptied and `os.sync()` flushes the last one.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import bench_store as B


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codecs", choices=sorted(B.CODEC_SETS), default="raw")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("variants", nargs="*", default=["default", "crc-thread", "help"])
    args = ap.parse_args()
    for v in args.variants:
        try:
            v == "default" or B.save_threads(v)
        except ValueError as e:
            ap.error(f"{e} (or default)")
    req = B.request(B.TOKENS)
    root = Path(tempfile.mkdtemp(prefix="anchorkv-save-threads-"))

    def fresh() -> Path:
        shutil.rmtree(root / "d", ignore_errors=True)
        (root / "d").mkdir(parents=True)
        os.sync()
        return root / "d"

    def timed(fn) -> float:
        d = fresh()
        t = time.perf_counter()
        fn(d)
        return time.perf_counter() - t

    runs = {"plain": lambda d: B.plain_save(req, d)}
    for v in args.variants:
        kind = args.codecs if v == "default" else f"{args.codecs}:{v}"
        runs[v] = lambda d, kind=kind: B.store_save(req, d / "store", kind)
    times: dict[str, list[float]] = {k: [] for k in runs}
    try:
        for r in range(args.rounds + 2):  # two warm-up rounds
            for k, fn in runs.items():
                t = timed(fn)
                if r >= 2:
                    times[k].append(t)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    plain = statistics.median(times["plain"])
    print(f"{args.codecs} request, {args.rounds} rounds interleaved (ms): median, mean, p90, ratio of medians vs plain")
    for k, v in times.items():
        v.sort()
        med = statistics.median(v)
        print(f"  {k:16s} {med * 1e3:7.2f} {statistics.mean(v) * 1e3:7.2f} {v[int(0.9 * len(v))] * 1e3:7.2f}"
              f"  {plain / med:.3f}")


if __name__ == "__main__":
    main()
