"""Property tests over generated layouts: exact raw round trips, canary bytes, aliasing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anchorkv.codec import pack, unpack
from anchorkv.kernels import reference
from tests.codec.layouts import ANY_LAST, EVEN_LAST, ODD_LAST, Case, cases, group_sizes, touched_mask

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: for the tests run once per format: half the layouts each, so that the four (three) formats
#: together cost about what one loop over them did, while each failure is reported on its own
PER_FORMAT = settings(SETTINGS, max_examples=75)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _last_dims(fmt: str) -> tuple[int, ...]:
    """The last-axis sizes to draw for `fmt`: int4 needs an even group, the others take any."""
    return EVEN_LAST if fmt == "int4" else ANY_LAST


def _draw_case_and_spec(data, fmt: str) -> tuple[Case, str]:
    """A generated layout and a `fmt:group` spec with a group `fmt` accepts for its last axis."""
    case = data.draw(cases(last_dims=_last_dims(fmt)), label="case")
    group = data.draw(group_sizes(case.view.page.field("x").shape[-1], fmt), label="group")
    return case, f"{fmt}:{group or 'whole'}"


@pytest.mark.parametrize("fmt", ["raw", "fp8", "int8", "int4"])
@PER_FORMAT
@given(data=st.data())
def test_pack_does_not_modify_the_source(fmt, data):
    case, spec = _draw_case_and_spec(data, fmt)
    before = case.buffer.clone()
    pack(case.view, "x", case.src_ids, spec)
    assert torch.equal(case.buffer, before)


@SETTINGS
@given(case=cases(last_dims=ODD_LAST))
def test_raw_round_trip_is_byte_identical_and_touches_nothing_else(case):
    source = case.view.tensor("x")[case.src_ids].clone()
    packed = pack(case.view, "x", case.src_ids, "raw")
    before = case.buffer.clone()
    unpack(packed, case.view, "x", case.dst_ids)
    after_values = case.view.tensor("x")[case.dst_ids]
    assert torch.equal(_bytes(after_values), _bytes(source))
    untouched = ~touched_mask(case.view, "x", case.dst_ids)
    assert torch.equal(case.buffer[untouched], before[untouched])


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
@PER_FORMAT
@given(data=st.data())
def test_lossy_unpack_writes_exactly_the_decoded_values_and_nothing_else(fmt, data):
    case, spec = _draw_case_and_spec(data, fmt)
    packed = pack(case.view, "x", case.src_ids, spec)
    f = case.view.page.field("x")
    expected = reference.dequantize(packed.payload, packed.scales, packed.codec, packed.shape, f.dtype)
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
    g = case.alias.strided("alias")
    direct = torch.as_strided(
        case.buffer.view(torch.uint8),
        (case.alias.region.num_blocks, *g.shape, g.itemsize),
        (g.block_stride, *[s * g.itemsize for s in g.strides], 1),
        g.offset,
    )[case.dst_ids]
    assert torch.equal(direct.reshape(-1), _bytes(source))
