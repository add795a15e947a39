"""The built-in quantization formats: their serialized ids and the numbers that define them.

This is the one place these facts live; the torch reference, the Triton kernels, the codec
layer and the store all read them from here. Golden fixtures under `tests/fixtures/` pin the
bytes they produce.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol


class Quant(str, Enum):
    """Serialized id of a built-in format (appears in packed metadata and store manifests)."""

    RAW = "raw"  # the source bytes as they are
    FP8 = "fp8"  # float8 e4m3fn, one fp32 scale per group, RNE, saturating at +-448
    INT8 = "int8"  # symmetric int8 in [-127, 127], one fp32 scale per group, RNE
    INT4 = "int4"  # asymmetric 4-bit in [0, 15], fp32 (scale, min) per group, 2 values a byte
    BF16 = "bf16"  # each value rounded to bfloat16 (RNE, Inf kept, NaN 0x7FC0), 2 bytes, no scales

    def __str__(self) -> str:  # so f-strings and json show "fp8", not "Quant.FP8"
        return self.value


class QuantSpec(Protocol):
    """What the kernels read of a codec spec: a built-in format's id and its group size (`None`:
    the whole last axis). `anchorkv.codec.CodecSpec` is one: the connector's configured spec
    reaches the kernels as it is, never split into loose (format, group) arguments."""

    @property
    def id(self) -> str: ...

    @property
    def group(self) -> int | None: ...


#: `Quant(id)` as a dict lookup (an Enum call costs more than the rest of a launch signature).
QUANT: dict[str, Quant] = {**{q: q for q in Quant}, **{q.value: q for q in Quant}}


def quant_of(spec: QuantSpec) -> Quant:
    """The built-in format `spec` names; a clear error for any other codec id."""
    fmt = QUANT.get(spec.id)
    if fmt is None:
        raise ValueError(f"the kernels pack the built-in formats {', '.join(q.value for q in Quant)}; "
                         f"found codec {spec.id!r} (a plug-in codec encodes through its own encode/decode)")
    return fmt


FP8_MAX = 448.0  # largest finite float8 e4m3fn
INT8_MAX = 127.0  # symmetric: -128 is never produced
INT4_LEVELS = 15.0  # codes 0..15

#: fp32 values kept per group next to the payload: (scale,) or (scale, minimum).
SCALE_COLUMNS = {Quant.RAW: 0, Quant.FP8: 1, Quant.INT8: 1, Quant.INT4: 2, Quant.BF16: 0}

#: Formats that work element by element: no groups, no scales (a spec's group is ignored).
ELEMENTWISE = frozenset({Quant.RAW, Quant.BF16})
#: Bytes per value of `Quant.BF16`'s payload, and the bf16 canonical NaN it writes.
BF16_ITEMSIZE = 2
BF16_NAN_BITS = 0x7FC0

#: The canonical quiet NaN written for a NaN result, by dtype (what torch writes on a CPU for an
#: fp32 NaN of bits 0x7FC00000): the reference and the kernels both take them from here.
FP16_NAN_BITS = 0x7E00
FP32_NAN_BITS = 0x7FC00000

#: The kernels' `FMT` constexpr of each format (named `FMT_*` constexprs in `kernels.bits`).
KERNEL_FORMAT = {Quant.RAW: 0, Quant.FP8: 1, Quant.INT8: 2, Quant.INT4: 3, Quant.BF16: 4}

#: The bit pattern written as the scale of a group that held a NaN or an infinity. Its payload
#: bytes are all zero; decoding gives NaN for the whole group, never a plausible finite value.
POISON_SCALE_BITS = 0x7FC00000


def payload_nbytes(fmt: Quant, numel: int, itemsize: int) -> int:
    """Bytes of payload for `numel` values whose source elements are `itemsize` bytes."""
    fmt = Quant(fmt)
    if fmt is Quant.RAW:
        return numel * itemsize
    if fmt is Quant.INT4:
        return (numel + 1) // 2
    if fmt is Quant.BF16:
        return numel * BF16_ITEMSIZE
    return numel


def resolve_group(last_dim: int, group: int | None) -> int:
    """The group size G for a last axis of `last_dim` elements (`None` = the whole axis).

    Groups never straddle rows of the last axis, so G must divide it; int4 also needs G even
    (two codes per byte never come from different groups).
    """
    g = last_dim if group is None else int(group)
    if g <= 0 or last_dim % g:
        raise ValueError(
            f"quantization group size {group} must be a positive divisor of the last axis "
            f"({last_dim} elements); use one that divides it, or the whole axis (a codec string such as "
            "'int8:whole'; group None)"
        )
    return g
