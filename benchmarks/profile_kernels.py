"""Where the time of one Kimi-Linear request's pack/unpack goes on a GPU: host vs kernels.

    python -m benchmarks.profile_kernels [--tp 1] [--out DIR]

Prints, for `pack_many`, `PackSet.pack` and `unpack_many` of the request `bench_kernels.py`
times: the wall and host time per call with direct launches of the compiled kernels
(`kernels.launch`, the default) against every launch through the JIT, alternated; the wall time
per call (host + device, synchronized), the CUDA kernel time from torch.profiler (`set_div`: the
same set with the pack kernels dividing once per value, as before `bits.quotient`; `set_unfused`
and `unpack set unfused`: the same sets launching once per signature, as before the set
kernels), the launches
per call, and the host-side hot spots (cProfile, top 15); at tp=1, the save path's stages
(`benchmarks.profile_save`, raw and quant codecs). A diagnostic, not a gate.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch


def _direct_vs_jit(ops, iters: int, launch) -> None:
    """Wall and host time per call with direct launches of the compiled kernels (the default,
    `kernels.launch`) and with every launch through the JIT, alternated in this process."""
    print(f"direct launches available: {launch.enabled()}")
    for name in ("pack", "set", "set_unfused", "unpack", "unpack set", "unpack set unfused"):
        fn = ops[name]
        for _ in range(3):
            fn()
        best = {}
        for _ in range(3):
            for mode in ("direct", "jit"):
                launch._disabled = mode == "jit"
                before = dict(launch.counts)
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(iters):
                    fn()
                host = time.perf_counter() - t
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
                made = {k: launch.counts[k] - before[k] for k in before}
                old = best.get(mode)
                if old is None or wall < old[0]:
                    best[mode] = (wall, host, made)
        launch._disabled = False
        for mode, (wall, host, made) in best.items():
            print(f"== {name}, {mode} launches: wall {wall / iters * 1e3:.3f} ms/call, host "
                  f"{host / iters * 1e3:.3f} ms/call (launches: {made['direct']} direct, {made['jit']} JIT)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_kernels needs CUDA", file=sys.stderr)
        return 2
    from anchorkv import kernels
    from anchorkv.kernels import launch
    from benchmarks.bench_kernels import request

    req = request(args.tp)
    # the same set whose plans divide once per value (`triton_pack.RECIPROCAL` off): the pack
    # kernels before `bits.quotient`, timed against it in this process (`set_div` vs `set`)
    from anchorkv.kernels import PackSet, UnpackSet, triton_pack

    triton_pack.RECIPROCAL = False
    try:
        div_set = PackSet(req.pack_set.targets, req.pack_set.slots)
        div_set.pack(req.slot_ids)  # (its plan is made now)
    finally:
        triton_pack.RECIPROCAL = True
    # the same sets launching once per signature (`triton_pack.FUSED` off), against their set
    # kernels' one launch a call (`set` vs `set_unfused`, `unpack set` vs `unpack set unfused`)
    triton_pack.FUSED = False
    try:
        unfused_set = PackSet(req.pack_set.targets, req.pack_set.slots)
        unfused_set.pack(req.slot_ids)
        unfused_unpack = UnpackSet(req.unpack_set.targets, req.unpack_set.slots)
        unfused_unpack.unpack(req.packed_batch, req.slot_ids)
    finally:
        triton_pack.FUSED = True
    req.unpack_set.unpack(req.packed_batch, req.slot_ids)  # (its plan: `request` packs, it has not unpacked)
    print(f"set kernels: pack {req.pack_set._plans.newest().fused is not None}, "
          f"unpack {req.unpack_set._plans.newest().fused is not None}")
    ops = {
        "pack": lambda: kernels.pack_many(req.items),
        "set": lambda: req.pack_set.pack(req.slot_ids),
        "set_unfused": lambda: unfused_set.pack(req.slot_ids),
        "set_div": lambda: div_set.pack(req.slot_ids),
        "unpack": lambda: kernels.unpack_many(req.unpack_items),
        "unpack set": lambda: req.unpack_set.unpack(req.packed_batch, req.slot_ids),
        "unpack set unfused": lambda: unfused_unpack.unpack(req.packed_batch, req.slot_ids),
        "copy": lambda: req.copy_dst.copy_(req.copy_src),
    }
    _direct_vs_jit(ops, args.iters, launch)
    for name, fn in ops.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.iters):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / args.iters
        t = time.perf_counter()
        for _ in range(args.iters):
            fn()
        host = (time.perf_counter() - t) / args.iters  # no sync: launch-side cost (if async)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
        kern = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                k = kern.setdefault(ev.name[:60], [0, 0.0])
                k[0] += 1
                k[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        total = sum(v[1] for v in kern.values()) / args.iters
        print(f"== {name} tp={args.tp}: wall {wall*1e3:.3f} ms/call, host-only {host*1e3:.3f} ms, "
              f"kernels {total/1e3:.3f} ms/call, source {req.source_bytes/1e6:.1f} MB")
        for k, (cnt, us) in sorted(kern.items(), key=lambda kv: -kv[1][1]):
            print(f"   {cnt/args.iters:5.1f}x {us/args.iters:9.1f} us  {k}")
        if name in ("pack", "unpack"):
            _per_launch(name, req, prof, args.iters)
        if name == "pack":
            _host_breakdown(req)
        if name == "set":
            _set_breakdown(req.pack_set, req.slot_ids)
        if name == "set_unfused":
            _set_breakdown(unfused_set, req.slot_ids)
        if name != "copy":
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
            print("\n".join(s.getvalue().splitlines()[:50]))
    if args.tp == 1:  # the save path's request is a tp=1 one: its save, stage by stage
        from benchmarks import profile_save

        for codecs in ("raw", "quant"):
            profile_save.main(["--codecs", codecs, "--rounds", str(min(args.iters, 10))])
    return 0


def _host_breakdown(req, iters: int = 200) -> None:
    """Host microseconds of each step of one `pack_many` call of the request (no profiler:
    perf_counter over `iters` calls, the GPU left to run behind)."""
    from anchorkv import kernels
    from anchorkv.codec import HostPool
    from anchorkv.kernels import batch
    from anchorkv.kernels import triton_pack as tp

    items = req.items

    def per_call(fn) -> float:
        return host_us(fn, iters)

    ids = batch.check_all_ids(items)
    plan = tp._plan_for(items, ids)
    pool = HostPool(pin=True)
    payload_bytes = req.pack_set.pack(req.slot_ids).payload.nbytes
    table = torch.zeros(4096, dtype=torch.int64)
    launches, real = [], tp._pack_kernel

    class Recorder:
        def __getitem__(self, grid):
            return lambda **kw: launches.append((grid, kw))

    steps = {"kernels.pack_many (all of it)": lambda: kernels.pack_many(items),
             "kernels.PackSet.pack (all of it)": lambda: req.pack_set.pack(req.slot_ids),
             "PackSet.pack + pinned host copies": lambda: req.pack_set.pack(req.slot_ids).to_host(pin=True),
             # the worker's save: one reused pinned buffer (given back at once here: timing only,
             # the bytes are not read)
             "PackSet.pack + copies into a HostPool buffer": lambda: _into_pool(req, pool),
             "torch.empty(pin_memory=True) of the batch's payload": lambda: torch.empty(
                 payload_bytes, dtype=torch.uint8, pin_memory=True),
             # what each call's item tables pay (`batch.TableArray.stage`) before their copy
             "pin_memory() of a 32 KB table": lambda: table.pin_memory(),
             "check the block ids": lambda: batch.check_all_ids(items),
             "find the cached plan": lambda: tp._plan_for(items, ids)}
    tp._pack_kernel = Recorder()
    try:
        steps["plan.run without the launches"] = lambda: plan.run(ids)
        host = {k: per_call(v) for k, v in steps.items()}
    finally:
        tp._pack_kernel = real
    order = [plan.launches[k] for k in plan.order if plan.launches[k].runs]  # as issued
    last = launches[-len(order):]
    host[f"the {len(last)} Triton launches alone, JIT"] = per_call(
        lambda: [real[g](**kw) for g, kw in last])
    host[f"the {len(last)} Triton launches alone, direct"] = per_call(
        lambda: [launch.launcher(real, tab=kw["tab"], payload=kw["payload"], scales=kw["scales"])
                 for launch, (_, kw) in zip(order, last, strict=True)])
    _print_steps("pack_many", host)


def host_us(fn, iters: int) -> float:
    """Host microseconds per call of `fn` over `iters` calls (after 10 warm-up calls), the GPU
    left to run behind and drained before and after."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t) / iters * 1e6
    torch.cuda.synchronize()
    return host


