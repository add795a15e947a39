"""pack_many / unpack_many: a Kimi-like request (state layers and MLA layers over shared,
aliased regions) in few launches, byte-identical to the reference item by item."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from anchorkv import kernels
from anchorkv.codec import CodecSpec
from anchorkv.kernels import PackItem, UnpackItem, reference
from anchorkv.kernels.strided import StridedField, field_view
from anchorkv.kernels.triton_pack import pack_many
from anchorkv.kernels.triton_unpack import unpack_many
from tests.kernels.helpers import DEVICE, split_set_launch, touched

pytestmark = pytest.mark.interpreter

# the launcher module, to count launches
pack_module = importlib.import_module("anchorkv.kernels.triton_pack")

BLOCKS = 6
TAPS, CH, HEADS, DK, TOKENS, LATENT = 3, 16, 2, 32, 5, 64


def _page():
    """(conv DS, recurrent, latent) fields sharing one page size, as in vLLM's HMA."""
    conv_bytes = TAPS * 3 * CH * 2
    rec = (HEADS, DK, DK)
    page = max(conv_bytes + HEADS * DK * DK * 4, TOKENS * LATENT * 2) + 64
    conv = StridedField(torch.bfloat16, (TAPS, 3, CH), (1, 3 * CH, TAPS), 0, page)
    recurrent = StridedField(torch.float32, rec, (DK * DK, DK, 1), conv_bytes, page)
    latent = StridedField(torch.bfloat16, (TOKENS, LATENT), (LATENT, 1), 0, page)
    return conv, recurrent, latent


def _regions(count: int, seed: int) -> list[torch.Tensor]:
    """`count` regions (separate allocations), each with finite values in every field."""
    conv, recurrent, latent = _page()
    out = []
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        buf = torch.randint(0, 256, (BLOCKS * conv.block_stride + 8 * i + 8,), dtype=torch.uint8,
                            generator=g)[8 * i:]
        for f in (conv, recurrent):  # the state blocks 0..2
            v = field_view(buf, f, BLOCKS)[:3]
            v.copy_(torch.randn(v.shape, generator=g).to(f.dtype))
        v = field_view(buf, latent, BLOCKS)[3:]  # the token blocks 3..5
        v.copy_(torch.randn(v.shape, generator=g).to(latent.dtype))
        out.append(buf.to(DEVICE))
    return out


def _request(regions, codecs=("int8", "int8", "fp8")):
    conv, recurrent, latent = _page()
    items = []
    for i, buf in enumerate(regions):
        items.append(PackItem(buf, conv, [i % 3], BLOCKS, CodecSpec(codecs[0], None)))
        items.append(PackItem(buf, recurrent, [i % 3], BLOCKS, CodecSpec(codecs[1], 32)))
        if i % 2:
            items.append(PackItem(buf, latent, [5, 3, 4], BLOCKS, CodecSpec(codecs[2], 64)))
    return items


@pytest.mark.parametrize("codecs", [("int8", "int8", "fp8"), ("raw", "int4", "int4"),
                                    ("fp8", "raw", "raw")])
