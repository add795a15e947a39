"""Bit-exact number conversions shared by the pack and unpack kernels.

Why integer bit operations instead of Triton's casts: the bytes must equal the torch reference
on a GPU *and* in the Triton interpreter, and the casts do not agree with it everywhere:

* the interpreter's fp32 -> float8e4nv cast is wrong when rounding carries into the exponent
  (-31.75 becomes -16), so e4m3fn codes are built from the fp32 bit pattern (on sm_89+ GPUs
  the kernels use the hardware's saturating convert, and its decode: `batch.hardware_fp8`);
* `libdevice.rint` does not run in the interpreter, so round-half-even is the classic
  `(x + 1.5 * 2**23) - 1.5 * 2**23`, exact for |x| < 2**22 (callers clamp first);
* fp32 -> bf16 must give c10's canonical NaN (0x7FC0) and RNE, so it is done on the bits
  (on sm_89+ GPUs `narrow(..., HW=True)` uses the hardware's RNE convert, then writes NaN
  canonical: the same bits);
* NaN results of the decode are written as the canonical NaN the reference writes on a CPU
  (a GPU multiply returns 0x7FFFFFFF instead).

Every helper takes and returns fp32 or int32 tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl

from anchorkv.kernels.quant import BF16_NAN_BITS, FP16_NAN_BITS, FP32_NAN_BITS, KERNEL_FORMAT, Quant

#: 1.5 * 2**23: adding and subtracting it rounds an fp32 of magnitude < 2**22 to an integer, RNE.
RNE_MAGIC = tl.constexpr(12582912.0)

#: The kernels' `FMT` constexpr values (`quant.KERNEL_FORMAT`).
FMT_RAW = tl.constexpr(KERNEL_FORMAT[Quant.RAW])
FMT_FP8 = tl.constexpr(KERNEL_FORMAT[Quant.FP8])
FMT_INT8 = tl.constexpr(KERNEL_FORMAT[Quant.INT8])
FMT_INT4 = tl.constexpr(KERNEL_FORMAT[Quant.INT4])
FMT_BF16 = tl.constexpr(KERNEL_FORMAT[Quant.BF16])

#: The `SRC` / `DST` constexpr values: the float dtype of a field (`batch.FLOAT_KIND`).
BF16 = tl.constexpr(0)
FP16 = tl.constexpr(1)
FP32 = tl.constexpr(2)

_BF16_NAN = tl.constexpr(BF16_NAN_BITS)
_FP16_NAN = tl.constexpr(FP16_NAN_BITS)
_FP32_NAN = tl.constexpr(FP32_NAN_BITS)


@triton.jit
def rne(x):
    """Round to the nearest integer, ties to even; `x` must satisfy |x| < 2**22."""
    return (x + RNE_MAGIC) - RNE_MAGIC


@triton.jit
def rne_bits(x):
    """The fp32 bits of `x + RNE_MAGIC`, whose low bits are rne(x) in two's complement
    (|x| < 2**22: the sum lies in [2**23, 2**24), where fp32 steps by 1, and RNE_MAGIC's bits
    0x4B400000 end in 22 zeros). A code is its low 8 (int8) or 4 (int4) bits: one add and one
    and a value, where `rne(x).to(tl.int32)` adds, subtracts and converts (a conversion runs at a
    quarter of the float rate on sm_90)."""
    return (x + RNE_MAGIC).to(tl.int32, bitcast=True)


@triton.jit
def widen(bits, SRC: tl.constexpr):
    """Integer bits of a bf16, fp16 or fp32 element (SRC) -> its exact fp32 value."""
    if SRC == BF16:
        x = ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    elif SRC == FP16:
        x = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        x = bits.to(tl.int32).to(tl.float32, bitcast=True)
    return x


#: `magnitude_bits` at and above which an element is not finite (all exponent bits set):
#: +inf's bits for bf16, fp16 and fp32 (a NaN's are larger).
_NONFINITE_BF16 = tl.constexpr(0x7F80)
_NONFINITE_FP16 = tl.constexpr(0x7C00)
_NONFINITE_FP32 = tl.constexpr(0x7F800000)


@triton.jit
def magnitude_bits(bits, SRC: tl.constexpr):
    """Integer bits of a bf16, fp16 or fp32 element (SRC) -> the bits of its magnitude |x|, as
    an int32 in the source's width.

    Non-negative floats order as their bit patterns do, so the integer max of a row's
    magnitude bits is the bits of its largest |x| (`widen` of it gives the value exactly), and
    the row holds a non-finite element iff that max is >= `nonfinite_bits(SRC)`. Two integer
    instructions a value (an and, a max) where a float max must also test every element for
    inf and NaN, whose float max would drop a NaN."""
    if SRC == FP32:
        out = bits.to(tl.int32) & 0x7FFFFFFF
    else:
        out = bits.to(tl.int32) & 0x7FFF
    return out


@triton.jit
def nonfinite_bits(SRC: tl.constexpr):
    """The least `magnitude_bits` of a non-finite element of SRC (inf's bits)."""
    if SRC == BF16:
        out = _NONFINITE_BF16
    elif SRC == FP16:
        out = _NONFINITE_FP16
    else:
        out = _NONFINITE_FP32
    return out


@triton.jit
def narrow(x, DST: tl.constexpr, HW: tl.constexpr = False):
    """fp32 -> integer bits of bf16, fp16 or fp32 (DST), RNE, NaN canonical.

    The canonical NaNs are those torch writes on a CPU for an fp32 NaN of bits 0x7FC00000:
    bf16 0x7FC0, fp16 0x7E00, fp32 0x7FC00000. `HW` (a GPU, never the interpreter): bf16 by
    the hardware's RNE convert (cvt.rn.bf16x2.f32, one instruction for two elements), the
    same bits as c10's integer rounding for every non-NaN value.
    """
    is_nan = x != x
    u = x.to(tl.int32, bitcast=True)
    if DST == BF16:
        if HW:
            r = x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)
            out = tl.where(is_nan, _BF16_NAN, r.to(tl.int32)).to(tl.int16)
        else:
            # c10::round_to_nearest_even, done in int32 with logical shifts
            lsb = (u >> 16) & 1
            r = ((u + 0x7FFF + lsb) >> 16) & 0xFFFF
            r = tl.where(is_nan, _BF16_NAN, r)
            out = r.to(tl.int16)
    elif DST == FP16:
        h = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        h = tl.where(is_nan, _FP16_NAN, h)
        out = h.to(tl.int16)
    else:
        out = tl.where(is_nan, _FP32_NAN, u)
    return out


