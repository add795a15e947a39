"""Plain-torch oracles of every kernel: they define the exact output bytes.

These functions are the CPU path of the library and the oracle the Triton kernels are tested
against with `torch.equal`. They are written for reading, not speed.

Shapes: `[N, *F]` is N selected blocks of a field with axes F; quantization works on groups
of G consecutive elements of the last axis D (see `anchorkv.kernels.strided`).

Quantization rules (all rounding is round-half-to-even, all arithmetic IEEE fp32):
  * the input is widened to fp32 (exact for bf16, fp16, fp32);
  * a group's `amax` is the largest |x|; `fp8`: scale = amax / 448, code = e4m3fn(x / scale)
    with x / scale clamped to [-448, 448]; `int8`: scale = amax / 127, code = round(x / scale)
    clamped to [-127, 127]; a scale that comes out 0 (all-zero or vanishing group) is 1.0;
  * `int4`: lo = min, hi = max of the group (a zero lo is +0.0: which signed zero a min
    reduction returns depends on its order), scale = (hi - lo) / 15 (0 -> 1.0),
    code = round((x - lo) / scale) clamped to [0, 15]; decoded as code * scale + lo (a rounded
    product, then a rounded sum: never a fused multiply-add); two codes a byte, the even
    element in the low nibble;
  * decoding multiplies the fp32 code value by the fp32 scale and rounds once to the field's
    dtype (RNE); a NaN result is written as the canonical quiet NaN of that dtype (bf16 0x7FC0,
    fp16 0x7E00, fp32 0x7FC00000), whatever NaN bits the device's multiply or cast produced;
  * NaN/Inf policy: a group holding any NaN or +-Inf is *poisoned*: scale NaN (bits 0x7FC00000),
    payload bytes 0 (and min 0 for int4). It decodes to NaN for every element of the group, so
    non-finite state is never turned into plausible numbers, and `Packed.poisoned_groups()`
    lets a caller refuse to store it. `raw` keeps bytes as they are (NaN stays NaN). An `int4`
    group of finite values whose range hi - lo overflows fp32 (to +Inf: values near +-3.4e38)
    is poisoned too: its scale would be Inf, and every code would decode to 0 * Inf = NaN.
  * `bf16` (no groups, no scales): each value, widened to fp32, is rounded to bfloat16 on its
    bits: bf16 = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 for the fp32 bits u (round-half-to-even;
    finite values past the bf16 range become +-Inf, as RNE says; +-Inf and -0.0 kept); every
    NaN is written 0x7FC0. The payload is those 16-bit codes, little-endian, in the field's
    logical element order. Decoded exactly to fp32 (code << 16), then rounded once to the
    field's dtype (RNE), NaN canonical. Unlike the quantizers, a NaN poisons only itself.
"""

from __future__ import annotations

import torch

from anchorkv.kernels.items import PackItem, UnpackItem
from anchorkv.kernels.quant import (
    BF16_NAN_BITS,
    FP8_MAX,
    FP16_NAN_BITS,
    FP32_NAN_BITS,
    INT4_LEVELS,
    INT8_MAX,
    POISON_SCALE_BITS,
    SCALE_COLUMNS,
    Quant,
    QuantSpec,
    quant_of,
    resolve_group,
)
from anchorkv.kernels.strided import StridedField, field_view

_POISON = torch.tensor([POISON_SCALE_BITS], dtype=torch.int32).view(torch.float32)[0].item()

#: The NaN written by a decode, per field dtype, as (same-size int dtype, bits).
_CANONICAL_NAN = {
    torch.bfloat16: (torch.int16, BF16_NAN_BITS),
    torch.float16: (torch.int16, FP16_NAN_BITS),
    torch.float32: (torch.int32, FP32_NAN_BITS),
}


# ----------------------------------------------------------------------------- gather/scatter


