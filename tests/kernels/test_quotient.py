"""`bits.quotient`'s arithmetic, checked against fp32 division over millions of values.

The pack kernels divide each value by its group's scale as a multiply by the row's reciprocal
and Markstein's fma correction (`bits.reciprocals`, `bits.quotient`), which must give the bits
of the reference's fp32 division wherever a code can tell them apart. Here the same steps run
in numpy, with an exact fp32 fma (below), over every fp32 value of a worst-case binade and
random (value, scale) pairs at every scale exponent; the kernels themselves are checked
against the reference in `test_rounding.py` (the interpreter's fma is exact too).
"""

from __future__ import annotations

import numpy as np
import pytest

F32 = np.float32
#: `bits.RECIP_LO`, `RECIP_HI`, `RECIP_SHIFT`
LO, HI, SHIFT = F32(2.0**-90), F32(2.0**100), F32(2.0**100)
#: a code cannot tell quotients below this from zero (e4m3fn's smallest step is 2**-9)
SENSITIVE = 2.0**-12


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 a * b + c rounded once: the product is exact in fp64; the fp64 sum and its error
    (TwoSum) give the exact result, and a sum that lands on an fp32 midpoint is rounded the way
    its error says (elsewhere rounding the fp64 sum rounds the exact one)."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        s = p + c64
        bp = s - c64
        err = (p - bp) + (c64 - (s - bp))
        f = s.astype(F32)
        # an fp32 midpoint: halfway between f and its neighbour towards s
        nb = np.nextafter(f, np.where(s > f.astype(np.float64), F32(np.inf), F32(-np.inf)))
        mid = (f.astype(np.float64) + nb.astype(np.float64)) / 2
        tie = (s == mid) & (err != 0)
        away = np.where(s > 0, err > 0, err < 0)  # the exact sum lies beyond the midpoint
        toward = np.where(tie & away, np.nextafter(f, np.copysign(F32(np.inf), f)), f)
    return np.where(tie, np.where(away, toward, f), f).astype(F32)


