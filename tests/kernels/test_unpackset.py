"""`kernels.UnpackSet`: a `PackedBatch` written back into fixed targets call after call. The
whole destination regions (every byte, the blocks not named and the fields not targeted
included) equal what `reference.unpack` of each part writes into a copy, on the Triton path
(interpreter on CPU) and the reference path; a batch laid out for other targets or counts, and
bad ids, are refused before any byte is written."""

from __future__ import annotations

import pytest
import torch

from anchorkv.codec import CodecSpec
from anchorkv.kernels import PackedBatch, PackSet, PackTarget, UnpackItem, UnpackSet, batch, reference
from tests.kernels.test_batched import BLOCKS, _page, _regions
from tests.kernels.test_packset import CODEC_SETS, _set

pytestmark = pytest.mark.interpreter


def _expected(regions, targets, slots, packed: PackedBatch, ids) -> list[torch.Tensor]:
    """Copies of `regions` with every part of `packed` written by the reference."""
    out = [r.clone() for r in regions]
    where = {r.data_ptr(): k for k, r in enumerate(regions)}
    for i, (t, s) in enumerate(zip(targets, slots, strict=True)):
        payload, scales = packed.part(i)
        dst = out[where[t.buffer.data_ptr()]]
        reference.unpack(UnpackItem(dst, t.field, ids[s], t.num_blocks, t.spec, payload, scales))
    return out


def _same_bytes(got, want) -> bool:
    return all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("codecs", CODEC_SETS, ids="-".join)
def test_every_byte_equals_the_reference_call_after_call(monkeypatch, backend, codecs):
    monkeypatch.setenv("ANCHORKV_BACKEND", backend)
    sources = _regions(4, seed=3)
    src_targets, slots = _set(sources, codecs)
    ps = PackSet(src_targets, slots)
    regions = _regions(4, seed=4)  # the destination: other values, stale bytes everywhere
    targets, _ = _set(regions, codecs)
    us = UnpackSet(targets, slots)
    assert us.backend == backend
    # (source ids, destination ids): counts change (a new plan), come back (a reused one), drop to 0;
    # state blocks and latent blocks alias the same bytes, so a call's slots name disjoint blocks
    calls = [([(1,), (5, 3, 4)], [(2,), (4, 5, 3)]), ([(0,), (4,)], [(1,), (3,)]),
             ([(2,), (3, 5, 4)], [(0,), [5, 3, 4]]), ([(1,), ()], [(2,), ()]),
             ([[2], (5, 3)], [torch.tensor([1]), torch.tensor([3, 4])])]
    for src_ids, dst_ids in calls:
        packed = ps.pack(src_ids)
        want = _expected(regions, targets, slots, packed, dst_ids)
        us.unpack(packed, dst_ids)
        assert _same_bytes(regions, want), f"{src_ids} -> {dst_ids}: a byte differs from the reference"
    if backend == "triton":
        assert len(us._plans) == 4  # slot lengths (1, 3), (1, 1), (1, 0), (1, 2)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_launch_whose_members_read_different_slots(monkeypatch, backend):
    """Kimi-Linear's three KDA groups: the same fields in three slots, one launch per field,
    each member written at its own slot's blocks."""
    monkeypatch.setenv("ANCHORKV_BACKEND", backend)
    conv, recurrent, _ = _page()
    sources, regions = _regions(4, seed=12), _regions(4, seed=13)

    def targets_of(bufs):
        return [PackTarget(b, f, BLOCKS, CodecSpec.parse(c)) for b in bufs
                for f, c in ((conv, "int8:16"), (recurrent, "raw"))]

    slots = [0, 0, 1, 1, 2, 2, 1, 1]
    packed = PackSet(targets_of(sources), slots).pack([(0,), (1,), (2,)])
    targets = targets_of(regions)
    us = UnpackSet(targets, slots)
    if backend == "triton":
        plan = us._plan((1, 1, 1))
        assert len(plan.launches) == 2 and len(plan.tables.views or plan.tables.writes) == 6  # 2 fields x 3 slots
    for ids in ([(2,), (0,), (1,)], [(1,), (2,), (0,)]):
        want = _expected(regions, targets, slots, packed, ids)
        us.unpack(packed, ids)
        assert _same_bytes(regions, want), ids