def check_block_ids(block_ids: torch.Tensor, num_blocks: int, *, distinct: bool = False) -> torch.Tensor:
    """`block_ids` as an int64 vector, each in [0, num_blocks) (and, for a scatter, distinct)."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64)
    if ids.dim() != 1:
        raise ValueError(f"block ids must be a 1-D tensor, found shape {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise IndexError(
            f"block ids must lie in [0, {num_blocks}), found min {int(ids.min())} "
            f"and max {int(ids.max())}"
        )
    if distinct and ids.unique().numel() != ids.numel():
        raise ValueError(f"block ids must be distinct to scatter, found {ids.tolist()}")
    return ids


def gather(buffer: torch.Tensor, field: StridedField, block_ids, num_blocks: int) -> torch.Tensor:
    """Copy the selected blocks of `field` out of `buffer`: a contiguous `[N, *F]` tensor."""
    ids = check_block_ids(block_ids, num_blocks).to(buffer.device)
    return field_view(buffer, field, num_blocks).index_select(0, ids).contiguous()


def scatter(
    buffer: torch.Tensor, field: StridedField, block_ids, num_blocks: int, values: torch.Tensor
) -> None:
    """Write `values` `[N, *F]` into the selected blocks of `field`; no other byte changes."""
    ids = check_block_ids(block_ids, num_blocks, distinct=True)
    expected = (ids.numel(), *field.shape)
    if tuple(values.shape) != expected or values.dtype != field.dtype:
        raise ValueError(
            f"values must be {field.dtype} {list(expected)}, found {values.dtype} "
            f"{list(values.shape)}"
        )
    view = field_view(buffer, field, num_blocks)
    view[ids.to(buffer.device)] = values.to(buffer.device)


# ----------------------------------------------------------------------------- quantize


def _rows(x: torch.Tensor, fmt: Quant, group: int | None) -> torch.Tensor:
    """`x` cut into rows of one group each, in its own dtype: `[groups, G]`."""
    g = resolve_group(x.shape[-1] if x.dim() else 1, group)
    if fmt is Quant.INT4 and g % 2:
        raise ValueError(f"int4 packs two codes a byte and needs an even group size, found {g}")
    return x.contiguous().reshape(-1, g)


#: Elements per slice of rows that `quantize` / `dequantize` work on at a time (1 MiB of fp32:
#: measured 3-4x faster than whole-request temporaries on a 2-core x86 CPU; slices of 64 Ki
#: elements were 1.5-2x slower, 512 Ki-1 Mi about the same).
_SLICE_ELEMENTS = 1 << 18


def _row_slices(rows: int, width: int):
    """[start, stop) row ranges of about `_SLICE_ELEMENTS` elements.

    Why: the per-group math below makes a dozen full-size fp32 temporaries; on slices that
    stay in the CPU's cache it runs several times faster than on a whole request, and since
    groups are independent the bytes are the same.
    """
    step = max(1, _SLICE_ELEMENTS // max(width, 1))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """`x / divisor`, correctly rounded (IEEE) on every device.

    Why: CUDA torch divides by a Python scalar as a multiplication by its reciprocal, which can
    differ from the true quotient in the last bit (seen on an H100: int8 scales 1 ulp off).
    A tensor divisor takes the true-division path on CPU and CUDA alike.
    """
    return x / torch.full_like(x, divisor)


def _nonzero_scale(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode `x` `[..., D]` with `spec`'s format and group: returns (payload uint8 `[bytes]`,
    scales fp32 `[groups, C]`).

    `C` is 1 (scale) for fp8/int8, 2 (scale, min) for int4, 0 for raw and bf16.
    """
    fmt, group = quant_of(spec), spec.group
    if fmt is Quant.RAW:
        flat = x.contiguous().reshape(-1)
        return flat.view(torch.uint8).clone(), torch.empty(0, 0, dtype=torch.float32, device=x.device)
    if fmt is Quant.BF16:
        codes = round_to_bf16(x.contiguous().reshape(-1).to(torch.float32))
        return codes.view(torch.uint8), torch.empty(0, 0, dtype=torch.float32, device=x.device)
    rows = _rows(x, fmt, group)
    n, g = rows.shape
    codes = torch.empty(n, g // 2 if fmt is Quant.INT4 else g, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n, SCALE_COLUMNS[fmt], dtype=torch.float32, device=x.device)
    for a, b in _row_slices(n, g):
        codes[a:b], scales[a:b] = quantize_groups(rows[a:b].to(torch.float32), fmt)
    return codes.reshape(-1), scales


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` -> the int16 codes of its bfloat16 rounding (the `bf16` rule above).

    Why on the bits and not `x.to(torch.bfloat16)`: the cast's NaN bits depend on the device
    and the CPU's vector path (0xFFFF on x86 for torch 2.13), and the bytes must be the same
    everywhere; for every non-NaN value the two agree (tested).
    """
    nan = torch.isnan(x)
    u = torch.where(nan, torch.zeros_like(x), x).contiguous().view(torch.int32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16  # no int32 overflow: non-NaN |u| <= 0x7F800000
    rounded = torch.where(nan, torch.full_like(rounded, BF16_NAN_BITS), rounded & 0xFFFF)
    return rounded.to(torch.int16)  # 16-bit two's complement of the code


def quantize_groups(g: torch.Tensor, fmt: Quant) -> tuple[torch.Tensor, torch.Tensor]:
    """The rules of the module docstring for fp32 groups `[groups, G]`: (codes, scales)."""
    finite = g.abs() < float("inf")
    poisoned = ~finite.all(dim=1)
    clean = torch.where(finite, g, torch.zeros_like(g))

    if fmt is Quant.FP8:
        scale = _nonzero_scale(_div(clean.abs().amax(dim=1), FP8_MAX))
        v = (clean / scale[:, None]).clamp(-FP8_MAX, FP8_MAX)
        codes = v.to(torch.float8_e4m3fn).view(torch.uint8)
        scales = scale[:, None]
    elif fmt is Quant.INT8:
        scale = _nonzero_scale(_div(clean.abs().amax(dim=1), INT8_MAX))
        v = torch.round(clean / scale[:, None]).clamp(-INT8_MAX, INT8_MAX)
        codes = v.to(torch.int8).view(torch.uint8)
        scales = scale[:, None]
    else:  # INT4
        lo = clean.amin(dim=1)
        lo = torch.where(lo == 0, torch.zeros_like(lo), lo)  # -0.0 -> +0.0, order-independent
        span = clean.amax(dim=1) - lo
        poisoned = poisoned | (span == float("inf"))  # a range past fp32: poisoned as well
        scale = _nonzero_scale(_div(span, INT4_LEVELS))
        v = torch.round((clean - lo[:, None]) / scale[:, None]).clamp(0, INT4_LEVELS)
        codes = v.to(torch.uint8)
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales = torch.stack([scale, lo], dim=1)

    codes = torch.where(poisoned[:, None], torch.zeros_like(codes), codes)
    scales = scales.clone()
    scales[poisoned, 0] = _POISON
    scales[poisoned, 1:] = 0.0
    return codes, scales


def dequantize(
    payload: torch.Tensor,
    scales: torch.Tensor,
    spec: QuantSpec,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Decode what `quantize(values, spec)` produced back to a `dtype` tensor of `shape`."""
    fmt, group = quant_of(spec), spec.group
    if fmt is Quant.RAW:
        return payload.contiguous().view(dtype).reshape(shape).clone()
    if fmt is Quant.BF16:
        codes = payload.contiguous().view(torch.int16).reshape(shape)
        values = (codes.to(torch.int32) << 16).view(torch.float32)  # exact
        return _canonical_nan(values.to(dtype))
    last = shape[-1] if shape else 1
    g = resolve_group(last, group)
    codes = payload.contiguous().reshape(-1, g // 2 if fmt is Quant.INT4 else g)
    n = codes.shape[0]
    out = torch.empty(n, g, dtype=dtype, device=payload.device)
    for a, b in _row_slices(n, g):
        out[a:b] = dequantize_groups(codes[a:b], scales[a:b], fmt, dtype)
    return out.reshape(shape)


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, fmt: Quant, dtype: torch.dtype) -> torch.Tensor:
    """The decode rules for the codes of groups `[groups, G]` (int4: `[groups, G/2]`)."""
    if fmt is Quant.FP8:
        out = codes.view(torch.float8_e4m3fn).to(torch.float32) * scales[:, 0:1]
    elif fmt is Quant.INT8:
        out = codes.view(torch.int8).to(torch.float32) * scales[:, 0:1]
    else:  # INT4
        lo_hi = torch.stack([codes & 0x0F, codes >> 4], dim=2).reshape(codes.shape[0], -1)
        out = lo_hi.to(torch.float32) * scales[:, 0:1]
        out = out + scales[:, 1:2]
    return _canonical_nan(out.to(dtype))


def _canonical_nan(values: torch.Tensor) -> torch.Tensor:
    """Rewrite every NaN as its dtype's canonical bits.

    Why: NaN bits after a multiply and a cast depend on the device and even on the CPU's vector
    path (torch 2.13 on x86 writes bf16 NaN as 0xFFFF, CUDA as 0x7FFF), and the output must be
    the same bytes everywhere.
    """
    if values.dtype not in _CANONICAL_NAN:
        return values
    int_dtype, bits = _CANONICAL_NAN[values.dtype]
    canonical = torch.tensor(bits, dtype=int_dtype, device=values.device)
    return torch.where(torch.isnan(values), canonical, values.view(int_dtype)).view(values.dtype)


# ----------------------------------------------------------------------------- fused ops


def pack(item: PackItem) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather the item's selected blocks and quantize them with its spec: (payload, scales)."""
    values = gather(item.buffer, item.field, item.block_ids, item.num_blocks)
    return quantize(values, item.spec)


def unpack(item: UnpackItem) -> None:
    """Dequantize the item's (payload, scales) and scatter them into its selected blocks."""
    ids = torch.as_tensor(item.block_ids, dtype=torch.int64)
    field = item.field
    values = dequantize(item.payload, item.scales, item.spec, (ids.numel(), *field.shape), field.dtype)
    scatter(item.buffer, field, ids, item.num_blocks, values)
