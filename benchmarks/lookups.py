"""What a shared-prefix lookup costs the scheduler: `Store.match` exact against `shared=True`.

    python -m benchmarks.lookups [--store local|s3] [--entries 64] [--rounds 20] [--out DIR]

A model without recurrent state (the store tests' tiny model, its paged layers alone): `--entries`
entries of ~2000 tokens under one key (token-keyed: they share their first 300 tokens, then
differ), and a prompt that shares those 300 tokens with each (no whole match: a shared lookup
finds 256 tokens). The scheduler runs a lookup per admitted request on its own thread, so this is
time vLLM's scheduler loop waits. Rows, the median of `--rounds` lookups each:

    fresh store   a new `Store` per lookup: its manifests read on demand (a shared lookup reads
                  up to `SHARED_READS` of them, at once from an object store)
    warm store    one `Store` after a lookup per 8 entries (every manifest cached)

`local`: a store in a temporary directory (the page cache); `s3`: moto on loopback (the `[test]`
extra; its server, on the same cores, bounds the concurrent reads). Results:
`benchmarks/results/<machine>-lookups-<store>.json`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def _tokens(n: int, seed: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7919 + seed * 104729) % 151_000


def run(store: str, entries: int, rounds: int) -> dict[str, float]:
    from anchorkv.codec.models import custom_layout
    from anchorkv.store.store import Store
    from tests.store.helpers import all_packed, tiny_layout

    full = tiny_layout()
    layout = custom_layout("TinyMLA", [(layer.name, "paged", layer.page) for layer in full.layers
                                       if layer.kind.value == "paged"], block_size=full.block_size)
    codecs = {"latent": "raw"}
    base = _tokens(300, 1)
    proc, tmp = None, Path(tempfile.mkdtemp(prefix="anchorkv-lookups-"))
    try:
        if store == "s3":
            from tests.store.conftest import S3_OPTIONS, make_s3_bucket, start_moto

            proc, url = start_moto()
            root, options = f"s3://{make_s3_bucket(url)}/cache", {**S3_OPTIONS, "endpoint": url}
        else:
            root, options = str(tmp / "store"), {}
        writer = Store.open(root, **options)
        for i in range(entries):
            toks = np.concatenate([base, _tokens(1700 + i, 10 + i)])
            writer.save(layout, codecs, toks, all_packed(layout, codecs, len(toks)))
        writer.close()
        prompt = np.concatenate([base, _tokens(1500, 999)])
        fp = layout.fingerprint_hash()

        def lookup(s: Store, shared: bool):
            return s.match(fingerprint_hash=fp, tokens=prompt, shared=shared)

        def median_ms(fn) -> float:
            times = []
            for _ in range(rounds):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return statistics.median(times) * 1e3

        assert lookup(Store.open(root, create=False, **options), True).tokens == 256
        out = {}
        for shared in (False, True):
            name = "shared" if shared else "exact"

            def fresh(shared=shared):
                s = Store.open(root, create=False, **options)
                lookup(s, shared)
                s.close()

            out[f"fresh store, {name}"] = median_ms(fresh)
            warm = Store.open(root, create=False, **options)
            for _ in range(-(-entries // 8) + 1):
                lookup(warm, True)
            out[f"warm store, {name}"] = median_ms(lambda s=warm, shared=shared: lookup(s, shared))
            warm.close()
        return out
    finally:
        if proc is not None:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", choices=["local", "s3"], default="local")
    ap.add_argument("--entries", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    from benchmarks.machine import machine_name

    t = time.perf_counter()
    ms = run(args.store, args.entries, args.rounds)
    for row, v in ms.items():
        print(f"{args.store}, {args.entries} entries: {row}: {v:.3f} ms")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{machine_name()}-lookups-{args.store}.json"
    path.write_text(json.dumps({
        "machine": machine_name(), "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.lookups " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": round(time.perf_counter() - t, 1), "store": args.store, "entries": args.entries,
        "rounds": args.rounds, "median_ms": {k: round(v, 4) for k, v in ms.items()},
    }, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
