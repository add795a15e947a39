"""Triton pack: fused strided gather + quantize + pack, one pass over the cache, in Triton.

Axis letters (see `anchorkv.kernels.strided`): N selected blocks, F the field's axes, D the
last axis, G the group size. The output is byte-identical to `anchorkv.kernels.reference.pack`
(its module docstring states the rules) on a GPU and in the Triton interpreter.

Ladder: `pack_program` (one program = BLOCK_R groups of one block of one item), run by
`_pack_kernel` (one launch: items of one signature, the grid's ids) -> `_Launch` (one batch of
same-signature items: its static table columns and launch configuration) -> `_Plan` (all
launches of one item list, cached; per call: allocate, stage the tables, launch) -> `pack_many`
(the public function; `kernels.pack` is one item of it). A `PackSet`'s plan of several
launches runs them all in one launch of `_pack_set_kernel` (`FUSED`, `set_config`): each of its
programs runs `pack_program` for the launch its id falls in, so a call costs the host one
Triton launch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from anchorkv.kernels import batch
from anchorkv.kernels.bits import (
    FMT_BF16,
    FMT_FP8,
    FMT_INT4,
    FMT_RAW,
    fp8_encode,
    magnitude_bits,
    narrow,
    nonfinite_bits,
    quotient,
    reciprocals,
    rne_bits,
    row_max,
    row_min,
    widen,
)
from anchorkv.kernels.items import PackItem, PackTarget, Span
from anchorkv.kernels.launch import Launcher, launch_site
from anchorkv.kernels.quant import FP8_MAX, INT4_LEVELS, INT8_MAX, POISON_SCALE_BITS

# Globals a @triton.jit function reads must be constexprs (a GPU compile refuses plain floats).
_FP8_MAX = tl.constexpr(FP8_MAX)
_TWO_127_BITS = tl.constexpr(0x7F000000)  # fp32 2**127: an int4 range of twice it or more overflows
_INT8_MAX = tl.constexpr(INT8_MAX)
_INT4_LEVELS = tl.constexpr(INT4_LEVELS)
_POISON = tl.constexpr(POISON_SCALE_BITS)


@triton.jit
def field_tile(cache, b_block, i_t, GROUPS, GPR, S1, S2, T0, T1, T2, TD, G: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, CONTIG: tl.constexpr,
               ALIGN: tl.constexpr, FLAT: tl.constexpr):
    """Tile `i_t` of one block of a field, shared by the pack and unpack kernels.

    `b_block` is the block's first element (from `cache`). Returns the tile's group indices
    `[BLOCK_R]`, their mask, the element pointers `[BLOCK_R, BLOCK_G]` into `cache` (row-major
    groups of G elements of the last axis, rows unravelled over `[S0, S1, S2]`) and their mask.

    The group arithmetic is 32-bit (a block holds fewer than 2**31 elements: `batch.field_cut`
    checks it); only offsets into the cache are 64-bit. A GPU has no integer divider: a 64-bit
    division by a runtime value is a called routine, and the unravelling did six per row, the
    larger part of the kernels' instructions (ncu on the H200: issue-bound, not memory-bound).
    `FLAT` (host-checked, `batch.FieldCut.flat`): the block's groups lie end to end, group k at
    element k * G, and the unravelling is skipped.
    """
    o_g = i_t * BLOCK_R + tl.arange(0, BLOCK_R)  # int32
    m_grp = o_g < GROUPS
    if FLAT:
        o_row = o_g.to(tl.int64) * G
    else:
        o_rowi = o_g // GPR
        o_j = o_g % GPR
        o_i2 = o_rowi % S2
        o_rest = o_rowi // S2
        o_row = ((o_rest // S1).to(tl.int64) * T0 + (o_rest % S1).to(tl.int64) * T1
                 + o_i2.to(tl.int64) * T2 + o_j.to(tl.int64) * (G * TD))
    o_grp = o_g.to(tl.int64)
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


@triton.jit
def divide(x, scale, RECIP: tl.constexpr):
    """x / scale[:, None] with the bits of `tl.math.div_rn`: by the rows' reciprocals
    (`bits.quotient`), or (RECIP False) by a division per value."""
    if RECIP:
        v = quotient(x, *reciprocals(scale))
    else:
        v = tl.math.div_rn(x, scale[:, None])
    return v


@triton.jit(do_not_specialize=["N", "TAB_W", "PAY0", "SC0"])
def _pack_kernel(
    src,  # integer alias of the first item's storage (the anchor of every source offset)
    tab,  # int64 [items, 2 + N]: field origin (elements from src), block stride, N block ids
    payload,  # the call's whole payload allocation: uint8 codes; raw: the source-width
    #           integer type; bf16: int16 bits (16-byte aligned)
    scales,  # int32 bits of the call's whole fp32 scales allocation
    PAY0,  # where this launch's payload starts in `payload` (its elements)
    SC0,  # where this launch's scales [items * N * GROUPS, C] start in `scales`
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
    FMT: tl.constexpr,  # bits.FMT_RAW, FMT_FP8, FMT_INT8, FMT_INT4 or FMT_BF16
    SRC: tl.constexpr,  # bits.BF16, FP16 or FP32 (unused for raw)
    G: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,  # next power of two of G
    CONTIG: tl.constexpr,  # the last axis is contiguous (TD == 1)
    ALIGN: tl.constexpr,  # host-checked: every row start is a multiple of ALIGN elements
    FLAT: tl.constexpr,  # host-checked: group k of a block starts at its element k * G
    HW_FP8: tl.constexpr,  # the GPU's own converts (sm_89+): fp8 codes and bf16 rounding
    OUT_ALIGN: tl.constexpr,  # host-checked: every payload group start is a multiple of OUT_ALIGN
    RECIP: tl.constexpr,  # divide by each row's reciprocal (`bits.quotient`); False: a division
    #                       per value (the same bits; `RECIPROCAL`, for profile_kernels' A/B)
):
    pack_program(src, tab, payload, scales, tl.program_id(0), tl.program_id(1).to(tl.int64),
                 tl.program_id(2).to(tl.int64), PAY0, SC0, N, GROUPS, GPR, S1, S2, T0, T1, T2, TD, NUMEL,
                 TAB_W, FMT, SRC, G, BLOCK_R, BLOCK_G, CONTIG, ALIGN, FLAT, HW_FP8, OUT_ALIGN, RECIP)


@triton.jit
def pack_program(src, tab, payload, scales, i_t, i_n, i_item, PAY0, SC0, N, GROUPS, GPR, S1, S2, T0, T1, T2,
                 TD, NUMEL, TAB_W, FMT: tl.constexpr, SRC: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_G: tl.constexpr, CONTIG: tl.constexpr, ALIGN: tl.constexpr, FLAT: tl.constexpr,
                 HW_FP8: tl.constexpr, OUT_ALIGN: tl.constexpr, RECIP: tl.constexpr):
    """One program of a pack: tile `i_t` of block `i_n` (int64) of item `i_item` (int64) of a
    launch whose item table starts at `tab` (`_pack_kernel`: the grid's ids; `_pack_set_kernel`:
    one of its launches, ids from its flat program id)."""
    i_b = i_item * N + i_n  # the (item, block) pair's place in the launch's outputs
    p_tab = tab + i_item * TAB_W
    b_base = tl.load(p_tab)
    b_bstride = tl.load(p_tab + 1)
    b_bid = tl.load(p_tab + 2 + i_n)

    o_grp, m_grp, p_src, m = field_tile(src, b_base + b_bid * b_bstride, i_t, GROUPS, GPR, S1,
                                        S2, T0, T1, T2, TD, G, BLOCK_R, BLOCK_G, CONTIG, ALIGN, FLAT)
    o_col = tl.arange(0, BLOCK_G).to(tl.int64)
    o_out = i_b * NUMEL + o_grp * G  # first element of each group in the launch's [N, *F] order
    o_scale = i_b * GROUPS + o_grp  # its scale row in the launch's scales

    if FMT == FMT_INT4:
        b_x = tl.load(p_src, mask=m, other=0)
        # a non-finite element poisons the group (one integer max: see the fp8/int8 branch);
        # its elements are zeroed, so its codes, lo and min come out 0 (its scale is replaced)
        bad = row_max(magnitude_bits(b_x, SRC)) >= nonfinite_bits(SRC)
        x = widen(tl.where(bad[:, None], 0, b_x), SRC)
        # one max and one min per group; padding columns and rows stay out
        hi = row_max(tl.where(m, x, -float("inf")))
        lo = row_min(tl.where(m, x, float("inf")))
        # rows past the end: keep inf out of the arithmetic; a zero min is +0.0 (the reference)
        lo = tl.where(m_grp & (lo != 0.0), lo, 0.0)
        hi = tl.where(m_grp, hi, 0.0)
        # a range past fp32 (finite values near +-3.4e38) poisons the group too: its scale would
        # be inf and every code decode to NaN. Its codes and min are zeroed below, as a
        # non-finite group's come out. The test halves both ends first, so nothing overflows:
        # hi - lo rounds to inf exactly when hi/2 - lo/2 rounds to 2**127 or more (halving is
        # exact there, and rounding commutes with it); that difference is >= +0.0, so it is
        # compared on its bits (an integer compare a row, no float one)
        half_span = (hi * 0.5 - lo * 0.5).to(tl.int32, bitcast=True)
        bad = bad | (half_span >= _TWO_127_BITS)
        lo = tl.where(bad, 0.0, lo)
        scale = tl.math.div_rn(hi - lo, _INT4_LEVELS)
        scale = tl.where(scale == 0.0, 1.0, scale)
        # split each group into its even and odd elements in registers: two codes a byte
        c_even, c_odd = tl.split(tl.reshape(x, (BLOCK_R, BLOCK_G // 2, 2)))
        o_half = tl.arange(0, BLOCK_G // 2).to(tl.int64)
        m = m_grp[:, None] & (o_half < G // 2)[None, :]
        # (x >= lo: a quotient is >= +0.0, and only the upper clamp can bind)
        v_even = tl.minimum(divide(c_even - lo[:, None], scale, RECIP), _INT4_LEVELS)
        v_odd = tl.minimum(divide(c_odd - lo[:, None], scale, RECIP), _INT4_LEVELS)
        q = tl.where(bad[:, None], 0, (rne_bits(v_even) & 0xF) | ((rne_bits(v_odd) & 0xF) << 4))
        o_pay = tl.multiple_of(PAY0 + o_out // 2, OUT_ALIGN)  # two codes a byte
        tl.store(payload + o_pay[:, None] + o_half[None, :], q.to(tl.uint8), mask=m)
        s_bits = tl.where(bad, _POISON, scale.to(tl.int32, bitcast=True))
        tl.store(scales + SC0 + 2 * o_scale, s_bits, mask=m_grp)
        tl.store(scales + SC0 + 2 * o_scale + 1, lo.to(tl.int32, bitcast=True), mask=m_grp)
    else:
        b_x = tl.load(p_src, mask=m, other=0)
        p_out = payload + tl.multiple_of(PAY0 + o_out, OUT_ALIGN)[:, None] + o_col[None, :]
        if FMT == FMT_RAW:
            tl.store(p_out, b_x, mask=m)
        elif FMT == FMT_BF16:  # bf16 bits of each value, RNE, NaN canonical (as `narrow`)
            tl.store(p_out, narrow(widen(b_x, SRC), 0, HW_FP8), mask=m)
        else:
            # one integer reduction per group: its largest magnitude's bits (`magnitude_bits`;
            # masked elements were loaded as 0). A non-finite element poisons the group: its
            # elements' bits are zeroed, so its codes come out 0 (its scale is replaced below)
            top = row_max(magnitude_bits(b_x, SRC))
            bad = top >= nonfinite_bits(SRC)
            amax = widen(tl.where(bad, 0, top), SRC)
            clean = widen(tl.where(bad[:, None], 0, b_x), SRC)
            if FMT == FMT_FP8:
                scale = tl.math.div_rn(amax, _FP8_MAX)
                scale = tl.where(scale == 0.0, 1.0, scale)
                v = divide(clean, scale, RECIP)
                if HW_FP8:  # the hardware's RNE, saturating convert (cvt.rn.satfinite.e4m3x2):
                    #         |v| past 448 gives 448, as the clamp below
                    q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
                else:  # the interpreter's cast rounds wrongly on exponent carries
                    q = fp8_encode(tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX))
            else:
                scale = tl.math.div_rn(amax, _INT8_MAX)
                scale = tl.where(scale == 0.0, 1.0, scale)
                # (a subnormal scale can leave |v| past 127: the clamp binds then)
                v = tl.minimum(tl.maximum(divide(clean, scale, RECIP), -_INT8_MAX), _INT8_MAX)
                q = rne_bits(v) & 0xFF
            tl.store(p_out, q.to(tl.uint8), mask=m)
            s_bits = tl.where(bad, _POISON, scale.to(tl.int32, bitcast=True))
            tl.store(scales + SC0 + o_scale, s_bits, mask=m_grp)


@triton.jit
def set_program(at, TILES: tl.constexpr, N, RCP):
    """(tile, block, item) of program `at` of one launch in a set kernel, whose programs are
    numbered tile-fastest as `launch_config`'s grid (tiles, N, items) would number them. The
    item is at // TILES // N: TILES is a constant (a multiply and a shift), N changes per plan,
    so j // N is taken in fp32 by the host's RN(1/N) (`RCP`): exact while j < 2**22 (the
    error of (j + 0.5) * RN(1/N) stays under 0.5 / N; `set_config` checks the bound)."""
    i_t = at % TILES
    j = at // TILES
    i_item = ((j.to(tl.float32) + 0.5) * RCP).to(tl.int32)  # (truncation: a floor, both >= 0)
    i_n = j - i_item * N
    return i_t, i_n.to(tl.int64), i_item.to(tl.int64)


@triton.jit
def payload_as(payload, PAY_W: tl.constexpr):
    """The uint8 `payload` pointer as the launch's payload elements (`batch.payload_dtype`)."""
    if PAY_W == 1:
        p = payload
    elif PAY_W == 2:
        p = payload.to(tl.pointer_type(tl.int16))
    elif PAY_W == 4:
        p = payload.to(tl.pointer_type(tl.int32))
    else:
        p = payload.to(tl.pointer_type(tl.int64))
    return p


