"""`PackSet`: pack the same targets call after call, only the block ids changing.

A connector packs the same (layer, field) pairs of its cache at every step that saves; what
changes is which blocks. `pack_many` re-derives everything from its items on every call (keys,
plan lookup, one output view per item); a `PackSet` fixes its targets once, so a call is: check
the ids (once per slot), find the plan by the slots' lengths, stage the item tables, launch. Its
result, a `PackedBatch`, is the call's one allocation (every payload in one uint8 view of it,
every scale in one fp32 view after them) and where each target's part lies: it crosses to the
host in one copy, and per-target views are made only when someone asks for them (on a writer
thread, off the step's critical path).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from anchorkv.kernels import batch, reference
from anchorkv.kernels.dispatch import backend_for
from anchorkv.kernels.items import PackItem, PackTarget, Span, UnpackItem

log = logging.getLogger(__name__)

#: Plans a `PackSet` keeps (one per distinct tuple of slot lengths; paged slots grow with the
#: request, so a server sees a few dozen lengths, each plan a few kB).
PLANS_PER_SET = 64


@dataclass(frozen=True)
class PackedBatch:
    """The outputs of one `PackSet.pack` call: all payloads in `payload` (uint8, 1-D), all
    scales in `scales` (fp32, 1-D), target i's part at `spans[i]`."""

    payload: torch.Tensor
    scales: torch.Tensor
    spans: tuple[Span, ...]
    #: (start, length) runs of `scales` that hold the parts' scales; between them, alignment
    #: padding no kernel writes
    scale_runs: tuple[tuple[int, int], ...] = ()
    #: the one allocation (uint8, `host_bytes` long) that `payload` and `scales` are views of,
    #: the payload at its start and the scales at the next 16-byte boundary (`batch.batch_tensors`),
    #: or None when they are two tensors; with it, a batch crosses to the host in one copy
    whole: torch.Tensor | None = None
    #: a host batch copied from a GPU in one allocation (`copy_into`, `copy_to_host`): the sum of
    #: its scales from the first run's start to the last run's end, reduced on the GPU and
    #: copied after the bytes (a 0-dim fp32 tensor, page-locked; read it, as the bytes, once
    #: the copies are complete). Not NaN: no run holds a NaN. Else None
    nan_sum: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.spans)

    def may_hold_nan(self) -> bool:
        """False only when no part's scales hold a NaN, i.e. no part has a poisoned group: the
        GPU's `nan_sum` when it is not NaN (no byte of the scales read on the host), else one
        reduction per run of scales on the host (`may_hold_nan`; the padding between runs,
        which no kernel writes and `nan_sum` adds in, is never read: a NaN there was a false
        alarm)."""
        if self.nan_sum is not None and not math.isnan(self.nan_sum.item()):
            return False
        return any(may_hold_nan(self.scales.narrow(0, at, n)) for at, n in self.scale_runs)

    def record_stream(self, stream) -> None:
        """Tell torch's caching allocator that `stream` uses this batch's device memory (its
        one allocation, or its two tensors), so none of it is handed to another allocation until
        the work queued on `stream` so far has run (a copy to the host on a second stream)."""
        for t in (self.whole,) if self.whole is not None else (self.payload, self.scales):
            t.record_stream(stream)

    def _nan_sum(self) -> torch.Tensor | None:
        """The `nan_sum` of this batch's host copy: the sum of its scale runs (and the padding
        between) reduced on its device, copied to page-locked memory, both queued on the current
        stream after the batch's own copy (the host reads it when it reads the bytes, after an
        event recorded behind both; queued first, its two host calls, ~10 us of an H200 host's
        time hot and several times that on a save's cold path, delayed the copy that bounds the
        save). None on a CPU, for two tensors, or without scales."""
        if self.whole is None or self.whole.device.type != "cuda" or not self.scale_runs:
            return None
        return self._runs_values().sum().to("cpu", non_blocking=True)

    def _runs_values(self) -> torch.Tensor:
        """The scales from the first run's start to the last run's end (padding between runs
        included), fp32, a view of `whole` (which must be set)."""
        assert self.whole is not None
        lo = self.scale_runs[0][0]
        hi = self.scale_runs[-1][0] + self.scale_runs[-1][1]
        at = batch.scales_start(self.sizes()[0]) + 4 * lo
        return self.whole.narrow(0, at, 4 * (hi - lo)).view(torch.float32)

    def part(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Target i's (payload uint8 `[bytes]`, scales fp32 `[rows, C]`), as `kernels.pack`
        returns them; views of the batch's allocations."""
        s = self.spans[i]
        payload = self.payload.narrow(0, s.payload_at, s.payload_bytes)
        if not s.columns:
            return payload, self.scales.new_empty(0, 0)
        return payload, self.scales.narrow(0, s.scales_at, s.scale_rows * s.columns).view(
            s.scale_rows, s.columns)

    def parts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every `part(i)`, in order, made by two `split_with_sizes` calls (one view each in C++;
        a `narrow` per tensor costs ~1.5 us of Python a view: ~190 -> ~70 us for the 47 parts of
        a Kimi-Linear request on a CPU core, on the writer thread of every save)."""
        cut = _cut_of(self.spans, self.payload.numel(), self.scales.numel())
        pays = self.payload.split_with_sizes(cut.payload_sizes)
        scs = self.scales.split_with_sizes(cut.scale_sizes)
        empty = self.scales.new_empty(0, 0)  # (raw and bf16 parts: no scales)
        return [(pays[p], scs[k].view(s.scale_rows, s.columns) if s.columns else empty)
                for s, p, k in zip(self.spans, cut.payload_index, cut.scale_index, strict=True)]

    def to_host(self, *, pin: bool = True, host: torch.Tensor | None = None) -> PackedBatch:
        """The batch in host memory: itself when it is there already, else two asynchronous
        copies on the current stream (into page-locked memory with `pin`: a copy into pageable
        memory would block the CPU until the stream drains), into `host` when given
        (`copy_into`). The host bytes are complete once the stream has passed this point
        (record an event after it)."""
        if (self.whole if self.whole is not None else self.payload).device.type == "cpu":
            return self  # (a `_WholeBatch` makes no view for this)
        return self.copy_into(host) if host is not None else self.copy_to_host(pin=pin)

    def copy_to_host(self, *, pin: bool) -> PackedBatch:
        """`to_host` without the shortcut: always new host memory (one copy of `whole`, or two
        new tensors)."""
        if self.whole is not None:
            whole = host_copy(self.whole, pin=pin)  # (the bytes' copy queued first: `_nan_sum`)
            return self._in(whole, self._nan_sum())
        return PackedBatch(host_copy(self.payload, pin=pin), host_copy(self.scales, pin=pin), self.spans,
                           self.scale_runs)

    def _in(self, whole: torch.Tensor, nan_sum: torch.Tensor | None = None) -> PackedBatch:
        """The batch laid out in `whole` (uint8, `host_bytes` long, as `batch.batch_tensors` lays
        it), its views made when first read (by the writer thread, not the step's)."""
        return _WholeBatch(whole, *self.sizes(), self.spans, self.scale_runs, nan_sum)

    def sizes(self) -> tuple[int, int]:
        """(the payload's bytes, the scales' values)."""
        return self.payload.numel(), self.scales.numel()

    @property
    def host_bytes(self) -> int:
        """The bytes of a host buffer that `copy_into` fills: the payload, then the scales at
        the next 16-byte boundary."""
        payload_bytes, scale_values = self.sizes()
        return batch.scales_start(payload_bytes) + 4 * scale_values

    def copy_into(self, host: torch.Tensor) -> PackedBatch:
        """The batch in `host` (uint8, 1-D, contiguous, at least `host_bytes`, on the CPU):
        the payload at its start and the scales at the next 16-byte boundary: one asynchronous
        copy on the current stream when the batch is one allocation (`whole`), else two
        (page-locked `host`: a copy into pageable memory blocks the CPU until the stream
        drains). A caller that reuses its buffers save after save skips torch's pinned
        allocations; the bytes are there once the stream has passed this point."""
        need = self.host_bytes
        if (host.dtype != torch.uint8 or host.dim() != 1 or not host.is_contiguous() or host.device.type != "cpu"
                or host.numel() < need):
            raise ValueError(f"copy_into needs a contiguous 1-D uint8 CPU tensor of at least {need} bytes, found "
                             f"{host.dtype} {list(host.shape)} on {host.device}")
        if self.whole is not None:  # one allocation: one copy (the padding between rides along)
            whole = host.narrow(0, 0, need)
            if need:
                whole.copy_(self.whole, non_blocking=True)
            return self._in(whole, self._nan_sum())  # (the bytes' copy queued first: `_nan_sum`)
        out = self._in(host.narrow(0, 0, need))
        if out.payload.numel():
            out.payload.copy_(self.payload, non_blocking=True)
        if out.scales.numel():
            out.scales.copy_(self.scales, non_blocking=True)
        return out


class _WholeBatch(PackedBatch):
    """A `PackedBatch` in one allocation (`whole`) whose `payload` and `scales` views are made
    when first read: what `PackSet.pack` returns for a set kernel's call on a GPU. Each view
    costs the host ~3 us there (`benchmarks.launch_variants` on an H200), and a save that copies
    the batch to the host (`copy_into`, `to_host`) reads neither on the step's thread."""

    def __init__(self, whole: torch.Tensor, payload_bytes: int, scale_values: int, spans: tuple[Span, ...],
                 scale_runs: tuple[tuple[int, int], ...], nan_sum: torch.Tensor | None = None) -> None:
        # (a frozen dataclass's fields: set as its own __init__ sets them)
        object.__setattr__(self, "whole", whole)
        object.__setattr__(self, "spans", spans)
        object.__setattr__(self, "scale_runs", scale_runs)
        object.__setattr__(self, "nan_sum", nan_sum)
        object.__setattr__(self, "_sizes", (payload_bytes, scale_values))
        object.__setattr__(self, "_views", None)

    def _made(self) -> tuple[torch.Tensor, torch.Tensor]:
        views = self.__dict__["_views"]
        if views is None:
            assert self.whole is not None
            views = batch.batch_views(self.whole, *self.__dict__["_sizes"])
            object.__setattr__(self, "_views", views)
        return views

    @property
    def payload(self) -> torch.Tensor:
        return self._made()[0]

    @property
    def scales(self) -> torch.Tensor:
        return self._made()[1]

    def sizes(self) -> tuple[int, int]:
        return self.__dict__["_sizes"]


@dataclass(frozen=True)
class _Cut:
    """The split sizes that cut a batch's two tensors into its parts (gaps included) and the
    index of each part's piece."""

    payload_sizes: list[int]
    payload_index: list[int]
    scale_sizes: list[int]
    scale_index: list[int]


def _cuts(spans: Sequence[tuple[int, int]], total: int) -> tuple[list[int], list[int]]:
    """(split sizes, index of each span's piece) of [0, total) for `spans` of (start, length)
    that do not overlap (in any order; gaps between them get pieces of their own, and empty
    spans the last piece, an empty one)."""
    sizes: list[int] = []
    index = [0] * len(spans)
    at = 0
    empty: list[int] = []
    for k in sorted(range(len(spans)), key=lambda k: spans[k]):
        start, n = spans[k]
        if not n:
            empty.append(k)
            continue
        if start < at:
            raise ValueError(f"a batch's parts overlap at {start}")
        if start > at:
            sizes.append(start - at)
        index[k] = len(sizes)
        sizes.append(n)
        at = start + n
    if total < at:
        raise ValueError(f"a batch's parts end at {at}, past its {total} values")
    sizes.append(total - at)
    for k in empty:
        index[k] = len(sizes)
    sizes.append(0)
    return sizes, index


#: `_Cut` of the spans of recent plans, by the spans tuple's id (the tuple is kept alongside:
#: a PackSet's batches share their plan's spans, so the cut is computed once a plan)
_CUTS: dict[int, tuple[tuple[Span, ...], int, int, _Cut]] = {}


def _cut_of(spans: tuple[Span, ...], payload: int, scales: int) -> _Cut:
    hit = _CUTS.get(id(spans))
    if hit is not None and hit[0] is spans and hit[1:3] == (payload, scales):
        return hit[3]
    pay_sizes, pay_index = _cuts([(s.payload_at, s.payload_bytes) for s in spans], payload)
    sc_sizes, sc_index = _cuts([(s.scales_at, s.scale_rows * s.columns) for s in spans], scales)
    cut = _Cut(pay_sizes, pay_index, sc_sizes, sc_index)
    if len(_CUTS) >= 256:
        _CUTS.clear()
    _CUTS[id(spans)] = (spans, payload, scales, cut)
    return cut


def may_hold_nan(t: torch.Tensor) -> bool:
    """False only when no element of the float tensor `t` is NaN: one reduction (a NaN makes the
    sum NaN; a sum that overflows both ways is NaN too, so True may be a false alarm, never a
    miss). About 15 us for the ~0.5M scales of a Kimi-Linear request on a CPU core, where
    `isnan(t).any()` takes 290 us and one `isnan` count per part ~2 ms in all."""
    return t.numel() > 0 and bool(torch.isnan(t.sum()))


def host_copy(t: torch.Tensor, *, pin: bool) -> torch.Tensor:
    """A host copy of `t`, made asynchronously on the current stream into page-locked memory
    with `pin` (an empty tensor is never pinned nor copied)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and t.numel() > 0)
    return out.copy_(t, non_blocking=True) if t.numel() else out


class _TargetSet:
    """Fixed targets on one device and the slot each reads its block ids from; what `PackSet`
    and `UnpackSet` share: the checks of the set and of each call's ids, the backend, the plans
    (one per distinct tuple of slot lengths)."""

    def __init__(self, targets: Sequence[PackTarget], slots: Sequence[int]) -> None:
        self.targets = tuple(targets)
        self.slots = tuple(slots)
        kind = type(self).__name__
        if not self.targets:
            raise ValueError(f"a {kind} needs at least one target")
        if len(self.slots) != len(self.targets):
            raise ValueError(f"one slot per target: {len(self.targets)} targets, {len(self.slots)} slots")
        devices = {t.buffer.device for t in self.targets}
        if len(devices) != 1:
            raise ValueError(f"a {kind}'s targets live on one device, found {sorted(map(str, devices))}; "
                             "make one set per device")
        self.device = devices.pop()
        self.backend = backend_for(self.device)
        if self.backend == "triton":
            for t in self.targets:  # unsupported fields fail here, not at the first call
                batch.field_cut(t.field, t.spec)
        # ids are checked once per distinct (slot, num_blocks)
        checks: dict[tuple[int, int], int] = {}
        self._check_of = tuple(checks.setdefault((s, t.num_blocks), len(checks))
                               for s, t in zip(self.slots, self.targets, strict=True))
        self._checks = tuple(checks)
        self._need = max(self.slots) + 1  # slots a call names ids for
        self._plans: batch.PlanCache = batch.PlanCache(PLANS_PER_SET)
        self._told = False  # (`_made`)

    def _ids(self, ids_by_slot: Sequence, *, distinct: bool) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
        """(each slot's length, each target's checked ids)."""
        need = self._need
        if len(ids_by_slot) < need:
            raise ValueError(f"block ids for {need} slots are needed, found {len(ids_by_slot)}")
        checked = [batch.check_ids(ids_by_slot[s], n, distinct=distinct) for s, n in self._checks]
        lens = [0] * need
        for (s, _), ids in zip(self._checks, checked, strict=True):
            lens[s] = len(ids)
        # (each target's ids by its check's index: one C-level map, ~half a list comprehension's
        # cost for a Kimi-Linear request's 47 targets)
        return tuple(lens), list(map(checked.__getitem__, self._check_of))

    def _lens(self, lens_by_slot: Sequence[int]) -> list[int]:
        return [lens_by_slot[s] for s in self.slots]

    def _made(self, plan):
        """A new Triton plan, said once per set at INFO: how many launches its calls make (a
        connector's log shows whether its saves and restores run as one set-kernel launch)."""
        launches = len(plan.tables.segments)  # (a set's plans lay out a table per launch)
        if not self._told:
            self._told = True
            kind = "packs" if isinstance(self, PackSet) else "unpacks"
            how = ("one set-kernel launch" if plan.fused is not None
                   else f"{launches} launch{'es' if launches != 1 else ''}, one per signature")
            name = type(self).__name__
            log.info("anchorkv: %s %s of %d parts %s them in %s (%d signatures)", "an" if name[0] in "AEIOU" else "a",
                     name, len(self.targets), kind, how, launches)
        return plan


class PackSet(_TargetSet):
    """Packs fixed targets; each call names the block ids of each *slot*, and target i reads
    the ids of slot `slots[i]` (a connector: one slot per KV-cache group, whose layers share
    their blocks).

    All targets live on one device, and the backend is chosen when the set is made
    (`dispatch.backend_for`, `ANCHORKV_BACKEND` read then, not per call). On CUDA the Triton
    kernels run (one plan per distinct
    tuple of slot lengths, kept while the set lives: regions stay aliased by the plan, so their
    addresses are never reused); elsewhere the reference packs each target and the parts are
    gathered into the batch's tensors. Either way, part i equals
    `kernels.pack(PackItem(target.buffer, target.field, ids, target.num_blocks, target.spec))`,
    and the parts lie where `batch.batch_layout` says (an `UnpackSet` of the same targets takes
    the batch as it is).
    """

    def pack(self, ids_by_slot: Sequence) -> PackedBatch:
        """Pack every target's blocks `ids_by_slot[slot]` (lists, tuples or CPU tensors of
        ints; ids on a GPU cost a host synchronization)."""
        lens, ids = self._ids(ids_by_slot, distinct=False)
        if self.backend != "triton":
            return self._reference(lens, ids)
        plan = self._plan(lens)
        whole, payload, scales = plan.launch(ids)
        if payload is None or scales is None:  # (a set kernel's call on a GPU: `whole` alone)
            assert whole is not None
            return _WholeBatch(whole, plan.payload_bytes, plan.scale_values, plan.spans, plan.scale_runs)
        return PackedBatch(payload, scales, plan.spans, plan.scale_runs, whole)

    def pack_chunks(self, ids_by_slot: Sequence, chunks: int,
                    on_chunk: Callable[[torch.Tensor, tuple[tuple[int, int], ...]], None]) -> PackedBatch:
        """`pack`, issued as up to `chunks` launches of the set kernel in program order, each
        followed by `on_chunk(whole, ranges)`: the batch's one allocation and the (start,
        length) byte ranges of it that the launches issued so far complete (a caller copies
        them to the host on another stream while the next chunks pack: a save's pack and its
        copy overlap). The ranges of all calls cover every part's payload and scales, each byte
        once; alignment padding between parts is in none. The batch is one allocation on every
        device. A plan without a set kernel (the reference backend, one signature, `FUSED` off)
        packs in one go: one call, the whole allocation. The bytes are `pack`'s."""
        if chunks < 1:
            raise ValueError(f"pack_chunks needs at least 1 chunk, found {chunks}")
        lens, ids = self._ids(ids_by_slot, distinct=False)
        if self.backend != "triton":
            packed = self._reference(lens, ids, one=True)
        else:
            plan = self._plan(lens)
            if plan.fused is not None:
                whole = plan.launch_chunks(ids, chunks, on_chunk)
                return _WholeBatch(whole, plan.payload_bytes, plan.scale_values, plan.spans, plan.scale_runs)
            whole, payload, scales = plan.launch(ids, one=True)
            assert whole is not None and payload is not None and scales is not None  # (one allocation asked)
            packed = PackedBatch(payload, scales, plan.spans, plan.scale_runs, whole)
        assert packed.whole is not None
        on_chunk(packed.whole, ((0, packed.whole.numel()),))
        return packed

    def _plan(self, lens: tuple[int, ...]):
        """The Triton plan for slots of `lens` blocks (keyed by the slots' lengths: the
        targets' lengths follow from them)."""
        from anchorkv.kernels.triton_pack import _Plan

        return self._plans.find(lens, lambda: self._made(_Plan(self.targets, self._lens(lens), self.slots)))

    def _reference(self, lens: tuple[int, ...], ids: list[tuple[int, ...]], *,
                   one: bool | None = None) -> PackedBatch:
        layout = self._plans.find(lens, lambda: batch.batch_layout(self.targets, self._lens(lens)))
        whole, payload, scales = batch.batch_tensors(layout.payload_bytes, layout.scale_values, self.device, one=one)
        for t, i, span in zip(self.targets, ids, layout.spans, strict=True):
            p, s = reference.pack(PackItem(t.buffer, t.field, i, t.num_blocks, t.spec))
            payload.narrow(0, span.payload_at, span.payload_bytes).copy_(p.reshape(-1))
            if span.columns:
                scales.narrow(0, span.scales_at, span.scale_rows * span.columns).copy_(s.reshape(-1))
        return PackedBatch(payload, scales, layout.spans, layout.scale_runs, whole)


class UnpackSet(_TargetSet):
    """The mirror of `PackSet`: decodes a `PackedBatch` into fixed targets, each call naming
    the block ids of each slot (target i writes the blocks of slot `slots[i]`).

    The batch must be laid out as `layout(lens)` says for the slots' lengths: what `PackSet.pack`
    of the same targets returns, or a batch filled part by part at those spans (a restore reading
    its parts into one host buffer). What a call does not depend on is planned once per tuple of
    slot lengths, so a call checks the ids and the batch's two tensors, stages the item tables
    and launches: no per-part Python. Part i is written as `kernels.unpack` of
    `UnpackItem(target.buffer, target.field, ids, target.num_blocks, target.spec, *batch.part(i))`
    would write it. Each slot's ids must be distinct; targets must not overlap.
    """

    def layout(self, lens_by_slot: Sequence[int]) -> batch.BatchLayout:
        """Where each part lies in a batch for slots of `lens_by_slot` blocks."""
        return self._plan(tuple(lens_by_slot)).layout

    def _plan(self, lens: tuple[int, ...]):
        if self.backend != "triton":
            return self._plans.find(lens, lambda: _ReferencePlan(batch.batch_layout(self.targets, self._lens(lens))))
        from anchorkv.kernels.triton_unpack import _SetPlan

        return self._plans.find(lens, lambda: self._made(_SetPlan(self.targets, self._lens(lens), self.slots)))

    def unpack(self, packed: PackedBatch, ids_by_slot: Sequence) -> None:
        """Write every part of `packed` into its target's blocks `ids_by_slot[slot]`. Everything
        is checked before the first byte is written."""
        lens, ids = self._ids(ids_by_slot, distinct=True)
        plan = self._plan(lens)
        if packed.spans is not plan.layout.spans and packed.spans is not plan.seen:
            _check_spans(packed.spans, plan.layout, lens)
            plan.seen = packed.spans  # a PackSet's batches share their plan's spans: compared once
        _check_tensors(packed, plan.layout, self.targets[0].buffer)
        if self.backend == "triton":
            plan.launch(packed, ids)
            return
        for k, (t, i) in enumerate(zip(self.targets, ids, strict=True)):
            payload, scales = packed.part(k)
            reference.unpack(UnpackItem(t.buffer, t.field, i, t.num_blocks, t.spec, payload, scales))


class _ReferencePlan:
    __slots__ = ("layout", "seen")

    def __init__(self, layout: batch.BatchLayout) -> None:
        self.layout = layout
        self.seen: tuple[Span, ...] | None = None  # spans found equal to the layout's


def _check_spans(spans: tuple[Span, ...], layout: batch.BatchLayout, lens) -> None:
    """A clear error unless a batch's `spans` are those of `layout`."""
    if spans != layout.spans:
        raise ValueError(
            f"the batch's parts are laid out for other targets or block counts than this set's "
            f"{len(layout.spans)} targets with slots of {list(lens)} blocks; pack it with a PackSet of "
            "the same targets, or fill the spans of UnpackSet.layout(lens)")


def _check_tensors(packed: PackedBatch, layout: batch.BatchLayout, target: torch.Tensor) -> None:
    """A clear error unless the batch's two tensors are what `layout` needs, on `target`'s device."""
    for name, t, dtype, n in (("payload", packed.payload, torch.uint8, layout.payload_bytes),
                              ("scales", packed.scales, torch.float32, layout.scale_values)):
        if (t.dtype != dtype or t.dim() != 1 or t.numel() != n or not t.is_contiguous()
                or not batch.same_device(t, target)
                or n and t.data_ptr() % batch.VECTOR_BYTES):
            raise ValueError(f"the batch's {name} must be {n} contiguous {dtype} values on {target.device} at a "
                             f"16-byte aligned address, found {t.dtype} {list(t.shape)} on {t.device} at "
                             f"{t.data_ptr():#x}")