@triton.jit
def fp8_encode(v):
    """fp32 `v` with |v| <= 448 -> float8 e4m3fn code (int32 in [0, 255]), RNE.

    Subnormal codes (|v| < 2**-6) are rne(|v| * 2**9); normal ones round the fp32 bit pattern
    to 3 mantissa bits (dropping 20, ties to even; a carry moves into the exponent, as it must)
    and rebias the exponent from 127 to 7. The sign is bit 7, also for -0.0.
    """
    u = v.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a_bits = u & 0x7FFFFFFF
    a = a_bits.to(tl.float32, bitcast=True)
    sub = rne(a * 512.0).to(tl.int32)
    normal = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - (120 << 3)
    code = tl.where(a < 0.015625, sub, normal)
    return code | sign


@triton.jit
def fp8_decode(code):
    """float8 e4m3fn code (int32 in [0, 255]) -> its fp32 value (codes 0x7F and 0xFF: NaN)."""
    sign = (code & 0x80) << 24
    e = (code >> 3) & 0xF
    m = code & 7
    sub_bits = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    normal_bits = ((e + 120) << 23) | (m << 20)
    bits = tl.where(e == 0, sub_bits, normal_bits)
    bits = tl.where((e == 15) & (m == 7), _FP32_NAN, bits)
    return (bits | sign).to(tl.float32, bitcast=True)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def row_max(x):
    """Max along axis 1 of a NaN-free tile.

    Why not `tl.max`: it is a `@triton.jit` function of Triton's standard library, decorated
    when Triton is first imported; if that happened before `TRITON_INTERPRET=1` was set (another
    library imported Triton first), the interpreter cannot call it. `tl.reduce` is a builtin.
    """
    return tl.reduce(x, 1, _maximum)