#: The most launches a set kernel runs (`set_config`; a plan of more launches per signature):
#: Kimi-Linear's sets have 3 (conv, recurrent, latent), Qwen3-Next's 5 (its conv state is
#: three fields of two shapes, its SSM state, K and V). Its per-launch values are scalar
#: parameters of their own (triton specializes a tuple's integers, whatever
#: `do_not_specialize` says), this many of each.
SET_LAUNCHES = 8

#: The set kernels' per-launch parameters (`_pack_set_kernel`'s; the unpack's are the first
#: four) for launch k: `name_k`, never specialized.
SET_PARAMS = ("START", "N", "RCP", "TAB", "PAY", "SC")
_SET_UNSPECIALIZED = [f"{p}_{k}" for p in SET_PARAMS for k in range(SET_LAUNCHES)]


@triton.jit(do_not_specialize=_SET_UNSPECIALIZED)
def _pack_set_kernel(
    srcs,  # per launch: the integer alias of its first item's storage (`_pack_kernel`'s src)
    tab,  # int64: the set's whole staged table array (`batch.TableArray`)
    payload,  # uint8: the call's whole payload (16-byte aligned)
    scales,  # int32 bits of the call's whole fp32 scales
    # per launch k, what changes with the plan (`set_config`'s VARY), never specialized, so a
    # new block count compiles nothing: its first program, N, RN(1/N), its table's start in
    # `tab`, PAY0, SC0 (unused launches: anything)
    START_0, START_1, START_2, START_3, START_4, START_5, START_6, START_7,
    N_0, N_1, N_2, N_3, N_4, N_5, N_6, N_7,
    RCP_0, RCP_1, RCP_2, RCP_3, RCP_4, RCP_5, RCP_6, RCP_7,
    TAB_0, TAB_1, TAB_2, TAB_3, TAB_4, TAB_5, TAB_6, TAB_7,
    PAY_0, PAY_1, PAY_2, PAY_3, PAY_4, PAY_5, PAY_6, PAY_7,
    SC_0, SC_1, SC_2, SC_3, SC_4, SC_5, SC_6, SC_7,
    CFG: tl.constexpr,  # per launch, `set_config`'s constants: (TILES, GROUPS, GPR, S1, S2, T0,
    #                     T1, T2, TD, NUMEL, FMT, SRC, G, BLOCK_R, BLOCK_G, CONTIG, ALIGN, FLAT,
    #                     OUT_ALIGN, PAY_W)
    K: tl.constexpr,  # launches (at most SET_LAUNCHES)
    HW_FP8: tl.constexpr,
    RECIP: tl.constexpr,
):
    """Every launch of a `PackSet` plan in one: each program runs `pack_program` for the launch
    its id falls in (launches one after the other on the grid's one axis, largest first), so a
    call costs one Triton launch instead of one per signature. The bytes are `_pack_kernel`'s."""
    pid = tl.program_id(0)
    starts = (START_0, START_1, START_2, START_3, START_4, START_5, START_6, START_7)
    ns = (N_0, N_1, N_2, N_3, N_4, N_5, N_6, N_7)
    rcps = (RCP_0, RCP_1, RCP_2, RCP_3, RCP_4, RCP_5, RCP_6, RCP_7)
    tabs = (TAB_0, TAB_1, TAB_2, TAB_3, TAB_4, TAB_5, TAB_6, TAB_7)
    pays = (PAY_0, PAY_1, PAY_2, PAY_3, PAY_4, PAY_5, PAY_6, PAY_7)
    scs = (SC_0, SC_1, SC_2, SC_3, SC_4, SC_5, SC_6, SC_7)
    for k in tl.static_range(K):
        # (CFG[k][i] inline: a constexpr tuple unpacked into names is no longer constexpr)
        if in_launch(pid, starts, k, K):
            n = ns[k]
            i_t, i_n, i_item = set_program(pid - starts[k], CFG[k][0], n, rcps[k])
            pack_program(srcs[k], tab + tabs[k], payload_as(payload, CFG[k][19]), scales, i_t, i_n, i_item, pays[k],
                         scs[k], n, CFG[k][1], CFG[k][2], CFG[k][3], CFG[k][4], CFG[k][5], CFG[k][6], CFG[k][7],
                         CFG[k][8], CFG[k][9], 2 + n, CFG[k][10], CFG[k][11], CFG[k][12], CFG[k][13], CFG[k][14],
                         CFG[k][15], CFG[k][16], CFG[k][17], HW_FP8, CFG[k][18], RECIP)


