"""Kimi-Linear-sized regions: GPU only (the interpreter would take minutes per case)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, CodecSpec, kimi_linear_layout
from anchorkv.kernels import PackItem, PackSet, PackTarget, UnpackItem, UnpackSet, reference, triton_pack
from anchorkv.kernels.strided import field_view
from anchorkv.kernels.triton_pack import pack_many
from anchorkv.kernels.triton_unpack import unpack_many

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="full Kimi-Linear sizes need CUDA; the interpreter runs the same kernels at small "
    "sizes in the other tests of this folder",
)


def _kimi_items(tp: int, codecs) -> tuple[list[torch.Tensor], list[PackItem]]:
    """4 regions of Kimi-Linear blocks on the GPU, random bytes with random values in the
    blocks packed, and each region's conv, recurrent and latent items."""
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=tp, conv_layout="DS")
    kda = layout.of_kind("state")[0].page
    mla = layout.of_kind("paged")[0].page
    blocks = 12
    g = torch.Generator(device="cuda").manual_seed(0)
    regions = [torch.randint(0, 256, (blocks * kda.page_bytes,), dtype=torch.uint8,
                             device="cuda", generator=g) for _ in range(4)]
    items = []
    for buf in regions:
        for f, codec in zip(kda.fields, codecs[:2], strict=True):  # conv, recurrent
            strided = f.strided(kda.page_bytes)
            view = torch.randn((blocks, *f.shape), device="cuda", generator=g).to(f.dtype)
            field_view(buf, strided, blocks)[:6] = view[:6]
            group = 128 if f.shape[-1] % 128 == 0 else None
            items.append(PackItem(buf, strided, [2], blocks, CodecSpec(codec, group)))
        lat = mla.fields[0].strided(mla.page_bytes)
        field_view(buf, lat, blocks)[6:] = torch.randn((6, *lat.shape), device="cuda",
                                                       generator=g).to(lat.dtype)
        items.append(PackItem(buf, lat, [6, 9, 7, 11], blocks, CodecSpec(codecs[2], 64)))
    return regions, items


def _destination(item: PackItem) -> list[int]:
    return [3] if len(item.block_ids) == 1 else [8, 10, 6, 7]


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("codecs", [("int8", "int8", "fp8"), ("raw", "raw", "raw"),
                                    ("fp8", "int4", "int4")])
def test_kimi_request_round_trip_equals_reference(tp, codecs):
    regions, items = _kimi_items(tp, codecs)
    results = pack_many(items)
    moves = []
    for it, (p, s) in zip(items, results, strict=True):
        wp, ws = reference.pack(it)
        assert torch.equal(p, wp) and torch.equal(s.view(torch.int32), ws.view(torch.int32))
        moves.append(UnpackItem(it.buffer, it.field, _destination(it), it.num_blocks, it.spec, p, s))
    want = [r.clone() for r in regions]
    for m in moves:
        reference.unpack(dataclasses.replace(m, buffer=want[[id(r) for r in regions].index(id(m.buffer))]))
    unpack_many(moves)
    assert all(torch.equal(r, w) for r, w in zip(regions, want, strict=True))


@pytest.mark.parametrize("fused", [True, False], ids=["set-kernel", "per-signature"])
@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("codecs", [("int8", "int8", "fp8"), ("raw", "bf16", "int4")])
def test_kimi_sets_round_trip_equals_reference(monkeypatch, tp, codecs, fused):
    """A `PackSet` and an `UnpackSet` of the request's targets (a connector's save and
    restore): one set-kernel launch a call (`triton_pack.FUSED`) or one per signature; every
    part equals the reference's pack, and the unpack writes what the reference would."""
    monkeypatch.setattr(triton_pack, "FUSED", fused)
    regions, items = _kimi_items(tp, codecs)
    targets = [PackTarget(i.buffer, i.field, i.num_blocks, i.spec) for i in items]
    slots = [0 if len(i.block_ids) == 1 else 1 for i in items]
    src_ids, dst_ids = [[2], [6, 9, 7, 11]], [[3], [8, 10, 6, 7]]
    pack_set = PackSet(targets, slots)
    packed = pack_set.pack(src_ids)
    assert (pack_set._plans.newest().fused is not None) == fused
    want = [r.clone() for r in regions]
    for k, it in enumerate(items):
        p, s = packed.part(k)
        wp, ws = reference.pack(it)
        assert torch.equal(p, wp) and torch.equal(s.view(torch.int32), ws.view(torch.int32)), (k, it.spec)
        buf = want[[id(r) for r in regions].index(id(it.buffer))]
        reference.unpack(UnpackItem(buf, it.field, _destination(it), it.num_blocks, it.spec, p, s))
    unpack_set = UnpackSet(targets, slots)
    unpack_set.unpack(packed, dst_ids)
    assert (unpack_set._plans.newest().fused is not None) == fused
    assert all(torch.equal(r, w) for r, w in zip(regions, want, strict=True))


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("codecs", [("int8", "int8", "fp8"), ("raw", "bf16", "int4")])
def test_kimi_chunked_pack_equals_the_one_launch_pack(codecs, chunks):
    """`PackSet.pack_chunks` at full size (tp=1): its chunks' launches, issued one after the
    other on the stream, give the one-launch pack's bytes, and each chunk's ranges copied to
    page-locked host memory on a second stream after the chunk's event (as a save overlaps
    its copy with the pack) give those bytes on the host."""
    regions, items = _kimi_items(1, codecs)
    targets = [PackTarget(i.buffer, i.field, i.num_blocks, i.spec) for i in items]
    slots = [0 if len(i.block_ids) == 1 else 1 for i in items]
    src_ids = [[2], [6, 9, 7, 11]]
    pack_set = PackSet(targets, slots)
    one = pack_set.pack(src_ids)
    copies = torch.cuda.Stream()
    host: list[torch.Tensor] = []

    def copy(whole, ranges):
        if not host:
            host.append(torch.empty(whole.numel(), dtype=torch.uint8, pin_memory=True))
        done = torch.cuda.Event()
        done.record()
        copies.wait_event(done)
        with torch.cuda.stream(copies):
            for start, n in ranges:
                host[0][start:start + n].copy_(whole[start:start + n], non_blocking=True)
        whole.record_stream(copies)

    chunked = pack_set.pack_chunks(src_ids, chunks, copy)
    copies.synchronize()
    torch.cuda.synchronize()
    on_host = chunked._in(host[0])
    for k in range(len(items)):
        for got in (chunked.part(k), on_host.part(k)):
            p, s = one.part(k)
            assert torch.equal(got[0].cpu(), p.cpu()), (k, codecs)
            assert torch.equal(got[1].cpu().view(torch.int32), s.cpu().view(torch.int32)), (k, codecs)