def quotient(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """`bits.reciprocals` then `bits.quotient`, in numpy."""
    shift = np.where(scale < LO, SHIFT, np.where(scale > HI, F32(1) / SHIFT, F32(1))).astype(F32)
    shifted = (scale * shift).astype(F32)
    recip = (F32(1) / shifted).astype(F32)
    xs = (x * shift).astype(F32)
    q = (xs * recip).astype(F32)
    neg = fma32(q, shifted, -xs)  # the residual, negated
    return fma32(-neg, recip, q)


def _mismatches(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Where `quotient` differs from fp32 division in a way a code could see: another value of
    2**-12 or more, or another sign."""
    got, want = quotient(x, scale), (x / scale).astype(F32)
    differ = got.view(np.int32) != want.view(np.int32)
    visible = (np.abs(want) >= SENSITIVE) | (np.abs(got) >= SENSITIVE) | (np.signbit(got) != np.signbit(want))
    return differ & visible


def test_fma32_rounds_once():
    """The reference fma: a case where a product rounded to fp32 and then added gives another
    result, the midpoint case decided by the error, and agreement with fp64 elsewhere."""
    a, b = F32(1 + 2.0**-12), F32(1 + 2.0**-12)
    c = F32(-1)
    assert fma32(np.array([a]), np.array([b]), np.array([c]))[0] == F32(2.0**-11 + 2.0**-24)
    assert F32(a * b) + c != F32(2.0**-11 + 2.0**-24)  # two roundings lose the 2**-24
    # 1 + 2**-24 is an fp32 midpoint; an exact sum a hair above it rounds up, at it to even
    tiny = F32(2.0**-60)
    up = fma32(np.array([tiny]), np.array([tiny]), np.array([F32(1 + 2.0**-23)]))  # not a tie
    assert up[0] == F32(1 + 2.0**-23)
    half = fma32(np.array([F32(2.0**-12)]), np.array([F32(2.0**-12)]), np.array([F32(1)]))
    assert half[0] == F32(1)  # exactly 1 + 2**-24: ties to even
    above = fma32(np.array([F32(2.0**-12 + 2.0**-35)]), np.array([F32(2.0**-12)]), np.array([F32(1)]))
    assert above[0] == F32(1 + 2.0**-23)  # past the midpoint by 2**-47: up


@pytest.mark.parametrize("significand", [0, 1, 0x7FFFFF, 0x12345])
def test_every_value_of_a_binade_for_a_hard_scale(significand):
    """Every fp32 x with |x| in [256 s, 448 s) and [1 s, 2 s) for a scale s of each significand
    (the reciprocal of 2 - 2**-23 is where a plain multiply errs most), both signs."""
    s = np.array([(127 << 23) | significand], dtype=np.int32).view(F32)[0]
    for lo, hi in ((256, 448), (1, 2)):
        start, stop = np.array([lo * s, hi * s], dtype=F32).view(np.int32)
        x = np.arange(start, stop, dtype=np.int32).view(F32)
        x = np.concatenate([x, -x])
        bad = _mismatches(x, np.full_like(x, s))
        assert not bad.any(), (s, x[bad][:5])


@pytest.mark.parametrize("levels", [448.0, 127.0, 15.0], ids=["fp8", "int8", "int4"])
def test_random_values_at_every_scale_exponent(levels):
    """Scales from 2**-149 (subnormal) to 2**120, with |x| <= levels * s spread over 70
    binades below that bound (subnormal x included), and signed zeros."""
    rng = np.random.default_rng(int(levels))
    n = 2_000_000
    exps = rng.integers(-149, 121, n)
    mant = rng.integers(0, 1 << 23, n)
    scale = np.where(exps >= -126, ((exps + 127) << 23) | mant,
                     mant & ((1 << np.clip(exps + 150, 1, 23)) - 1) | 1).astype(np.int32).view(F32)
    with np.errstate(over="ignore"):  # (the largest scales have no finite bound: left out)
        bound = (scale * F32(levels)).astype(F32)
    ok = np.isfinite(bound)
    scale, bound = scale[ok], bound[ok]
    top = bound.view(np.int32) >> 23
    e = top - rng.integers(0, 70, top.size)
    bits = np.where(e >= 1, (e << 23) | rng.integers(0, 1 << 23, top.size), rng.integers(0, 1 << 23, top.size))
    x = np.minimum(bits.astype(np.int32).view(F32), bound)
    x = np.where(rng.random(x.size) < 0.5, -x, x).astype(F32)
    x[:1000] = np.where(np.arange(1000) % 2, F32(-0.0), F32(0.0))
    bad = _mismatches(x, scale)
    assert not bad.any(), list(zip(x[bad][:5], scale[bad][:5], strict=True))


def test_the_check_would_catch_a_plain_multiply_and_a_missing_shift():
    """Without the correction, or without the shift at tiny scales, the same checks fail."""
    s = np.array([(127 << 23) | 0x7FFFFF], dtype=np.int32).view(F32)[0]
    start, stop = np.array([256 * s, 448 * s], dtype=F32).view(np.int32)
    x = np.arange(start, stop, dtype=np.int32).view(F32)
    plain = (x * (F32(1) / s)).astype(F32)
    assert (plain != (x / s).astype(F32)).sum() > 1000
    tiny = np.full(100_000, F32(2.0**-122) * F32(1.7), dtype=F32)
    xt = (np.random.default_rng(1).random(tiny.size).astype(F32) * tiny * F32(448)).astype(F32)
    recip = (F32(1) / tiny).astype(F32)
    q = (xt * recip).astype(F32)
    unshifted = np.where(fma32(-q, tiny, xt) == 0, q, fma32(fma32(-q, tiny, xt), recip, q))
    want = (xt / tiny).astype(F32)
    assert ((unshifted != want) & (np.abs(want) >= SENSITIVE)).any()
    assert not _mismatches(xt, tiny).any()