@pytest.mark.parametrize("fused", [True, False], ids=["set-kernel", "per-signature"])
@pytest.mark.parametrize("codecs", [("int4:16", "raw", "bf16"), ("fp8:8", "int8:32", "int4:64")], ids="-".join)
def test_each_launch_claims_an_alignment_every_group_start_has(monkeypatch, codecs, fused):
    """IN_ALIGN (`tl.multiple_of` on the payload loads: an over-claim faults on a GPU, and the
    interpreter ignores it) divides the address of every group the launch reads, checked from
    the recorded launch arguments; some launch claims more than 1. With the set kernel
    (`triton_pack.FUSED`), its launches as `split_set_launch` cuts them."""
    from anchorkv.kernels import triton_pack
    from tests.kernels.test_packset import _record_launches

    calls: list = []
    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")
    monkeypatch.setattr(triton_pack, "FUSED", fused)
    src_targets, slots = _set(_regions(4, seed=15), codecs)
    packed = PackSet(src_targets, slots).pack([(1,), (5, 3)])
    targets, _ = _set(_regions(4, seed=16), codecs)
    _record_launches(monkeypatch, calls, "unpack")
    UnpackSet(targets, slots).unpack(packed, [(2,), (4, 3)])
    claims = []
    for _, kw in calls:
        width, w = kw["payload"].element_size(), 4 + kw["N"]
        rows = kw["tab"].view(-1, w)
        half = kw["FMT"] == batch.FMT_CODE[batch.Quant.INT4]  # two codes a byte
        for row in rows.tolist():
            for i_n in range(kw["N"]):
                for grp in range(kw["GROUPS"]):
                    e = i_n * kw["NUMEL"] + grp * kw["G"]
                    e = row[2] + (e // 2 if half else e)
                    assert (kw["payload"].data_ptr() + e * width) % (kw["IN_ALIGN"] * width) == 0, kw["IN_ALIGN"]
        claims.append(kw["IN_ALIGN"])
    assert len(claims) == 3 and max(claims) > 1, claims


def test_the_layout_is_the_same_on_every_backend(monkeypatch):
    """A PackSet on either backend lays its parts out as `UnpackSet.layout` says, so a batch
    packed on one backend (or filled part by part) unpacks on the other."""
    targets, slots = _set(_regions(3, seed=5), CODEC_SETS[0])
    ids = [(1,), (5, 3)]
    layouts = {}
    for backend in ("triton", "reference"):
        monkeypatch.setenv("ANCHORKV_BACKEND", backend)
        layouts[backend] = (PackSet(targets, slots).pack(ids).spans, UnpackSet(targets, slots).layout((1, 2)).spans)
    assert len({spans for pair in layouts.values() for spans in pair}) == 1
    spans = layouts["triton"][0]
    for s in spans:  # every part where the payload's dtype can be viewed and loaded 16 bytes wide
        assert s.payload_bytes == 0 or s.payload_at % 2 == 0


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_a_batch_filled_part_by_part_unpacks(monkeypatch, backend):
    """What a restore does: one buffer per tensor of the batch, each part read into its span."""
    monkeypatch.setenv("ANCHORKV_BACKEND", backend)
    sources = _regions(2, seed=6)
    src_targets, slots = _set(sources, ("int4:16", "fp8:32", "raw"))
    regions = _regions(2, seed=7)
    targets, _ = _set(regions, ("int4:16", "fp8:32", "raw"))
    us = UnpackSet(targets, slots)
    layout = us.layout((1, 2))
    device = regions[0].device  # the batch lies where the targets do (cuda:0 on a GPU)
    payload = torch.full((layout.payload_bytes,), 0xAB, dtype=torch.uint8, device=device)
    scales = torch.full((layout.scale_values,), float("nan"), device=device)  # padding is never read
    for t, s, span in zip(src_targets, slots, layout.spans, strict=True):
        from anchorkv.kernels import PackItem

        p, sc = reference.pack(PackItem(t.buffer, t.field, [(0,), (3, 5)][s], t.num_blocks, t.spec))
        payload.narrow(0, span.payload_at, span.payload_bytes).copy_(p.reshape(-1))
        scales.narrow(0, span.scales_at, span.scale_rows * span.columns).copy_(sc.reshape(-1))
    packed = PackedBatch(payload, scales, layout.spans)
    ids = [(2,), (4, 3)]
    want = _expected(regions, targets, slots, packed, ids)
    us.unpack(packed, ids)
    assert _same_bytes(regions, want)


def test_bad_calls_are_refused_and_write_nothing(monkeypatch):
    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")
    src_targets, slots = _set(_regions(2, seed=8), CODEC_SETS[0])
    packed = PackSet(src_targets, slots).pack([(1,), (5, 3)])
    regions = _regions(2, seed=9)
    targets, _ = _set(regions, CODEC_SETS[0])
    us = UnpackSet(targets, slots)
    before = [r.clone() for r in regions]
    other = PackSet(src_targets, slots).pack([(1,), (5,)])
    bad = [
        ([(2,), (4,)], packed, "laid out for other targets or block counts .* slots of \\[1, 1\\] blocks"),
        ([(2,), (4, 3)], other, "laid out for other targets"),
        ([(2,), (4, 4)], packed, "distinct"),
        ([(2,), (4, BLOCKS)], packed, f"lie in \\[0, {BLOCKS}\\)"),
        ([(2,)], packed, "block ids for 2 slots are needed, found 1"),
        ([(2,), (4, 3)], PackedBatch(packed.payload[:-16], packed.scales, packed.spans), "payload must be"),
        ([(2,), (4, 3)], PackedBatch(packed.payload, packed.scales.double(), packed.spans), "scales must be"),
        ([(2,), (4, 3)], PackedBatch(packed.payload.view(2, -1), packed.scales, packed.spans), "payload must be"),
        ([(2,), (4, 3)], PackedBatch(_shifted(packed.payload), packed.scales, packed.spans), "16-byte aligned"),
        ([(2,), (4, 3)], PackedBatch(packed.payload, _shifted(packed.scales), packed.spans), "16-byte aligned"),
    ]
    for ids, batch_, match in bad:
        with pytest.raises((ValueError, IndexError), match=match):
            us.unpack(batch_, ids)
        assert _same_bytes(regions, before), f"a refused call ({match}) wrote bytes"
    with pytest.raises(ValueError, match="at least one target"):
        UnpackSet([], [])
    with pytest.raises(ValueError, match="one slot per target"):
        UnpackSet(targets, slots[:-1])


def _shifted(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` at an address 4 bytes past a 16-byte boundary."""
    raw = torch.empty(t.nbytes + 32, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % 16 + 4
    return raw[skip:skip + t.nbytes].view(t.dtype).copy_(t)


def test_batch_layout_groups_by_signature_and_aligns_each_group():
    conv, recurrent, latent = _page()
    buf = torch.zeros(BLOCKS * conv.block_stride, dtype=torch.uint8)
    items = [PackTarget(buf, conv, BLOCKS, CodecSpec.parse("int8:16")),
             PackTarget(buf, latent, BLOCKS, CodecSpec.parse("raw")),
             PackTarget(buf, conv, BLOCKS, CodecSpec.parse("int8:16"))]
    layout = batch.batch_layout(items, [1, 3, 1])
    assert layout.groups == ((0, 2), (1,))
    conv_bytes = conv.numel  # int8: a byte a value
    assert [s.payload_at for s in layout.spans] == [0, 2 * conv_bytes + (-2 * conv_bytes) % 16, conv_bytes]
    assert layout.spans[1].payload_bytes == 3 * latent.numel * 2
    assert layout.scale_runs == ((0, 2 * conv.numel // 16),)
    assert layout.payload_bytes % 16 == 0 and layout.scale_values % 4 == 0
