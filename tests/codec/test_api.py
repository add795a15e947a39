"""The public codec API: pack/unpack over Kimi-Linear views, Packed, specs, the registry."""

from __future__ import annotations

import pytest
import torch

from anchorkv.codec import (
    KIMI_LINEAR_48B_CONFIG,
    CacheView,
    CodecSpec,
    Packed,
    Packer,
    Region,
    available_codecs,
    get_codec,
    kimi_linear_layout,
    pack,
    pack_many,
    register_codec,
    registry,
    unpack,
    unpack_many,
)
from anchorkv.kernels import dispatch


def make_kimi_views():
    """A tp=8 Kimi-Linear region on the CPU with one KDA and one MLA view over the same bytes,
    finite values in blocks 1-2 (KDA) and 3-5 (MLA): (buffer, kda view, mla view)."""
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=8)
    page = layout.layers[0].page.page_bytes
    buf = torch.zeros(6 * page, dtype=torch.int8)
    kda = CacheView(Region(buf, 6, page), layout.layers[0].page, "kda")
    mla = CacheView(Region(buf, 6, page), layout.layers[3].page, "mla")
    g = torch.Generator().manual_seed(3)
    kda.tensor("recurrent")[1:3] = torch.randn(2, 4, 128, 128, generator=g)
    kda.tensor("conv")[1:3] = torch.randn(2, 3, 3, 512, generator=g).bfloat16()
    mla.tensor("latent")[3:6] = torch.randn(3, 256, 576, generator=g).bfloat16()
    return buf, kda, mla


@pytest.fixture
def kimi_views():
    return make_kimi_views()


@pytest.mark.parametrize("field,src,dst", [("recurrent", [1], [4]), ("conv", [2, 1], [0, 5])])
def test_kda_raw_restore_into_other_blocks(kimi_views, field, src, dst):
    buf, kda, _ = kimi_views
    packed = pack(kda, field, src, "raw")
    assert packed.shape == (len(src), *kda.page.field(field).shape)
    unpack(packed, kda, field, dst)
    assert torch.equal(kda.tensor(field)[dst], kda.tensor(field)[src])


def test_mla_fp8_restore_clears_floor_and_keeps_kda(kimi_views):
    buf, kda, mla = kimi_views
    kda_before = kda.tensor("recurrent")[1:3].clone()
    x = mla.tensor("latent")[[3, 4]].float()
    packed = pack(mla, "latent", [3, 4], "fp8:64")
    assert packed.nbytes == 2 * 256 * 576 + 2 * 256 * 9 * 4
    unpack(packed, mla, "latent", [0, 5])
    y = mla.tensor("latent")[[0, 5]].float()
    sqnr = 10 * torch.log10((x**2).sum() / ((x - y) ** 2).sum())
    assert sqnr > 31.0
    assert torch.equal(kda.tensor("recurrent")[1:3], kda_before)


def test_unpack_refuses_wrong_shape_or_dtype(kimi_views):
    _, kda, _ = kimi_views
    packed = pack(kda, "recurrent", [1, 2], "int8")
    expects = r"field 'recurrent': it expects torch.float32 \[1, 4, 128, 128\].*\[2, 4, 128, 128\]"
    with pytest.raises(ValueError, match=expects):
        unpack(packed, kda, "recurrent", [4])
    with pytest.raises(ValueError, match="cannot unpack into field 'conv'"):
        unpack(packed, kda, "conv", [4, 5])


def test_block_ids_out_of_range(kimi_views):
    _, kda, _ = kimi_views
    with pytest.raises(IndexError, match=r"block ids must lie in \[0, 6\), found min 1 and max 6"):
        pack(kda, "conv", [1, 6], "raw")


