"""Triton pack/unpack against the torch reference, byte for byte, over a table of layouts.

Every codec x group x source dtype x layout: `torch.equal` on payload and scale bits, the
source untouched; unpack writes the reference's bytes into the target blocks and not one byte
elsewhere (the region is random canary bytes).
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch

from anchorkv.codec import CodecSpec
from anchorkv.kernels import PackItem, UnpackItem, reference
from tests.kernels.helpers import (
    CODECS,
    DTYPES,
    make_field,
    make_region,
    same_bits,
    touched,
    triton_pack,
    triton_unpack,
)

pytestmark = pytest.mark.interpreter

# name: (shape, strides) in elements; odd sizes, gaps, permuted axes, a strided last axis
LAYOUTS = {
    "rows3x128": ((3, 128), (128, 1)),
    "rows42x64_gap": ((42, 64), (70, 1)),
    "conv_ds_3x3x64": ((3, 3, 64), (1, 3 * 64, 3)),  # vLLM DS conv: last-axis stride 3
    "rec_6x2x128_perm": ((6, 2, 128), (128, 6 * 128 + 5, 1)),
    "latent_5x576": ((5, 576), (576, 1)),
    "deep_2x3x2x2x32": ((2, 3, 2, 2, 32), (3 * 2 * 2 * 40, 2 * 2 * 40, 2 * 40, 40, 1)),
}
GROUPS = (32, 64, 128, 192, 576, None)


def _cases():
    for name, (shape, _) in LAYOUTS.items():
        for group in GROUPS:
            if group is not None and shape[-1] % group:
                continue
            yield pytest.param(name, group, id=f"{name}-g{group or 'whole'}")


CASES = list(_cases())
BLOCKS = 5
SRC_IDS = [3, 0, 4]
DST_IDS = [1, 4, 2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("layout,group", CASES)
def test_pack_equals_reference(layout, group, codec, dtype):
    field = make_field(dtype, *LAYOUTS[layout])
    buffer = make_region(field, BLOCKS, seed=zlib.crc32(f"{layout}/{codec}".encode()) % 1000)
    before = buffer.clone()
    ids = torch.tensor(SRC_IDS)
    payload, scales = triton_pack(PackItem(buffer, field, ids, BLOCKS, CodecSpec(codec, group)))
    want_payload, want_scales = reference.pack(PackItem(buffer, field, ids, BLOCKS, CodecSpec(codec, group)))
    assert torch.equal(payload, want_payload)
    assert same_bits(scales, want_scales)
    assert torch.equal(buffer, before), "pack wrote to its source"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("layout,group", CASES)
def test_unpack_equals_reference_and_touches_only_target_blocks(layout, group, codec, dtype):
    field = make_field(dtype, *LAYOUTS[layout])
    source = make_region(field, BLOCKS, seed=7)
    payload, scales = reference.pack(PackItem(source, field, SRC_IDS, BLOCKS, CodecSpec(codec, group)))
    target = make_region(field, BLOCKS, seed=8, scale=100.0)
    want = target.clone()
    reference.unpack(UnpackItem(want, field, DST_IDS, BLOCKS, CodecSpec(codec, group), payload, scales))
    got = target.clone()
    triton_unpack(UnpackItem(got, field, torch.tensor(DST_IDS), BLOCKS, CodecSpec(codec, group), payload, scales))
    assert torch.equal(got, want)
    outside = ~touched(target, field, BLOCKS, DST_IDS)
    assert torch.equal(got[outside], target[outside]), "unpack changed bytes outside its blocks"


def _aliasing_fields() -> dict:
    """An MLA-like and a KDA-like field over the same bytes, with one block stride."""
    latent = make_field(torch.bfloat16, (6, 64), (64, 1), offset_elems=0, pad_bytes=0)
    state = make_field(torch.float32, (2, 3, 32), (1, 2 * 32 + 1, 2), offset_elems=1)
    stride = max(latent.block_stride, state.block_stride)
    return {
        "latent": dataclasses.replace(latent, block_stride=stride),
        "state": dataclasses.replace(state, block_stride=stride),
    }


@pytest.mark.parametrize("view", ["latent", "state"])
@pytest.mark.parametrize("codec", CODECS)
def test_aliasing_views_each_use_their_own_strides(codec, view):
    """An MLA-like and a KDA-like field over the same bytes (vLLM's HMA dual-purpose regions):
    each view packs and unpacks through its own strides."""
    fields = _aliasing_fields()
    buffer = make_region(fields["state"], 4, seed=3)
    f = fields[view]
    payload, scales = triton_pack(PackItem(buffer, f, [2, 0], 4, CodecSpec(codec, 32)))
    want_payload, want_scales = reference.pack(PackItem(buffer, f, [2, 0], 4, CodecSpec(codec, 32)))
    assert torch.equal(payload, want_payload) and same_bits(scales, want_scales)
    got, want = buffer.clone(), buffer.clone()
    triton_unpack(UnpackItem(got, f, [3, 1], 4, CodecSpec(codec, 32), payload, scales))
    reference.unpack(UnpackItem(want, f, [3, 1], 4, CodecSpec(codec, 32), payload, scales))
    assert torch.equal(got, want)


def test_empty_block_list():
    field = make_field(torch.bfloat16, (3, 64), (64, 1))
    buffer = make_region(field, 2)
    payload, scales = triton_pack(PackItem(buffer, field, torch.empty(0, dtype=torch.int64), 2, CodecSpec("fp8", 32)))
    assert payload.numel() == 0 and tuple(scales.shape) == (0, 1)
    before = buffer.clone()
    triton_unpack(UnpackItem(buffer, field, [], 2, CodecSpec("fp8", 32), payload, scales))
    assert torch.equal(buffer, before)


@pytest.mark.parametrize("bad_ids,error", [([0, 2], IndexError), ([-1], IndexError)])
def test_block_ids_out_of_range_are_refused(bad_ids, error):
    field = make_field(torch.float32, (3, 32), (32, 1))
    buffer = make_region(field, 2)
    with pytest.raises(error, match=r"\[0, 2\)"):
        triton_pack(PackItem(buffer, field, bad_ids, 2, CodecSpec("int8", 32)))


def test_duplicate_target_blocks_are_refused():
    field = make_field(torch.float32, (3, 32), (32, 1))
    buffer = make_region(field, 3)
    payload, scales = reference.pack(PackItem(buffer, field, [0, 1], 3, CodecSpec("int8", 32)))
    with pytest.raises(ValueError, match="distinct"):
        triton_unpack(UnpackItem(buffer, field, [2, 2], 3, CodecSpec("int8", 32), payload, scales))


def test_wrong_payload_size_is_refused_with_what_was_expected():
    field = make_field(torch.float32, (3, 32), (32, 1))
    buffer = make_region(field, 3)
    payload, scales = reference.pack(PackItem(buffer, field, [0, 1], 3, CodecSpec("int8", 32)))
    with pytest.raises(ValueError, match="payload must be 96 uint8 bytes"):
        triton_unpack(UnpackItem(buffer, field, [2], 3, CodecSpec("int8", 32), payload, scales))


# the last axis is 96: 40 does not divide it; 3 divides it but is odd (int4 needs even)
@pytest.mark.parametrize("codec,group,match", [
    ("fp8", 40, "divisor"),
    ("int4", 3, "even group"),
])
def test_bad_groups_are_refused(codec, group, match):
    field = make_field(torch.float32, (2, 96), (96, 1))
    buffer = make_region(field, 1)
    with pytest.raises(ValueError, match=match):
        triton_pack(PackItem(buffer, field, [0], 1, CodecSpec(codec, group)))


@pytest.mark.parametrize("what", ["payload", "scales"])
def test_payload_or_scales_on_another_device_are_refused(what):
    field = make_field(torch.float32, (3, 32), (32, 1))
    buffer = make_region(field, 3)
    payload, scales = reference.pack(PackItem(buffer, field, [0], 3, CodecSpec("int8", 32)))
    if what == "payload":
        payload = payload.to("meta")
    else:
        scales = scales.to("meta")
    # the buffer's device: cpu here, cuda:0 where the tests run on a GPU
    with pytest.raises(ValueError, match=f"{what} must be .* on {buffer.device}.*, found .* on meta"):
        triton_unpack(UnpackItem(buffer, field, [2], 3, CodecSpec("int8", 32), payload, scales))


def test_wrong_scales_shape_is_refused_with_what_was_expected():
    field = make_field(torch.float32, (3, 32), (32, 1))
    buffer = make_region(field, 3)
    payload, scales = reference.pack(PackItem(buffer, field, [0], 3, CodecSpec("int8", 32)))
    expected = rf"scales must be float32 \[3, 1\] on {buffer.device}, found torch.float32 \[1, 3\]"
    with pytest.raises(ValueError, match=expected):
        triton_unpack(UnpackItem(buffer, field, [2], 3, CodecSpec("int8", 32), payload, scales.view(1, -1)))
