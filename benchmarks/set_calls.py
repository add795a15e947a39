"""Set calls back to back: what the host's launch path costs them, variant against variant in
one process (issue 13's `stream` rows; needs CUDA).

    python -m benchmarks.set_calls [--tp 1] [--rounds 30] [--calls 10]

One Kimi-Linear request (`bench_kernels.request`), `--calls` `PackSet.pack` (or
`UnpackSet.unpack`) calls issued back to back and one synchronization, per call; variants
interleaved round by round, median of `--rounds`:

    pack    tables by torch (`copy_`, `Event.record`) / by the driver (`cuda_driver`)
    unpack  the same two, each with the set kernel launched through the `Launcher`'s key
            (`Launcher.__call__`: a key from the tensors, an int32 view of the scales) or with
            addresses only (`_SetPlan._launch_set`, the default)

and, for scale, a device copy of the source back to back and one synchronized copy (what
`bench_kernels` divides by). Ratio = bytes read + written per second over the synchronized
copy's, as `bench_kernels`' `stream` rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("set_calls needs CUDA", file=sys.stderr)
        return 2
    from anchorkv.kernels import cuda_driver
    from anchorkv.kernels.triton_unpack import _unpack_set_kernel
    from benchmarks.bench_kernels import request

    req = request(args.tp)
    pset, uset, ids = req.pack_set, req.unpack_set, req.slot_ids
    packed = req.packed_batch
    for _ in range(3):
        uset.unpack(packed, ids)
        pset.pack(ids)
    torch.cuda.synchronize()
    lens = pset._ids(ids, distinct=False)[0]
    pplan, uplan = pset._plans.find(lens, lambda: None), uset._plans.find(lens, lambda: None)
    rings = [pplan.tables.ring, uplan.tables.ring]
    drv = cuda_driver.driver()
    if drv is None or any(r is None or r.driver is None for r in rings):
        print("set_calls: no driver path here (libcuda not loaded, ANCHORKV_CUDA_DRIVER=0, or no set kernel)",
              file=sys.stderr)
        return 2
    fused = uplan.fused
    direct = uplan._launch_set

    def keyed(batch, table, site):  # (the launch before addresses only: the Launcher's key path)
        fused(_unpack_set_kernel, _at=site, tab=table, payload=batch.payload, scales=batch.scales.view(torch.int32))

    def setting(tables: str, launch: str = "direct"):
        def apply():
            for r in rings:
                r.driver = drv if tables == "driver" else None
            uplan._launch_set = direct if launch == "direct" else keyed
        return apply

    ops = {
        "pack   tables torch": (setting("torch"), lambda: pset.pack(ids)),
        "pack   tables driver": (setting("driver"), lambda: pset.pack(ids)),
        "unpack tables torch,  key launch": (setting("torch", "key"), lambda: uset.unpack(packed, ids)),
        "unpack tables torch,  direct": (setting("torch"), lambda: uset.unpack(packed, ids)),
        "unpack tables driver, key launch": (setting("driver", "key"), lambda: uset.unpack(packed, ids)),
        "unpack tables driver, direct": (setting("driver"), lambda: uset.unpack(packed, ids)),
        "copy of the source": (setting("driver"), lambda: req.copy_dst.copy_(req.copy_src)),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}
    synced: list[float] = []
    calls = args.calls
    for _ in range(args.rounds):
        for name, (apply, fn) in ops.items():
            apply()
            fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t) / calls)
        t = time.perf_counter()
        req.copy_dst.copy_(req.copy_src)
        torch.cuda.synchronize()
        synced.append(time.perf_counter() - t)
    setting("driver")()
    copy_gbps = 2 * req.source_bytes / statistics.median(synced) / 1e9
    moved = req.source_bytes + req.packed_bytes
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; tp={args.tp}, {len(req.items)} parts, "
          f"{req.source_bytes / 1e6:.1f} MB source, {req.packed_bytes / 1e6:.1f} MB packed; {calls} calls back to "
          f"back, median of {args.rounds} interleaved rounds; synchronized copy {copy_gbps:.0f} GB/s")
    for name, ts in times.items():
        sec = statistics.median(ts)
        nbytes = 2 * req.source_bytes if name.startswith("copy") else moved
        gbps = nbytes / sec / 1e9
        print(f"  {name:34s} {sec * 1e6:8.1f} us a call  {gbps:7.0f} GB/s  ratio {gbps / copy_gbps:.3f}")
    fallbacks = [r.fallbacks for r in rings]
    print(f"  (ring fallbacks pack/unpack: {fallbacks}; driver calls {cuda_driver.counts})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