@pytest.mark.parametrize("ids", [[1.5], [1, 2.0], [True], torch.tensor([1.0])])
def test_block_ids_that_are_not_whole_numbers_are_refused(kimi_views, ids):
    """[1.5] was converted to block 1 and packed (a review's finding)."""
    _, kda, _ = kimi_views
    with pytest.raises(ValueError, match=r"block ids must be whole numbers \(Python ints or an integer tensor\)"):
        pack(kda, "conv", ids, "raw")
    packed = pack(kda, "conv", list(range(1, 1 + len(ids))), "raw")
    with pytest.raises(ValueError, match="block ids must be whole numbers"):
        unpack(packed, kda, "conv", ids)


def test_packed_dict_round_trip(kimi_views):
    _, kda, _ = kimi_views
    packed = pack(kda, "recurrent", [1], "int4:32")
    again = Packed.from_dict(packed.to_dict())
    assert again.codec == packed.codec and again.shape == packed.shape and again.dtype == packed.dtype
    assert torch.equal(again.payload, packed.payload) and torch.equal(again.scales, packed.scales)
    assert packed.meta()["codec"] == {"id": "int4", "group": 32, "params": {}}


def test_poisoned_groups_are_counted(kimi_views):
    _, kda, _ = kimi_views
    kda.tensor("recurrent")[1, 0, 5, 7] = float("nan")
    assert pack(kda, "recurrent", [1], "int8").poisoned_groups() == 1
    assert pack(kda, "recurrent", [2], "int8").poisoned_groups() == 0


def test_nan_check_never_misses_and_its_false_alarm_counts_zero():
    """`may_hold_nan` (one reduction) is True whenever a NaN is present, and its false alarm (a
    sum of +Inf and -Inf) only sends `poisoned_groups` to the exact count."""
    from anchorkv.kernels.packset import may_hold_nan

    scales = torch.rand(1000, 2) + 0.5
    assert not may_hold_nan(scales) and not may_hold_nan(torch.empty(0, 1))
    for at in (0, 777, 1999):
        s = scales.clone()
        s.view(-1)[at] = float("nan")
        assert may_hold_nan(s)
    s = scales.clone()
    s[3, 0], s[4, 1] = float("inf"), float("-inf")
    assert may_hold_nan(s)
    packed = Packed(CodecSpec("int4", 32), (1, 1000 * 32), torch.float32,
                    torch.zeros(1000 * 16, dtype=torch.uint8), s)
    assert packed.poisoned_groups() == 0
    s[9, 0] = float("nan")
    assert packed.poisoned_groups() == 1


@pytest.mark.parametrize("text,spec", [
    ("fp8", CodecSpec("fp8", 128)), ("int8:64", CodecSpec("int8", 64)),
    ("fp8:whole", CodecSpec("fp8", None)), (" int4:32 ", CodecSpec("int4", 32)),
])
def test_spec_parse(text, spec):
    assert CodecSpec.parse(text) == spec
    assert CodecSpec.parse(str(spec)) == spec
    assert CodecSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize("text,msg", [("fp8:abc", "group must be a number"), ("FP8", "codec id must match"),
                                      ("int8:0", "positive int")])
def test_spec_parse_errors(text, msg):
    with pytest.raises(ValueError, match=msg):
        CodecSpec.parse(text)


class HalfCodec:
    """A plug-in: stores values as fp16 bytes, no scales."""

    id = "test-half"

    def encode(self, values, spec):
        return values.to(torch.float16).reshape(-1).view(torch.uint8).clone(), torch.empty(0, 0)

    def decode(self, payload, scales, spec, shape, dtype):
        return payload.view(torch.float16).to(dtype).reshape(shape)


def test_custom_codec_round_trip(kimi_views, monkeypatch):
    monkeypatch.setattr(registry, "_codecs", dict(registry._codecs))
    register_codec(HalfCodec)
    _, kda, _ = kimi_views
    packed = pack(kda, "recurrent", [1], "test-half")
    assert packed.payload.numel() == 4 * 128 * 128 * 2
    unpack(packed, kda, "recurrent", [0])
    assert torch.equal(kda.tensor("recurrent")[0], kda.tensor("recurrent")[1].half().float())
    with pytest.raises(ValueError, match="codec id 'test-half' is taken"):
        register_codec(HalfCodec)