@triton.jit
def in_launch(pid, starts, k: tl.constexpr, K: tl.constexpr):
    """Whether program `pid` of a set kernel is one of launch k's (launches lie one after the
    other from `starts[k]`; the last runs to the grid's end)."""
    if k + 1 < K:
        inside = (pid >= starts[k]) & (pid < starts[k + 1])
    else:
        inside = pid >= starts[k]
    return inside


def set_arguments(vary: Sequence[tuple]) -> dict:
    """A set kernel's per-launch parameters (`SET_PARAMS`, `name_k`) from `set_config`'s VARY
    (unused launches: zeros, and N 1)."""
    out = {}
    unused = (0, 0, 1, 1.0, 0, 0) + (0,) * (len(vary[0]) - 6)
    for k in range(SET_LAUNCHES):
        start, _, n, rcp, tab0, _, *extra = vary[k] if k < len(vary) else unused
        values = (start, n, rcp, tab0, *extra)
        out.update({f"{name}_{k}": v for name, v in zip(SET_PARAMS, values, strict=False)})
    return out


#: Whether plans made from now on divide by each row's reciprocal (`bits.quotient`, the
#: default) or once per value (the kernels before it: the same bytes, more instructions). Read
#: when a plan is made; `profile_kernels` makes a second set with it off to time both.
RECIPROCAL = True

