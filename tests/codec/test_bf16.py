"""The `bf16` codec: fp32 -> bfloat16 round-half-to-even on the bits, Inf kept, NaN canonical.

The reference (`anchorkv.kernels.reference.round_to_bf16`) is checked against two independent
definitions: a brute-force nearest-value search in float64, and torch's own cast (which agrees
everywhere except the NaN bits it writes).
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from anchorkv.codec import (
    KIMI_LINEAR_48B_CONFIG,
    CacheView,
    CodecSpec,
    Region,
    get_codec,
    kimi_linear_layout,
    pack,
    pack_many,
    registry,
    unpack,
    unpack_many,
)
from anchorkv.kernels import reference
from anchorkv.kernels.quant import Quant, payload_nbytes
from anchorkv.kernels.reference import dequantize, quantize, round_to_bf16


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _bits_tensor(bits: list[int]) -> torch.Tensor:
    return torch.tensor([b & 0xFFFFFFFF for b in bits], dtype=torch.int64).to(torch.int32).view(torch.float32)


def _bf16_value(code: int) -> float:
    return _f32((code & 0xFFFF) << 16)


def _nearest_bf16(x: float) -> int:
    """Round-half-to-even by search: of the two bf16 codes around `x` (truncation and the next
    one up in magnitude), the nearer; on a tie the even one; past the largest finite bf16 by at
    least half an ulp, infinity (IEEE's overflow rule)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    sign = bits & 0x80000000
    lo = (bits >> 16) & 0x7FFF  # magnitude code, truncated
    hi = lo + 1
    a = abs(x)
    if lo == 0x7F80:  # infinity itself
        return (sign >> 16) | lo
    d_lo = a - _bf16_value(lo)
    if hi == 0x7F80:  # above the largest finite: the "next" value is 2^128 for the midpoint test
        d_hi = 2.0**128 - a
    else:
        d_hi = _bf16_value(hi) - a
    if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0):
        code = lo
    else:
        code = hi
    return (sign >> 16) | code


def _edge_bits() -> list[int]:
    """fp32 bit patterns at every kind of boundary of the rounding."""
    out = []
    for base in (0x3F800000, 0x3F810000, 0x00010000, 0x00000000, 0x7F7F0000, 0x7F7E0000, 0x00800000, 0x4B000000):
        for low in (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF):
            out += [base | low, (base | low) | 0x80000000]
    out += [0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000001]
    return out


def test_rounding_matches_brute_force_at_the_edges():
    x = _bits_tensor(_edge_bits())
    got = [int(c) & 0xFFFF for c in round_to_bf16(x).tolist()]
    want = [_nearest_bf16(v) for v in x.tolist()]
    assert got == want


def test_rounding_matches_brute_force_on_random_bits():
    g = torch.Generator().manual_seed(11)
    bits = torch.randint(0, 2**32, (4000,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = x[~torch.isnan(x)]
    got = [int(c) & 0xFFFF for c in round_to_bf16(x).tolist()]
    assert got == [_nearest_bf16(v) for v in x.tolist()]


def test_rounding_matches_torch_cast_except_nan_bits():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200_000, generator=g) * torch.exp(torch.randn(200_000, generator=g) * 25)
    x = torch.cat([x, _bits_tensor(_edge_bits())])
    assert torch.equal(round_to_bf16(x), x.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("bits", [0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFFFFFFFF, 0xFF800001])
def test_every_nan_becomes_the_canonical_nan(bits):
    assert int(round_to_bf16(_bits_tensor([bits]))[0]) & 0xFFFF == 0x7FC0


def test_inf_signed_zero_and_overflow():
    x = torch.tensor([math.inf, -math.inf, 0.0, -0.0, 3.4e38, -3.4e38, 3.3895e38])
    codes = [int(c) & 0xFFFF for c in round_to_bf16(x).tolist()]
    assert codes == [0x7F80, 0xFF80, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x7F7F]


def _fp32_input() -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 5, 64, generator=g) * torch.exp(torch.randn(3, 5, 1, generator=g) * 3)
    x[0, 0, :4] = torch.tensor([math.nan, math.inf, -math.inf, -0.0])
    return x


@pytest.mark.parametrize("group", [None, 64, 7])
def test_fp32_round_trip_is_the_bf16_rounding(group):
    """Decoding gives exactly the rounded values; the group (meaningless for bf16) is ignored;
    a NaN poisons only itself (the quantizers poison a whole group)."""
    x = _fp32_input()
    payload, scales = quantize(x, CodecSpec("bf16", group))
    assert payload.dtype == torch.uint8 and payload.numel() == x.numel() * 2 == payload_nbytes(Quant.BF16, x.numel(), 4)
    assert scales.shape == (0, 0)
    y = dequantize(payload, scales, CodecSpec("bf16", group), tuple(x.shape), torch.float32)
    nan = torch.isnan(x)
    assert torch.equal(y[~nan], x.to(torch.bfloat16).float()[~nan])
    assert y.view(torch.int32)[nan].eq(0x7FC00000).all()
    assert torch.isfinite(y[0, 0, 4:]).all() and torch.isinf(y[0, 0, 1:3]).all()


def test_relative_error_is_at_most_half_an_ulp():
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(2)) * 1e3
    payload, scales = quantize(x, CodecSpec("bf16", None))
    y = dequantize(payload, scales, CodecSpec("bf16", None), tuple(x.shape), torch.float32)
    rel = ((y.double() - x.double()).abs() / x.double().abs()).max().item()
    assert 0 < rel <= 2.0**-8  # 8 significant bits: half an ulp is at most 2^-8 of the value


