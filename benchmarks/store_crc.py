"""Which crc32c library and where: a store save of one Kimi-Linear request, interleaved A/B.

    python -m benchmarks.store_crc [--rounds 25] [--loads] [--out DIR]

The request of `bench_store.py` (tp=1, 7680 tokens, 105.3 MB raw, raw and quant codecs), saved
to a local store with its checksums computed by google-crc32c on the writing thread before each
write (anchorkv's default on 2 cores without a GIL-free library), by fastcrc (the default
library) on the writing thread and on a chunk thread while the shard is written, and by the
`crc32c` package on a chunk thread (where installed): all in one process, round
after round (plain files first in each round, `os.sync()` before every save), so the two see the
same machine state. `--loads` also loads each entry after its save (a fresh `Store`, as
`bench_store.py`), which moves the page cache between saves. Medians of the rounds after the
first; ratio = plain files' time / this time (the DESIGN's 0.8x). Results:
`benchmarks/results/<machine>-store-crc.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--loads", action="store_true", help="load each entry after its save")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    from anchorkv.store import format as F
    from anchorkv.store import store as S
    from benchmarks.bench_store import _fresh, plain_load, plain_save, request, store_load, store_save
    from benchmarks.machine import machine_name

    variants: dict[str, tuple] = {"google-crc32c inline": (None, 1)}
    try:
        from fastcrc import crc32 as fast
    except ImportError:
        pass
    else:
        variants |= {"fastcrc inline": (fast.iscsi, 1), "fastcrc thread": (fast.iscsi, 2)}
    try:
        import crc32c as icrar
    except ImportError:
        pass
    else:
        variants["crc32c thread"] = (icrar.crc32c, 2)
    if len(variants) == 1:
        sys.exit("benchmarks.store_crc: neither fastcrc nor the crc32c package is installed (pip install -e .)")
    req = request(7680)
    kept = F._CRC_FREE, S.CHUNK_THREADS
    times: dict[str, list[float]] = {}

    def timed(key: str, fn) -> object:
        t = time.perf_counter()
        out = fn()
        times.setdefault(key, []).append(time.perf_counter() - t)
        return out

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plain = root / "plain"
        try:
            for _ in range(args.rounds + 1):
                _fresh(plain)
                os.sync()
                timed("plain save", lambda: plain_save(req, plain))
                if args.loads:
                    timed("plain load", lambda: plain_load(req, plain))
                for name, (fn, threads) in variants.items():
                    F._CRC_FREE, S.CHUNK_THREADS = fn, threads
                    for codecs in ("raw", "quant"):
                        d = _fresh(root / f"{name}-{codecs}".replace(" ", "-"))
                        os.sync()
                        info = timed(f"{codecs} save, {name}", lambda d=d, c=codecs: store_save(req, d, c))
                        if args.loads:
                            timed(f"{codecs} load, {name}", lambda d=d, i=info: store_load(req, d, i.id))
        finally:
            F._CRC_FREE, S.CHUNK_THREADS = kept
    median = {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in times.items()}
    rows = {}
    for key, m in median.items():
        base = median["plain load" if " load" in key else "plain save"]
        rows[key] = {"median_ms": round(m * 1e3, 2), "ratio_vs_plain": round(base / m, 3)}
        print(f"{key}: {m * 1e3:.1f} ms ({base / m:.3f}x plain)")
    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_name()
    (args.out / f"{machine}-store-crc.json").write_text(json.dumps({
        "device": machine, "cpus": os.cpu_count(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.store_crc " + " ".join(argv if argv is not None else sys.argv[1:]),
        "rounds": args.rounds, "loads": args.loads, "results": rows,
    }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
