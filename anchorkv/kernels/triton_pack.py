"""Triton pack: fused strided gather + quantize + pack, one pass over the cache, in Triton.

Axis letters (see `anchorkv.kernels.geometry`): N selected blocks, F the field's axes, D the
last axis, G the group size. The output is byte-identical to `anchorkv.kernels.reference.pack`
(its module docstring states the rules) on a GPU and in the Triton interpreter.

Ladder: `_pack_kernel` (one program = BLOCK_R groups of one block of one item) ->
`_launch` (validates one batch of same-signature items, allocates, launches) -> `pack` and
`pack_many` (the public functions).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton
import triton.language as tl

from anchorkv.kernels import batch as B
from anchorkv.kernels.bits import fp8_encode, narrow, rne, row_max, row_min, widen
from anchorkv.kernels.formats import FP8_MAX, INT4_LEVELS, INT8_MAX, POISON_SCALE_BITS, Quant
from anchorkv.kernels.geometry import StridedField

# Globals a @triton.jit function reads must be constexprs (a GPU compile refuses plain floats).
_FP8_MAX = tl.constexpr(FP8_MAX)
_INT8_MAX = tl.constexpr(INT8_MAX)
_INT4_LEVELS = tl.constexpr(INT4_LEVELS)
_POISON = tl.constexpr(POISON_SCALE_BITS)


@triton.jit
def field_tile(cache, b_block, i_t, GROUPS, GPR, S1, S2, T0, T1, T2, TD, G: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, CONTIG: tl.constexpr,
               ALIGN: tl.constexpr):
    """Tile `i_t` of one block of a field, shared by the pack and unpack kernels.

    `b_block` is the block's first element (from `cache`). Returns the tile's group indices
    `[BLOCK_R]`, their mask, the element pointers `[BLOCK_R, BLOCK_G]` into `cache` (row-major
    groups of G elements of the last axis, rows unravelled over `[S0, S1, S2]`) and their mask.
    """
    o_grp = i_t * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    m_grp = o_grp < GROUPS
    o_rowi = o_grp // GPR
    o_j = o_grp % GPR
    o_i2 = o_rowi % S2
    o_rest = o_rowi // S2
    o_row = (o_rest // S1) * T0 + (o_rest % S1) * T1 + o_i2 * T2 + o_j * (G * TD)
    # the block's start (a runtime value) is added last, so the sum the alignment claim is
    # attached to is never folded away (a claim on a folded `x + 0` is lost)
    o_start = tl.multiple_of(b_block + o_row, ALIGN)
    o_col = tl.arange(0, BLOCK_G).to(tl.int64)
    if CONTIG:
        p = cache + o_start[:, None] + o_col[None, :]
    else:
        p = cache + o_start[:, None] + o_col[None, :] * TD
    if BLOCK_G == G:
        m = m_grp[:, None] & (o_col >= 0)[None, :]
    else:
        m = m_grp[:, None] & (o_col < G)[None, :]
    return o_grp, m_grp, p, m


@triton.jit(do_not_specialize=["N", "TAB_W"])
def _pack_kernel(
    src,  # integer alias of the first item's storage (the anchor of every source offset)
    tab,  # int64 [items, 2 + N]: field origin (elements from src), block stride, N block ids
    payload,  # uint8 codes; raw: the source-width integer type; bf16: int16 bits
    scales,  # int32 bits of the fp32 scales [items * N * GROUPS, C]
    N,
    GROUPS,
    GPR,
    S1,
    S2,
    T0,
    T1,
    T2,
    TD,
    NUMEL,
    TAB_W,
    FMT: tl.constexpr,  # 0 raw, 1 fp8, 2 int8, 3 int4, 4 bf16
    SRC: tl.constexpr,  # 0 bf16, 1 fp16, 2 fp32 (unused for raw)
    G: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,  # next power of two of G
    CONTIG: tl.constexpr,  # the last axis is contiguous (TD == 1)
    ALIGN: tl.constexpr,  # host-checked: every row start is a multiple of ALIGN elements
):
    i_t = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1).to(tl.int64)  # item * N + block
    i_item = i_b // N
    i_n = i_b % N
    p_tab = tab + i_item * TAB_W
    b_base = tl.load(p_tab)
    b_bstride = tl.load(p_tab + 1)
    b_bid = tl.load(p_tab + 2 + i_n)

    o_grp, m_grp, p_src, m = field_tile(src, b_base + b_bid * b_bstride, i_t, GROUPS, GPR, S1,
                                        S2, T0, T1, T2, TD, G, BLOCK_R, BLOCK_G, CONTIG, ALIGN)
    o_col = tl.arange(0, BLOCK_G).to(tl.int64)
    o_out = i_b * NUMEL + o_grp * G  # first element of each group in the packed [N, *F] order
    o_scale = i_b * GROUPS + o_grp

    if FMT == 3:
        x = widen(tl.load(p_src, mask=m, other=0), SRC)
        ok = tl.abs(x) < float("inf")
        # one max and one min per group: a non-finite element makes the max +inf (the group is
        # then poisoned, and lo/hi are not used); padding columns and rows stay out
        hi = row_max(tl.where(m, tl.where(ok, x, float("inf")), -float("inf")))
        bad = hi == float("inf")
        lo = row_min(tl.where(m, x, float("inf")))
        # rows past the end: keep inf out of the arithmetic; a zero min is +0.0 (the reference)
        lo = tl.where(m_grp & (lo != 0.0) & ~bad, lo, 0.0)
        hi = tl.where(m_grp & ~bad, hi, 0.0)
        scale = tl.math.div_rn(hi - lo, _INT4_LEVELS)
        scale = tl.where(scale == 0.0, 1.0, scale)
        clean = tl.where(ok, x, 0.0)
        # split each group into its even and odd elements in registers: two codes a byte
        c_even, c_odd = tl.split(tl.reshape(clean, (BLOCK_R, BLOCK_G // 2, 2)))
        o_half = tl.arange(0, BLOCK_G // 2).to(tl.int64)
        m = m_grp[:, None] & (o_half < G // 2)[None, :]
        v_even = tl.math.div_rn(c_even - lo[:, None], scale[:, None])
        v_odd = tl.math.div_rn(c_odd - lo[:, None], scale[:, None])
        v_even = tl.where(v_even > _INT4_LEVELS, _INT4_LEVELS, tl.where(v_even < 0.0, 0.0, v_even))
        v_odd = tl.where(v_odd > _INT4_LEVELS, _INT4_LEVELS, tl.where(v_odd < 0.0, 0.0, v_odd))
        q = rne(v_even).to(tl.int32) | (rne(v_odd).to(tl.int32) << 4)
        q = tl.where(bad[:, None], 0, q)
        tl.store(payload + (o_out // 2)[:, None] + o_half[None, :], q.to(tl.uint8), mask=m)
        s_bits = tl.where(bad, _POISON, scale.to(tl.int32, bitcast=True))
        lo_bits = tl.where(bad, 0, lo.to(tl.int32, bitcast=True))
        tl.store(scales + 2 * o_scale, s_bits, mask=m_grp)
        tl.store(scales + 2 * o_scale + 1, lo_bits, mask=m_grp)
    else:
        b_x = tl.load(p_src, mask=m, other=0)
        p_out = payload + o_out[:, None] + o_col[None, :]
        if FMT == 0:
            tl.store(p_out, b_x, mask=m)
        elif FMT == 4:  # bf16 bits of each value, RNE, NaN canonical (as `narrow`)
            tl.store(p_out, narrow(widen(b_x, SRC), 0), mask=m)
        else:
            x = widen(b_x, SRC)
            ok = tl.abs(x) < float("inf")
            # one reduction per group: a non-finite element makes amax +inf and poisons the
            # group (its scale and codes are then replaced; masked elements were loaded as 0)
            amax = row_max(tl.where(ok, tl.abs(x), float("inf")))
            bad = amax == float("inf")
            amax = tl.where(bad, 0.0, amax)
            clean = tl.where(ok, x, 0.0)
            if FMT == 1:
                scale = tl.math.div_rn(amax, _FP8_MAX)
                scale = tl.where(scale == 0.0, 1.0, scale)
                v = tl.math.div_rn(clean, scale[:, None])
                v = tl.where(v > _FP8_MAX, _FP8_MAX, tl.where(v < -_FP8_MAX, -_FP8_MAX, v))
                q = fp8_encode(v)
            else:
                scale = tl.math.div_rn(amax, _INT8_MAX)
                scale = tl.where(scale == 0.0, 1.0, scale)
                v = tl.math.div_rn(clean, scale[:, None])
                v = tl.where(v > _INT8_MAX, _INT8_MAX, tl.where(v < -_INT8_MAX, -_INT8_MAX, v))
                q = rne(v).to(tl.int32) & 0xFF
            q = tl.where(bad[:, None], 0, q)
            tl.store(p_out, q.to(tl.uint8), mask=m)
            s_bits = tl.where(bad, _POISON, scale.to(tl.int32, bitcast=True))
            tl.store(scales + o_scale, s_bits, mask=m_grp)


def block_g(geom: B.Geometry) -> int:
    """BLOCK_G: the power-of-two tile width covering one group."""
    out = triton.next_power_of_2(geom.g)
    if out > 16384:
        raise ValueError(
            f"group of {geom.g} elements is too wide for one tile (at most 16384); pass a "
            "group size that divides the last axis, e.g. 128"
        )
    return out


@functools.lru_cache(maxsize=4096)
def launch_config(geom: B.Geometry, count: int, n: int) -> tuple[tuple[int, int], dict]:
    """(grid, keyword arguments) that the pack and unpack kernels share for `count` items of
    `n` blocks each: the field geometry, the format, the tile sizes, the launch options.
    Cached (the caller must not change the dict): a connector launches the same shapes every
    step."""
    bg = block_g(geom)
    br = B.tile_rows(geom, bg)
    grid = (triton.cdiv(geom.groups, br), count * n)
    B.grid_check(grid[0], grid[1])
    return grid, dict(
        N=n,
        GROUPS=geom.groups,
        GPR=geom.gpr,
        S1=geom.sizes[1],
        S2=geom.sizes[2],
        T0=geom.strides[0],
        T1=geom.strides[1],
        T2=geom.strides[2],
        TD=geom.td,
        NUMEL=geom.numel,
        FMT=B.FMT_CODE[geom.fmt],
        G=geom.g,
        BLOCK_R=br,
        BLOCK_G=bg,
        CONTIG=geom.td == 1,
        num_warps=B.num_warps(br * bg),
        enable_fp_fusion=False,  # a rounded product, then a rounded sum: as the reference
    )


def _plan(items: Sequence[B.PackItem], ids: list[tuple[int, ...]]):
    """Outputs, item-table rows and the launch of one batch of same-signature items.

    Returns (outputs, rows, go): `go(table)` launches once `rows` are on the device (None when
    there is nothing to move).
    """
    first = items[0]
    geom = B.geometry(first.field, first.fmt, first.group)
    device = first.buffer.device
    n = len(ids[0])
    count = len(items)
    per_payload = n * geom.payload_per_block
    per_groups = n * geom.groups
    payload = torch.empty(count * per_payload, dtype=torch.uint8, device=device)
    payloads = payload.split(per_payload) if per_payload else [payload] * count
    if geom.columns:
        scales = torch.empty(count * per_groups, geom.columns, dtype=torch.float32, device=device)
        outputs = list(zip(payloads, scales.split(per_groups) if per_groups else [scales] * count))
    else:
        scales = torch.empty(0, 0, dtype=torch.float32, device=device)
        outputs = [(p, scales) for p in payloads]
    if n == 0 or geom.numel == 0:
        return outputs, [], None

    itemsize = geom.itemsize
    int_dtype = B.INT_OF_SIZE[itemsize]
    src = B.anchor(first.buffer, int_dtype)
    rows: list[int] = []
    offsets = B.row_offsets(geom)
    for item, block_ids in zip(items, ids):
        origin = B.element_offset(B.field_origin(item.buffer, item.field), src, "field")
        stride = item.field.block_stride // itemsize
        rows += (origin, stride, *block_ids)
        offsets += (origin, stride)
    align = B.alignment(geom, src.data_ptr(), offsets, itemsize) if geom.td == 1 else 1
    grid, common = launch_config(geom, count, n)

    def go(table: torch.Tensor) -> None:
        _pack_kernel[grid](
            src=src,
            tab=table,
            payload=payload.view(B.payload_dtype(geom)),
            scales=scales.view(torch.int32),
            TAB_W=2 + n,
            SRC=B.FLOAT_KIND.get(geom.dtype, 0),
            ALIGN=align,
            **common,
        )

    return outputs, rows, go


def pack_many(items: Sequence[B.PackItem]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`pack` for many (region, field, blocks, codec) items in as few launches as possible.

    Items with the same device, field dtype, shape and strides, format, group and number of
    block ids share one launch; regions, field offsets and block strides may all differ. Returns
    one (payload, scales) per item, in order, equal to `pack(...)` of that item; payloads of one
    launch are slices of one allocation. The item tables of all launches cross to the device
    in one asynchronous copy from page-locked memory: no host synchronization.
    """
    items = list(items)
    ids = [B.check_ids(it.block_ids, it.num_blocks) for it in items]
    keys = [
        B.signature(it.buffer.device, it.field, i, it.fmt, it.group) for it, i in zip(items, ids)
    ]
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(items)
    launches = []
    for members in B.group_items(keys):
        outputs, rows, go = _plan([items[i] for i in members], [ids[i] for i in members])
        for i, result in zip(members, outputs):
            out[i] = result
        if go is not None:
            launches.append((items[members[0]].buffer.device, rows, go))
    tables = B.stage_tables([(device, rows) for device, rows, _ in launches])
    for (_, _, go), table in zip(launches, tables):
        go(table)
    return out  # type: ignore[return-value]


def pack(
    buffer: torch.Tensor,
    field: StridedField,
    block_ids: torch.Tensor,
    num_blocks: int,
    fmt: Quant | str,
    group: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather blocks `block_ids` of `field` out of the region in `buffer` and quantize them.

    Reads the strided source once (any block stride, field offset and element strides,
    including a non-contiguous last axis) and writes only the outputs:

    * payload: uint8 `[bytes]`, the codes of `[N, *F]` in row-major order (raw: the source
      bytes; fp8/int8: one byte a value; int4: two values a byte, the even one low);
    * scales: fp32 `[N * numel(F) / G, C]`, C = 1 (scale) for fp8/int8, 2 (scale, min) for
      int4, 0 for raw.

    `fmt` is raw, fp8, int8 or int4; `group` is G, a divisor of D (None: all of D). Source
    dtypes bf16, fp16 and fp32 (raw: any 1/2/4/8-byte dtype). Groups holding NaN or +-Inf are
    poisoned (scale NaN 0x7FC00000, zero payload, min 0). Block ids on a GPU cost one host
    synchronization; pass them as a list or CPU tensor.
    """
    return pack_many([B.PackItem(buffer, field, block_ids, num_blocks, fmt, group)])[0]
