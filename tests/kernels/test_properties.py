"""Hypothesis layouts (random strides, offsets, aliasing views) through the Triton kernels."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anchorkv.codec import CodecSpec
from anchorkv.kernels import PackItem, UnpackItem, reference
from tests.codec.layouts import ANY_LAST, EVEN_LAST, cases, group_sizes, touched_mask
from tests.kernels.helpers import DEVICE, triton_pack, triton_unpack

pytestmark = pytest.mark.interpreter

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CODECS = st.sampled_from(["raw", "fp8", "int8", "int4"])


@st.composite
def cases_with_group(draw):
    """(case, codec, group): a layout whose last axis the codec takes (int4: even sizes, the
    others odd ones too) and a real group size for it (a divisor of the last axis, or None)."""
    codec = draw(CODECS)
    case = draw(cases(last_dims=EVEN_LAST if codec == "int4" else ANY_LAST))
    group = draw(group_sizes(case.view.page.field("x").shape[-1], codec))
    return case, codec, group


@SETTINGS
@given(drawn=cases_with_group())
def test_pack_equals_reference_on_generated_layouts(drawn):
    case, codec, group = drawn
    f = case.view.page.field("x")
    strided = f.strided(case.view.region.block_stride)
    buf = case.buffer.to(DEVICE)
    n = case.view.region.num_blocks
    payload, scales = triton_pack(PackItem(buf, strided, torch.tensor(case.src_ids), n, CodecSpec(codec, group)))
    want_payload, want_scales = reference.pack(PackItem(buf, strided, case.src_ids, n, CodecSpec(codec, group)))
    assert torch.equal(payload, want_payload)
    assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))


@SETTINGS
@given(drawn=cases_with_group())
def test_unpack_through_one_view_keeps_the_aliasing_view_and_canaries(drawn):
    """Unpack via `view`; every byte outside its target elements (including the bytes the
    aliasing view sees elsewhere) is unchanged, and the target equals the reference."""
    case, codec, group = drawn
    f = case.view.page.field("x")
    strided = f.strided(case.view.region.block_stride)
    n = case.view.region.num_blocks
    buf = case.buffer.to(DEVICE)
    payload, scales = reference.pack(PackItem(buf, strided, case.src_ids, n, CodecSpec(codec, group)))
    want = buf.clone()
    reference.unpack(UnpackItem(want, strided, case.dst_ids, n, CodecSpec(codec, group), payload, scales))
    got = buf.clone()
    triton_unpack(UnpackItem(got, strided, case.dst_ids, n, CodecSpec(codec, group), payload, scales))
    assert torch.equal(got, want)
    untouched = ~touched_mask(case.view, "x", case.dst_ids).to(DEVICE)
    assert torch.equal(got[untouched], buf[untouched])
    # the alias reads through its own strides: pack it from the written region, both ways
    a = case.alias.page.field("alias").strided(case.alias.region.block_stride)
    p1, s1 = triton_pack(PackItem(got, a, case.dst_ids, n, CodecSpec("raw", None)))
    p2, s2 = reference.pack(PackItem(got, a, case.dst_ids, n, CodecSpec("raw", None)))
    assert torch.equal(p1, p2)
