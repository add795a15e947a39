"""A restore's reads: the worker's `_read` of every part of one saved Kimi-Linear request, with
its parts read one at a time, as many at a time as the worker does (`READ_THREADS` from a local
directory: up to 3, no more than the cores; `REMOTE_READ_THREADS` from an object store: up to 8)
and 8 at a time (or the `--threads` given), alternated in one process.

    python -m benchmarks.restore_reads [--store local|s3] [--rounds 4] [--tokens 7680] [--threads 1,2,3,4,8]

`local`: a store in a temporary directory (reads come from the page cache). `s3`: a real
S3-compatible server, moto, started on loopback (the `[test]` extra). Default raw codecs (105 MB
at 7680 tokens, tp=1), the pack kernel stubbed (the bytes do not matter here). Prints ms per
read of the whole request, per round.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run(store: str, rounds: int, tokens: int, threads: tuple[int, ...] = ()) -> dict[int, list[float]]:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("ANCHORKV_BACKEND", "triton")
    from anchorkv.connector.config import ConnectorConfig
    from anchorkv.connector.plan import LoadSpec, Metadata
    from anchorkv.connector.storage_zarr import ZarrEntryStore
    from anchorkv.connector.worker import WorkerSide
    from benchmarks.bench_save_path import CODEC_SETS, Request, request_layout
    from benchmarks.host_path import zero_scale_packs

    zero_scale_packs()
    proc = None
    req = Request(request_layout(False), tokens, "raw", Path(tempfile.mkdtemp(prefix="anchorkv-reads-")))
    entries = req.entries
    try:
        if store == "s3":
            from tests.store.conftest import S3_OPTIONS, make_s3_bucket, start_moto

            proc, url = start_moto()
            config = ConnectorConfig.from_extra_config({
                "store": f"s3://{make_s3_bucket(url)}/cache", "codec": CODEC_SETS["raw"],
                "storage_options": {**S3_OPTIONS, "endpoint": url}})
            entries = ZarrEntryStore(config, req.layout)
        worker = WorkerSide(entries.config, req.groups, "none", entries, 1, 0)
        worker.register(req.layout, req.views)
        spec = req.spec()
        worker.save(Metadata(saves=[spec]))
        worker.flush()
        [entry] = entries.store.list()
        load = LoadSpec("restore", entry.id, 0, spec.num_tokens, spec.blocks)
        own = worker.read_threads  # (the worker's: local or remote)
        pools = {n: ThreadPoolExecutor(n) for n in sorted({*(threads or (1, 8)), own})}
        pools[own] = worker._read_pool
        times: dict[int, list[float]] = {n: [] for n in pools}
        for _ in range(rounds + 1):  # the first round warms up (and sizes the arena)
            for n, pool in pools.items():
                worker._read_pool = pool
                worker._arena.reset()
                t = time.perf_counter()
                worker._read(load)
                times[n].append((time.perf_counter() - t) * 1e3)
        worker.shutdown()
        return {n: ms[1:] for n, ms in times.items()}
    finally:
        if entries is not req.entries:
            entries.close()
        req.close()
        if proc is not None:
            proc.kill()


def _counts(value: str) -> tuple[int, ...]:
    """`--threads`: thread counts, comma-separated, each at least 1."""
    try:
        counts = tuple(int(n) for n in value.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected thread counts >= 1 like 1,2,4, found {value!r}")
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", choices=["local", "s3"], default="local")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=7680)
    ap.add_argument("--threads", type=_counts, default=(),
                    help="read thread counts to time beside the worker's own (default: 1,8)")
    args = ap.parse_args(argv)
    for n, ms in run(args.store, args.rounds, args.tokens, args.threads).items():
        print(f"{args.store}: {n} read thread(s): " + ", ".join(f"{t:.1f}" for t in ms) + " ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