def _print_steps(call: str, host: dict[str, float]) -> None:
    print(f"   host time per {call} call, by step:")
    for k, us in host.items():
        print(f"     {k:40s} {us:8.1f} us")


def set_steps(pack_set, slot_ids) -> dict[str, object]:
    """Each step of one `PackSet.pack` call, as a callable of its own (timed one by one on a
    GPU by `_set_breakdown`): the ids' check, the plan's lookup, the batch's allocation, the
    item tables' write and staging (a `TableRing` slot, released at once: the copy is not
    waited for), the launch site, the launches alone (direct once compiled; the set kernel's one,
    `triton_pack.FUSED`), and the call. The launches are the plan's own, in the order it issues
    them."""
    from anchorkv.kernels import batch, launch
    from anchorkv.kernels import triton_pack as tp

    lens, ids = pack_set._ids(slot_ids, distinct=False)
    pack_set.pack(slot_ids)  # (the plan exists)
    plan = pack_set._plans.find(lens, lambda: None)
    device = plan.device
    cuda = device.type == "cuda"
    whole, payload, scales = batch.batch_tensors(plan.payload_bytes, plan.scale_values, device)
    plan.tables.write(ids)
    tables = plan.tables.stage(device)
    plan.tables.release()
    order = [plan.launches[k] for k in plan.order]

    def stage() -> None:
        plan.tables.write(ids)
        plan.tables.stage(device)
        plan.tables.release()

    def launches() -> None:
        site = launch.launch_site() if cuda else None
        if plan.fused is not None:  # the set kernel: one launch (`triton_pack.FUSED`)
            plan.fused(tp._pack_set_kernel, _at=site, tab=tables[0], payload=payload, scales=scales.view(torch.int32))
            return
        for run, table in zip(order, tables, strict=True):
            run.launcher(tp._pack_kernel, _at=site, tab=table, payload=payload.view(batch.payload_dtype(run.cut)),
                         scales=scales.view(torch.int32))

    alone = (f"the set kernel's launch alone (for {len(order)} launches)" if plan.fused is not None
             else f"the {len(order)} launches alone")

    return {"check the ids (PackSet._ids)": lambda: pack_set._ids(slot_ids, distinct=False),
            "find the plan": lambda: pack_set._plans.find(lens, lambda: None),
            # (a set kernel's call on a GPU allocates only: `triton_pack._Plan._launch_set`)
            "the batch's one allocation": (lambda: torch.empty(plan.whole_bytes, dtype=torch.uint8, device=device))
            if cuda and plan.fused is not None else
            (lambda: batch.batch_tensors(plan.payload_bytes, plan.scale_values, device)),
            "write + stage the item tables (TableRing)": stage,
            "launch_site()": (lambda: launch.launch_site()) if cuda else (lambda: None),
            alone: launches,
            "PackSet.pack (all of it)": lambda: pack_set.pack(slot_ids)}