#: Whether `PackSet` and `UnpackSet` plans made from now on launch once per call (the set
#: kernels, `_pack_set_kernel` / `triton_unpack._unpack_set_kernel`: the default) or once per
#: signature (`_pack_kernel`, the same bytes; for profile_kernels' A/B). Read when a plan is made.
FUSED = True

#: The most (item, block) pairs one launch of a set kernel may have: `set_program` finds a
#: pair's item by an fp32 product, exact below 2**22 (twice this).
SET_PAIRS_LIMIT = 1 << 21


def set_config(parts: Sequence[tuple]) -> tuple[tuple[int], list[tuple], list[tuple], int] | None:
    """(grid, VARY, CFG, num_warps) of a set kernel running the launches `parts` one after the
    other, or None when it cannot (more than `SET_LAUNCHES` launches, a launch past
    `SET_PAIRS_LIMIT`, or 2**31 programs in all).

    Each part: (its field cut, its `Launcher`'s grid and fixed arguments, the payload's element
    width, its table's start and row width in the staged array, the source/target alignment
    claim, the payload alignment claim, what else the kernel's VARY takes (the pack: PAY0,
    SC0)). The warps are the most any part's own launch asks for, and each part's tile is
    re-cut to `batch.ELEMENTS_PER_THREAD` values a thread at that many warps (`set_tile_rows`):
    a smaller tile would give its threads fewer values (the H100 sweep: 8 values a thread
    ~19% slower than 16 for the recurrent state's int8 pack, a 4x larger tile ~10%). A part's
    programs are numbered tile-fastest, as its own grid."""
    if len(parts) > SET_LAUNCHES:
        return None
    warps = max(fixed["num_warps"] for _, _, fixed, *_ in parts)
    vary: list[tuple] = []
    cfg: list[tuple] = []
    start = 0
    for cut, (_, n, count), fixed, width, tab0, tab_w, align, io_align, extra in parts:
        if n * count > SET_PAIRS_LIMIT:
            return None
        rows = set_tile_rows(cut, warps)
        tiles = triton.cdiv(cut.groups, rows)
        end = start + tiles * n * count
        rcp = float(np.float32(1.0) / np.float32(n))  # RN(1/n): IEEE fp32 division
        vary.append((start, end, n, rcp, tab0, tab_w, *extra))
        cfg.append((tiles, fixed["GROUPS"], fixed["GPR"], fixed["S1"], fixed["S2"], fixed["T0"], fixed["T1"],
                    fixed["T2"], fixed["TD"], fixed["NUMEL"], fixed["FMT"], fixed.get("SRC", fixed.get("DST")),
                    fixed["G"], rows, fixed["BLOCK_G"], fixed["CONTIG"], align, fixed["FLAT"], io_align, width))
        start = end
    if start >= 2**31:
        return None
    return (start,), vary, cfg, warps


