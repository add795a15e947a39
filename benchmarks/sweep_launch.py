"""Measure the kernels' launch configuration on a GPU: tile size x warps per program.

    python -m benchmarks.sweep_launch [--json OUT]

For each field of one Kimi-Linear request (tp 1 and 4: conv, recurrent, latent; the codecs of
`bench_kernels.py` plus raw), times `pack_many` / `unpack_many` of that field's items for every
tile size x `num_warps` pair (kernel time from the profiler, mean of 10) and prints the
best pair per (op, field) and the default's distance from it. The measured rule goes into
`anchorkv.kernels.batch` (`TILE_BYTES`, `ELEMENTS_PER_THREAD`).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _time(fn, iters=10) -> float:
    """Kernel time per call in us, from the profiler's device timestamps (host launch overhead
    and gaps between launches excluded: this sweep is about the kernels' launch configuration)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = sum(ev.device_time_total for ev in prof.events()
                if ev.device_type == torch.autograd.DeviceType.CUDA and "kernel" in ev.name)
    return total / iters


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_launch needs CUDA", file=sys.stderr)
        return 2
    from anchorkv.codec import CodecSpec
    from anchorkv.kernels import PackItem, UnpackItem, batch, triton_pack, triton_unpack
    from benchmarks.bench_kernels import request

    default_tile, default_warps = batch.tile_elements, batch.num_warps
    rows = []
    defaults = {}
    for tp in (1, 4):
        req = request(tp)
        by_field: dict[str, list[int]] = {}
        for i, it in enumerate(req.items):
            key = f"{it.field.dtype} {list(it.field.shape)} {it.spec}"
            by_field.setdefault(key, []).append(i)
        for fmt_override in (None, "raw"):
            for key, idx in by_field.items():
                items = [req.items[i] for i in idx]
                if fmt_override:
                    items = [PackItem(it.buffer, it.field, it.block_ids, it.num_blocks,
                                      CodecSpec("raw", None)) for it in items]
                    key = key.rsplit(" ", 1)[0] + " raw"
                packed = triton_pack.pack_many(items)
                un = [UnpackItem(it.buffer, it.field, it.block_ids, it.num_blocks, it.spec, p, s)
                      for it, (p, s) in zip(items, packed, strict=True)]
                nbytes = sum(len(it.block_ids) * it.field.numel * it.field.itemsize
                             for it in items) + sum(p.numel() + s.numel() * 4 for p, s in packed)
                for tile in (1024, 4096, 16384):
                    for warps in (2, 4, 8):
                        batch.tile_elements = lambda _g, t=tile: t
                        batch.num_warps = lambda _e, w=warps: w
                        triton_pack.launch_config.cache_clear()
                        for op, fn in (("pack", lambda items=items: triton_pack.pack_many(items)),
                                       ("unpack", lambda un=un: triton_unpack.unpack_many(un))):
                            us = _time(fn)
                            rows.append(dict(tp=tp, field=key, op=op, tile=tile, warps=warps,
                                             us=us, gbps=nbytes / us / 1e3))
                batch.tile_elements, batch.num_warps = default_tile, default_warps
                triton_pack.launch_config.cache_clear()
                for op, fn in (("pack", lambda items=items: triton_pack.pack_many(items)),
                               ("unpack", lambda un=un: triton_unpack.unpack_many(un))):
                    defaults[(tp, key, op)] = _time(fn)
    best = {}
    for r in rows:
        k = (r["tp"], r["field"], r["op"])
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
    for k, r in sorted(best.items()):
        d = defaults.get(k, float("nan"))
        print(f"tp={k[0]} {k[2]:6} {k[1]:45} best tile={r['tile']:5} warps={r['warps']:2} "
              f"{r['us']:8.1f} us {r['gbps']:7.0f} GB/s | default {d:8.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            from benchmarks.machine import machine_name

            json.dump({"machine": machine_name(), "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
