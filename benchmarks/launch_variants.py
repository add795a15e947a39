"""Host microseconds of the pieces of a `PackSet.pack` call on a GPU, and of the alternatives
to each (a diagnostic for issue 13's host-bound set calls; needs CUDA).

    python -m benchmarks.launch_variants [--tp 1] [--iters 300]

Pieces: the whole call; the set kernel's launch through its `Launcher`, through the compiled
kernel's runner with the same argument list, through the driver launcher (`CompiledKernel.run`,
no runner), each with tensors or with their addresses as ints (no `data_ptr()` call, no
`cuPointerGetAttribute`); the item tables' write, staging and release (`TableRing`) and each of
their CUDA calls; the batch's allocation and views. Kernel time: the set kernel with its
table on the device and read from page-locked host memory (no staging copy), bytes compared.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch


def gpu_us(fn, iters: int) -> float:
    """Wall microseconds a call with a sync at the end of `iters` back-to-back calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_variants needs CUDA", file=sys.stderr)
        return 2
    import triton

    from anchorkv.kernels import batch, launch
    from anchorkv.kernels import triton_pack as tp
    from benchmarks.bench_kernels import request
    from benchmarks.profile_kernels import host_us

    req = request(args.tp)
    pset = req.pack_set
    ids_by_slot = req.slot_ids
    pset.pack(ids_by_slot)
    lens, ids = pset._ids(ids_by_slot, distinct=False)
    plan = pset._plans.find(lens, lambda: None)
    fused = plan.fused
    assert fused is not None, "no set kernel for this plan"
    device = plan.device
    it = args.iters
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")

    def show(name: str, us: float) -> None:  # (one line a piece: `gpu_validate.launch_pieces` reads them)
        print(f"  {name:58s} {us:8.2f} us", flush=True)

    def row(name, fn, n=it):
        show(name, host_us(fn, n))

    for _ in range(3):
        row("PackSet.pack (all of it)", lambda: pset.pack(ids_by_slot))
    # the pieces
    row("_ids", lambda: pset._ids(ids_by_slot, distinct=False))
    row("plans.find", lambda: pset._plans.find(lens, lambda: None))
    row("batch_tensors (alloc + views)", lambda: batch.batch_tensors(plan.payload_bytes, plan.scale_values, device))
    nbytes = batch.scales_start(plan.payload_bytes) + 4 * plan.scale_values
    row("torch.empty alone", lambda: torch.empty(nbytes, dtype=torch.uint8, device=device))
    whole = torch.empty(nbytes, dtype=torch.uint8, device=device)
    row("batch_views alone", lambda: batch.batch_views(whole, plan.payload_bytes, plan.scale_values))
    row("tables.write", lambda: plan.tables.write(ids))
    ring = plan.tables.ring
    assert ring is not None

    def stage_release():
        plan.tables.stage(device)
        plan.tables.release()

    row("tables.stage + release (ring)", stage_release)

    def stage_release_at_site():
        at = launch.launch_site()
        plan.tables.stage(device, at)
        plan.tables.release(at)

    row("tables.stage + release (ring, at the launch site)", stage_release_at_site)
    row("  np.copyto into the pinned slot", lambda: np.copyto(ring.hosts[0], plan.tables.array))
    row("  device.copy_(pinned, non_blocking)", lambda: ring.devices[0].copy_(ring.host_tensors[0], non_blocking=True))
    drv = ring.driver
    if drv is not None:  # (`cuda_driver`: what the ring stages through given a launch site)
        raw = launch.launch_site()[1]
        row("  driver copy (cuMemcpyHtoDAsync)",
            lambda: drv.copy(ring.device_ptrs[0], ring.host_ptrs[0], ring.nbytes, raw))
        row("  driver event record (cuEventRecord)", lambda: drv.record(ring.events[0].cuda_event, raw))
    row("  event.query()", lambda: ring.events[0].query())
    stream = torch.cuda.current_stream(device)
    row("  event.record(stream)", lambda: ring.events[0].record(stream))
    row("  torch.cuda.current_stream", lambda: torch.cuda.current_stream(device))
    row("launch_site()", launch.launch_site)
    row("plan.launch(ids)", lambda: plan.launch(ids))
    payload, scales = batch.batch_views(whole, plan.payload_bytes, plan.scale_values)
    sbits = scales.view(torch.int32)
    tab = plan.tables.stage(device)[0]
    plan.tables.release()
    site = launch.launch_site()
    kern = tp._pack_set_kernel
    row("Launcher call (direct)", lambda: fused(kern, _at=site, tab=tab, payload=payload, scales=sbits))
    key = launch.key_of({"tab": tab, "payload": payload, "scales": sbits})
    kept = fused.compiled[key]  # (`launch._direct_call`: (args, stream) -> None)

    def cells_of(fn) -> dict:
        return {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True)}

    cells = cells_of(kept)  # `launch` (the driver's launcher, its `via_runner` kept) or `via_runner`
    if "runner" not in cells:
        cells = cells_of(cells["via_runner"])
    runner = cells["runner"]  # the compiled kernel's own runner, `CompiledKernel[grid]`
    cells = cells_of(runner)
    compiled = cells.get("self")
    grid = cells.get("grid")
    argv_t = fused._args({"tab": tab, "payload": payload, "scales": sbits})

    def ints(a):
        if isinstance(a, torch.Tensor):
            return a.data_ptr()
        if isinstance(a, tuple) and a and all(isinstance(x, torch.Tensor) for x in a):
            return tuple(x.data_ptr() for x in a)
        return a

    argv_i = [ints(a) for a in argv_t]
    s = site[1]
    base = whole.data_ptr()
    row("Launcher.direct (addresses)", lambda: fused.direct(kern, key, site, tab=tab.data_ptr(), payload=base,
                                                            scales=base + plan.scales_at))
    row("its kept launch(args, stream)", lambda: kept(argv_i, s))
    row("runner(*args, stream) tensors", lambda: runner(*argv_t, stream=s))
    row("runner(*args, stream) ints", lambda: runner(*argv_i, stream=s))
    if compiled is not None and grid is not None:
        run, fn, md = compiled.run, compiled.function, compiled.packed_metadata
        g0, g1, g2 = grid
        row("CompiledKernel.run tensors", lambda: run(g0, g1, g2, s, fn, md, None, None, None, *argv_t))
        row("CompiledKernel.run ints", lambda: run(g0, g1, g2, s, fn, md, None, None, None, *argv_i))
        inner = getattr(run, "launch", None)
        print(f"  (driver launcher {type(run).__name__}; .launch {inner!r})")
    # GPU-bound time of the kernel, table on the device vs read from page-locked host memory
    ref = payload.clone(), sbits.clone()
    fused(kern, _at=site, tab=tab, payload=payload, scales=sbits)
    torch.cuda.synchronize()
    want = payload.clone(), sbits.clone()
    show("the kernel back to back, its table on the device", gpu_us(lambda: runner(*argv_i, stream=s), it))
    del ref
    for _ in range(2):
        row("PackSet.pack (all of it)", lambda: pset.pack(ids_by_slot))
    fell_back = ring.fallbacks
    show("PackSet.pack back to back", gpu_us(lambda: pset.pack(ids_by_slot), it))
    print(f"  (table ring fallbacks in those {it} calls: {ring.fallbacks - fell_back}, in all: {ring.fallbacks})")
    show("a copy of its source back to back", gpu_us(lambda: req.copy_dst.copy_(req.copy_src), it))
    host_tab = ring.host_tensors[1]
    np.copyto(ring.hosts[1], plan.tables.array)
    payload.zero_()
    sbits.zero_()
    try:
        fused(kern, _at=site, tab=host_tab, payload=payload, scales=sbits)  # (JIT once: the key differs)
        torch.cuda.synchronize()
        same = torch.equal(payload, want[0]) and torch.equal(sbits, want[1])
        argv_h = list(argv_i)
        argv_h[fused.at["tab"]] = host_tab.data_ptr()
        show("the kernel back to back, its table in page-locked host memory",
             gpu_us(lambda: runner(*argv_h, stream=s), it))
        print(f"  (its bytes equal the staged table's: {same})")
    except Exception as e:  # noqa: BLE001 (a diagnostic)
        print(f"  (the kernel with its table in page-locked host memory failed: {type(e).__name__}: {e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