def test_custom_codec_from_entry_point(monkeypatch):
    class EP:
        name = "test-half"

        def load(self):
            return HalfCodec

    monkeypatch.setattr(registry, "_codecs", dict(registry._codecs))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.setattr(registry, "entry_points", lambda group: [EP()] if group == "anchorkv.codecs" else [])
    assert get_codec("test-half").id == "test-half"
    assert "test-half" in available_codecs()


def test_unknown_codec_says_how_to_add_one():
    with pytest.raises(KeyError, match="no codec 'nope'.*register_codec"):
        get_codec("nope")


def test_register_rejects_non_codec():
    with pytest.raises(TypeError, match="needs an `id`"):
        register_codec(object())


def test_backend_env_is_read_per_call(monkeypatch):
    cpu = torch.device("cpu")
    assert dispatch.backend_for(cpu) == "reference"
    monkeypatch.setenv("ANCHORKV_BACKEND", "bogus")
    with pytest.raises(ValueError, match="ANCHORKV_BACKEND must be one of"):
        dispatch.backend_for(cpu)
    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
        dispatch.backend_for(cpu)


@pytest.mark.parametrize("codec", ["raw", "fp8:64", "int8:192", "int4:32"])
def test_packed_rows_narrow_reshape_cat_match_direct_packing(kimi_views, codec):
    """Token rows of a packed MLA block are what packing those rows alone would give."""
    _, _, mla = kimi_views
    whole = pack(mla, "latent", [3, 4], codec).reshape(512, 576)
    rows = whole.narrow(100, 300)
    direct = mla.tensor("latent")[[3, 4]].reshape(512, 576)[100:400]
    from anchorkv.kernels.reference import quantize
    payload, scales = quantize(direct, CodecSpec(codec.split(":")[0], whole.codec.group))
    assert torch.equal(rows.payload, payload) and torch.equal(rows.scales, scales)
    again = Packed.cat([whole.narrow(0, 100), rows, whole.narrow(400, 112)]).reshape(2, 256, 576)
    assert torch.equal(again.payload, whole.payload) and again.shape == (2, 256, 576)
    with pytest.raises(ValueError, match="last axis"):
        whole.reshape(1024, 288)


def _same(a: Packed, b: Packed) -> bool:
    return (a.codec == b.codec and a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.payload, b.payload)
            and torch.equal(a.scales.view(torch.int32), b.scales.view(torch.int32)))


def test_pack_many_and_unpack_many_equal_one_by_one(kimi_views, monkeypatch):
    """The batched API (what the connector uses for a whole request) gives the same Packed and
    writes the same bytes as pack/unpack per item, a custom codec mixed in included."""
    monkeypatch.setattr(registry, "_codecs", dict(registry._codecs))
    register_codec(HalfCodec)
    buf, kda, mla = kimi_views
    requests = [(kda, "recurrent", [1], "int8:128"), (kda, "conv", [2, 1], "fp8:64"),
                (mla, "latent", [3, 4], "fp8:whole"), (kda, "recurrent", [2], "test-half"),
                (mla, "latent", [5], "int4:64"), (kda, "conv", [1], "raw")]
    many = pack_many(requests)
    assert len(many) == len(requests)
    for got, (view, field, ids, codec) in zip(many, requests, strict=True):
        assert _same(got, pack(view, field, ids, codec)), (field, codec)
    targets = [[4], [0, 5], [0, 1], [3], [2], [0]]
    fields = [(r[0], r[1]) for r in requests]
    # one by one into a copy, batched into the original; the regions must end byte-identical
    # (each target pair is disjoint within one batch: the first three, then the rest)
    for lo, hi in ((0, 3), (3, 6)):
        expect = buf.clone()
        exp_views = {id(v): CacheView(Region(expect, 6, v.region.block_stride), v.page, v.name) for v in (kda, mla)}
        batch = list(zip(many[lo:hi], fields[lo:hi], targets[lo:hi], strict=True))
        for p, (view, field), ids in batch:
            unpack(p, exp_views[id(view)], field, ids)
        unpack_many([(p, view, field, ids) for p, (view, field), ids in batch])
        assert torch.equal(buf, expect)


