"""Property tests over generated layouts: exact raw round trips, canary bytes, aliasing."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings

from anchorkv.codec import pack, unpack
from anchorkv.kernels import reference
from tests.codec.layouts import cases, touched_mask

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@SETTINGS
@given(case=cases())
def test_pack_does_not_modify_the_source(case):
    before = case.buffer.clone()
    for codec in ["raw", "fp8", "int8", "int4"]:
        pack(case.view, "x", case.src_ids, f"{codec}:whole")
    assert torch.equal(case.buffer, before)


@SETTINGS
@given(case=cases(even_last=False))
def test_raw_round_trip_is_byte_identical_and_touches_nothing_else(case):
    source = case.view.tensor("x")[case.src_ids].clone()
    packed = pack(case.view, "x", case.src_ids, "raw")
    before = case.buffer.clone()
    unpack(packed, case.view, "x", case.dst_ids)
    after_values = case.view.tensor("x")[case.dst_ids]
    assert torch.equal(_bytes(after_values), _bytes(source))
    untouched = ~touched_mask(case.view, "x", case.dst_ids)
    assert torch.equal(case.buffer[untouched], before[untouched])


@SETTINGS
@given(case=cases())
def test_lossy_unpack_writes_exactly_the_decoded_values_and_nothing_else(case):
    for codec in ["fp8:whole", "int8:whole", "int4:whole"]:
        packed = pack(case.view, "x", case.src_ids, codec)
        f = case.view.page.field("x")
        expected = reference.dequantize(packed.payload, packed.scales, packed.codec.id,
                                        None, packed.shape, f.dtype)
        before = case.buffer.clone()
        unpack(packed, case.view, "x", case.dst_ids)
        got = case.view.tensor("x")[case.dst_ids]
        assert torch.equal(_bytes(got), _bytes(expected))
        untouched = ~touched_mask(case.view, "x", case.dst_ids)
        assert torch.equal(case.buffer[untouched], before[untouched])


@SETTINGS
@given(case=cases())
def test_aliasing_view_uses_its_own_strides(case):
    """Bytes written through one view read back through that view, whatever the other does."""
    packed = pack(case.alias, "alias", case.src_ids, "raw")
    source = case.alias.tensor("alias")[case.src_ids].clone()
    unpack(packed, case.alias, "alias", case.dst_ids)
    assert torch.equal(_bytes(case.alias.tensor("alias")[case.dst_ids]), _bytes(source))
    # the gathered bytes equal a plain strided read of the alias geometry, not of the other view
    g = case.alias.geometry("alias")
    direct = torch.as_strided(
        case.buffer.view(torch.uint8),
        (case.alias.region.num_blocks, *g.shape, g.itemsize),
        (g.block_stride, *[s * g.itemsize for s in g.strides], 1),
        g.offset,
    )[case.dst_ids]
    assert torch.equal(direct.reshape(-1), _bytes(source))
