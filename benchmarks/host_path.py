"""Host time of the launch path, measurable without a GPU: the Triton kernels stubbed out.

    python -m benchmarks.host_path [--tp 1] [--iters 400] [--out DIR]

On a GPU the pack of a whole Kimi-Linear request is host-bound (`profile_kernels` on an H100:
0.40 ms of host time per `pack_many` call against 0.086 ms of kernels), so the host side of
the launch path is what stands between the kernels and the copy bandwidth. Everything of it
but the Triton launch itself runs on a CPU: this runs `kernels.pack_many`, `unpack_many` and
the connector's `WorkerSide._pack` (the codec layer, the kernels' launch path) and its whole
save (`save` + `flush`: the writer thread's views, trimming and NaN check too) and an idle `flush` with
CPU tensors through the Triton launchers (`TRITON_INTERPRET=1`, `ANCHORKV_BACKEND=triton`),
each kernel replaced by a no-op (in the whole save, one that zeroes the scales it is given),
and reports microseconds per call (the best of 5 repeats of `--iters` calls; the `cold` rows: the
median of single calls each after 64 MB of other memory traffic, `cold_us`). The `A/B` rows time
the sets with their set kernel against the same sets launching once per signature, alternated
(`_set_kernel_ab`). The CPU path
skips the pinned staging copy a CUDA call makes. The restore rows time a worker's reads of a
saved request from a local store (the page cache) and their staging for the copy to the GPU
(`_restore_rows`), now and as before host arenas, in the same run.

Results: `benchmarks/results/<machine>-host-path.json` (`benchmarks.machine`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


class _NoKernel:
    """Stands for a `@triton.jit` kernel: `kernel[grid](**kwargs)` does nothing."""

    def __getitem__(self, grid):
        return lambda **kwargs: None


class _ZeroScales:
    """Stands for the pack kernel in a whole save: writes zero scales (what the kernel writes
    for zero state; left as allocated, they would read as NaN now and then and the writer would
    refuse the save, timing the refusal instead)."""

    def __getitem__(self, grid):
        def launch(**kwargs):
            # every launch gets the call's whole scales (its part from SC0 on; a set kernel's
            # one launch, all of them): zero them once
            if kwargs.get("SC0", 0) == 0:
                kwargs["scales"].zero_()
        return launch


def per_call_us(fn, iters: int, repeats: int = 5) -> float:
    for _ in range(min(iters, 20)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t) / iters)
    return best * 1e6


#: Bytes of other memory traffic before each call of a `cold_us` row (a step's other work: the
#: forward pass's launches, the scheduler), and the Python run with it
POLLUTE_BYTES = 64 << 20


def pollute(junk) -> None:
    """Other work between cold calls: `junk` (a numpy array of `POLLUTE_BYTES`) read and written
    once, and some other Python."""
    junk += 1
    sum(len(str(i)) for i in range(20_000))


def cold_us(fn, calls: int = 30) -> float:
    """Median microseconds of single calls of `fn`, each after `POLLUTE_BYTES` of other memory
    traffic and some other Python (the host's caches cold, as a save's launch path finds them
    once a step: its code and data evicted by the step's other work)."""
    import numpy as np

    junk = np.zeros(POLLUTE_BYTES, dtype=np.uint8)
    fn()
    out = []
    for _ in range(calls):
        pollute(junk)
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    out.sort()
    return out[len(out) // 2] * 1e6


def measure(tp: int, iters: int, tokens: int | None = None) -> dict[str, float]:
    """Host microseconds per call of each step, the kernels stubbed for the duration (the
    caller sets TRITON_INTERPRET=1 and ANCHORKV_BACKEND=triton before triton is imported)."""

    kernels = {(m, name): getattr(m, name) for m, name in _kernels()}
    for m, name in kernels:
        setattr(m, name, _NoKernel())
    try:
        return _measure(tp, iters, tokens)
    finally:
        for (m, name), kernel in kernels.items():
            setattr(m, name, kernel)


def _kernels():
    """(module, name) of every Triton kernel the launch path calls."""
    from anchorkv.kernels import triton_pack, triton_unpack

    return ((triton_pack, "_pack_kernel"), (triton_pack, "_pack_set_kernel"), (triton_unpack, "_unpack_kernel"),
            (triton_unpack, "_unpack_set_kernel"))


def zero_scale_packs() -> None:
    """Stub the pack kernels (per signature and set) with `_ZeroScales` (the caller restores them
    or leaves the process)."""
    from anchorkv.kernels import triton_pack

    triton_pack._pack_kernel = _ZeroScales()  # type: ignore[assignment]
    triton_pack._pack_set_kernel = _ZeroScales()  # type: ignore[assignment]


def _measure(tp: int, iters: int, tokens: int | None) -> dict[str, float]:
    from anchorkv.connector.plan import Metadata
    from anchorkv.kernels import batch, triton_pack, triton_unpack
    from benchmarks.bench_kernels import request
    from benchmarks.bench_save_path import TOKENS, Request, request_layout

    req = request(tp)
    items, unpack_items = req.items, req.unpack_items
    ids = batch.check_all_ids(items)
    plan = triton_pack._plan_for(items, ids)
    out = {
        "kernels.pack_many": per_call_us(lambda: triton_pack.pack_many(items), iters),
        "kernels.pack_many: check the block ids": per_call_us(lambda: batch.check_all_ids(items), iters),
        "kernels.pack_many: find the cached plan": per_call_us(lambda: triton_pack._plan_for(items, ids), iters),
        "kernels.pack_many: plan.run (outputs, tables)": per_call_us(lambda: plan.run(ids), iters),
        "kernels.PackSet.pack (the same items as fixed targets)": per_call_us(
            lambda: req.pack_set.pack(req.slot_ids), iters),
        "kernels.PackSet.pack, cold (after 64 MB of other memory traffic)": cold_us(
            lambda: req.pack_set.pack(req.slot_ids)),
        "kernels.unpack_many": per_call_us(lambda: triton_unpack.unpack_many(unpack_items), iters),
        "kernels.UnpackSet.unpack (the same items as fixed targets)": per_call_us(
            lambda: req.unpack_set.unpack(req.packed_batch, req.slot_ids), iters),
        "kernels.UnpackSet.unpack, cold": cold_us(lambda: req.unpack_set.unpack(req.packed_batch, req.slot_ids)),
    }
    out.update(_set_kernel_ab(req, iters))
    if tp == 1:  # the save path's request (bench_save_path) is a tp=1 one
        root = Path(tempfile.mkdtemp(prefix="anchorkv-host-path-"))
        save = Request(request_layout(False), tokens or TOKENS, "quant", root)
        try:
            spec = save.spec()
            worker = save.discard_worker
            out["codec.pack_many (quant codecs)"] = per_call_us(save.pack, iters)
            out["WorkerSide._pack (quant codecs)"] = per_call_us(lambda: worker._pack(spec), iters)
            out["WorkerSide._pack (quant codecs), cold"] = cold_us(lambda: worker._pack(spec))

            def save_and_flush() -> None:  # the step's part, then the writer thread's, to the store
                worker.save(Metadata(saves=[spec]))
                worker.flush()

            zero_scale_packs()
            out["WorkerSide.save + flush (quant codecs, a store that keeps nothing)"] = per_call_us(
                save_and_flush, max(1, iters // 4))
            out["WorkerSide.flush (nothing queued)"] = per_call_us(worker.flush, iters)
            if (worker.stats.take() or {}).get("save_failed"):
                raise RuntimeError("a save was refused: the figure would time the refusal")
        finally:
            save.close()
        out.update(_restore_rows(iters, tokens))
    return out


def _set_kernel_ab(req, iters: int, rounds: int = 3) -> dict[str, float]:
    """The request's sets with one set-kernel launch a call (`triton_pack.FUSED`, the default)
    and the same sets launching once per signature (FUSED off when their plans are made),
    timed alternately `rounds` times, the best of each (this machine's speed drifts by 20-30%
    over minutes: only figures taken side by side compare)."""
    from anchorkv.kernels import PackSet, UnpackSet, triton_pack

    triton_pack.FUSED = False
    try:
        pack_set, unpack_set = PackSet(req.pack_set.targets, req.pack_set.slots), UnpackSet(
            req.unpack_set.targets, req.unpack_set.slots)
        pack_set.pack(req.slot_ids)  # (the plans are made now)
        unpack_set.unpack(req.packed_batch, req.slot_ids)
    finally:
        triton_pack.FUSED = True
    calls = {
        "A/B: PackSet.pack, one set-kernel launch": lambda: req.pack_set.pack(req.slot_ids),
        "A/B: PackSet.pack, one launch per signature (FUSED off)": lambda: pack_set.pack(req.slot_ids),
        "A/B: UnpackSet.unpack, one set-kernel launch": lambda: req.unpack_set.unpack(req.packed_batch,
                                                                                     req.slot_ids),
        "A/B: UnpackSet.unpack, one launch per signature (FUSED off)": lambda: unpack_set.unpack(
            req.packed_batch, req.slot_ids),
    }
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, fn in calls.items():
            best[name] = min(best[name], per_call_us(fn, iters))
    return best


class _IgnoresHost:
    """The worker's store, less the `host` memory of its loads (which the `EntryStore` contract
    lets an implementation ignore): every part in its own pageable tensors, as before arenas."""

    def __init__(self, entries) -> None:
        self.entries = entries

    def load(self, *args, host=None, **kwargs):
        return self.entries.load(*args, **kwargs)


def _restore_rows(iters: int, tokens: int | None) -> dict[str, float]:
    """The host side of a restore up to its one copy to the GPU, the worker's reads of every
    part (default raw codecs, the local store, from the page cache) included:

    - now: into the worker's host arena (warm after the first restore), sent as it lies;
    - before (a store that ignores `host`, as before arenas): each part into new tensors, then
      copied into one staging buffer, warm here as torch's caching host allocator gives it on a
      GPU (a new 100 MB buffer would add its page faults);
    - batch: each part into its span of the restore's batch in the arena (`WorkerSide._batch_for`,
      `_Batch.fill`); the batch's tensors lie in the arena's page-locked slab on a GPU, which
      crosses as it lies (here, with nothing pinned, `stage_to_device` would stage a lone tensor:
      not timed).

    On this CPU the copy to the "device" itself is free; a GPU adds the same copy to all three.
    Then the launch side of the restore, the kernels stubbed: part by part (`_restore`:
    `codec.unpack_many` and the zeroing of a partial block's stale rows) and as one batch
    (`_restore_batch`: one `Unpacker.unpack`)."""
    from anchorkv.codec import HostArena
    from anchorkv.codec.api import stage_to_device
    from anchorkv.connector.plan import LoadSpec, Metadata
    from benchmarks.bench_save_path import TOKENS, Request, request_layout

    zero_scale_packs()
    root = Path(tempfile.mkdtemp(prefix="anchorkv-host-path-"))
    req = Request(request_layout(False), tokens or TOKENS, "raw", root)
    try:
        spec = req.spec()
        worker = req.worker
        worker.save(Metadata(saves=[spec]))
        worker.flush()
        [entry] = req.entries.store.list()
        load = LoadSpec("restore", entry.id, 0, spec.num_tokens, spec.blocks)
        staging = HostArena(pin=False)  # kept: warm from the second call on

        def now() -> None:
            worker._arena.reset()
            parts = worker._read(load)
            stage_to_device([t for p in parts.values() for t in (p.payload, p.scales)], "cpu", pin=False)

        def before() -> None:
            parts = worker._read(load)
            staging.reset()
            for t in (t for p in parts.values() for t in (p.payload, p.scales)):
                staging(t.nbytes).view(t.dtype).view(t.shape).copy_(t)

        def batch_path() -> None:
            worker._arena.reset()
            batch = worker._batch_for(load)
            assert batch is not None and batch.fill(worker._read(load, batch))

        n = max(1, iters // 100)
        out = {"restore: read into the worker's arena, sent as it lies (now)": per_call_us(now, n),
               "restore: read into the batch's spans (batch)": per_call_us(batch_path, n)}
        worker._arena.reset()
        parts = worker._read(load)
        out["restore, launch side: part by part (codec.unpack_many + zeroing)"] = per_call_us(
            lambda: worker._restore(load, parts), iters)
        worker._arena.reset()
        batch = worker._batch_for(load)
        assert batch is not None and batch.fill(worker._read(load, batch))
        out["restore, launch side: one batch (Unpacker.unpack)"] = per_call_us(
            lambda: worker._restore_batch(batch), iters)
        store = worker.store
        try:
            worker.store = _IgnoresHost(store)  # type: ignore[assignment]
            out["restore: read into new tensors + copy into a warm staging buffer (before)"] = per_call_us(before, n)
        finally:
            worker.store = store
        return out
    finally:
        req.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes (default: %(default)s)")
    args = ap.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the launchers take CPU tensors
    os.environ["ANCHORKV_BACKEND"] = "triton"
    from benchmarks.machine import device_info, machine_name

    started = time.perf_counter()
    results = measure(args.tp, args.iters)
    for name, us in results.items():
        print(f"{name:48s} {us:8.1f} us")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{machine_name()}-host-path.json"
    path.write_text(json.dumps({
        "machine": machine_name(), "device": device_info(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.host_path " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": time.perf_counter() - started, "tp": args.tp, "iters": args.iters,
        "host_us_per_call": results,
    }, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