def set_launcher(ordered: Sequence, tables: batch.TableArray, head: int, io_aligns: Sequence[int],
                 extras: Sequence[tuple], fixed: dict, device: torch.device) -> Launcher | None:
    """The `Launcher` of the set kernel that runs a set plan's launches `ordered` (`_Launch`es of
    the pack or the unpack, in issue order; each with `head` fixed columns a table row, its
    payload alignment claim and its extra VARY values), with the kernel's other arguments
    `fixed` (the anchors, ...); or None: `FUSED` off, a single launch, or `set_config` unable.
    Given a launcher, `tables` is staged as one table from now on."""
    if not FUSED or len(ordered) < 2:
        return None
    parts = []
    for launch, (tab0, _), io_align, extra in zip(ordered, tables.segments, io_aligns, extras, strict=True):
        own = launch.launcher.fixed
        parts.append((launch.cut, launch.grid, own, batch.payload_dtype(launch.cut).itemsize, tab0, head + launch.n,
                      own["ALIGN"], io_align, extra))
    config = set_config(parts)
    if config is None:
        return None
    tables.whole = True  # staged as one table: the set kernel's
    grid, vary, cfg, warps = config
    return Launcher(grid, dict(fixed, **set_arguments(vary), CFG=tuple(cfg), K=len(cfg),
                               HW_FP8=batch.hardware_fp8(device), num_warps=warps, enable_fp_fusion=False))


def set_tile_rows(cut: batch.FieldCut, warps: int) -> int:
    """BLOCK_R of a part of a set kernel of `warps` warps: `batch.ELEMENTS_PER_THREAD` values a
    thread, as few rows as the field has groups (as `batch.tile_rows`)."""
    return batch.tile_rows(cut, block_g(cut), warps * 32 * batch.ELEMENTS_PER_THREAD)


def block_g(cut: batch.FieldCut) -> int:
    """BLOCK_G: the power-of-two tile width covering one group."""
    out = triton.next_power_of_2(cut.g)
    if out > 16384:
        raise ValueError(
            f"group of {cut.g} elements is too wide for one tile (at most 16384); pass a "
            "group size that divides the last axis, e.g. 128"
        )
    return out


@functools.lru_cache(maxsize=4096)
def launch_config(cut: batch.FieldCut, count: int, n: int) -> tuple[tuple[int, int, int], dict]:
    """(grid, keyword arguments) that the pack and unpack kernels share for `count` items of
    `n` blocks each: the field cut, the format, the tile sizes, the launch options. The grid is
    (tiles of a block, block, item): a program reads its block and item from its ids, with no
    division (a GPU has no integer divider: `pid // N` cost ~35 instructions a thread).
    Cached (the caller must not change the dict): a connector launches the same shapes every
    step."""
    bg = block_g(cut)
    br = batch.tile_rows(cut, bg)
    grid = (triton.cdiv(cut.groups, br), n, count)
    batch.grid_check(grid[0], n, count)
    return grid, dict(
        N=n,
        GROUPS=cut.groups,
        GPR=cut.gpr,
        S1=cut.sizes[1],
        S2=cut.sizes[2],
        T0=cut.strides[0],
        T1=cut.strides[1],
        T2=cut.strides[2],
        TD=cut.td,
        NUMEL=cut.numel,
        FMT=batch.FMT_CODE[cut.fmt],
        G=cut.g,
        BLOCK_R=br,
        BLOCK_G=bg,
        CONTIG=cut.td == 1,
        FLAT=cut.flat,
        num_warps=batch.num_warps(br * bg),
        enable_fp_fusion=False,  # a rounded product, then a rounded sum: as the reference
    )


