"""Set calls back to back: what the host's launch path costs them, variant against variant in
one process (issue 13's `stream` rows; needs CUDA).

    python -m benchmarks.set_calls [--tp 1] [--rounds 30] [--calls 10]

One Kimi-Linear request (`bench_kernels.request`), `--calls` `PackSet.pack` (or
`UnpackSet.unpack`) calls issued back to back and one synchronization, per call; variants
interleaved round by round, median of `--rounds`:

    pack    tables staged by torch (`copy_`, `Event.record`) / by the driver (`cuda_driver`),
            rings of 4, 8 or 16 slots (`TableRing.SLOTS`: a call whose slot is still busy stages
            through torch's allocators)
    unpack  the same, and with the set kernel launched through the `Launcher`'s key
            (`Launcher.__call__`: a key from the tensors, an int32 view of the scales) instead of
            with addresses only (`_SetPlan._launch_set`, the default)

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
    from anchorkv.kernels import batch, cuda_driver
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
    tables = [pplan.tables, uplan.tables]
    if cuda_driver.driver() is None or uplan.fused is None:
        print("set_calls: no driver path here (libcuda not loaded, ANCHORKV_CUDA_DRIVER=0) or no set kernel",
              file=sys.stderr)
        return 2
    fused = uplan.fused
    direct = uplan._launch_set

    def keyed(batch_, table, site):  # (the launch before addresses only: the Launcher's key path)
        fused(_unpack_set_kernel, _at=site, tab=table, payload=batch_.payload, scales=batch_.scales.view(torch.int32))

    rings: dict[tuple, list] = {}

    def setting(how: str, slots: int = batch.TableRing.SLOTS, launch: str = "direct"):
        """Each variant's own rings (made at its first use), its unpack launch."""
        def apply():
            key = (how, slots)
            if key not in rings:
                saved = batch.TableRing.SLOTS
                batch.TableRing.SLOTS = slots
                try:
                    made = []
                    for t in tables:
                        t.ring = None
                        t.stage(pplan.device)  # (makes the ring)
                        t.ring.SLOTS = slots  # (the ring reads its size from itself at every call)
                        t.ring.release()  # (that stage launched nothing: its event says so at once)
                        if how == "torch":
                            t.ring.driver = None
                        made.append(t.ring)
                    rings[key] = made
                finally:
                    batch.TableRing.SLOTS = saved
            for t, r in zip(tables, rings[key], strict=True):
                t.ring = r
            uplan._launch_set = direct if launch == "direct" else keyed
        return apply

    default = batch.TableRing.SLOTS
    ops = {}
    for how, slots in (("torch", default), ("driver", default), ("driver", 4), ("driver", 16)):
        label = f"{how}, {slots} slots"
        ops[f"pack   {label}"] = (setting(how, slots), lambda: pset.pack(ids))
        if slots == default:
            ops[f"unpack {label}, key launch"] = (setting(how, slots, "key"), lambda: uset.unpack(packed, ids))
        ops[f"unpack {label}"] = (setting(how, slots), lambda: uset.unpack(packed, ids))
    ops["copy of the source"] = (setting("driver"), lambda: req.copy_dst.copy_(req.copy_src))
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
    falls = {f"{k[0]},{k[1]}": [r.fallbacks for r in v] for k, v in rings.items()}
    copy_gbps = 2 * req.source_bytes / statistics.median(synced) / 1e9
    moved = req.source_bytes + req.packed_bytes
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; tp={args.tp}, {len(req.items)} parts, "
          f"{req.source_bytes / 1e6:.1f} MB source, {req.packed_bytes / 1e6:.1f} MB packed; {calls} calls back to "
          f"back, median of {args.rounds} interleaved rounds; synchronized copy {copy_gbps:.0f} GB/s")
    for name, ts in times.items():
        sec = statistics.median(ts)
        nbytes = 2 * req.source_bytes if name.startswith("copy") else moved
        gbps = nbytes / sec / 1e9
        print(f"  {name:48s} {sec * 1e6:8.1f} us a call  {gbps:7.0f} GB/s  ratio {gbps / copy_gbps:.3f}")
    print(f"  (ring fallbacks pack/unpack by rings: {falls}; driver calls {cuda_driver.counts})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
