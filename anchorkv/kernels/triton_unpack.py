"""Triton unpack: fused dequantize + strided scatter into a request's blocks, in Triton.

Axis letters as in `anchorkv.kernels.triton_pack`. The bytes written equal those of
`anchorkv.kernels.reference.unpack`, and no byte of the region outside the selected blocks'
field changes (every store is masked to the field's own elements).

Ladder: `_unpack_kernel` (one program = BLOCK_R groups of one block of one item) ->
`_Launch` (one batch of same-signature items, planned once per item list; per call it
validates the payloads and builds the item table) ->
`unpack_many` (the public function; `kernels.unpack` is one item of it). A
`kernels.UnpackSet` plans its fixed targets once per tuple of slot lengths (`_SetPlan`): its
calls skip the per-item checks, the batch being checked as two tensors against the plan's
layout, and a plan of several launches runs them in one launch of `_unpack_set_kernel`
(`triton_pack.FUSED`). Both kernels run `unpack_program` per program.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from anchorkv.kernels import batch
from anchorkv.kernels.bits import FMT_BF16, FMT_FP8, FMT_INT4, FMT_RAW, fp8_decode, narrow, widen
from anchorkv.kernels.items import UnpackItem
from anchorkv.kernels.launch import Launcher, launch_site
from anchorkv.kernels.triton_pack import (
    PLAN_CACHE_SIZE,
    SET_LAUNCHES,
    SET_PARAMS,
    field_tile,
    in_launch,
    largest_first,
    launch_config,
    payload_as,
    set_launcher,
    set_program,
)


@triton.jit(do_not_specialize=["N", "TAB_W"])
def _unpack_kernel(
    dst,  # integer alias of the first item's region storage (anchor of target offsets)
    tab,  # int64 [items, 4 + N]: field origin, block stride (elements of dst), payload offset
    #       (elements of payload), scales offset (int32 elements of scales), N block ids
    payload,  # first item's payload storage as uint8 (raw: source-width ints; bf16: int16)
    scales,  # int32 alias of the first item's scales storage
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
    DST: tl.constexpr,  # bits.BF16, FP16 or FP32 (unused for raw)
    G: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_G: tl.constexpr,  # next power of two of G
    CONTIG: tl.constexpr,  # the last axis is contiguous (TD == 1)
    ALIGN: tl.constexpr,  # host-checked: every target row start is a multiple of ALIGN elements
    IN_ALIGN: tl.constexpr,  # host-checked: every payload group start is a multiple of IN_ALIGN
    FLAT: tl.constexpr,  # host-checked: group k of a block starts at its element k * G
    HW_FP8: tl.constexpr,  # the GPU's own converts (sm_89+): fp8 decode and bf16 rounding
):
    unpack_program(dst, tab, payload, scales, tl.program_id(0), tl.program_id(1).to(tl.int64),
                   tl.program_id(2).to(tl.int64), N, GROUPS, GPR, S1, S2, T0, T1, T2, TD, NUMEL, TAB_W, FMT, DST, G,
                   BLOCK_R, BLOCK_G, CONTIG, ALIGN, IN_ALIGN, FLAT, HW_FP8)


@triton.jit
def unpack_program(dst, tab, payload, scales, i_t, i_n, i_item, N, GROUPS, GPR, S1, S2, T0, T1, T2, TD, NUMEL,
                   TAB_W, FMT: tl.constexpr, DST: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_G: tl.constexpr, CONTIG: tl.constexpr, ALIGN: tl.constexpr, IN_ALIGN: tl.constexpr,
                   FLAT: tl.constexpr, HW_FP8: tl.constexpr):
    """One program of an unpack: tile `i_t` of block `i_n` (int64) of item `i_item` (int64) of
    a launch whose item table starts at `tab` (`_unpack_kernel`: the grid's ids;
    `_unpack_set_kernel`: one of its launches, ids from its flat program id)."""
    p_tab = tab + i_item * TAB_W
    b_base = tl.load(p_tab)
    b_bstride = tl.load(p_tab + 1)
    b_pay = tl.load(p_tab + 2)
    b_sc = tl.load(p_tab + 3)
    b_bid = tl.load(p_tab + 4 + i_n)

    o_grp, m_grp, p_dst, m = field_tile(dst, b_base + b_bid * b_bstride, i_t, GROUPS, GPR, S1,
                                        S2, T0, T1, T2, TD, G, BLOCK_R, BLOCK_G, CONTIG, ALIGN, FLAT)
    o_col = tl.arange(0, BLOCK_G).to(tl.int64)
    o_in = i_n * NUMEL + o_grp * G  # first element of each group in the item's [N, *F] order
    o_scale = i_n * GROUPS + o_grp

    if FMT == FMT_INT4:
        o_half = tl.arange(0, BLOCK_G // 2).to(tl.int64)
        m_half = m_grp[:, None] & (o_half < G // 2)[None, :]
        o_in = tl.multiple_of(b_pay + o_in // 2, IN_ALIGN)  # two codes a byte
        b_q = tl.load(payload + o_in[:, None] + o_half[None, :], mask=m_half, other=0).to(tl.int32)
        scale = tl.load(scales + b_sc + 2 * o_scale, mask=m_grp, other=0).to(tl.float32, bitcast=True)
        lo = tl.load(scales + b_sc + 2 * o_scale + 1, mask=m_grp, other=0).to(tl.float32, bitcast=True)
        # a rounded product, then a rounded sum: the launch disables fp fusion (no FMA)
        y_even = (b_q & 0xF).to(tl.float32) * scale[:, None]
        y_even = y_even + lo[:, None]
        y_odd = ((b_q >> 4) & 0xF).to(tl.float32) * scale[:, None]
        y_odd = y_odd + lo[:, None]
        # interleave back into element order: one contiguous store per group
        y = tl.reshape(tl.join(narrow(y_even, DST, HW_FP8), narrow(y_odd, DST, HW_FP8)), (BLOCK_R, BLOCK_G))
        tl.store(p_dst, y, mask=m)
    else:
        o_in = tl.multiple_of(b_pay + o_in, IN_ALIGN)
        b_q = tl.load(payload + o_in[:, None] + o_col[None, :], mask=m, other=0)
        if FMT == FMT_RAW:
            tl.store(p_dst, b_q, mask=m)
        elif FMT == FMT_BF16:  # bf16 bits -> exact fp32 -> the field's dtype, rounded once
            tl.store(p_dst, narrow(widen(b_q, 0), DST, HW_FP8), mask=m)
        else:
            scale = tl.load(scales + b_sc + o_scale, mask=m_grp, other=0).to(tl.float32, bitcast=True)
            if FMT == FMT_FP8:
                if HW_FP8:  # cvt.rn.f16x2.e4m3x2: exact (every e4m3 value is an fp16); NaN
                    #         codes stay NaN, written canonical by `narrow` as in software
                    v = b_q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                else:
                    v = fp8_decode(b_q.to(tl.int32) & 0xFF)
            else:
                v = b_q.to(tl.int8, bitcast=True).to(tl.float32)
            tl.store(p_dst, narrow(v * scale[:, None], DST, HW_FP8), mask=m)


@triton.jit(do_not_specialize=[f"{p}_{k}" for p in SET_PARAMS[:4] for k in range(SET_LAUNCHES)])
def _unpack_set_kernel(
    dsts,  # per launch: the integer alias of its first target's storage (`_unpack_kernel`'s dst)
    tab,  # int64: the set's whole staged table array (`batch.TableArray`)
    payload,  # uint8: the batch's whole payload (16-byte aligned)
    scales,  # int32 bits of the batch's whole fp32 scales
    # per launch k, what changes with the plan, never specialized (`triton_pack._pack_set_kernel`):
    # its first program, N, RN(1/N), its table's start in `tab`
    START_0, START_1, START_2, START_3, START_4, START_5, START_6, START_7,
    N_0, N_1, N_2, N_3, N_4, N_5, N_6, N_7,
    RCP_0, RCP_1, RCP_2, RCP_3, RCP_4, RCP_5, RCP_6, RCP_7,
    TAB_0, TAB_1, TAB_2, TAB_3, TAB_4, TAB_5, TAB_6, TAB_7,
    CFG: tl.constexpr,  # per launch, `triton_pack.set_config`'s constants (IO_ALIGN: IN_ALIGN)
    K: tl.constexpr,  # launches (at most `triton_pack.SET_LAUNCHES`)
    HW_FP8: tl.constexpr,
):
    """Every launch of an `UnpackSet` plan in one (as `triton_pack._pack_set_kernel`): one
    Triton launch a call. The bytes are `_unpack_kernel`'s."""
    pid = tl.program_id(0)
    starts = (START_0, START_1, START_2, START_3, START_4, START_5, START_6, START_7)
    ns = (N_0, N_1, N_2, N_3, N_4, N_5, N_6, N_7)
    rcps = (RCP_0, RCP_1, RCP_2, RCP_3, RCP_4, RCP_5, RCP_6, RCP_7)
    tabs = (TAB_0, TAB_1, TAB_2, TAB_3, TAB_4, TAB_5, TAB_6, TAB_7)
    for k in tl.static_range(K):
        # (CFG[k][i] inline: a constexpr tuple unpacked into names is no longer constexpr)
        if in_launch(pid, starts, k, K):
            n = ns[k]
            i_t, i_n, i_item = set_program(pid - starts[k], CFG[k][0], n, rcps[k])
            unpack_program(dsts[k], tab + tabs[k], payload_as(payload, CFG[k][19]), scales, i_t, i_n, i_item, n,
                           CFG[k][1], CFG[k][2], CFG[k][3], CFG[k][4], CFG[k][5], CFG[k][6], CFG[k][7], CFG[k][8],
                           CFG[k][9], 4 + n, CFG[k][10], CFG[k][11], CFG[k][12], CFG[k][13], CFG[k][14], CFG[k][15],
                           CFG[k][16], CFG[k][18], CFG[k][17], HW_FP8)