@triton.jit
def row_min(x):
    """Min along axis 1 of a NaN-free tile (see `row_max` for why not `tl.min`)."""
    return tl.reduce(x, 1, _minimum)


#: Scales whose reciprocal divides exactly (`quotient`) as they are. Below 2**-90 the
#: correction's residual could underflow (a quotient's residual is ~2**-24 of the dividend,
#: and a dividend whose quotient a code tells from zero is >= 2**-12 of the scale); above
#: 2**100 the reciprocal nears the subnormals. Rows outside are scaled by RECIP_SHIFT or its
#: inverse first, dividend and divisor alike (a power of two: exact, the quotient unchanged).
RECIP_LO = tl.constexpr(2.0**-90)
RECIP_HI = tl.constexpr(2.0**100)
RECIP_SHIFT = tl.constexpr(2.0**100)


@triton.jit
def reciprocals(scale):
    """(shift, shifted scale, its reciprocal) per row for `quotient`: the shift is 1 where the
    scale is in [RECIP_LO, RECIP_HI], else the power of two that brings it there; the
    reciprocal is div_rn(1, shifted scale), correctly rounded."""
    shift = tl.where(scale < RECIP_LO, RECIP_SHIFT, tl.where(scale > RECIP_HI, 1.0 / RECIP_SHIFT, 1.0))
    shifted = scale * shift
    return shift, shifted, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), shifted)


@triton.jit
def quotient(x, shift, scale, recip):
    """x / scale[:, None] rounded to nearest even, as `tl.math.div_rn` (the reference's fp32
    division) gives it, from `reciprocals(scale)`: two multiplies and two fmas a value, no
    division (on a GPU a division is a reciprocal approximation, its refinement, a range check
    and a branch to a slow path: ~20 instructions, most of a pack's).

    With x and the scale shifted (exact), q = x * recip is within 1.5 ulp of the quotient; the
    residual r = x - q * scale is exact in one fma, and q + r * recip, rounded once, is the
    correctly rounded quotient (Markstein's correction: `recip` correctly rounded, nothing
    underflows). The residual is computed negated (q * scale - x, then q - that * recip), which
    keeps a zero quotient's sign with no test: -0.0 gives -0.0 + -(+0.0) * recip = -0.0 and +0.0
    gives +0.0 + -(+0.0) * recip = +0.0 (the plain form gives +0.0 for both, and needed a compare
    and a select a value). Checked in C against fp32
    division (`scripts/quotient_*.c`; in numpy in CI: `tests/kernels/test_quotient.py`): every fp32 x in
    [-448 s, 448 s] for 7 scales s (significands 1, 1 + 2**-23, 2 - 2**-23, ...), and 2.8e8
    random (x, s) with s from 2**-149 to 2**120 for each bound |x| <= 448 s, 127 s and 15 s
    (fp8, int8, int4): equal wherever the quotient is 2**-12 or more (below that every code
    rounds it to zero, and the sign is kept)."""
    xs = x * shift[:, None]
    r = recip[:, None]
    q = xs * r
    neg = tl.fma(q, scale[:, None], -xs)  # the residual, negated
    # q - neg * r as fma(neg, -r, q), never fma(-neg, r, q): triton 3.6 and older compile a
    # float's unary minus as 0.0 - x, so -neg of a +0.0 residual was +0.0 and a -0.0 quotient
    # came out +0.0 (fp8 code 0x00 for the reference's 0x80: seen on an H100, triton 3.6; the
    # interpreter negates truly). -r is exact either way: the reciprocal is positive, never 0
    return tl.fma(neg, (-recip)[:, None], q)