class _Launch:
    """One launch of a plan: items `members` (same signature), their static table columns
    (field origin and block stride, in elements of `src`) and where their outputs go in the
    call's payload and scales allocations."""

    __slots__ = ("members", "static", "cut", "n", "src", "align", "grid", "pay_at",
                 "per_payload", "sc_at", "per_groups", "runs", "launcher")

    def __init__(self, items: Sequence[PackItem | PackTarget], members: list[int], n: int, pay_at: int,
                 sc_at: int) -> None:
        first = items[members[0]]
        cut = batch.field_cut(first.field, first.spec)
        self.members, self.cut, self.n = members, cut, n
        self.pay_at, self.per_payload = pay_at, n * cut.payload_per_block
        self.sc_at, self.per_groups = sc_at, n * cut.groups
        self.runs = n > 0 and cut.numel > 0
        self.static: list[tuple[int, int]] = []
        self.src = self.grid = None
        self.align = 1
        self.launcher: Launcher | None = None  # the kernel, grid and fixed arguments (when it runs)
        if not self.runs:
            return
        self.src, self.static, self.align = batch.region_columns(items, members, cut)
        self.grid, common = launch_config(cut, len(members), n)
        # the outputs are the call's whole allocations (16-byte aligned): this launch's part
        # starts at pay_at (16-byte aligned by `batch.batch_layout`, so whole elements) and sc_at
        width = batch.payload_dtype(cut).itemsize
        pay0 = pay_at // width
        self.launcher = Launcher(self.grid, dict(
            common, src=self.src, TAB_W=2 + n, SRC=batch.FLOAT_KIND.get(cut.dtype, 0), ALIGN=self.align,
            HW_FP8=batch.hardware_fp8(first.buffer.device), PAY0=pay0, SC0=sc_at,
            OUT_ALIGN=batch.payload_alignment(cut, 0, [pay0], width), RECIP=RECIPROCAL))

    @property
    def payload_bytes(self) -> int:
        return len(self.members) * self.per_payload

    @property
    def scale_values(self) -> int:
        return len(self.members) * self.per_groups * self.cut.columns


def largest_first(launches: Sequence) -> list[int]:
    """Indices of `launches` by the bytes they read, most first. A Triton launch costs the host
    ~28 us (H100, stop 19), about what the smaller fields of a Kimi-Linear request take on the
    GPU: issued after the largest (the MLA latent, ~60 us of GPU time), the other launches are
    made while it runs, instead of the GPU idling between small kernels."""
    def moved(k: int) -> int:  # bytes of the field the launch reads (pack) or writes (unpack)
        launch = launches[k]
        return len(launch.members) * launch.n * launch.cut.numel * launch.cut.itemsize

    return sorted(range(len(launches)), key=lambda k: -moved(k))


