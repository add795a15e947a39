"""`kernels.PackSet`: fixed targets packed call after call into one `PackedBatch`; every part
byte-identical to `reference.pack` of the same item, on the Triton path (interpreter on CPU) and
the reference path, whatever the block ids and their counts."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from anchorkv.codec import CodecSpec
from anchorkv.kernels import PackedBatch, PackItem, PackSet, PackTarget, packset, reference
from anchorkv.kernels.strided import StridedField, field_view
from tests.kernels.helpers import DEVICE, split_set_launch
from tests.kernels.test_batched import BLOCKS, _page, _regions

pytestmark = pytest.mark.interpreter

CODEC_SETS = [("int8:16", "int8:32", "fp8:64"), ("raw", "int4:32", "int4:64"), ("fp8:8", "raw", "bf16")]


def _set(regions, codecs):
    """conv and recurrent of every region read slot 0 (a state group), latents of the odd
    regions slot 1 (a paged group)."""
    conv, recurrent, latent = _page()
    targets, slots = [], []
    for i, buf in enumerate(regions):
        targets += [PackTarget(buf, conv, BLOCKS, CodecSpec.parse(codecs[0])),
                    PackTarget(buf, recurrent, BLOCKS, CodecSpec.parse(codecs[1]))]
        slots += [0, 0]
        if i % 2:
            targets.append(PackTarget(buf, latent, BLOCKS, CodecSpec.parse(codecs[2])))
            slots.append(1)
    return targets, slots


def _assert_parts_equal_reference(batch: PackedBatch, targets, slots, ids) -> None:
    assert len(batch) == len(targets)
    for k, (t, s) in enumerate(zip(targets, slots, strict=True)):
        payload, scales = batch.part(k)
        want_p, want_s = reference.pack(PackItem(t.buffer, t.field, ids[s], t.num_blocks, t.spec))
        payload, scales, want_p, want_s = (x.cpu() for x in (payload, scales, want_p, want_s))  # (on a GPU)
        assert torch.equal(payload, want_p), f"target {k} ({t.spec}): payload differs"
        assert scales.shape == want_s.shape and torch.equal(scales.view(torch.int32), want_s.view(torch.int32)), \
            f"target {k} ({t.spec}): scales differ"


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("codecs", CODEC_SETS, ids="-".join)
def test_every_part_equals_the_reference_call_after_call(monkeypatch, backend, codecs):
    monkeypatch.setenv("ANCHORKV_BACKEND", backend)
    regions = _regions(4, seed=2)
    before = [r.clone() for r in regions]
    targets, slots = _set(regions, codecs)
    ps = PackSet(targets, slots)
    assert ps.backend == backend
    # the counts change between calls (a new plan), come back (a reused one), and drop to 0
    for ids in ([(1,), (5, 3, 4)], [(2,), (4,)], [(0,), (3, 5, 4)], [(1,), ()], [[2], torch.tensor([5, 3])]):
        _assert_parts_equal_reference(ps.pack(ids), targets, slots, ids)
    assert all(torch.equal(a, b) for a, b in zip(regions, before, strict=True)), "a source byte changed"
    if backend == "triton":
        assert len(ps._plans) == 4  # slot lengths (1, 3), (1, 1), (1, 0), (1, 2)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_launch_whose_members_read_different_slots(monkeypatch, backend):
    """Kimi-Linear's three KDA groups: the same fields in three slots share a launch; each
    member packs its own slot's blocks."""
    monkeypatch.setenv("ANCHORKV_BACKEND", backend)
    conv, recurrent, _ = _page()
    regions = _regions(4, seed=14)
    targets = [PackTarget(b, f, BLOCKS, CodecSpec.parse(c)) for b in regions
               for f, c in ((conv, "int8:16"), (recurrent, "raw"))]
    slots = [0, 0, 1, 1, 2, 2, 1, 1]
    ps = PackSet(targets, slots)
    for ids in ([(0,), (1,), (2,)], [(2,), (0,), (1,)]):
        _assert_parts_equal_reference(ps.pack(ids), targets, slots, ids)


def test_a_plan_per_length_tuple_is_reused_and_the_oldest_evicted(monkeypatch):
    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")
    monkeypatch.setattr(packset, "PLANS_PER_SET", 2)
    from anchorkv.kernels import triton_pack

    built = []
    real = triton_pack._Plan

    def counting(targets, lens, slots):
        built.append(tuple(lens))  # one length per target
        return real(targets, lens, slots)

    monkeypatch.setattr(triton_pack, "_Plan", counting)
    targets, slots = _set(_regions(2, seed=3), CODEC_SETS[0])
    ps = PackSet(targets, slots)
    for ids in ([(1,), (3,)], [(2,), (4,)], [(1,), (3, 4)], [(0,), (5,)], [(0,), (3, 4, 5)], [(1,), (3,)]):
        ps.pack(ids)
    # (1,1) built, then reused (its use makes (1,2) the oldest); (1,3) evicts (1,2); (1,1) is kept
    assert [lens[-1] for lens in built] == [1, 2, 3]
    ps.pack([(1,), (3, 4)])  # (1,2) again: rebuilt, evicting (1,3)
    assert [lens[-1] for lens in built] == [1, 2, 3, 2]
    assert ps._plans.keys() == [(1, 1), (1, 2)]  # keyed by the slots' lengths