def test_payload_is_little_endian_codes_in_element_order():
    x = torch.tensor([1.0, -2.0, 1.00390625 + 2**-9])  # the last: a tie, to even (1.0078125)
    payload, _ = quantize(x, CodecSpec("bf16", None))
    assert payload.tolist() == [0x80, 0x3F, 0x00, 0xC0, 0x81, 0x3F]


def test_bf16_source_is_kept_exactly_and_fp16_rounds_once_per_step():
    x = _fp32_input()
    b = x.to(torch.bfloat16)
    payload, scales = quantize(b, CodecSpec("bf16", None))
    codes, raw = payload.view(torch.int16), b.reshape(-1).view(torch.int16)
    nan = torch.isnan(b.reshape(-1))
    assert torch.equal(codes[~nan], raw[~nan])  # bf16 of a bf16 field: its bytes, NaN canonical
    assert codes[nan].eq(0x7FC0).all()
    h = x.clamp(-6e4, 6e4).to(torch.float16)
    payload, scales = quantize(h, CodecSpec("bf16", None))
    y = dequantize(payload, scales, CodecSpec("bf16", None), tuple(h.shape), torch.float16)
    nan = torch.isnan(h)
    assert torch.equal(y[~nan], h.float().to(torch.bfloat16).float().to(torch.float16)[~nan])
    assert y.view(torch.int16)[nan].eq(0x7E00).all()


# ----------------------------------------------------------------------------- codec API


@pytest.fixture
def kda():
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=8)
    page = layout.layers[0].page.page_bytes
    buf = torch.zeros(4 * page, dtype=torch.int8)
    view = CacheView(Region(buf, 4, page), layout.layers[0].page, "kda")
    g = torch.Generator().manual_seed(9)
    view.tensor("recurrent")[:2] = torch.randn(2, 4, 128, 128, generator=g)
    view.tensor("conv")[:2] = torch.randn(2, 3, 3, 512, generator=g).bfloat16()
    return buf, view


def test_pack_unpack_recurrent_touches_only_the_target(kda):
    buf, view = kda
    src = view.tensor("recurrent")[[1]].clone()
    packed = pack(view, "recurrent", [1], "bf16")
    assert packed.nbytes == src.numel() * 2 and packed.poisoned_groups() == 0
    before = buf.clone()
    unpack(packed, view, "recurrent", [3])
    assert torch.equal(view.tensor("recurrent")[3], src[0].to(torch.bfloat16).float())
    changed = (buf != before).nonzero().flatten()
    f = view.page.field("recurrent")
    start = 3 * view.region.block_stride + f.offset
    assert changed.numel() and changed.min() >= start and changed.max() < start + f.nbytes


def test_pack_many_mixes_bf16_with_kernel_formats(kda):
    buf, view = kda
    requests = [(view, "recurrent", [0], "bf16"), (view, "conv", [1], "fp8:64"), (view, "recurrent", [1], "int8")]
    many = pack_many(requests)
    for got, (v, field, ids, codec) in zip(many, requests, strict=True):
        one = pack(v, field, ids, codec)
        assert got.codec == one.codec and torch.equal(got.payload, one.payload)
    expect = buf.clone()
    unpack_many([(many[0], view, "recurrent", [2]), (many[1], view, "conv", [3])])
    exp_view = CacheView(Region(expect, 4, view.region.block_stride), view.page, "kda")
    unpack(many[0], exp_view, "recurrent", [2])
    unpack(many[1], exp_view, "conv", [3])
    assert torch.equal(buf, expect)


def test_bf16_is_a_kernel_format(kda):
    """bf16 is a built-in format of the fused kernels (FMT 4; `tests/kernels/test_bf16.py` checks
    the Triton kernels byte for byte against the reference): the codec API hands it to the
    kernel dispatch like fp8/int8/int4, and the bytes are the reference's."""
    _, view = kda
    codec = get_codec("bf16")
    assert isinstance(codec, registry.QuantCodec) and codec.fmt is Quant.BF16 and not codec.lossless
    packed = pack(view, "recurrent", [0], "bf16")
    want, scales = reference.quantize(view.tensor("recurrent")[[0]], CodecSpec("bf16", None))
    assert torch.equal(packed.payload, want) and packed.scales.numel() == 0 == scales.numel()