def test_packer_equals_pack_call_after_call(kimi_views, monkeypatch):
    """`Packer` (what the connector saves with: fixed parts, block ids per slot) gives, call
    after call, the `Packed` that `pack` gives part by part, a custom codec mixed in included,
    before and after its bytes are moved to the host. (The Triton side of its `PackSet`:
    tests/kernels/test_packset.py.)"""
    monkeypatch.setattr(registry, "_codecs", dict(registry._codecs))
    register_codec(HalfCodec)
    _, kda, mla = kimi_views
    parts = [(kda, "recurrent", "int8:128", 0), (kda, "conv", "fp8:64", 0), (mla, "latent", "fp8:whole", 1),
             (kda, "recurrent", "test-half", 0), (mla, "latent", "int4:64", 1), (kda, "conv", "raw", 0)]
    packer = Packer(parts)
    assert len(packer) == 6
    for ids in ([[1], [3, 4]], [(2,), (5,)], [[1], []]):
        packed = packer.pack(ids)
        for host in (packed, packed.to_host(pin=False)):
            got = host.packed()
            for p, (view, field, codec, slot) in zip(got, parts, strict=True):
                assert _same(p, pack(view, field, ids[slot], codec)), (field, codec, ids)


@pytest.mark.parametrize("one", [True, False], ids=["one-allocation", "two-tensors"])
def test_packed_parts_record_every_device_tensor_on_a_copy_stream(kimi_views, monkeypatch, one):
    """`PackedParts.record_stream` (a save copied to the host on a stream of its own): the
    built-in codecs' batch records its one allocation (else its payload and scales), each
    custom part not on the host its payload and scales; host tensors none."""
    from anchorkv.kernels import batch as kbatch

    monkeypatch.setattr(registry, "_codecs", dict(registry._codecs))
    register_codec(HalfCodec)
    make = kbatch.batch_tensors
    monkeypatch.setattr(kbatch, "batch_tensors", lambda *a, **kw: make(*a, **{**kw, "one": one}))
    _, kda, mla = kimi_views
    packed = Packer([(kda, "recurrent", "int8:128", 0), (kda, "conv", "test-half", 0),
                     (mla, "latent", "fp8:64", 1)]).pack([[1], [3, 4]])
    assert (packed.quant.whole is not None) == one
    custom = packed.custom[1]
    # a custom part "on a device": meta tensors (record_stream is CUDA's; recorded, not run, here)
    packed.custom[1] = Packed(custom.codec, custom.shape, custom.dtype, custom.payload.to("meta"),
                              custom.scales.to("meta"))
    packed.custom[9] = custom  # and one on the host
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: recorded.append((self, stream)))
    packed.record_stream("copy stream")
    want = [packed.quant.whole] if one else [packed.quant.payload, packed.quant.scales]
    want += [packed.custom[1].payload, packed.custom[1].scales]
    assert [id(t) for t, _ in recorded] == [id(t) for t in want] and {s for _, s in recorded} == {"copy stream"}


def test_stage_to_device_moves_every_tensor_in_one_copy(monkeypatch):
    """A restore's host parts reach the GPU through one staging buffer and one copy: exact
    bytes, each tensor's dtype and shape, 16-byte aligned starts (run here host to host)."""
    from anchorkv.codec.api import stage_to_device

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 256, (37,), dtype=torch.uint8, generator=g),
               torch.randn(5, 2, generator=g), torch.empty(0, 0),
               torch.randn(3, 4, generator=g).t(),  # not contiguous
               torch.randint(0, 256, (16,), dtype=torch.uint8, generator=g)]
    moves = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: moves.append((a, kw)) or real_to(self, *a, **kw))
    out = stage_to_device(tensors, "cpu", pin=False)
    assert moves == [(("cpu",), {"non_blocking": True})]
    for t, o in zip(tensors, out, strict=True):
        assert o.dtype == t.dtype and o.shape == t.shape and torch.equal(o, t)
        assert o.data_ptr() % 16 == 0 or not o.numel()
    base = out[0].untyped_storage().data_ptr()
    assert all(o.untyped_storage().data_ptr() == base for o in out if o.numel())


