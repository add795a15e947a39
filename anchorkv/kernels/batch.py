"""Work items of the batched kernels, and how the launchers turn them into launches.

A Kimi-Linear request is 20 KDA layers x (conv, recurrent) plus 7 MLA layers: packing it one
launch per (layer, field) would spend more time launching than moving bytes. So the launchers
take a list of items, put items with the same *signature* (device, dtype, field shape and
strides, format, group, number of blocks) in one launch, and pass what differs between them
(where the region is, its block stride, the block ids, where the payload lives) in a small int64
*item table*. Addresses in the table are element offsets from one *anchor* tensor (the first
item's storage), so one kernel reaches every region without a pointer table.

This module is plain Python and torch; the Triton kernels live in `triton_pack.py` and `triton_unpack.py`.
"""

from __future__ import annotations

import functools
import math
import weakref
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from anchorkv.kernels import cuda_driver, launch, reference
from anchorkv.kernels.items import Span
from anchorkv.kernels.quant import (
    ELEMENTWISE,
    KERNEL_FORMAT,
    QUANT,
    SCALE_COLUMNS,
    Quant,
    QuantSpec,
    payload_nbytes,
    quant_of,
    resolve_group,
)
from anchorkv.kernels.strided import StridedField

#: Same-size integer dtype used to move the bits of a field element.
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: `SRC`/`DST` constexpr of the kernels for each quantizable source dtype (`bits.BF16`,
#: `bits.FP16`, `bits.FP32`; see `bits.widen`).
FLOAT_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

#: `FMT` constexpr of the kernels (`bits.FMT_*`).
FMT_CODE = KERNEL_FORMAT

#: Leading axes the kernels unravel a row index into (after merging mergeable axes).
MAX_LEADING_AXES = 3

#: Bytes of source one program reads, roughly (a tile of BLOCK_R groups of BLOCK_G elements),
#: and elements per thread: measured on an H100 (benchmarks/sweep_launch.py, results in
#: benchmarks/results/nvidia-h100-80gb-hbm3-sweep.json): the big fields of a Kimi-Linear request
#: ran fastest with 4096-element bf16 tiles x 8 warps (MLA latent) and 1024-element fp32 tiles x
#: 2 warps (KDA recurrent), both 16 elements a thread; tiles of 4x the bytes were up to 10%
#: slower, and small fields (the conv state) liked small tiles too.
TILE_BYTES = 8192
ELEMENTS_PER_THREAD = 16

#: Largest chunk of the last axis one row of a raw tile holds.
RAW_CHUNK = 1024


@dataclass(frozen=True)
class FieldCut:
    """A field cut into groups: what a launch needs besides the per-item table.

    rows of the last axis are unravelled as `[S0, S1, S2]` with element strides `[T0, T1, T2]`;
    `td` is the last axis' stride; each row holds `gpr` groups of `g` elements (for raw, `g` is
    a chunk size only); `groups` = groups per block.
    """

    fmt: Quant
    dtype: torch.dtype
    sizes: tuple[int, int, int]
    strides: tuple[int, int, int]
    td: int
    last: int
    g: int
    gpr: int
    groups: int
    numel: int
    payload_per_block: int  # bytes
    columns: int  # scale columns C

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def flat(self) -> bool:
        """Whether a block's groups lie end to end (group k at element k * g of the block): a
        contiguous last axis under at most one leading axis whose stride is the row's length."""
        return (self.td == 1 and self.sizes[0] == 1 and self.sizes[1] == 1
                and (self.sizes[2] == 1 or self.strides[2] == self.last))


def _merge_leading(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """Leading axes as (size, stride), size-1 axes dropped and row-major-adjacent axes merged."""
    axes = [(n, s) for n, s in zip(shape, strides, strict=True) if n != 1]
    merged: list[tuple[int, int]] = []
    for n, s in axes:
        if merged and merged[-1][1] == n * s:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    return merged


def _raw_chunk(last: int) -> int:
    """The largest divisor of the last axis that is at most `RAW_CHUNK`."""
    for c in range(min(last, RAW_CHUNK), 0, -1):
        if last % c == 0:
            return c
    return 1


def field_cut(field: StridedField, spec: QuantSpec) -> FieldCut:
    """Validate `field` for the Triton kernels and describe its groups (cached: a connector
    packs the same fields every step)."""
    return _field_cut(field, quant_of(spec), spec.group)


@functools.lru_cache(maxsize=4096)
def _field_cut(field: StridedField, fmt: Quant, group: int | None) -> FieldCut:
    if not field.shape:
        raise ValueError("the Triton kernels need a field with at least one axis, found a scalar")
    if fmt is Quant.RAW:
        if field.itemsize not in INT_OF_SIZE:
            raise ValueError(f"raw packing copies 1, 2, 4 or 8-byte elements, found {field.dtype}")
    elif field.dtype not in FLOAT_KIND:
        raise ValueError(
            f"{fmt} quantizes bfloat16, float16 or float32 fields, found {field.dtype}; "
            "pack it as raw instead"
        )
    last = field.last_dim
    if fmt in ELEMENTWISE:  # no groups: the chunk only cuts rows into tiles
        g = _raw_chunk(last)
    else:
        g = resolve_group(last, group)
        if fmt is Quant.INT4 and g % 2:
            raise ValueError(f"int4 packs two codes a byte and needs an even group size, found {g}")
    leading = _merge_leading(field.shape[:-1], field.strides[:-1])
    if len(leading) > MAX_LEADING_AXES:
        raise ValueError(
            f"the Triton kernels unravel at most {MAX_LEADING_AXES} leading axes; field shape "
            f"{list(field.shape)} with strides {list(field.strides)} has {len(leading)} that do "
            "not merge; use the reference backend (ANCHORKV_BACKEND=reference) for it"
        )
    leading = [(1, 0)] * (MAX_LEADING_AXES - len(leading)) + leading
    numel = field.numel
    if numel >= 2**31 - 2**16:  # the kernels count a block's groups in 32 bits
        raise ValueError(
            f"the Triton kernels take fields of fewer than 2**31 - 2**16 elements per block, found "
            f"{numel} ({list(field.shape)}); use the reference backend (ANCHORKV_BACKEND=reference)"
        )
    return FieldCut(
        fmt=fmt,
        dtype=field.dtype,
        sizes=(leading[0][0], leading[1][0], leading[2][0]),
        strides=(leading[0][1], leading[1][1], leading[2][1]),
        td=field.strides[-1],
        last=last,
        g=g,
        gpr=last // g,
        groups=numel // g,
        numel=numel,
        payload_per_block=payload_nbytes(fmt, numel, field.itemsize),
        columns=SCALE_COLUMNS[fmt],
    )


def tile_elements(cut: FieldCut) -> int:
    """Elements one program handles: about `TILE_BYTES` of source, at least 1024."""
    return max(1024, TILE_BYTES // cut.itemsize)


def tile_rows(cut: FieldCut, block_g: int, elements: int | None = None) -> int:
    """BLOCK_R: groups per program, a power of two of about `elements` elements (default
    `tile_elements`), no more rows than the field has groups."""
    want = max(1, (tile_elements(cut) if elements is None else elements) // block_g)
    return min(want, max(1, 1 << (cut.groups - 1).bit_length()))


def num_warps(tile: int) -> int:
    """Warps per program for a tile of `tile` elements: `ELEMENTS_PER_THREAD` a thread, 1-16."""
    return min(16, max(1, tile // (32 * ELEMENTS_PER_THREAD)))


def check_ids(block_ids, num_blocks: int, *, distinct: bool = False) -> tuple[int, ...]:
    """Block ids as a tuple of Python ints, each in [0, num_blocks) (and distinct if asked).

    Plain Python on purpose: the launchers turn a request's ids into an item table every step,
    and a few torch ops per item cost more than the kernels move. Ids on a GPU are copied to the
    host (a synchronization): pass them as a list or a CPU tensor on the hot path.
    """
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.is_floating_point() or block_ids.is_complex():
            return tuple(reference.check_block_ids(block_ids, num_blocks).tolist())  # raises
        ids = tuple(block_ids.tolist())
    else:
        ids = tuple(block_ids)
    if any(type(i) is not int for i in ids):
        ids = tuple(reference.check_block_ids(torch.as_tensor(ids, dtype=torch.int64),
                                              num_blocks).tolist())
    if ids and (min(ids) < 0 or max(ids) >= num_blocks) or (distinct and len(set(ids)) != len(ids)):
        reference.check_block_ids(torch.tensor(ids, dtype=torch.int64), num_blocks,
                                  distinct=distinct)  # raises with the reference's message
    return ids


def check_all_ids(items, *, distinct: bool = False) -> list[tuple[int, ...]]:
    """`check_ids` of every item's block ids; items that share one ids object (a connector
    passes one tuple for all the layers of a KV-cache group) are checked once."""
    seen: dict[tuple[int, int], tuple[int, ...]] = {}
    out = []
    for it in items:
        key = (id(it.block_ids), it.num_blocks)  # the objects live for the whole call
        ids = seen.get(key)
        if ids is None:
            ids = seen[key] = check_ids(it.block_ids, it.num_blocks, distinct=distinct)
        out.append(ids)
    return out


def region_columns(items, members: list[int], cut: FieldCut):
    """The region side of one launch, shared by pack and unpack: the anchor (an integer alias of
    the first member's storage), each member's (field origin, block stride) in elements of it,
    and the alignment claim over every row start (1 for a strided last axis)."""
    itemsize = cut.itemsize
    base = anchor(items[members[0]].buffer, INT_OF_SIZE[itemsize])
    static, offsets = [], row_offsets(cut)
    for m in members:
        item = items[m]
        origin = element_offset(field_origin(item.buffer, item.field), base, "field")
        stride = item.field.block_stride // itemsize
        static.append((origin, stride))
        offsets += (origin, stride)
    align = alignment(cut, base.data_ptr(), offsets, itemsize) if cut.td == 1 else 1
    return base, static, align


def plan_key(items, ids: list[tuple[int, ...]]) -> tuple:
    """What a launch plan of `items` depends on: each item's device (type and index), region
    address, field, format, group and number of block ids."""
    return tuple((it.buffer.is_cuda, it.buffer.get_device(), it.buffer.data_ptr(), it.field,
                  QUANT.get(it.spec.id), it.spec.group, len(i)) for it, i in zip(items, ids, strict=True))


class _HashedKey:
    """A plan key hashed once: a dict lookup and an LRU touch would otherwise each hash the
    whole tuple again (about 47 x 7 values for a Kimi-Linear request)."""

    __slots__ = ("key", "hash")

    def __init__(self, key: tuple) -> None:
        self.key, self.hash = key, hash(key)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HashedKey) and self.hash == other.hash and self.key == other.key


P = TypeVar("P")


class PlanCache(Generic[P]):
    """Launch plans of the most recent item lists, least recently used first out.

    A plan holds aliases of its regions (so an address in a key can never be reused by another
    allocation while the plan lives); a connector packs the same few lists every step, so a
    handful is enough. `get` keys by `plan_key` and makes a missing plan with
    `build(items, ids)`; `find` takes any key and a maker (a `PackSet` keys by slot lengths).
    """

    def __init__(self, size: int, build: Callable[[Sequence, list[tuple[int, ...]]], P] | None = None) -> None:
        self.size, self.build = size, build
        self._plans: OrderedDict[Hashable, P] = OrderedDict()

    def get(self, items: Sequence, ids: list[tuple[int, ...]]) -> P:
        """The plan of `items` with block ids `ids`, keyed by `plan_key`, built with `build`."""
        assert self.build is not None, "get() needs the cache's build function"
        build = self.build
        return self.find(_HashedKey(plan_key(items, ids)), lambda: build(items, ids))

    def find(self, key: Hashable, make: Callable[[], P]) -> P:
        """The plan under `key`, made by `make()` when missing (the least recently used plan
        goes when there are more than `size`)."""
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make()
            if len(self._plans) > self.size:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def keys(self) -> list:
        """The keys held, least recently used first."""
        return list(self._plans)

    def newest(self) -> P | None:
        """The most recently used plan (diagnostics: `benchmarks.profile_kernels`)."""
        return next(reversed(self._plans.values()), None)

    def __len__(self) -> int:
        return len(self._plans)


def same_device(t: torch.Tensor, other: torch.Tensor) -> bool:
    """`t.device == other.device`; on CUDA by index (a device object per tensor costs ~1 us)."""
    if t.is_cuda:
        return other.is_cuda and t.get_device() == other.get_device()
    return t.device == other.device


def byte_address(t: torch.Tensor) -> int:
    """Address of the first byte of `t` (its storage start plus its storage offset)."""
    return t.data_ptr()


def anchor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A one-element `dtype` alias at the start of `t`'s storage: the base of relative offsets."""
    view = torch.empty(0, dtype=dtype, device=t.device)
    view.set_(t.untyped_storage(), 0, (1,), (1,))
    return view


def element_offset(address: int, base: torch.Tensor, what: str) -> int:
    """`address - base`, in elements of `base`; both must be aligned to its element size."""
    return offset_in(address, base.untyped_storage().data_ptr(), base.element_size(), what)


def offset_in(address: int, base_address: int, size: int, what: str) -> int:
    """`element_offset` with the base's address and element size already looked up (a launch
    computes one per member against the same base)."""
    delta = address - base_address
    if delta % size:
        raise ValueError(
            f"{what} at byte address {address:#x} is not {size}-byte aligned relative to the "
            f"batch's first region; regions, field offsets and block strides must be multiples "
            f"of the element size"
        )
    return delta // size


def field_origin(buffer: torch.Tensor, field: StridedField) -> int:
    """Byte address of element 0 of `field` in block 0 of the region in `buffer`."""
    itemsize = field.itemsize
    if field.block_stride % itemsize or field.offset % itemsize:
        raise ValueError(
            f"field of dtype {field.dtype} needs {itemsize}-byte alignment, found field offset "
            f"{field.offset} bytes and block stride {field.block_stride} bytes"
        )
    return byte_address(buffer) + field.offset


def signature(device: torch.device, field: StridedField, n: int, spec: QuantSpec) -> tuple:
    """Items with equal signatures (`n`: their number of block ids) share one launch."""
    return (device, field.dtype, field.shape, field.strides, QUANT.get(spec.id), spec.group, n)


def group_items(keys: Sequence[tuple]) -> list[list[int]]:
    """Indices of equal keys, in order of first appearance."""
    out: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        out.setdefault(key, []).append(i)
    return list(out.values())


@dataclass(frozen=True)
class BatchLayout:
    """Where the parts of a batch of items lie in its two tensors (a `PackedBatch`): the
    items grouped by signature (`group_items`: one launch each), each group's payload starting
    16-byte aligned and its scales at a multiple of 4 values, its items in order within it.
    It depends only on the items' fields, codecs and block counts, never on the backend, so a
    `PackSet` on any backend and an `UnpackSet` of the same targets agree on it."""

    groups: tuple[tuple[int, ...], ...]  # item indices of each group (launch)
    starts: tuple[tuple[int, int], ...]  # (payload byte, scale value) where each group starts
    spans: tuple[Span, ...]  # each item's part, in item order
    payload_bytes: int
    scale_values: int
    #: (start, length) runs of the scales that hold parts' scales; between them, padding
    scale_runs: tuple[tuple[int, int], ...]


def part_size(field: StridedField, spec: QuantSpec) -> tuple[int, int, int]:
    """(payload bytes, scale rows, scale columns) one block of `field` packs to with `spec`."""
    fmt = quant_of(spec)
    columns = SCALE_COLUMNS[fmt]
    rows = field.numel // resolve_group(field.last_dim, spec.group) if columns else 0
    return payload_nbytes(fmt, field.numel, field.itemsize), rows, columns


def batch_layout(items: Sequence, lens: Sequence[int]) -> BatchLayout:
    """The `BatchLayout` of `items` (anything with `buffer`, `field` and `spec`) packing
    `lens[i]` blocks each."""
    keys = [signature(it.buffer.device, it.field, n, it.spec) for it, n in zip(items, lens, strict=True)]
    groups = group_items(keys)
    spans: list = [None] * len(keys)
    starts, runs = [], []
    pay = sc = 0
    for members in groups:
        first = items[members[0]]
        per_block, rows, cols = part_size(first.field, first.spec)
        n = lens[members[0]]
        per_payload, per_rows = n * per_block, n * rows
        starts.append((pay, sc))
        for k, m in enumerate(members):
            spans[m] = Span(pay + k * per_payload, per_payload, sc + k * per_rows * cols, per_rows, cols)
        values = len(members) * per_rows * cols
        if values:
            runs.append((sc, values))
        pay += -(-len(members) * per_payload // VECTOR_BYTES) * VECTOR_BYTES
        sc += -(-values // 4) * 4
    return BatchLayout(tuple(tuple(g) for g in groups), tuple(starts), tuple(spans), pay, sc, tuple(runs))


def grid_check(programs_per_block: int, blocks: int, items: int = 1) -> None:
    """A clear error unless a launch of `items` items of `blocks` blocks each, `programs_per_block`
    programs a block, fits a grid (axes 1 and 2 hold at most 65535)."""
    if blocks > 65535 or items > 65535:
        raise ValueError(
            f"one launch handles at most 65535 blocks of at most 65535 items, found {blocks} blocks of "
            f"{items} items; split the batch"
        )
    if programs_per_block >= 2**31:
        raise ValueError(f"a field of {programs_per_block} tiles per block is too large for one launch")


def prod(values) -> int:
    return math.prod(values)


#: Widest global access the kernels aim for (16 bytes: `ld/st.global.v4.b32`).
VECTOR_BYTES = 16


def alignment(cut: FieldCut, anchor_address: int, offsets: Sequence[int], itemsize: int) -> int:
    """The `*_ALIGN` constexpr of a launch: a power of two of elements (at most 16 bytes' worth)
    that the host has checked divides the anchor's address and every element offset the
    kernel adds to it per row (`offsets`: item origins, block strides, axis strides, ...).

    Why: row starts come from values the kernel loads out of the item table, so the compiler
    cannot prove they are aligned and emits one scalar access per element; `tl.multiple_of`
    with this value lets it use 16-byte vector accesses. 1 means no claim.
    """
    a = VECTOR_BYTES // itemsize
    if anchor_address % VECTOR_BYTES:
        return 1
    while a > 1 and any(v % a for v in offsets):
        a //= 2
    return max(a, 1)


def payload_alignment(cut: FieldCut, address: int, offsets: Sequence[int], width: int) -> int:
    """The payload side's `*_ALIGN` of a launch (pack: OUT_ALIGN, unpack: IN_ALIGN): what
    `alignment` allows for the payload group starts from `address`, the members' payloads at
    `offsets` (elements of `width` bytes). Group k of block i of a launch starts at its member's
    offset + i * numel + k * g elements (int4: half that, two codes a byte)."""
    if cut.fmt is Quant.INT4:
        return alignment(cut, address, [cut.numel // 2, cut.g // 2, *offsets], width)
    return alignment(cut, address, [cut.numel, cut.g, *offsets], width)


def row_offsets(cut: FieldCut) -> list[int]:
    """The per-row element offsets of a field inside one block: leading axis strides (of axes
    longer than 1) and the start of each group within a row."""
    out = [s for n, s in zip(cut.sizes, cut.strides, strict=True) if n > 1]
    if cut.gpr > 1:
        out.append(cut.g * cut.td)
    return out


def hardware_fp8(device: torch.device) -> bool:
    """Whether the kernels convert with the GPU's own instructions (fp8 codes and their decode,
    fp32 -> bf16 rounding): CUDA devices of compute capability 8.9 or newer. The Triton
    interpreter's casts round wrongly (fp8 when rounding carries into the exponent), so CPU
    tensors take the integer encodings of `kernels.bits`; both give the reference's bytes."""
    return device.type == "cuda" and _capability(device.index) >= (8, 9)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def payload_dtype(cut: FieldCut) -> torch.dtype:
    """The element type the kernels read and write the payload as: the source's same-size
    integer for raw, int16 (bf16 bits) for bf16, bytes for the quantized formats."""
    if cut.fmt is Quant.RAW:
        return INT_OF_SIZE[cut.itemsize]
    if cut.fmt is Quant.BF16:
        return torch.int16
    return torch.uint8


def batch_tensors(payload_bytes: int, scale_values: int, device: torch.device, *,
                  one: bool | None = None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(whole, payload, scales) of a new batch. With `one` (the default on a GPU) one
    allocation of `host_bytes`, the payload (uint8) at its start and the scales (fp32) at the
    next 16-byte boundary: one allocation per call instead of two, and one copy to the host
    instead of two. Else two tensors and no `whole`: the default on a CPU, where the batch is
    on the host already, and a payload past glibc's mmap threshold (32 MB) is new pages at
    every call, so scales inside it would fault in too (+0.65 ms a Kimi-Linear save in
    `benchmarks.host_path` here)."""
    if not (device.type == "cuda" if one is None else one):
        return (None, torch.empty(payload_bytes, dtype=torch.uint8, device=device),
                torch.empty(scale_values, dtype=torch.float32, device=device))
    whole = torch.empty(scales_start(payload_bytes) + 4 * scale_values, dtype=torch.uint8, device=device)
    return (whole, *batch_views(whole, payload_bytes, scale_values))


def scales_start(payload_bytes: int) -> int:
    """Where a batch's scales start in its one allocation (or a host buffer laid out alike):
    the first 16-byte boundary at or after its payload."""
    return -(-payload_bytes // VECTOR_BYTES) * VECTOR_BYTES


def batch_views(whole: torch.Tensor, payload_bytes: int, scale_values: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload uint8, scales fp32) of a batch laid out in `whole` (uint8, exactly
    `scales_start(payload_bytes) + 4 * scale_values` bytes): one `split_with_sizes` for both
    (~1.5 us less than two narrows on a CPU core)."""
    at = scales_start(payload_bytes)
    payload, _, scales = whole.split_with_sizes([payload_bytes, at - payload_bytes, 4 * scale_values])
    return payload, scales.view(torch.float32)


class TableArray:
    """The item tables of a set's launches (`PackSet`, `UnpackSet`), laid out once per plan in
    one int64 host array, each table at an even offset (16-byte aligned, as `stage_tables`
    places them): a launch's rows are its members' fixed columns (`heads`), then their block
    ids. A call writes the ids (`write`: one numpy assignment per launch and slot, the members
    of a launch that read one slot sharing its ids), stages the array (`stage`), launches, and
    says so (`release`: on a GPU, the end of the launches that read the staged tables). With
    `whole`, the array is staged as one table (a set kernel's)."""

    def __init__(self, launches: Sequence[tuple[Sequence[tuple[int, ...]], Sequence[int], int]],
                 slots: Sequence[int]) -> None:
        """`launches`: per launch, (each member's fixed columns, its members' item indices, the
        number of block ids); `slots[i]`: the slot item i reads its ids from."""
        self.segments: list[tuple[int, int]] = []  # (start, length) of each launch's table
        #: (the array's indices of the ids of some rows, an item whose ids those rows take)
        self.writes: list[tuple[np.ndarray, int]] = []
        at = 0
        for heads, members, n in launches:
            head = len(heads[0]) if heads else 0
            w = head + n
            self.segments.append((at, len(heads) * w))
            by_slot: dict[int, list[int]] = {}
            for k, m in enumerate(members):
                by_slot.setdefault(slots[m], []).append(k)
            cells = np.arange(at, at + len(heads) * w, dtype=np.int64).reshape(len(heads), w)
            for ks in by_slot.values():
                self.writes.append((cells[ks, head:], members[ks[0]]))
            at += len(heads) * w + (len(heads) * w) % 2
        self.array = np.zeros(at, dtype=np.int64)
        # each write as a view of the array where its rows are evenly spaced (a launch's members
        # that read one slot are, in every plan a set makes): an assignment to a view converts
        # the ids once and broadcasts them, where an index array writes each cell by its index
        # (~4x the time for 23 rows of 480 ids here)
        self.views: list[tuple[np.ndarray, int]] = []
        for cells, m in self.writes:
            view = _rows_view(self.array, cells)
            if view is not None:
                self.views.append((view, m))
        if len(self.views) == len(self.writes):
            self.writes = []
        else:
            self.views = []
        for (start, length), (heads, _, _) in zip(self.segments, launches, strict=True):
            if heads:
                self.array[start:start + length].reshape(len(heads), -1)[:, :len(heads[0])] = heads
        self.ring: TableRing | None = None  # made at the first stage on a GPU
        #: stage the array as one table (a set kernel's, which finds each launch's at its
        #: segment's start) instead of one per launch; set before the first stage
        self.whole = False

    def write(self, ids: Sequence[Sequence[int]]) -> None:
        """Put each item's block ids `ids[i]` in its rows."""
        for view, m in self.views:
            view[...] = ids[m]
        for cells, m in self.writes:
            self.array[cells] = ids[m]

    def stage(self, device: torch.device, site: tuple[int, int] | None = None) -> list[torch.Tensor]:
        """The launches' tables on `device`: on a GPU one `non_blocking` copy from page-locked
        memory of this set's own (`TableRing`: no allocation, nothing for the next call to
        overwrite; `site`, the call's `launch.launch_site()`, lets it go to the driver);
        elsewhere the array itself (the Triton interpreter runs each launch before the call
        returns). Call `release` once the launches that read them are issued."""
        segments = [(0, self.array.size)] if self.whole else self.segments
        if device.type != "cuda":
            host = torch.from_numpy(self.array)
            return [host] if self.whole else [host[start:start + length] for start, length in segments]
        if self.ring is None:
            self.ring = TableRing(self.array.size, segments, device)
        return self.ring.stage(self.array, site)

    def release(self, site: tuple[int, int] | None = None) -> None:
        """The launches that read the last staged tables are issued (on the current stream;
        `site`: `launch.launch_site()`, when the caller asked for it)."""
        if self.ring is not None:
            self.ring.release(site)


def _rows_view(array: np.ndarray, cells: np.ndarray) -> np.ndarray | None:
    """A view of `array` whose elements are `array[cells]` (`cells`: rows of consecutive
    indices, `cells.shape` (rows, n)), when the rows start evenly spaced; else None."""
    rows, n = cells.shape
    if not rows or not n:
        return None
    start = int(cells[0, 0])
    step = int(cells[1, 0] - cells[0, 0]) if rows > 1 else n
    if step < n or np.any(cells != start + step * np.arange(rows)[:, None] + np.arange(n)[None, :]):
        return None
    view = array[start:start + step * (rows - 1) + n]
    if rows > 1:
        view = np.lib.stride_tricks.as_strided(view, shape=(rows, n), strides=(step * 8, 8), writeable=True)
    else:
        view = view.reshape(1, n)
    return view


class TableRing:
    """Reused page-locked and device buffers for a `TableArray`'s staged copies: `SLOTS` of
    each, and one CUDA event per slot.

    `stage` copies the array into the next slot's page-locked buffer and from there, with one
    `non_blocking` copy on the current stream, into the slot's device buffer, whose per-launch
    views were made once; `release` records the slot's event on the current stream, after the
    launches that read it. A slot is written again only once its event has completed (a
    query, never a wait), so neither the host copy nor a kernel of an earlier call can still be
    reading it, whatever stream that call ran on. A busy slot (a call `SLOTS` calls back still
    running), or one staged but never released, is skipped: the call takes torch's page-locked
    and device allocators instead (`_stage_copy`, the path before the ring), so a call never
    waits for the GPU.

    What this saves per call, against that path: a page-locked allocation from torch's caching
    host allocator (its lock, its event bookkeeping) and a device allocation, and the views.
    `alloc` (bytes -> (page-locked host tensor, device tensor), int64) and `event` (-> an object
    with `record(stream)` and `query()`) are the CUDA ones unless a test passes stand-ins.

    Given the call's launch site (`launch.launch_site()`, on this ring's device), the copy and
    the record go to the driver directly (`cuda_driver`: the copy 1.4-3.1 us less host time a
    call than torch's `copy_` on an H200 host); `driver` is the process's unless a test passes
    a stand-in (None: torch's calls only, as for stand-in buffers).

    A ring that dies (its plan evicted from its set's cache, or the set dropped) with a slot's
    work still queued keeps its buffers until every slot's event has completed (`_bury`): torch's
    allocators were never told which stream reads them (a driver copy tells the caching host
    allocator nothing; the device buffers are read on whatever stream the calls ran on), so
    freeing them at once could hand a page-locked block to another allocation while a queued
    copy still reads it, and the kernel would write the wrong blocks.
    One thread at a time, as the set that owns it (the connector packs on the step's thread
    and unpacks on its one load thread).
    """

    #: 8: pack calls issued back to back on an H200 took 1.9 (tp=1) and 2.7 (tp=4) us less a call
    #: with 8 than with 4, unpacks the same within 0.4 us (stop 42, one `benchmarks.set_calls`
    #: run; 16 no better); a slot is a few hundred bytes twice
    SLOTS = 8

    def __init__(self, size: int, segments: Sequence[tuple[int, int]], device: torch.device, *,
                 alloc: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
                 event: Callable[[], object] | None = None, stream: Callable[[], object] | None = None,
                 driver: cuda_driver.Driver | None | bool = True) -> None:
        self.device = device
        self.segments = list(segments)
        if driver is True:  # (the process's, for CUDA buffers; none for a test's stand-in buffers)
            driver = cuda_driver.driver() if alloc is None else None
        self.driver: cuda_driver.Driver | None = driver or None
        alloc = alloc or functools.partial(_cuda_table_buffers, device)
        event = event or torch.cuda.Event
        self.stream = stream or functools.partial(torch.cuda.current_stream, device)
        self.hosts: list[np.ndarray] = []
        self.host_tensors: list[torch.Tensor] = []
        self.devices: list[torch.Tensor] = []
        self.views: list[list[torch.Tensor]] = []
        self.events: list = []
        for _ in range(self.SLOTS):
            host, dev = alloc(size)
            self.host_tensors.append(host)
            self.hosts.append(host.numpy())
            self.devices.append(dev)
            self.views.append([dev[start:start + length] for start, length in self.segments])
            self.events.append(event())
        #: per slot: staged and not yet released (its event then says nothing of this use)
        self.staged: list[bool] = [False] * self.SLOTS
        self.next = 0
        self.current: int | None = None  # the slot of the last stage, until its release
        self.fallbacks = 0  # calls that found their slot busy (tests, profiles)
        self.streams = launch.Streams()  # (device, raw stream handle) -> its stream (`release`)
        # (the driver path's addresses and size, per slot)
        self.host_ptrs = [t.data_ptr() for t in self.host_tensors]
        self.device_ptrs = [t.data_ptr() for t in self.devices]
        self.nbytes = size * 8
        weakref.finalize(self, _bury, (self.host_tensors, self.devices, self.events, self.staged))
        if _BURIED:
            _sweep()

    def stage(self, array: np.ndarray, site: tuple[int, int] | None = None) -> list[torch.Tensor]:
        """The array in the next slot's device buffer (its per-launch views), copied on the
        current stream (`site`'s stream through the driver, when `site` is on this ring's
        device); torch's allocators when the slot is busy."""
        if _BURIED:
            _sweep()
        k = self.next
        if self.staged[k] or not self.events[k].query():
            self.fallbacks += 1
            self.current = None
            return _stage_copy(array, self.device, self.segments)
        self.next = (k + 1) % self.SLOTS
        np.copyto(self.hosts[k], array)
        d = self.driver
        if (d is None or not d.on or site is None or site[0] != self.device.index
                or not d.copy(self.device_ptrs[k], self.host_ptrs[k], self.nbytes, site[1])):
            self.devices[k].copy_(self.host_tensors[k], non_blocking=True)
        self.staged[k] = True
        self.current = k
        return self.views[k]

    def release(self, site: tuple[int, int] | None = None) -> None:
        """Record the staged slot's event on the current stream. With `site`
        (`launch.launch_site()`: the current device and its current stream's raw handle) on
        this ring's device, the stream object is the one kept for that handle
        (`launch.Streams`)."""
        k = self.current
        if k is None:
            return
        handle = site[1] if site is not None and site[0] == self.device.index else None
        d, event = self.driver, self.events[k]
        # (a torch event is made at its first record: until then it has no handle)
        if not (handle is not None and d is not None and d.on and event.cuda_event
                and d.record(event.cuda_event, handle)):
            event.record(self.stream() if handle is None else self.streams.of(self.device.index, handle, self.stream))
        self.staged[k] = False
        self.current = None


#: The buffers of dead rings whose events had not all completed (`TableRing`). No lock: a ring
#: dies on whichever thread drops it last, possibly inside a sweep (the garbage collector runs
#: finalizers during allocations), so only the list's atomic `append` / `pop` / `extend` touch it.
_BURIED: list[tuple[list, list, list, list]] = []


def _done(buffers: tuple[list, list, list, list]) -> bool:
    """Whether a dead ring's queued work has all run: every slot's event complete and no slot
    staged without its release (then no event covers its copy: kept for good)."""
    if any(buffers[3]):
        return False
    try:
        return all(e.query() for e in buffers[2])
    except Exception:  # (a CUDA error, or CUDA torn down at exit: keep them, never free early)
        return False


def _bury(buffers: tuple[list, list, list, list]) -> None:
    """A dead ring's (host tensors, device tensors, events, staged flags): dropped now if its
    work has all run (`_done`), else kept until a later `_sweep` finds it has."""
    if not _done(buffers):
        _BURIED.append(buffers)


def _sweep() -> None:
    """Drop the buried buffers whose work has all run (a query each, never a wait); what
    another thread buries meanwhile is kept or examined, never lost."""
    keep = []
    try:
        while True:
            try:
                buffers = _BURIED.pop()
            except IndexError:
                break
            if not _done(buffers):
                keep.append(buffers)
    finally:
        _BURIED.extend(keep)


def _cuda_table_buffers(device: torch.device, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    host = torch.empty(size, dtype=torch.int64, pin_memory=True)
    return host, torch.empty(size, dtype=torch.int64, device=device)


def _stage_copy(array: np.ndarray, device: torch.device, segments: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """A set's array on `device` through torch's allocators: a page-locked copy (the next call
    rewrites the array) and one `non_blocking` copy from it."""
    table = torch.from_numpy(array).pin_memory().to(device, non_blocking=True)
    return [table[start:start + length] for start, length in segments]


def stage_tables(segments: Sequence[tuple[torch.device, list[int]]]) -> list[torch.Tensor]:
    """The item tables of one call's launches on their devices, without a host synchronization.

    All tables for one device go into one page-locked host tensor (torch's caching host
    allocator reuses such buffers and keeps each from reuse until the copy that reads it has
    run) and cross in one `non_blocking=True` copy on the current stream, so the launch path
    never waits for the GPU. A copy from pageable memory would block the CPU until the stream
    had drained: with the side stream waiting on the forward pass, that would undo vLLM's async
    scheduling on every step. Each table starts 16-byte aligned (even int64 offsets), so the
    kernels' pointer specialization never changes between calls.
    """
    out: list[torch.Tensor | None] = [None] * len(segments)
    by_device: dict[torch.device, list[int]] = {}
    for i, (device, _) in enumerate(segments):
        by_device.setdefault(device, []).append(i)
    for device, members in by_device.items():
        flat: list[int] = []
        starts = []
        for i in members:
            starts.append(len(flat))
            flat += segments[i][1]
            flat += [0] * (len(flat) % 2)
        # (torch.tensor of a list converts element by element: ~10x slower than the buffer)
        host = torch.frombuffer(array("q", flat), dtype=torch.int64) if flat else torch.empty(
            0, dtype=torch.int64)
        table = host if device.type != "cuda" else host.pin_memory().to(device, non_blocking=True)
        for i, start in zip(members, starts, strict=True):
            out[i] = table[start : start + len(segments[i][1])]
    return out  # type: ignore[return-value]
