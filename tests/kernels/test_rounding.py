"""Adversarial values: the cases where a cast, a division or a reduction could round wrongly.

Each builds groups of values, writes them through a strided field (last-axis stride 2) and
checks the Triton pack and unpack against the reference bytes. The reference itself is checked
against independent definitions in `tests/codec/test_reference.py`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from anchorkv.codec import CodecSpec
from anchorkv.kernels import PackItem, UnpackItem, reference
from anchorkv.kernels.strided import StridedField, field_view
from tests.kernels.helpers import DEVICE, DTYPES, same_bits, triton_pack, triton_unpack

pytestmark = pytest.mark.interpreter

G = 32


@pytest.fixture(params=["reciprocal", "division"], autouse=True)
def division(request, monkeypatch):
    """Every case packs both ways: by each row's reciprocal (`bits.quotient`, the default) and
    by a division per value (`triton_pack.RECIPROCAL = False`, what `profile_kernels` times
    against it): the same bytes."""
    from anchorkv.kernels import batch, triton_pack

    monkeypatch.setattr(triton_pack, "RECIPROCAL", request.param == "reciprocal")
    monkeypatch.setattr(triton_pack, "_plans", batch.PlanCache(triton_pack.PLAN_CACHE_SIZE, triton_pack._plans.build))
    return request.param


def _e4m3_values() -> torch.Tensor:
    """Every finite positive e4m3fn value and every midpoint between neighbours."""
    vals = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    v = torch.tensor(vals, dtype=torch.float64)
    return torch.cat([v, (v[:-1] + v[1:]) / 2])


def _groups(rows: list[list[float]]) -> torch.Tensor:
    """Pad each row to a multiple of G with zeros: `[groups, G]` fp64."""
    out = []
    for r in rows:
        r = list(r) + [0.0] * (-len(r) % G)
        out += [r[i : i + G] for i in range(0, len(r), G)]
    return torch.tensor(out, dtype=torch.float64)


def _pinned(values: torch.Tensor, amax: float) -> torch.Tensor:
    """Rows of G with element 0 set to `amax`, so each group's scale is amax / levels exactly."""
    flat = values.reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % (G - 1))]).reshape(-1, G - 1)
    return torch.cat([flat.new_full((flat.shape[0], 1), amax), flat], dim=1)