def test_host_arena_hands_out_aligned_disjoint_spans_and_grows():
    from anchorkv.codec import HostArena

    arena = HostArena(pin=False, hint=100)
    got = [arena(n) for n in (5, 30, 0, 40, 300, 7)]
    assert [t.numel() for t in got] == [5, 30, 0, 40, 300, 7]
    assert all(t.dtype == torch.uint8 and t.data_ptr() % 16 == 0 for t in got if t.numel())
    # 5, 30 and 40 fill the first slab (the hint, 100) to 88; 300 opens one of max(300, 2 x 100);
    # 7 does not fit after it: max(7, 2 x 300)
    assert [s.numel() for s in arena.slabs] == [100, 300, 600]
    assert [t.data_ptr() - arena.slabs[0].data_ptr() for t in got[:2]] == [0, 16]
    assert got[3].data_ptr() - arena.slabs[0].data_ptr() == 48
    assert got[4].data_ptr() == arena.slabs[1].data_ptr() and got[5].data_ptr() == arena.slabs[2].data_ptr()
    assert arena.used == 400 + 7  # as one slab: 0+5, 16+30, 48+40, 96+300, 400+7
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in got if t.numel())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # disjoint
    for i, t in enumerate(got):
        t.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate(got))
    again = HostArena(pin=False, hint=arena.used)  # a restore of the same shape: one slab
    for n in (5, 30, 0, 40, 300, 7):
        again(n)
    assert len(again.slabs) == 1 and again.used == arena.used
    arena.reset()  # the round took three slabs: the next takes one of the size it needed
    assert arena.slabs == [] and arena.used == 0
    first = [arena(n) for n in (5, 30, 0, 40, 300, 7)]
    [slab] = arena.slabs
    assert slab.numel() == 407 and [t.data_ptr() - slab.data_ptr() for t in first if t.numel()] == [0, 16, 48, 96, 400]
    arena.reset()  # and the round after reuses that slab, from its first byte
    assert arena(8).data_ptr() == slab.data_ptr() and len(arena.slabs) == 1 and arena.slabs[0] is slab
    with pytest.raises(ValueError, match="expected >= 0"):
        arena(-1)


def test_host_pool_reuses_the_smallest_fitting_free_buffer():
    from anchorkv.codec import HostPool

    pool = HostPool(pin=False, keep=2)
    mib = HostPool.GRANULE
    a = pool.take(3 * mib + 1)  # rounded up to whole granules
    b = pool.take(10)
    assert (a.numel(), b.numel(), pool.made) == (4 * mib, mib, 2)
    assert a.dtype == torch.uint8 and a.dim() == 1 and pool.free == []
    pool.give(a)
    pool.give(b)
    assert pool.take(100) is b  # the smallest that fits, not the first given back
    assert pool.take(2 * mib) is a and pool.made == 2
    c = pool.take(mib)  # none free: a new one
    assert pool.made == 3 and c is not a and c is not b
    for t in (a, b, c):
        pool.give(t)
    assert len(pool.free) == 2 and all(t is not b for t in pool.free)  # at most `keep`, the largest kept
    assert pool.take(5 * mib).numel() == 5 * mib and pool.made == 4
    assert pool.take(0).numel() == mib  # (a buffer is never empty)
    with pytest.raises(ValueError, match="expected >= 0"):
        pool.take(-1)


@pytest.fixture
def asked(monkeypatch) -> list[tuple[int, bool]]:
    """(size, pin_memory) of every `torch.empty` call of the test; the tensors are pageable (no
    CUDA here to page-lock them)."""
    calls: list[tuple[int, bool]] = []
    real_empty = torch.empty

    def empty(*size, pin_memory=False, **kwargs):
        calls.append((size[0], pin_memory))
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    return calls