def _one_allocation(monkeypatch) -> None:
    """Batches made as on a GPU: one allocation (`batch.batch_tensors(one=True)`), here on a CPU."""
    from anchorkv.kernels import batch as batch_module

    make = batch_module.batch_tensors
    monkeypatch.setattr(batch_module, "batch_tensors", lambda *a, **kw: make(*a, **{**kw, "one": True}))


def _skip_two_on_a_gpu(alloc: str) -> None:
    """Batches on a GPU are always one allocation (`batch.batch_tensors`' default there, and a
    set kernel's call allocates only that): the two-tensor mode is a CPU batch's."""
    if alloc == "two" and DEVICE.type == "cuda":
        pytest.skip("a batch on a GPU is one allocation: the two-tensor mode runs on a CPU (CI)")


@pytest.mark.parametrize("alloc", ["whole", "two"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_batch_buffers_and_views(monkeypatch, backend, alloc):
    """A batch on a GPU is one allocation (`whole`, `host_bytes` long): the payload at its
    start, the scales at the next 16-byte boundary; on a CPU two (`whole` None). Parts are views
    of them, at 16-byte aligned launch starts, and equal the reference either way."""
    _skip_two_on_a_gpu(alloc)
    monkeypatch.setenv("ANCHORKV_BACKEND", backend)
    if alloc == "whole":
        _one_allocation(monkeypatch)
    targets, slots = _set(_regions(2, seed=4), CODEC_SETS[0])
    batch = PackSet(targets, slots).pack([(1,), (3, 4)])
    assert batch.payload.dim() == 1 and batch.payload.dtype == torch.uint8
    assert batch.scales.dim() == 1 and batch.scales.dtype == torch.float32
    whole = batch.whole
    if alloc == "two":
        assert whole is None
        whole = batch.payload
    else:
        assert whole is not None and whole.dtype == torch.uint8 and whole.numel() == batch.host_bytes
        assert batch.payload.data_ptr() == whole.data_ptr()
        assert batch.scales.data_ptr() == whole.data_ptr() + -(-batch.payload.nbytes // 16) * 16
    for k in range(len(batch)):
        payload, scales = batch.part(k)
        assert payload.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
        if scales.numel():
            assert (scales.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()) == (alloc == "whole")
    assert [p for p, _ in batch.parts()][0].numel() == batch.spans[0].payload_bytes
    _assert_parts_equal_reference(batch, targets, slots, [(1,), (3, 4)])


@pytest.mark.parametrize("alloc", ["whole", "two"])
def test_copy_to_host_is_one_copy_a_allocation_of_exact_bytes(monkeypatch, alloc):
    _skip_two_on_a_gpu(alloc)
    if alloc == "whole":
        _one_allocation(monkeypatch)
    targets, slots = _set(_regions(2, seed=5), CODEC_SETS[0])
    batch = PackSet(targets, slots).pack([(2,), (5, 4)])
    assert (batch.whole is not None) == (alloc == "whole")
    copies = []
    real_copy = torch.Tensor.copy_

    def counting(self, src, non_blocking=False):
        copies.append(non_blocking)
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    host = batch.copy_to_host(pin=False)
    want = [True] if alloc == "whole" else [True, True]
    assert copies == want, "one non_blocking copy per allocation"
    assert host.payload.data_ptr() != batch.payload.data_ptr()
    assert host.payload.device.type == "cpu" and host.scales.device.type == "cpu"
    assert torch.equal(host.payload, batch.payload.cpu()) and torch.equal(host.scales.view(torch.int32),
                                                                          batch.scales.cpu().view(torch.int32))
    for (p, s), (hp, hs) in zip(batch.parts(), host.parts(), strict=True):
        assert torch.equal(p.cpu(), hp) and torch.equal(s.cpu().view(torch.int32), hs.view(torch.int32))
    assert host.to_host() is host  # already on the host: no copy


@pytest.mark.parametrize("codecs", CODEC_SETS, ids="-".join)
@pytest.mark.parametrize("ids", [[(1,), (3, 4)], [(2,), ()], [(), (0, 5, 1)]], ids=["both", "no-paged", "no-state"])
def test_parts_are_the_views_part_makes(monkeypatch, codecs, ids):
    """`parts()` (two `split_with_sizes` calls) gives each part's very view `part(i)` gives:
    same address, shape and strides, in target order (the layout's order differs), with
    alignment gaps skipped and empty parts (a slot of no blocks, raw scales) empty."""
    monkeypatch.setenv("ANCHORKV_BACKEND", "reference")
    targets, slots = _set(_regions(3, seed=7), codecs)
    batch = PackSet(targets, slots).pack(ids)
    if ids[0] and ids[1]:  # launches group targets by signature: the layout's order is not theirs
        assert [s.payload_at for s in batch.spans] != sorted(s.payload_at for s in batch.spans)
    for _ in range(2):  # the second time from the cached cut
        parts = batch.parts()
        assert len(parts) == len(targets)
        for k, (p, s) in enumerate(parts):
            want_p, want_s = batch.part(k)
            for got, want in ((p, want_p), (s, want_s)):
                assert got.shape == want.shape and got.stride() == want.stride() and got.dtype == want.dtype, k
                assert got.numel() == 0 or got.data_ptr() == want.data_ptr(), k


def test_cuts_refuse_overlapping_or_overflowing_parts():
    sizes, index = packset._cuts([(16, 8), (0, 10), (30, 0), (24, 2)], 40)
    assert sizes == [10, 6, 8, 2, 14, 0] and index == [2, 0, 5, 3]
    with pytest.raises(ValueError, match="overlap at 5"):
        packset._cuts([(0, 10), (5, 2)], 20)
    with pytest.raises(ValueError, match="end at 12, past its 10"):
        packset._cuts([(0, 12)], 10)


@pytest.mark.parametrize("alloc", ["whole", "two"])
def test_copy_into_fills_one_buffer_payload_then_aligned_scales(monkeypatch, alloc):
    """`copy_into` (the worker's reused pinned buffers): the payload at 0 and the scales at the
    next 16-byte boundary of the given buffer, in one non_blocking copy of a one-allocation
    batch (two for two tensors), every part byte-equal; bytes past `host_bytes` untouched; a
    buffer that cannot hold it is refused."""
    _skip_two_on_a_gpu(alloc)
    if alloc == "whole":
        _one_allocation(monkeypatch)
    targets, slots = _set(_regions(2, seed=6), CODEC_SETS[0])
    batch = PackSet(targets, slots).pack([(1,), (2, 5)])
    assert (batch.whole is not None) == (alloc == "whole")
    need = batch.host_bytes
    assert need == -(-batch.payload.nbytes // 16) * 16 + batch.scales.nbytes
    host = torch.full((need + 64,), 0xAB, dtype=torch.uint8)
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False: (
        copies.append(non_blocking), real_copy(self, src, non_blocking=non_blocking))[1])
    out = batch.copy_into(host)
    monkeypatch.undo()
    assert copies == ([True] if alloc == "whole" else [True, True])
    assert out.whole is not None and out.whole.data_ptr() == host.data_ptr() and out.whole.numel() == need
    assert out.payload.data_ptr() == host.data_ptr() and out.scales.data_ptr() == host.data_ptr() + need - \
        batch.scales.nbytes and out.scales.data_ptr() % 16 == 0
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    for (p, s), (hp, hs) in zip(batch.parts(), out.parts(), strict=True):
        assert torch.equal(p.cpu(), hp) and torch.equal(s.cpu().view(torch.int32), hs.view(torch.int32))
    assert bool((host[need:] == 0xAB).all()), "copy_into wrote past host_bytes"
    if DEVICE.type == "cpu":
        assert batch.to_host(host=host) is batch  # on the host already: no copy, the buffer unused
    _assert_parts_equal_reference(out, targets, slots, [(1,), (2, 5)])
    for bad, found in ((torch.empty(need - 1, dtype=torch.uint8), "uint8"),
                       (torch.empty(need, dtype=torch.int8), "int8"),
                       (torch.empty(2, need, dtype=torch.uint8), "[2, ")):
        with pytest.raises(ValueError, match=f"at least {need} bytes, found .*{re.escape(found)}"):
            batch.copy_into(bad)


def test_a_whole_batch_makes_its_views_when_first_read(monkeypatch):
    """`packset._WholeBatch` (what a set kernel's call on a GPU returns: the one allocation, its
    views left unmade): sizes, `host_bytes` and `copy_into` read no view of it; `payload` and
    `scales` are `batch.batch_views` of the allocation, made once; parts equal the eager
    batch's."""
    from anchorkv.kernels import batch as kbatch

    _one_allocation(monkeypatch)
    targets, slots = _set(_regions(2, seed=6), CODEC_SETS[0])
    eager = PackSet(targets, slots).pack([(1,), (2, 5)])
    assert eager.whole is not None
    n, m = eager.payload.numel(), eager.scales.numel()
    made = []
    real = kbatch.batch_views
    monkeypatch.setattr(kbatch, "batch_views", lambda *a: made.append(a[0].data_ptr()) or real(*a))
    lazy = packset._WholeBatch(eager.whole, n, m, eager.spans, eager.scale_runs)
    assert lazy.sizes() == (n, m) and lazy.host_bytes == eager.host_bytes and len(lazy) == len(eager)
    host = torch.empty(lazy.host_bytes, dtype=torch.uint8)
    out = lazy.copy_into(host)
    assert made == [] and isinstance(out, packset._WholeBatch)  # nor the host copy's (the writer's)
    assert lazy.payload is lazy.payload and lazy.scales.dtype == torch.float32
    assert made == [eager.whole.data_ptr()]  # made once, when first read
    assert lazy.to_host(host=host) is not lazy or DEVICE.type == "cpu"
    assert made == [eager.whole.data_ptr()]  # (to_host asks the allocation where it is)
    assert lazy.payload.data_ptr() == eager.payload.data_ptr() and lazy.scales.data_ptr() == eager.scales.data_ptr()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    for (p, s), (lp, ls), (hp, hs) in zip(eager.parts(), lazy.parts(), out.parts(), strict=True):
        assert torch.equal(p, lp) and torch.equal(p.cpu(), hp)
        assert torch.equal(s.view(torch.int32), ls.view(torch.int32))
        assert torch.equal(s.cpu().view(torch.int32), hs.view(torch.int32))


def test_ids_are_checked_once_per_slot_and_blocks(monkeypatch):
    from anchorkv.kernels import batch as batch_module

    calls = []
    real = batch_module.check_ids
    monkeypatch.setattr(batch_module, "check_ids", lambda ids, n, **kw: calls.append(n) or real(ids, n, **kw))
    targets, slots = _set(_regions(4, seed=6), CODEC_SETS[0])
    PackSet(targets, slots).pack([(1,), (3,)])
    assert calls == [BLOCKS, BLOCKS]  # 10 targets, 2 slots


@pytest.mark.parametrize("ids, error, match", [
    ([(1,)], ValueError, r"block ids for 2 slots are needed, found 1"),
    ([(1,), (6,)], IndexError, r"block ids must lie in \[0, 6\), found min 6 and max 6"),
])
def test_bad_ids_are_refused_with_the_reason(ids, error, match):
    targets, slots = _set(_regions(2, seed=7), CODEC_SETS[0])
    with pytest.raises(error, match=match):
        PackSet(targets, slots).pack(ids)


def test_bad_sets_are_refused_with_the_reason(monkeypatch):
    targets, slots = _set(_regions(2, seed=8), CODEC_SETS[0])
    with pytest.raises(ValueError, match="at least one target"):
        PackSet([], [])
    with pytest.raises(ValueError, match="one slot per target: 5 targets, 4 slots"):
        PackSet(targets, slots[:-1])
    meta = PackTarget(torch.empty(64, dtype=torch.uint8, device="meta"), targets[0].field, 1, targets[0].spec)
    where = targets[0].buffer.device  # cpu here, cuda:0 where the tests run on a GPU
    with pytest.raises(ValueError, match=rf"one device, found \['{where}', 'meta'\]; make one set per device"):
        PackSet([targets[0], meta], [0, 0])
    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")
    odd = StridedField(torch.bfloat16, (4, 6), (6, 1), 0, 64)
    with pytest.raises(ValueError, match="even group size, found 3"):  # at construction, not per call
        PackSet([PackTarget(torch.zeros(128, dtype=torch.uint8, device=where), odd, 2, CodecSpec("int4", 3))], [0])


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_nan_check_reads_every_part_and_no_padding(monkeypatch, backend):
    """`PackedBatch.may_hold_nan` covers every part's scales (a NaN in any one is found) and
    nothing else: the alignment padding between launches, which no kernel writes, may hold
    anything. Codecs whose scale counts are not multiples of 4, so the Triton plan pads."""
    monkeypatch.setenv("ANCHORKV_BACKEND", backend)
    targets, slots = _set(_regions(3, seed=8), ("int8:16", "int4:32", "fp8:64"))
    batch = PackSet(targets, slots).pack([(1,), (5, 3, 4)])
    assert not batch.may_hold_nan()
    covered = torch.zeros(batch.scales.numel(), dtype=torch.bool)
    for at, n in batch.scale_runs:
        covered[at:at + n] = True
    for s in batch.spans:
        assert covered[s.scales_at:s.scales_at + s.scale_rows * s.columns].all()
    assert int(covered.sum()) == sum(s.scale_rows * s.columns for s in batch.spans)
    padding = (~covered).nonzero().flatten()
    if backend == "triton":
        assert padding.numel() > 0, "no padding: the test would not check it"
    batch.scales[padding] = float("nan")
    assert not batch.may_hold_nan()
    for k in range(len(batch)):
        _, scales = batch.part(k)
        if scales.numel():
            keep = scales.view(-1)[-1].clone()
            scales.view(-1)[-1] = float("nan")
            assert batch.may_hold_nan(), f"a NaN in part {k} was missed"
            scales.view(-1)[-1] = keep


@pytest.mark.parametrize("codecs", [CODEC_SETS[0], ("int8:16", "int4:32", "fp8:64")], ids="-".join)
def test_a_gpu_nan_sum_decides_alone_when_it_is_not_nan(monkeypatch, codecs):
    """A batch copied from a GPU carries `nan_sum`, the sum of its scales from the first run to
    the last (`_runs_values`: every run inside it, nothing past its ends) reduced on the GPU:
    `may_hold_nan` trusts it when it is not NaN (no scale read on the host), and when it is
    NaN (a NaN in a run, or in the padding: a false alarm) reduces each run on the host."""
    import dataclasses

    _one_allocation(monkeypatch)
    targets, slots = _set(_regions(3, seed=8), codecs)
    batch = PackSet(targets, slots).pack([(1,), (5, 3, 4)])
    assert batch.whole is not None and batch.scale_runs and batch.nan_sum is None
    region = batch._runs_values()
    lo, hi = batch.scale_runs[0][0], batch.scale_runs[-1][0] + batch.scale_runs[-1][1]
    assert region.data_ptr() == batch.scales.data_ptr() + 4 * lo and region.numel() == hi - lo
    assert all(lo <= at and at + n <= hi for at, n in batch.scale_runs)
    nan, zero = torch.tensor(float("nan")), torch.tensor(0.0)
    cpu = PackedBatch(batch.payload.cpu(), batch.scales.cpu(), batch.spans, batch.scale_runs)
    k = next(i for i, s in enumerate(cpu.spans) if s.columns)
    cpu.part(k)[1].view(-1)[0] = float("nan")  # a poisoned group
    assert not dataclasses.replace(cpu, nan_sum=zero).may_hold_nan()  # the GPU said clean: trusted
    assert dataclasses.replace(cpu, nan_sum=nan).may_hold_nan()  # it said NaN: the host finds it
    cpu.part(k)[1].view(-1)[0] = 1.0
    assert not dataclasses.replace(cpu, nan_sum=nan).may_hold_nan()  # a false alarm, cleared on the host


@pytest.mark.parametrize("how", ["copy_into", "copy_to_host"])
def test_the_batchs_copy_is_queued_before_its_nan_sum(monkeypatch, how):
    """A one-allocation batch's copy to the host is issued before its NaN sum (`_nan_sum`: a
    reduction and a small copy, queued on the same stream, read after both): the copy bounds a
    save, so nothing of the host's is spent ahead of it. The sum still reaches the host batch."""
    _one_allocation(monkeypatch)
    targets, slots = _set(_regions(3, seed=8), CODEC_SETS[0])
    batch = PackSet(targets, slots).pack([(1,), (5, 3, 4)])
    assert batch.whole is not None and batch.scale_runs
    order: list[str] = []
    total = torch.tensor(0.0)
    monkeypatch.setattr(PackedBatch, "_nan_sum", lambda self: (order.append("nan_sum"), total)[1])
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False: (
        order.append("copy"), real_copy(self, src, non_blocking=non_blocking))[1])
    if how == "copy_into":
        out = batch.copy_into(torch.empty(batch.host_bytes, dtype=torch.uint8))
    else:
        out = batch.copy_to_host(pin=False)
    monkeypatch.undo()
    assert order == ["copy", "nan_sum"], order
    assert out.nan_sum is total and torch.equal(out.whole, batch.whole.cpu())


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the GPU's NaN sum: CUDA only (its host side runs in CI above)")
@pytest.mark.parametrize("poisoned", [False, True])
def test_a_batch_copied_from_a_gpu_brings_its_nan_sum(monkeypatch, poisoned):
    """`copy_into` and `copy_to_host` of a GPU batch queue the NaN sum after the copy; it lands
    in page-locked memory, NaN exactly when a source group held a NaN (its scale is NaN)."""
    _, _, latent = _page()
    regions = _regions(3, seed=9)
    targets, slots = _set(regions, CODEC_SETS[0])  # latents: fp8:64 of the odd regions, slot 1
    if poisoned:  # a NaN in region 1's latent block 3: its group's scale is NaN
        field_view(regions[1], latent, BLOCKS)[3].view(-1)[0] = float("nan")
    batch = PackSet(targets, slots).pack([(1,), (5, 3, 4)])
    assert batch.whole is not None and batch.whole.is_cuda
    for out in (batch.copy_into(torch.empty(batch.host_bytes, dtype=torch.uint8, pin_memory=True)),
                batch.copy_to_host(pin=True)):
        torch.cuda.synchronize()
        assert out.nan_sum is not None and out.nan_sum.is_pinned() and out.nan_sum.dim() == 0
        assert bool(torch.isnan(out.nan_sum)) == poisoned
        assert out.may_hold_nan() == poisoned
        assert bool(torch.isnan(out._runs_values().sum())) == poisoned  # the host's own sum agrees


class _Recorder:  # stands for a kernel (tests.kernels.sm90's recorder: importing it leaves the interpreter)
    def __init__(self, calls, op=None):
        self.calls, self.op = calls, op

    def __getitem__(self, grid):
        def launch(**kwargs):  # a set kernel's launch: the launches it runs
            self.calls.extend(split_set_launch(grid, kwargs, self.op) if self.op else [(grid, kwargs)])
        return launch


def _record_launches(monkeypatch, calls: list, op: str = "pack") -> None:
    """Record the launches of `op` (grid, per-signature kernel arguments) instead of running
    them, a set kernel's as the launches it runs."""
    from anchorkv.kernels import triton_pack, triton_unpack

    module = triton_pack if op == "pack" else triton_unpack
    monkeypatch.setattr(module, f"_{op}_kernel", _Recorder(calls))
    monkeypatch.setattr(module, f"_{op}_set_kernel", _Recorder(calls, op))


@pytest.mark.parametrize("codecs", [("int4:16", "raw", "bf16"), ("fp8:8", "int8:32", "int4:64"),
                                    ("raw", "int4:32", "int4:64")], ids="-".join)
@pytest.mark.parametrize("entry", ["set", "set-unfused", "pack_many"])
def test_each_pack_launch_claims_an_alignment_every_group_start_has(monkeypatch, codecs, entry):
    """OUT_ALIGN (`tl.multiple_of` on the payload stores: an over-claim faults on a GPU, and the
    interpreter ignores it) divides the address of every group a launch writes into the call's
    whole payload (from PAY0, the launch's part), checked from the recorded launch arguments;
    some launch claims more than 1. The launches' parts tile the payload and scales in the
    layout's order. A set's launches are those its set kernel runs (`triton_pack.FUSED`), or
    its per-signature launches."""
    from anchorkv.kernels import batch, triton_pack
    from anchorkv.kernels.triton_pack import pack_many

    calls: list = []
    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")
    monkeypatch.setattr(triton_pack, "FUSED", entry == "set")
    _record_launches(monkeypatch, calls)
    targets, slots = _set(_regions(4, seed=17), codecs)
    ids = [(1,), (5, 3)]
    if entry.startswith("set"):
        PackSet(targets, slots).pack(ids)
    else:
        pack_many([PackItem(t.buffer, t.field, ids[s], t.num_blocks, t.spec) for t, s in zip(targets, slots,
                                                                                           strict=True)])
    claims, parts = [], []
    for _, kw in calls:
        width, n = kw["payload"].element_size(), kw["N"]
        items = kw["tab"].numel() // kw["TAB_W"]
        half = kw["FMT"] == batch.FMT_CODE[batch.Quant.INT4]  # two codes a byte
        for i_b in range(items * n):
            for grp in range(kw["GROUPS"]):
                e = i_b * kw["NUMEL"] + grp * kw["G"]
                e = kw["PAY0"] + (e // 2 if half else e)
                assert (kw["payload"].data_ptr() + e * width) % (kw["OUT_ALIGN"] * width) == 0, kw["OUT_ALIGN"]
        per_block = kw["NUMEL"] // 2 if half else kw["NUMEL"] * width  # bytes
        parts.append((kw["PAY0"] * width, items * n * per_block))
        claims.append(kw["OUT_ALIGN"])
    assert len(claims) == 3 and max(claims) > 1, claims
    parts.sort()
    assert all(a + size <= b for (a, size), (b, _) in zip(parts, parts[1:], strict=False)), parts  # no overlap


@pytest.mark.parametrize("payload_bytes", [0, 37, 48])
def test_one_allocation_puts_the_scales_at_the_next_16_byte_boundary(payload_bytes):
    """`batch.batch_tensors(one=True)` for payloads that do and do not end on a 16-byte
    boundary: the scales start at the next one, the allocation ends with them, and a batch laid
    out there crosses into a host buffer in one copy with every byte where it was."""
    from anchorkv.kernels import batch as batch_module

    whole, payload, scales = batch_module.batch_tensors(payload_bytes, 5, torch.device("cpu"), one=True)
    at = -(-payload_bytes // 16) * 16
    assert whole is not None and whole.numel() == at + 20 and payload.numel() == payload_bytes
    assert payload_bytes == 0 or payload.data_ptr() == whole.data_ptr()  # (an empty view has no address)
    assert scales.data_ptr() == whole.data_ptr() + at
    assert scales.dtype == torch.float32 and scales.numel() == 5
    payload.copy_(torch.arange(payload_bytes, dtype=torch.uint8))
    scales.copy_(torch.arange(5, dtype=torch.float32) + 0.5)
    b = PackedBatch(payload, scales, (), (), whole)
    assert b.host_bytes == whole.numel()
    out = b.copy_into(torch.zeros(b.host_bytes + 16, dtype=torch.uint8))
    assert torch.equal(out.payload, payload) and torch.equal(out.scales, scales)
    assert out.scales.data_ptr() == out.whole.data_ptr() + at


def _same_arguments(a: dict, b: dict) -> bool:
    """The same launch arguments: tables equal, the regions' anchors the same tensors, the
    payload and scales the same dtype and size (each call's own batch), the rest equal."""
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor):
            if not isinstance(w, torch.Tensor) or (v.dtype, v.shape) != (w.dtype, w.shape):
                return False
            if k == "tab" and not torch.equal(v, w) or k in ("src", "dst") and v.data_ptr() != w.data_ptr():
                return False
        elif v != w:
            return False
    return True


@pytest.mark.parametrize("op", ["pack", "unpack"])
@pytest.mark.parametrize("codecs", CODEC_SETS, ids="-".join)
def test_a_set_kernel_runs_the_launches_of_the_per_signature_plan(monkeypatch, op, codecs):
    """`triton_pack.FUSED`: a set's call is one launch of its set kernel, whose launches (cut
    from its per-launch values and CFG by `split_set_launch`) have the grids and arguments of the
    per-signature launches the same set makes with FUSED off: the same tables, payload views,
    offsets, alignment claims and constants, in the same order, each tile re-cut to 16 values
    a thread at the set's warps (`set_tile_rows`). With `set_config` unable
    (past `SET_PAIRS_LIMIT`), the plan launches per signature."""
    from anchorkv.kernels import UnpackSet, batch, triton_pack

    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")
    targets, slots = _set(_regions(4, seed=19), codecs)
    ids = [(2,), (4, 1, 5)]
    packed = PackSet(targets, slots).pack(ids)
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(triton_pack, "FUSED", fused)
        calls: list = []
        _record_launches(monkeypatch, calls, op)
        if op == "pack":
            set_ = PackSet(targets, slots)
            set_.pack(ids)
        else:
            set_ = UnpackSet(targets, slots)
            set_.unpack(packed, ids)
        plan = set_._plans.newest()
        assert (plan.fused is not None) == fused
        runs[fused] = (calls, plan)
    (calls, plan), (fused_calls, fused_plan) = runs[False], runs[True]
    # the set kernel's warps: the most any launch's tile asks for; no fp fusion, as theirs
    warps = fused_plan.fused.fixed["num_warps"]
    assert warps == max(kw["num_warps"] for _, kw in calls) and fused_plan.fused.fixed["enable_fp_fusion"] is False
    assert len(calls) == 3 and [g[1:] for g, _ in fused_calls] == [g[1:] for g, _ in calls]
    launches = [plan.launches[k] for k in plan.order] if op == "pack" else [run for run, _ in plan.launches]
    for (grid, a), (fused_grid, b), launch in zip(calls, fused_calls, launches, strict=True):
        assert a["enable_fp_fusion"] is False
        # each tile re-cut to 16 values a thread at the set's warps (as few rows as groups)
        rows = b["BLOCK_R"]
        assert rows == batch.tile_rows(launch.cut, a["BLOCK_G"], warps * 32 * 16)
        assert fused_grid[0] == -(-a["GROUPS"] // rows) and grid[0] == -(-a["GROUPS"] // a["BLOCK_R"])
        assert _same_arguments({k: v for k, v in a.items() if k not in ("num_warps", "enable_fp_fusion", "BLOCK_R")},
                               {k: v for k, v in b.items() if k != "BLOCK_R"})
    monkeypatch.setattr(triton_pack, "SET_PAIRS_LIMIT", 2)  # the paged slot's 3 blocks x 2 latents
    set_ = PackSet(targets, slots) if op == "pack" else UnpackSet(targets, slots)
    set_.pack(ids) if op == "pack" else set_.unpack(packed, ids)
    assert set_._plans.newest().fused is None


def test_a_kimi_linear_set_kernel_keeps_16_values_a_thread():
    """`set_config` on the Kimi-Linear tp=1 fields with the connector's lossy codecs: 8 warps
    (the latent's and conv's own), the recurrent state's tile regrown from 2048 to 4096 values
    (its own launch: 4 warps), so every part's threads take 16 values; the parts' programs
    tile the grid in order; the division by N is exact at the bound, and past it no set."""
    import numpy as np

    from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, kimi_linear_layout
    from anchorkv.kernels import batch, triton_pack

    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=1)
    fields = {f.name: f.strided(layout.layers[0].page.page_bytes) for layer in layout.layers for f in layer.page.fields}
    codecs = {"latent": "fp8:64", "recurrent": "int8:128", "conv": "int8:128"}
    parts, own = [], {}
    for name, count, n in (("latent", 7, 4), ("recurrent", 20, 1), ("conv", 20, 1)):
        cut = batch.field_cut(fields[name], CodecSpec.parse(codecs[name]))
        grid, fixed = triton_pack.launch_config(cut, count, n)
        own[name] = fixed["num_warps"]
        parts.append((cut, grid, fixed, 1, 0, 2 + n, 8, 16, (0, 0)))
    assert own == {"latent": 8, "recurrent": 4, "conv": 8}
    (programs,), vary, cfg, warps = triton_pack.set_config(parts)
    assert warps == 8
    at = 0
    for (cut, (_, n, count), *_), v, c in zip(parts, vary, cfg, strict=True):
        tiles, rows, block_g = c[0], c[13], c[14]
        assert rows * block_g == 8 * 32 * 16 and tiles == -(-cut.groups // rows)
        assert v[:3] == (at, at + tiles * n * count, n)
        at = v[1]
    assert programs == at
    # set_program's fp32 floor((j + 0.5) * RN(1/n)) is j // n for every pair below the bound
    for n in (1, 3, 7, 69, 1000, 4097):
        j = np.arange(min(triton_pack.SET_PAIRS_LIMIT, 4 << 20), dtype=np.int64)
        rcp = np.float32(1.0) / np.float32(n)
        got = ((j.astype(np.float32) + np.float32(0.5)) * rcp).astype(np.int32)
        assert np.array_equal(got, j // n), n
    big = [(cut, (tiles, triton_pack.SET_PAIRS_LIMIT + 1, 1), *rest) for cut, (tiles, _, _), *rest in parts]
    assert triton_pack.set_config(big) is None


@pytest.mark.parametrize("codecs", [("int8:16", "raw", "fp8:64"), ("bf16", "int4:32", "int8:64")], ids="-".join)
def test_a_set_kernel_finds_the_item_of_every_block_of_a_long_slot(monkeypatch, codecs):
    """A paged slot of 41 and 47 blocks read by two latent targets: the first counts where the
    plain fp32 product j * RN(1/N) truncates below the item (41 * RN(1/41) < 1 in fp32), which
    `set_program`'s + 0.5 keeps exact. The set kernel's pack and unpack match the reference
    on every block of both items."""
    from anchorkv.kernels import UnpackSet
    from anchorkv.kernels.strided import field_view
    from tests.kernels.test_unpackset import _expected, _same_bytes

    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")
    conv, recurrent, latent = _page()
    blocks = 50
    g = torch.Generator().manual_seed(23)
    regions = []
    for _ in range(2):
        buf = torch.randint(0, 256, (blocks * conv.block_stride,), dtype=torch.uint8, generator=g)
        for f in (conv, recurrent, latent):
            v = field_view(buf, f, blocks)
            v.copy_(torch.randn(v.shape, generator=g).to(f.dtype))
        regions.append(buf.to(DEVICE))  # (the interpreter here, the compiled kernels on a GPU)
    targets = [PackTarget(b, f, blocks, CodecSpec.parse(c)) for b in regions
               for f, c in ((conv, codecs[0]), (recurrent, codecs[1]), (latent, codecs[2]))]
    slots = [0, 0, 1] * 2
    for n in (41, 47):
        assert int(np.float32(n) * (np.float32(1) / np.float32(n))) == 0  # the plain product's floor: wrong
        # (the state block 7 is no latent's block: the unpack's targets must not overlap)
        ids = [(7,), tuple(b for b in torch.randperm(blocks, generator=g).tolist() if b != 7)[:n]]
        ps = PackSet(targets, slots)
        packed = ps.pack(ids)
        assert ps._plans.newest().fused is not None
        _assert_parts_equal_reference(packed, targets, slots, ids)
        dst = [tuple(reversed(i)) for i in ids]
        before = [r.clone() for r in regions]
        want = _expected(regions, targets, slots, packed, dst)
        UnpackSet(targets, slots).unpack(packed, dst)
        assert _same_bytes(regions, want)
        for r, b in zip(regions, before, strict=True):
            r.copy_(b)


def test_a_set_says_once_how_many_launches_its_calls_make(monkeypatch, caplog):
    """At its first Triton plan a set logs (INFO) whether its calls are one set-kernel launch
    or one launch per signature; later plans say nothing."""
    import logging

    from anchorkv.kernels import UnpackSet, triton_pack

    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")
    targets, slots = _set(_regions(2, seed=29), CODEC_SETS[0])
    for fused, want in ((True, "in one set-kernel launch (3 signatures)"),
                        (False, "in 3 launches, one per signature (3 signatures)")):
        monkeypatch.setattr(triton_pack, "FUSED", fused)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="anchorkv"):
            ps = PackSet(targets, slots)
            packed = ps.pack([(1,), (3,)])
            ps.pack([(2,), (4, 5)])  # a second plan: nothing more said
            UnpackSet(targets, slots).unpack(packed, [(2,), (4,)])
        lines = [r.getMessage() for r in caplog.records]
        assert lines == [f"anchorkv: a PackSet of 5 parts packs them {want}",
                         f"anchorkv: an UnpackSet of 5 parts unpacks them {want}"], lines


def test_a_set_kernel_of_six_launches_packs_and_unpacks_the_references_bytes(monkeypatch):
    """Two codecs a field (layers configured apart, or a model with more field shapes, as
    Qwen3-Next's 5): 6 signatures, one set-kernel launch a call, every part and every
    restored byte the reference's."""
    from anchorkv.kernels import UnpackSet
    from tests.kernels.test_unpackset import _expected, _same_bytes

    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")
    conv, recurrent, latent = _page()
    regions = _regions(4, seed=31)
    targets, slots = [], []
    for i, buf in enumerate(regions):
        first = i < 2
        targets += [PackTarget(buf, conv, BLOCKS, CodecSpec.parse("int8:16" if first else "bf16")),
                    PackTarget(buf, recurrent, BLOCKS, CodecSpec.parse("raw" if first else "int4:32")),
                    PackTarget(buf, latent, BLOCKS, CodecSpec.parse("fp8:64" if first else "int8:32"))]
        slots += [0, 0, 1]
    ids = [(1,), (4, 3)]
    ps = PackSet(targets, slots)
    packed = ps.pack(ids)
    plan = ps._plans.newest()
    assert plan.fused is not None and len(plan.order) == 6
    _assert_parts_equal_reference(packed, targets, slots, ids)
    dst = [(2,), (5, 3)]
    want = _expected(regions, targets, slots, packed, dst)
    us = UnpackSet(targets, slots)
    us.unpack(packed, dst)
    assert us._plans.newest().fused is not None
    assert _same_bytes(regions, want)


def _part_ranges(batch: PackedBatch) -> set[int]:
    """Every byte of the batch's one allocation that a part's payload or scales occupies."""
    assert batch.whole is not None
    at = batch.scales.data_ptr() - batch.whole.data_ptr()
    out: set[int] = set()
    for s in batch.spans:
        out.update(range(s.payload_at, s.payload_at + s.payload_bytes))
        out.update(range(at + 4 * s.scales_at, at + 4 * (s.scales_at + s.scale_rows * s.columns)))
    return out


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 7])
@pytest.mark.parametrize("codecs", CODEC_SETS[:2], ids="-".join)
def test_chunked_packs_complete_each_chunks_ranges_and_cover_every_part(monkeypatch, backend, chunks, codecs):
    """`PackSet.pack_chunks` (a save's pack cut so its copy to the host overlaps the rest): up to
    `chunks` launches of the set kernel, each followed by `on_chunk(whole, ranges)`. At each
    call the bytes of its ranges are already the final ones (its launches wrote them: the rest
    of the allocation still holds a fill pattern where no earlier chunk wrote); the ranges of
    all calls cover every part's payload and scales, each byte once; the batch equals the
    reference's part by part. The reference backend packs in one go: one call, everything."""
    monkeypatch.setenv("ANCHORKV_BACKEND", backend)
    from anchorkv.kernels import batch as kbatch

    fill = 0xA5
    make = kbatch.batch_tensors

    def filled(*a, **kw):  # (allocations start as a pattern: a range not written yet still shows it)
        whole, payload, scales = make(*a, **kw)
        if whole is not None:
            whole.fill_(fill)
        return whole, payload, scales

    monkeypatch.setattr(kbatch, "batch_tensors", filled)
    regions = _regions(4, seed=31)
    targets, slots = _set(regions, codecs)
    ids = [(2,), (5, 3, 4)]  # (`_regions` fills the state fields of blocks 0..2, the latents of 3..5)
    ps = PackSet(targets, slots)
    seen: list[tuple[tuple[tuple[int, int], ...], torch.Tensor]] = []
    batch = ps.pack_chunks(ids, chunks, lambda whole, ranges: seen.append((ranges, whole.clone())))
    _assert_parts_equal_reference(batch, targets, slots, ids)
    assert batch.whole is not None and all(w.numel() == batch.whole.numel() for _, w in seen)
    final = batch.whole
    if backend == "reference":
        assert [r for r, _ in seen] == [((0, final.numel()),)]
        return
    plan = ps._plans.newest()
    assert plan.fused is not None and 1 <= len(seen) <= chunks
    assert len(seen) == min(chunks, len(targets)) or len(seen) < chunks  # (at most one chunk an item)
    covered: list[int] = []
    written: set[int] = set()
    for ranges, snapshot in seen:
        mine = [b for start, n in ranges for b in range(start, start + n)]
        covered += mine
        written.update(mine)
        idx = torch.tensor(mine, dtype=torch.long)
        assert torch.equal(snapshot[idx], final[idx]), "a chunk's ranges were not final at its call"
        rest = torch.tensor(sorted(set(range(final.numel())) - written), dtype=torch.long)
        if rest.numel():  # (what no chunk so far wrote: still the pattern)
            assert bool((snapshot[rest] == fill).all()), "a chunk wrote past its ranges"
    assert len(covered) == len(set(covered)) and set(covered) == _part_ranges(batch)
    grids = [launcher.grid[0] for launcher, _ in plan.chunk_launchers(chunks)]
    assert sum(grids) == plan.fused.grid[0]  # the chunks' programs are the one launch's