def _set_breakdown(pack_set, slot_ids, iters: int = 200) -> None:
    """Host microseconds of each step of one `PackSet.pack` call (`set_steps`), on a GPU."""
    _print_steps("PackSet.pack", {name: host_us(fn, iters) for name, fn in set_steps(pack_set, slot_ids).items()})


def _into_pool(req, pool) -> None:
    packed = req.pack_set.pack(req.slot_ids)
    buffer = pool.take(packed.host_bytes)
    packed.copy_into(buffer)
    pool.give(buffer)


def _per_launch(name, req, prof, iters) -> None:
    """Each launch of one call: its items, bytes moved (source + packed) and kernel time, from
    the cached plan of the request's item list (`triton_pack._plans`) and the profiler's kernel
    events in launch order."""
    from anchorkv.kernels import triton_pack, triton_unpack

    plan = (triton_pack._plans if name == "pack" else triton_unpack._plans).newest()
    if plan is None:
        return
    issued = [plan.launches[k] for k in plan.order] if isinstance(plan, triton_pack._Plan) else plan
    launches = [launch for launch in issued if launch.runs]
    kernel = "_pack_kernel" if name == "pack" else "_unpack_kernel"
    events = sorted((ev for ev in prof.events()
                     if ev.device_type == torch.autograd.DeviceType.CUDA and kernel in ev.name),
                    key=lambda ev: ev.time_range.start)
    if len(events) != iters * len(launches):
        print(f"   per launch: {len(events)} kernel events for {iters} x {len(launches)} launches")
        return
    for j, launch in enumerate(launches):
        us = sorted(ev.time_range.elapsed_us() for ev in events[j :: len(launches)])[iters // 2]
        cut, count = launch.cut, len(launch.members)
        source = count * launch.n * cut.numel * cut.itemsize
        packed = count * launch.n * cut.payload_per_block + count * launch.n * cut.groups * cut.columns * 4
        print(f"   launch {j}: {count} items x {launch.n} blocks {cut.fmt.value} {cut.dtype} "
              f"g={cut.g} grid={launch.grid} warps={launch.launcher.fixed['num_warps']} "
              f"BLOCK_R={launch.launcher.fixed['BLOCK_R']}: {us:.1f} us, "
              f"{(source + packed) / us / 1e3:.0f} GB/s (source {source / 1e6:.1f} MB)")


if __name__ == "__main__":
    sys.exit(main())