def test_pack_many_equals_reference_item_by_item(codecs):
    regions = _regions(5, seed=1)
    items = _request(regions, codecs)
    before = [r.clone() for r in regions]
    results = pack_many(items)
    for item, (payload, scales) in zip(items, results, strict=True):
        want_p, want_s = reference.pack(item)
        assert torch.equal(payload, want_p)
        assert torch.equal(scales.view(torch.int32), want_s.view(torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(regions, before, strict=True))


def test_pack_many_uses_one_launch_per_signature(monkeypatch):
    calls = []
    real = pack_module._pack_kernel

    class Counting:  # the kernel, recording how many items each launch covers
        def __getitem__(self, grid):
            def launch(**kwargs):
                calls.append(grid[2])
                return real[grid](**kwargs)
            return launch

    monkeypatch.setattr(pack_module, "_pack_kernel", Counting())
    items = _request(_regions(7, seed=2))
    pack_many(items)
    assert sorted(calls) == [3, 7, 7]  # latent x 3 layers, conv x 7, recurrent x 7
    pack_many(items)  # the cached plan launches the same way
    assert sorted(calls) == [3, 3, 7, 7, 7, 7]


def _recording(real, calls, region):
    """The kernel, recording the bytes of field each launch moves."""

    class Recording:
        def __getitem__(self, grid):
            def launch(**kwargs):
                calls.append(grid[1] * grid[2] * kwargs["NUMEL"] * kwargs[region].element_size())
                return real[grid](**kwargs)
            return launch

    return Recording()


def test_launches_are_issued_largest_first(monkeypatch):
    """The big launch first, so the small ones are issued while it runs (the items' natural
    order here is conv, recurrent, latent: 2, 57 and 6 kB); outputs keep the items' order."""
    unpack_module = importlib.import_module("anchorkv.kernels.triton_unpack")
    calls: list[int] = []
    monkeypatch.setattr(pack_module, "_pack_kernel", _recording(pack_module._pack_kernel, calls, "src"))
    monkeypatch.setattr(unpack_module, "_unpack_kernel",
                        _recording(unpack_module._unpack_kernel, calls, "dst"))
    items = _request(_regions(7, seed=2))
    want = [(7 * 2 * 32 * 32 * 4), (3 * 3 * 5 * 64 * 2), (7 * 3 * 3 * 16 * 2)]
    packed = pack_many(items)
    assert calls == want
    for item, (payload, scales) in zip(items, packed, strict=True):
        want_p, want_s = reference.pack(item)
        assert torch.equal(payload, want_p) and torch.equal(scales.view(torch.int32), want_s.view(torch.int32))
    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")  # (a PackSet picks its backend when made)
    sets: list = []  # a set kernel's launches, in the order its grid runs them

    class SetRecording:
        def __getitem__(self, grid):
            def launch(**kwargs):
                sets.append([g[1] * g[2] * kw["NUMEL"] * kw["src"].element_size()
                             for g, kw in split_set_launch(grid, kwargs, "pack")])
                return real_set[grid](**kwargs)
            return launch

    real_set = pack_module._pack_set_kernel
    monkeypatch.setattr(pack_module, "_pack_set_kernel", SetRecording())
    for fused in (False, True):
        calls.clear()
        monkeypatch.setattr(pack_module, "FUSED", fused)
        kernels.PackSet([kernels.PackTarget(i.buffer, i.field, i.num_blocks, i.spec) for i in items],
                        [0] * len(items)).pack([[2]])
        # one latent block each: now the smallest
        assert (sets.pop() if fused else calls) == [want[0], want[2], 3 * 5 * 64 * 2]
    assert calls == [] and sets == []
    calls.clear()
    unpack_many([UnpackItem(i.buffer, i.field, i.block_ids, i.num_blocks, i.spec, p, s)
                 for i, (p, s) in zip(items, packed, strict=True)])
    assert calls == want


def test_unpack_many_writes_reference_bytes_and_nothing_else():
    src = _regions(4, seed=3)
    items = _request(src, ("int4", "int8", "fp8"))
    packed = [reference.pack(i) for i in items]
    targets = _regions(4, seed=4)
    index = {id(b): k for k, b in enumerate(src)}
    moves = []
    for item, (payload, scales) in zip(items, packed, strict=True):
        dst_ids = [(b + 1) % 3 for b in item.block_ids] if item.field.dtype == torch.float32 or \
            item.field.shape[0] == TAPS else [4, 5, 3]
        moves.append(UnpackItem(targets[index[id(item.buffer)]], item.field, dst_ids, BLOCKS,
                                item.spec, payload, scales))
    want = [t.clone() for t in targets]
    want_by_id = {id(t): w for t, w in zip(targets, want, strict=True)}
    for m in moves:
        reference.unpack(dataclasses.replace(m, buffer=want_by_id[id(m.buffer)]))
    before = [t.clone() for t in targets]
    unpack_many(moves)
    for t, w in zip(targets, want, strict=True):
        assert torch.equal(t, w)
    for m in moves:  # outside every item's target bytes nothing changed
        k = [id(t) for t in targets].index(id(m.buffer))
        mask = touched(m.buffer, m.field, BLOCKS, m.block_ids)
        assert torch.equal(targets[k][mask], want[k][mask])
    assert not any(torch.equal(t, b) for t, b in zip(targets, before, strict=True))


def test_public_entry_falls_back_to_the_reference(monkeypatch):
    monkeypatch.setenv("ANCHORKV_BACKEND", "reference")
    items = _request(_regions(3, seed=5))
    ref = kernels.pack_many(items)
    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")
    tri = kernels.pack_many(items)
    for (a, b), (c, d) in zip(ref, tri, strict=True):
        assert torch.equal(a, c) and torch.equal(b.view(torch.int32), d.view(torch.int32))


def test_codec_api_through_the_triton_backend(monkeypatch):
    """`anchorkv.codec.pack`/`unpack` on a Kimi layout give the same bytes on both backends."""
    from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, CacheView, Region, kimi_linear_layout
    from anchorkv.codec import pack as codec_pack
    from anchorkv.codec import unpack as codec_unpack

    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=8, conv_layout="DS")
    kda = layout.of_kind("state")[0].page
    buf = torch.zeros(3 * kda.page_bytes, dtype=torch.uint8, device=DEVICE)
    view = CacheView(Region(buf, 3, kda.page_bytes), kda)
    g = torch.Generator().manual_seed(6)
    for name in kda.names:
        t = view.tensor(name)
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    out = {}
    for backend in ["reference", "triton"]:
        monkeypatch.setenv("ANCHORKV_BACKEND", backend)
        packed = codec_pack(view, "conv", [1], "fp8:64")
        target = buf.clone()
        codec_unpack(packed, CacheView(Region(target, 3, kda.page_bytes), kda), "conv", [2])
        out[backend] = (packed.payload, packed.scales.view(torch.int32), target)
    assert all(torch.equal(a, b) for a, b in zip(out["reference"], out["triton"], strict=True))