def _merged(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """(start, length) ranges in order, each run of adjacent ones as one."""
    out: list[tuple[int, int]] = []
    for start, n in ranges:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((start, n))
    return tuple(out)


class _Plan:
    """Everything about packing one list of items that does not depend on the block ids: the
    launches (items grouped by signature), their static table columns, alignment claims, launch
    configurations and where each item's outputs lie (`spans`). Built once per distinct item
    list (`_plan_for`, or once per block count by a `kernels.PackSet`); a call then only
    allocates the outputs, stages the tables and launches (`launch`). A `PackSet`'s plan
    (`slots` given: the slot each item reads its ids from) keeps its tables laid out in one
    array (`batch.TableArray`): a call writes the ids there."""

    def __init__(self, items: Sequence[PackItem | PackTarget], lens: Sequence[int],
                 slots: Sequence[int] | None = None) -> None:
        self.device = items[0].buffer.device
        self.count = len(items)
        layout = batch.batch_layout(items, lens)
        self.launches: list[_Launch] = [_Launch(items, list(members), lens[members[0]], pay, sc)
                                        for members, (pay, sc) in zip(layout.groups, layout.starts, strict=True)]
        self.payload_bytes, self.scale_values = layout.payload_bytes, layout.scale_values
        self.scale_runs = layout.scale_runs
        self.spans: tuple[Span, ...] = layout.spans
        #: the order the launches are issued in (`largest_first`); the outputs' layout keeps
        #: the items' order
        self.order = [k for k in largest_first(self.launches) if self.launches[k].runs]
        ordered = [self.launches[k] for k in self.order]
        self.tables = None if slots is None else batch.TableArray(
            [(launch.static, launch.members, launch.n) for launch in ordered], slots)
        own = [launch.launcher.fixed for launch in ordered if launch.launcher is not None]  # (every one runs)
        #: the set kernel's call: its one allocation's bytes and where its scales start
        self.whole_bytes = batch.scales_start(self.payload_bytes) + 4 * self.scale_values
        self.scales_at = batch.scales_start(self.payload_bytes)
        self._chunks: dict[int, list] = {}  # `chunk_launchers`, by chunk count
        #: the set kernel's launcher (`FUSED`, a set's plan of several launches), else None
        self.fused: Launcher | None = None if self.tables is None else set_launcher(
            ordered, self.tables, 2, [f["OUT_ALIGN"] for f in own], [(f["PAY0"], f["SC0"]) for f in own],
            {"srcs": tuple(launch.src for launch in ordered), "RECIP": RECIPROCAL}, self.device)

    def launch(self, ids: Sequence[Sequence[int]], *, one: bool | None = None) -> tuple[
            torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Pack the items' blocks `ids` (checked by the caller): the call's one allocation (on a
        GPU, or with `one`; else None) and its payload (uint8) and scales (fp32)
        (`batch.batch_tensors`), each item's part where `spans` says (the launches take the
        whole tensors and their parts' offsets: no per-call slicing); a set kernel's call on a
        GPU returns the allocation alone (`_launch_set`)."""
        if self.fused is not None and self.device.type == "cuda":
            return self._launch_set(ids)
        whole, payload, scales = batch.batch_tensors(self.payload_bytes, self.scale_values, self.device, one=one)
        scale_bits = scales.view(torch.int32)
        # (asked before the tables are staged: a staged slot is released only in the `finally`)
        site = launch_site() if self.device.type == "cuda" else None  # (once for the launches)
        if self.tables is not None:
            self.tables.write(ids)
            tables = self.tables.stage(self.device, site)
        else:
            rows_of = []
            for k in self.order:
                rows: list[int] = []
                launch = self.launches[k]
                for m, (origin, stride) in zip(launch.members, launch.static, strict=True):
                    rows += (origin, stride, *ids[m])
                rows_of.append((self.device, rows))
            tables = batch.stage_tables(rows_of)
        views: dict[torch.dtype, torch.Tensor] = {}
        try:
            if self.fused is not None:  # one launch: the staged array is one table
                self.fused(_pack_set_kernel, _at=site, tab=tables[0], payload=payload, scales=scale_bits)
                return whole, payload, scales
            for k, table in zip(self.order, tables, strict=True):
                launch = self.launches[k]
                dtype = batch.payload_dtype(launch.cut)
                pay = views.get(dtype)
                if pay is None:
                    pay = views[dtype] = payload.view(dtype)
                assert launch.launcher is not None  # (made for every launch that runs)
                launch.launcher(_pack_kernel, _at=site, tab=table, payload=pay, scales=scale_bits)
        finally:  # (after whatever was issued: the tables' buffers are free once it has run)
            if self.tables is not None:
                self.tables.release(site)
        return whole, payload, scales

    def _launch_set(self, ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, None, None]:
        """`launch` of a set kernel's plan on a GPU: (the call's one allocation, None, None),
        the payload and scales views left to the caller (`PackSet.pack`'s batch makes them when
        first read: each costs the host ~3 us on an H200's, and a save that copies the whole
        allocation to the host reads neither). Once the JIT has launched the kernel, a call
        passes addresses only (`Launcher.by_address`): the allocation's, its scales' (at
        `scales_start`) and the staged table's."""
        fused, tables = self.fused, self.tables
        assert fused is not None and tables is not None  # (the caller's test; a set kernel's plan has tables)
        whole = torch.empty(self.whole_bytes, dtype=torch.uint8, device=self.device)
        site = launch_site()  # (before the stage: a staged slot is released only in the `finally`)
        tables.write(ids)
        table = tables.stage(self.device, site)[0]
        try:
            base = whole.data_ptr()

            def tensors() -> dict[str, torch.Tensor]:
                payload, scales = batch.batch_views(whole, self.payload_bytes, self.scale_values)
                return {"tab": table, "payload": payload, "scales": scales.view(torch.int32)}

            fused.by_address(_pack_set_kernel, site, tensors, tab=table.data_ptr(), payload=base,
                             scales=base + self.scales_at)
        finally:  # (after whatever was issued: the tables' buffers are free once it has run)
            tables.release(site)
        return whole, None, None

    def chunk_launchers(self, chunks: int) -> list[tuple[Launcher, tuple[tuple[int, int], ...]]]:
        """The set kernel's call cut into at most `chunks` launches, in program order, at item
        boundaries, of about equal output bytes: per launch, its `Launcher` and the byte ranges
        of the call's allocation (`whole`: payload, then scales at `scales_at`) its programs
        write, adjacent ranges merged. No kernel change: a launch over programs [p0, p1) is the
        set kernel on a grid of p1 - p0 with every launch's START shifted down by p0 (its
        STARTs are unspecialized values, so every chunk runs the one compiled kernel), and the
        programs of an item write its part and nothing else. Cached per `chunks`."""
        fused = self.fused
        assert fused is not None  # (a set kernel's plan)
        made = self._chunks.get(chunks)
        if made is not None:
            return made
        cfg = fused.fixed["CFG"]
        units = []  # per item in program order: (its programs' end, its payload range, its scale range)
        for k, launch in enumerate(self.launches[j] for j in self.order):
            start, per_item = fused.fixed[f"START_{k}"], cfg[k][0] * launch.n
            per_sc = launch.per_groups * launch.cut.columns
            for i in range(len(launch.members)):
                units.append((start + (i + 1) * per_item, (launch.pay_at + i * launch.per_payload, launch.per_payload),
                              (self.scales_at + 4 * (launch.sc_at + i * per_sc), 4 * per_sc)))
        total = sum(pay[1] + sc[1] for _, pay, sc in units)
        made, p0, done = [], 0, 0
        pays: list[tuple[int, int]] = []
        scs: list[tuple[int, int]] = []
        for u, (end, pay, sc) in enumerate(units):
            pays += [pay] if pay[1] else []
            scs += [sc] if sc[1] else []
            done += pay[1] + sc[1]
            if u + 1 < len(units) and done * chunks < total * (len(made) + 1):
                continue  # (cut once this chunk holds its share of the bytes, or at the end)
            starts = {f"START_{k}": fused.fixed[f"START_{k}"] - p0 for k in range(len(cfg))}
            made.append((Launcher((end - p0,), dict(fused.fixed, **starts)), _merged(pays) + _merged(scs)))
            p0, pays, scs = end, [], []
        assert p0 == fused.grid[0], (p0, fused.grid)  # the chunks' programs are the call's
        self._chunks[chunks] = made
        return made

    def launch_chunks(self, ids: Sequence[Sequence[int]], chunks: int,
                      on_chunk: Callable[[torch.Tensor, tuple[tuple[int, int], ...]], None]) -> torch.Tensor:
        """`launch` as `chunk_launchers(chunks)`' launches, `on_chunk(whole, ranges)` called
        after each is issued (its ranges' bytes are final once what is issued has run: a caller
        copies them to the host on another stream while the next chunks pack). Returns the
        call's one allocation (laid out as `batch.batch_tensors` lays it, on a CPU too)."""
        whole, payload, scales = batch.batch_tensors(self.payload_bytes, self.scale_values, self.device, one=True)
        tables = self.tables
        assert tables is not None and whole is not None  # (a set kernel's plan; one allocation asked for)
        site = launch_site() if self.device.type == "cuda" else None
        tables.write(ids)
        table = tables.stage(self.device, site)[0]
        try:
            scale_bits = scales.view(torch.int32)
            for launcher, ranges in self.chunk_launchers(chunks):
                launcher(_pack_set_kernel, _at=site, tab=table, payload=payload, scales=scale_bits)
                on_chunk(whole, ranges)
        finally:
            tables.release(site)
        return whole

    def run(self, ids: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`launch`, then one (payload, scales) view per item, in item order."""
        _, payload, scales = self.launch(ids)
        assert payload is not None and scales is not None  # (an item list's plan: no set kernel)
        out: list = [None] * self.count
        for launch in self.launches:
            pay = payload.narrow(0, launch.pay_at, launch.payload_bytes)
            sc = scales.narrow(0, launch.sc_at, launch.scale_values)
            cut, count = launch.cut, len(launch.members)
            # one view per item; `unbind` makes them in one call (`split` costs ~1.5 us a view)
            pays = pay.view(count, -1).unbind(0) if launch.per_payload else [pay] * count
            if cut.columns:
                sc = sc.view(-1, cut.columns)
                scs = (sc.view(count, -1, cut.columns).unbind(0) if launch.per_groups
                       else [sc] * count)
            else:
                scs = [scales.new_empty(0, 0)] * count
            for m, p, s in zip(launch.members, pays, scs, strict=True):
                out[m] = (p, s)
        return out


#: Plans of the most recent item lists (see `batch.PlanCache`).
PLAN_CACHE_SIZE = 8
_plans: batch.PlanCache[_Plan] = batch.PlanCache(
    PLAN_CACHE_SIZE, lambda items, ids: _Plan(items, [len(i) for i in ids]))


def _plan_for(items: Sequence[PackItem], ids: list[tuple[int, ...]]) -> _Plan:
    """The cached plan of `items` (keyed by what a plan depends on: each item's device, region
    address, field, format, group and number of ids)."""
    return _plans.get(items, ids)


def pack_many(items: Sequence[PackItem]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`pack` for many (region, field, blocks, codec) items in as few launches as possible.

    Items with the same device, field dtype, shape and strides, format, group and number of
    block ids share one launch; regions, field offsets and block strides may all differ. Returns
    one (payload, scales) per item, in order, equal to `reference.pack(item)`; the payloads
    of one call are slices of one allocation, and so are the scales (one copy each moves them
    to the host). The item tables of all launches cross to the device in one asynchronous copy
    from page-locked memory: no host synchronization. What does not depend on the block ids is
    planned once per item list and reused (`_plan_for`).
    """
    items = list(items)
    if not items:
        return []
    ids = batch.check_all_ids(items)
    device = items[0].buffer.get_device()  # (an int: cheaper than a device object per item)
    if all(it.buffer.get_device() == device for it in items):
        return _plan_for(items, ids).run(ids)
    out: list = [None] * len(items)  # several devices: one plan each
    for members in batch.group_items([(it.buffer.get_device(),) for it in items]):
        sub_ids = [ids[i] for i in members]
        for i, result in zip(members, _plan_for([items[i] for i in members], sub_ids).run(sub_ids), strict=True):
            out[i] = result
    return out
