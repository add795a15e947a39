"""A save's shard writes to an S3-compatible store: `Store.save` of one Kimi-Linear request
(`bench_store`'s, tp=1) into a real S3-compatible server, moto, started on loopback (the `[test]`
extra), with the object backend's writes one at a time (`write_concurrency` 1) and
`ObjectBackend.write_concurrency` at a time, alternated in one process.

    python -m benchmarks.store_puts [--rounds 4] [--tokens 7680] [--codecs raw|quant]

Prints ms per save, per round (after one warm-up round). moto is a Python server on the same
machine: its own CPU bounds what writes in flight gain here; a remote store's round trips are
what they hide.
"""

from __future__ import annotations

import argparse
import sys


def run(rounds: int, tokens: int, codecs: str) -> dict[int, list[float]]:
    import time

    from anchorkv.store.backends._object import ObjectBackend
    from anchorkv.store.store import Store
    from benchmarks.bench_store import request
    from tests.store.conftest import S3_OPTIONS, make_s3_bucket, start_moto

    req = request(tokens)
    proc, url = start_moto()
    try:
        bucket = make_s3_bucket(url)
        times: dict[int, list[float]] = {n: [] for n in sorted({1, ObjectBackend.write_concurrency})}
        for r in range(rounds + 1):  # the first round warms up
            for n, ms in times.items():
                with Store.open(f"s3://{bucket}/r{r}-{n}", **S3_OPTIONS, endpoint=url) as store:
                    store.backend.write_concurrency = n  # (this store's backend only)
                    t = time.perf_counter()
                    store.save(req.layout, req.codecs(codecs), req.token_ids, req.packed[codecs], anchor="bench")
                    ms.append((time.perf_counter() - t) * 1e3)
        return {n: ms[1:] for n, ms in times.items()}
    finally:
        proc.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=7680, help="a multiple of 1920 (default: %(default)s)")
    ap.add_argument("--codecs", choices=["raw", "quant"], default="raw")
    args = ap.parse_args(argv)
    for n, ms in run(args.rounds, args.tokens, args.codecs).items():
        print(f"s3 {args.codecs}: {n} put(s) at a time: " + ", ".join(f"{t:.1f}" for t in ms) + " ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