def _check(item: UnpackItem, cut: batch.FieldCut, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The item's payload and scales, validated, contiguous and aligned for the kernel."""
    payload, scales = item.payload, item.scales
    want_bytes = n * cut.payload_per_block
    if (payload.dtype != torch.uint8 or payload.numel() != want_bytes
            or not batch.same_device(payload, item.buffer)):
        raise ValueError(
            f"payload must be {want_bytes} uint8 bytes on {item.buffer.device} for {n} blocks of "
            f"{cut.fmt} {list(item.field.shape)} {cut.dtype}, found {payload.numel()} "
            f"{payload.dtype} on {payload.device}"
        )
    if cut.columns:
        want = (n * cut.groups, cut.columns)
        if (scales.dtype != torch.float32 or tuple(scales.shape) != want
                or not batch.same_device(scales, item.buffer)):
            raise ValueError(
                f"scales must be float32 {list(want)} on {item.buffer.device}, found {scales.dtype} "
                f"{list(scales.shape)} on {scales.device}"
            )
    if payload.dim() != 1 or not payload.is_contiguous():
        payload = payload.contiguous().reshape(-1)
    if payload.data_ptr() % batch.payload_dtype(cut).itemsize:
        payload = payload.clone()  # a fresh allocation is aligned for the wide loads
    return payload, scales.contiguous()


class _Launch:
    """What one launch of same-signature items needs that does not depend on the payloads or
    the block ids: the target anchor, each member's field origin and block stride (elements of
    the anchor), the target alignment claim and the launch configuration."""

    __slots__ = ("members", "cut", "n", "dst", "static", "align", "grid", "runs", "launcher")

    def __init__(self, items: Sequence[UnpackItem], members: list[int], n: int) -> None:
        first = items[members[0]]
        self.members, self.n = members, n
        self.cut = cut = batch.field_cut(first.field, first.spec)
        self.runs = n > 0 and cut.numel > 0
        self.static: list[tuple[int, int]] = []
        self.dst = self.grid = None
        self.align = 1
        self.launcher: Launcher | None = None  # the kernel, grid and fixed arguments (when it runs)
        if not self.runs:
            return
        self.dst, self.static, self.align = batch.region_columns(items, members, cut)
        self.grid, common = launch_config(cut, len(members), n)
        self.launcher = Launcher(self.grid, dict(common, dst=self.dst, TAB_W=4 + n,
                                                 DST=batch.FLOAT_KIND.get(cut.dtype, 0), ALIGN=self.align,
                                                 HW_FP8=batch.hardware_fp8(first.buffer.device)))

    def rows(self, items: Sequence[UnpackItem], ids: list[tuple[int, ...]]):
        """Validate the members' payloads; (table rows, launch) of this call, or None when
        there is nothing to move."""
        cut = self.cut
        checked = [_check(items[m], cut, self.n) for m in self.members]
        if not self.runs:
            return None
        device = items[self.members[0]].buffer.device
        pay = batch.anchor(checked[0][0], batch.payload_dtype(cut))
        if cut.columns:
            sc = batch.anchor(checked[0][1], torch.int32)
        else:  # raw has no scales; the kernel never reads this
            sc = torch.zeros(1, dtype=torch.int32, device=device)
        rows: list[int] = []
        pay_offsets = []
        pay_at, pay_size = pay.untyped_storage().data_ptr(), pay.element_size()
        sc_at, sc_size = sc.untyped_storage().data_ptr(), sc.element_size()
        for m, (origin, stride), (payload, scales) in zip(self.members, self.static, checked, strict=True):
            pay_off = batch.offset_in(payload.data_ptr(), pay_at, pay_size, "payload")
            sc_off = batch.offset_in(scales.data_ptr(), sc_at, sc_size, "scales") if cut.columns else 0
            rows += (origin, stride, pay_off, sc_off, *ids[m])
            pay_offsets.append(pay_off)
        in_align = batch.payload_alignment(cut, pay.data_ptr(), pay_offsets, pay.element_size())

        launcher = self.launcher
        assert launcher is not None

        def go(table: torch.Tensor) -> None:
            launcher(_unpack_kernel, tab=table, payload=pay, scales=sc, IN_ALIGN=in_align)

        return rows, go


class _SetPlan:
    """An `UnpackSet`'s plan for one tuple of slot lengths: the launches (targets grouped by
    signature, as `batch.batch_layout` lays out their parts), their alignment claims, and all
    their item tables as one host array laid out once: each launch's rows hold its members'
    field origin, block stride and payload and scales offsets from the start of the batch's
    tensors, then the block ids, which are all a call writes (one numpy assignment per launch
    and slot). A call then stages that array in one copy and launches with the batch's whole
    tensors: no per-part or per-launch slicing."""

    def __init__(self, targets: Sequence, lens: Sequence[int], slots: Sequence[int]) -> None:
        self.device = targets[0].buffer.device
        self.layout = layout = batch.batch_layout(targets, lens)
        planned = []
        for members, (pay_at, sc_at) in zip(layout.groups, layout.starts, strict=True):
            launch = _Launch(targets, list(members), lens[members[0]])
            if not launch.runs:
                continue
            cut, n = launch.cut, launch.n
            width = batch.payload_dtype(cut).itemsize  # pay_at is 16-byte aligned: whole elements
            per_payload, per_scales = n * cut.payload_per_block // width, n * cut.groups * cut.columns
            head = [(origin, stride, pay_at // width + k * per_payload, sc_at + k * per_scales)
                    for k, (origin, stride) in enumerate(launch.static)]
            # the claim from a 16-byte aligned batch (`UnpackSet` checks that it is)
            planned.append((launch, head, batch.payload_alignment(cut, 0, [h[2] for h in head], width)))
        planned = [planned[k] for k in largest_first([entry[0] for entry in planned])]
        self.tables = batch.TableArray([(head, launch.members, launch.n) for launch, head, _ in planned], slots)
        self.launches = [(launch, align) for launch, _, align in planned]
        #: the set kernel's launcher (`triton_pack.FUSED`, a plan of several launches), else None
        self.fused: Launcher | None = set_launcher(
            [launch for launch, _, _ in planned], self.tables, 4, [align for _, _, align in planned],
            [()] * len(planned), {"dsts": tuple(launch.dst for launch, _, _ in planned)}, self.device)
        #: the scales argument when the batch has none (never read)
        self.no_scales = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.seen: tuple | None = None  # spans found equal to the layout's (`UnpackSet.unpack`)

    def launch(self, packed, ids: Sequence[Sequence[int]]) -> None:
        """Decode `packed` (checked by the caller against `layout`, 16-byte aligned) into the
        targets' blocks `ids`."""
        site = launch_site() if self.device.type == "cuda" else None  # (once for the launches)
        self.tables.write(ids)
        tables = self.tables.stage(self.device, site)  # (released in the `finally`: nothing may raise between)
        payloads: dict[torch.dtype, torch.Tensor] = {}
        try:
            if self.fused is not None:  # one launch: the staged array is one table
                self._launch_set(packed, tables[0], site)
                return
            scales = packed.scales.view(torch.int32) if packed.scales.numel() else self.no_scales
            for (launch, align), table in zip(self.launches, tables, strict=True):
                dtype = batch.payload_dtype(launch.cut)
                payload = payloads.get(dtype)
                if payload is None:
                    payload = payloads[dtype] = packed.payload.view(dtype)
                assert launch.launcher is not None  # (made for every launch that runs)
                launch.launcher(_unpack_kernel, _at=site, tab=table, payload=payload, scales=scales,
                                IN_ALIGN=align)
        finally:  # (after whatever was issued: the tables' buffers are free once it has run)
            self.tables.release(site)

    def _launch_set(self, packed, table: torch.Tensor, site: tuple[int, int] | None) -> None:
        """The set kernel's launch: once the JIT has launched it, with addresses only
        (`Launcher.by_address`: the table's, the payload's, the scales' or `no_scales`'; no
        int32 view of the scales, no key to compute), as `triton_pack`'s set calls do."""
        fused = self.fused
        assert fused is not None
        payload, scales = packed.payload, packed.scales
        has_scales = scales.numel() > 0
        fused.by_address(_unpack_set_kernel, site, lambda: {
            "tab": table, "payload": payload, "scales": scales.view(torch.int32) if has_scales else self.no_scales},
            tab=table.data_ptr(), payload=payload.data_ptr(),
            scales=scales.data_ptr() if has_scales else self.no_scales.data_ptr())


def _build(items: Sequence[UnpackItem], ids: list[tuple[int, ...]]) -> list[_Launch]:
    keys = [batch.signature(it.buffer.device, it.field, len(i), it.spec)
            for it, i in zip(items, ids, strict=True)]
    launches = [_Launch(items, members, len(ids[members[0]])) for members in batch.group_items(keys)]
    return [launches[k] for k in largest_first(launches)]  # small launches issued while it runs


#: Launch plans of the most recent item lists (see `batch.PlanCache`).
_plans: batch.PlanCache[list[_Launch]] = batch.PlanCache(PLAN_CACHE_SIZE, _build)


def _plan_for(items: Sequence[UnpackItem], ids: list[tuple[int, ...]]) -> list[_Launch]:
    return _plans.get(items, ids)


def unpack_many(items: Sequence[UnpackItem]) -> None:
    """Decode every item in as few launches as possible (grouped as in `pack_many`), each as
    `reference.unpack(item)` would.

    The targets of different items must not overlap (the order of writes between items is
    unspecified); each item's block ids must be distinct. Every item is checked before any
    launch. The item tables of all launches cross to the device in one asynchronous copy from
    page-locked memory: no host synchronization. What depends only on the targets is planned
    once per item list and reused.
    """
    items = list(items)
    if not items:
        return
    ids = batch.check_all_ids(items, distinct=True)
    launches = []
    for launch in _plan_for(items, ids):
        staged = launch.rows(items, ids)
        if staged is not None:
            launches.append((items[launch.members[0]].buffer.device, *staged))
    tables = batch.stage_tables([(device, rows) for device, rows, _ in launches])
    for (_, _, go), table in zip(launches, tables, strict=True):
        go(table)