def test_a_page_locked_pool_takes_whole_power_of_two_blocks(asked):
    """Page-locked, a new buffer is the power-of-two block torch's host allocator would hold for
    it anyway: a conversation's saves, each a little larger than the last, reuse one buffer (by
    granules they took four, and four blocks of page-locked memory)."""
    from anchorkv.codec import HostPool

    pool = HostPool(pin=True)
    mib = HostPool.GRANULE
    for n in (100 * mib + 5, 104 * mib, 112 * mib, 128 * mib):
        buf = pool.take(n)
        assert buf.numel() >= n
        pool.give(buf)
    assert asked == [(128 * mib, True)] and pool.made == 1
    assert pool.take(128 * mib + 1).numel() == 256 * mib and pool.made == 2
    assert pool.size_for(3) == mib and HostPool(pin=False).size_for(100 * mib + 5) == 101 * mib


def test_a_page_locked_arena_takes_whole_power_of_two_blocks(asked):
    """A restore a little larger than the last one (the next turn of a conversation) still fits
    the page-locked slab: the slab is all of its power-of-two block (by the bytes asked: a second
    slab, twice as large, then both replaced by a third at the next reset)."""
    from anchorkv.codec import HostArena

    arena = HostArena(pin=True)
    mib = 1 << 20
    for parts in ([60 * mib, 40 * mib + 3], [60 * mib, 44 * mib], [60 * mib, 50 * mib, 3 * mib]):
        for n in parts:
            assert arena(n).numel() == n
        arena.reset()
    assert asked == [(64 * mib, True), (128 * mib, True), (128 * mib, True)] and len(arena.slabs) == 1
    assert arena.slabs[0].numel() == 128 * mib


def test_stage_to_device_sends_a_shared_buffer_as_it_lies(monkeypatch):
    """Parts read into one arena slab cross in one copy of the span they cover, with no
    staging copy on the CPU (here host to host: the "device" copies are the slab itself);
    tensors of no shared buffer are staged in one more copy."""
    from anchorkv.codec import HostArena
    from anchorkv.codec.api import stage_to_device

    g = torch.Generator().manual_seed(1)
    arena = HostArena(pin=False, hint=4096)
    parts = []
    for n in (37, 100, 16, 0, 512):
        t = arena(n)
        t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
        parts.append(t)
    scales = arena(24).view(torch.float32).view(2, 3)
    scales.copy_(torch.randn(2, 3, generator=g))
    lone = torch.randn(4, generator=g)
    tensors = [parts[0], scales, parts[1], lone, parts[3], parts[2], parts[4], parts[1]]  # a repeat, as
    moves = []  # a state part restored into several blocks gives
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: moves.append(self.nbytes) or real_to(self, *a, **kw))
    out = stage_to_device(tensors, "cpu", pin=False)
    [slab] = arena.slabs
    first, last = parts[0].data_ptr(), scales.data_ptr() + scales.nbytes
    assert sorted(moves) == [lone.nbytes, last - first]  # the slab's used span, and the staged lone tensor
    for t, o in zip(tensors, out, strict=True):
        assert o.dtype == t.dtype and o.shape == t.shape and torch.equal(o, t)
    for t, o in zip(tensors, out, strict=True):
        if t is not lone and t.numel():  # host to host: the views are the slab's own bytes
            assert o.data_ptr() == t.data_ptr()
    assert out[3].data_ptr() != lone.data_ptr()


def test_unpack_many_checks_everything_before_writing(kimi_views):
    buf, kda, mla = kimi_views
    before = buf.clone()
    good = pack(kda, "recurrent", [1], "int8:128")
    bad = pack(kda, "conv", [1, 2], "raw")  # two blocks packed, one target given
    with pytest.raises(ValueError, match="cannot unpack into field 'conv'"):
        unpack_many([(good, kda, "recurrent", [4]), (bad, kda, "conv", [5])])
    assert torch.equal(buf, before)