def _check(values: torch.Tensor, dtype: torch.dtype, codec: str) -> None:
    """Pack `values` `[rows, G]` (as `dtype`) with Triton and the reference; unpack both ways."""
    rows = values.shape[0]
    isz = torch.empty((), dtype=dtype).element_size()
    field = StridedField(dtype, (rows, G), (2 * G + 1, 2), 2 * isz, ((2 * G + 1) * rows + 4) * isz)
    field = StridedField(dtype, field.shape, field.strides, field.offset,
                         field.block_stride + (-field.block_stride) % 8)
    g = torch.Generator().manual_seed(rows)
    buffer = torch.randint(0, 256, (2 * field.block_stride + 16,), dtype=torch.uint8, generator=g)
    field_view(buffer, field, 2)[1] = values.to(dtype)
    buffer = buffer.to(DEVICE)
    payload, scales = triton_pack(PackItem(buffer, field, [1], 2, CodecSpec(codec, G)))
    want_payload, want_scales = reference.pack(PackItem(buffer, field, [1], 2, CodecSpec(codec, G)))
    assert torch.equal(payload, want_payload)
    assert same_bits(scales, want_scales)
    got, want = buffer.clone(), buffer.clone()
    triton_unpack(UnpackItem(got, field, [0], 2, CodecSpec(codec, G), payload, scales))
    reference.unpack(UnpackItem(want, field, [0], 2, CodecSpec(codec, G), want_payload, want_scales))
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("amax", [448.0, 56.0, 3.0, 1e-3], ids=lambda a: f"amax{a:g}")
def test_fp8_ties_and_exponent_carries(dtype, amax):
    """Midpoints between e4m3 codes, and 31.75 -> 32 (a carry into the exponent), at scales
    that are and are not powers of two."""
    v = _e4m3_values() * (amax / 448.0)
    special = torch.tensor([31.75, -31.75, 15.875, 2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-6,
                            2.0**-6 - 2.0**-10, 447.9, -447.9, -0.0, 1e-12], dtype=torch.float64)
    values = torch.cat([v, -v, special * (amax / 448.0)])
    _check(_pinned(values, amax), dtype, "fp8")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int8_ties_round_half_to_even(dtype):
    ties = torch.arange(-127, 127, dtype=torch.float64) + 0.5
    near = torch.tensor([3.4999, 3.5001, -0.5, -1.5, 0.5, 1.5, -0.0], dtype=torch.float64)
    _check(_pinned(torch.cat([ties, near]), 127.0), dtype, "int8")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int4_ties_round_half_to_even(dtype):
    ties = torch.arange(0, 15, dtype=torch.float64) + 0.5
    row = torch.cat([torch.tensor([0.0, 15.0]), ties, torch.tensor([7.5, 8.5, 0.25, 14.75])])
    _check(_groups([row.tolist(), (row - 8.0).tolist(), (row * 0.125).tolist()]), dtype, "int4")


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_negative_zero_and_vanishing_groups(codec, dtype):
    tiny = torch.finfo(dtype).smallest_normal / 8  # subnormal in the source dtype
    rows = [
        [0.0] * G,
        [-0.0] * G,
        [-0.0, 0.0] * (G // 2),
        [0.0, -0.0] * (G // 2),
        [tiny, -tiny] * (G // 2),
        [tiny * (i - 16) for i in range(G)],
        [1.0] + [tiny] * (G - 1),
        [-1.0] + [-0.0] * (G - 1),
    ]
    _check(_groups(rows), dtype, codec)


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_fp32_subnormals_and_extremes(codec):
    """fp32-only: denormal amax (scale underflows to 0 -> 1.0), huge magnitudes (int4's range
    hi - lo must stay finite, so its extremes are smaller)."""
    rows = [[1e-44] * G, [1e-40 * (i - 16) for i in range(G)]]
    if codec == "int4":
        rows += [[1e30, -1e30] * (G // 2)]
    else:
        rows += [[3e38] + [1e-30] * (G - 1), [-3.4e38, 3.4e38] * (G // 2)]
    _check(_groups(rows), torch.float32, codec)


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_heavy_tailed_random_values(codec, dtype):
    g = torch.Generator().manual_seed(5)
    mags = torch.pow(10.0, torch.empty(40, G).uniform_(-4, 4, generator=g))
    signs = torch.where(torch.rand(40, G, generator=g) < 0.5, -1.0, 1.0)
    values = (mags * signs * torch.randn(40, 1, generator=g).abs()).double()
    limit = 6e4 if dtype == torch.float16 else 1e30
    _check(values.clamp(-limit, limit), dtype, codec)


BAD = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("codec", ["raw", "fp8", "int8", "int4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_groups_are_poisoned_exactly(bad, codec, dtype):
    """Scale bits 0x7FC00000, zero codes, min 0, neighbours untouched; decodes to canonical NaN."""
    x = BAD[bad]
    rows = [
        [1.0 + i for i in range(G)],
        [x] + [2.0] * (G - 1),
        [3.0] * (G - 1) + [x],
        [x] * G,
        [x, -x] * (G // 2) if bad != "nan" else [x, 1.0] * (G // 2),
        [-(i + 0.5) for i in range(G)],
    ]
    _check(_groups(rows), dtype, codec)


def _codes(q: np.ndarray, codec: str) -> np.ndarray:
    """The code each fp32 quotient rounds to: e4m3fn bits (fp8), the nearest integer (int8, int4)."""
    if codec == "fp8":
        return torch.from_numpy(q.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    return np.rint(q)


def _hard_quotients(codec: str, amax: float, want: int = 48) -> tuple[list[list[float]], int]:
    """(groups, how many hard values they hold): values x whose quotient x / scale a plain
    multiply by the reciprocal rounds to another fp32 *and* another code, found among the fp32
    values within 64 ulps of each code boundary (e4m3fn midpoints, k + 0.5). Each boundary has
    one or two, so groups are made for amax, then amax a few ulps up, and so on until `want`:
    element 0 of a group pins its amax (the scale is amax / levels) and element 1 is 0 (int4's
    min)."""
    levels = {"fp8": 448.0, "int8": 127.0, "int4": 15.0}[codec]
    mids = _e4m3_values().numpy()[0x7F:] if codec == "fp8" else np.arange(0, levels) + 0.5
    rows, found = [], 0
    a = np.float32(amax)
    while found < want and len(rows) < 400:
        s = a / np.float32(levels)  # fp32 division: the kernels' scale
        centre = (mids * np.float64(s)).astype(np.float32).view(np.int32)
        xs = (centre[:, None] + np.arange(-64, 65, dtype=np.int32)[None, :]).reshape(-1).view(np.float32)
        xs = xs[(xs > 0) & (xs <= a)]
        if codec != "int4":
            xs = np.concatenate([xs, -xs])
        by_mul, by_div = xs * (np.float32(1.0) / s), xs / s
        hard = xs[(by_mul != by_div) & (_codes(by_mul, codec) != _codes(by_div, codec))]
        for i in range(0, len(hard), G - 2):
            part = hard[i:i + G - 2].tolist()
            rows.append([float(a), 0.0] + part + [0.0] * (G - 2 - len(part)))
        found += len(hard)
        a = np.nextafter(np.nextafter(a, np.float32(np.inf)), np.float32(np.inf))
    return rows, found


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("amax", [448.0 * (2 - 2**-23), 1.2345e-3, 3.3e-30, 9.9e35],
                         ids=["significand-all-ones", "plain", "tiny-scale", "huge-scale"])
def test_quotients_a_multiply_by_the_reciprocal_would_round_wrongly(codec, amax, division):
    """The kernels divide by a row's reciprocal and one fma correction (`bits.quotient`), not
    by division: values whose quotient a plain multiply would round to the wrong code, at
    scales inside and outside the range where the reciprocal divides as it is (the tiny and
    huge scales are shifted by a power of two first). Found here, not listed: each case holds
    dozens of them."""
    rows, hard = _hard_quotients(codec, amax)
    assert hard >= 48, f"{hard} hard quotients found: the case would test nothing"
    _check(torch.tensor(rows, dtype=torch.float64), torch.float32, codec)
    from anchorkv.kernels import triton_pack

    launches = [launch for launch in triton_pack._plans.newest().launches if launch.runs]
    assert [launch.launcher.fixed["RECIP"] for launch in launches] == [division == "reciprocal"]


@pytest.fixture
def zero_minus_negation(monkeypatch):
    """Triton's float negation as triton 3.6 and older compile it: 0.0 - x (+0.0 for x = +0.0;
    3.9 and the interpreter negate truly). The kernels must give the same bytes either way."""
    from triton.language.semantic import TritonSemantic

    def minus(self, input):
        if input.type.scalar.is_floating():
            zero = self.make_tensor(self.builder.get_null_value(input.type.scalar.to_ir(self.builder)),
                                    input.type.scalar)
            return self.sub(zero, input, True)
        return real(self, input)

    real = TritonSemantic.minus
    monkeypatch.setattr(TritonSemantic, "minus", minus)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="patches the Triton interpreter's negation (the GPU runs the "
                                                   "other fp8 and sign cases of this file as compiled)")
@pytest.mark.parametrize("amax", [448.0, 4.04e34, 3.3e-30], ids=["unit-scale", "huge-scale", "tiny-scale"])
def test_a_negative_quotient_that_rounds_to_zero_keeps_its_sign_under_either_negation(zero_minus_negation, amax):
    """-0.0 and negative values whose quotient underflows give fp8 code 0x80 (the reference's
    -0.0), also where a float's unary minus is 0.0 - x: `bits.quotient` negated a +0.0
    residual, and so turned every such code into 0x00 on an H100 with triton 3.6 (a test of
    `tests/kernels/test_packset.py` on random bytes found it). Mutation: `tl.fma(-neg, r, q)`
    fails this test and passes every other one in the interpreter."""
    tiny = torch.tensor([-0.0, -1e-36, -2.7e-31, -1.97e-18, -1e-40, 0.0, 1e-36], dtype=torch.float64) * (amax / 4.04e34)
    values = torch.cat([tiny, torch.tensor([-0.0, -amax * 2.0**-40, -amax * 2.0**-30], dtype=torch.float64)])
    _check(_pinned(values, amax), torch.float32, "fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_int4_group_whose_range_overflows_fp32_is_poisoned(dtype):
    """int4 groups of finite values whose max - min is past fp32's largest (values near
    +-3.4e38): the scale would be Inf and every code decode to 0 * Inf = NaN, so the group is
    poisoned as a non-finite one is (scale NaN, min 0, codes 0) and a save refuses it; a range
    just inside fp32 is not. Triton and the reference write the same bytes."""
    big = 3.0e38
    rows = [[big, -big, 1.0, -2.0],  # range 6e38: overflows
            [1.6e38, -1.6e38, 0.5, 0.25],  # range 3.2e38: fits
            [big, big / 2, 1.0, 0.0],  # one sign: fits
            [1.0, 2.0, 3.0, 4.0]]
    want = [True, False, False, False]
    if dtype == torch.float32:  # at the edge (fp32 only: bf16 rounds fp32's largest to inf)
        top = float(torch.finfo(torch.float32).max)  # 2**128 - 2**104
        rows += [[top, -(2.0**103), 0.0, 1.0],  # exactly halfway to 2**128: rounds to inf
                 [top, -(2.0**102), 0.0, 1.0],  # under halfway: rounds to fp32's largest
                 [-top, 2.0**103, 0.0, 1.0]]  # the first one's mirror image
        want += [True, False, True]
    values = _groups(rows)
    _check(values, dtype, "int4")
    x = values.to(dtype).to(torch.float32)
    codes, scales = reference.quantize_groups(x, reference.Quant.INT4)
    poisoned = torch.isnan(scales[:, 0])
    assert poisoned.tolist() == want
    ok = ~poisoned
    assert torch.isfinite(scales[ok]).all() and not codes[poisoned].any() and not scales[poisoned, 1].any()
    decoded = reference.dequantize_groups(codes, scales, reference.Quant.INT4, torch.float32)
    assert torch.isnan(decoded[poisoned]).all() and torch.isfinite(decoded[ok]).all()
