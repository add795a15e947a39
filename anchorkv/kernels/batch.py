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

from dataclasses import dataclass
import math
from typing import Sequence

import torch

from anchorkv.kernels import reference
from anchorkv.kernels.formats import SCALE_COLUMNS, Quant, payload_nbytes, resolve_group
from anchorkv.kernels.geometry import StridedField

#: Same-size integer dtype used to move the bits of a field element.
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: `SRC`/`DST` constexpr of the kernels for each quantizable source dtype (see `bits.widen`).
FLOAT_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

#: `FMT` constexpr of the kernels.
FMT_CODE = {Quant.RAW: 0, Quant.FP8: 1, Quant.INT8: 2, Quant.INT4: 3}

#: Leading axes the kernels unravel a row index into (after merging mergeable axes).
MAX_LEADING_AXES = 3

#: Elements one program handles, roughly (a tile of BLOCK_R groups of BLOCK_G elements).
TILE_ELEMENTS = 4096

#: Largest chunk of the last axis one row of a raw tile holds.
RAW_CHUNK = 1024


@dataclass(frozen=True)
class PackItem:
    """Pack `field` of blocks `block_ids` of the region in `buffer` (see `triton_pack.pack`)."""

    buffer: torch.Tensor
    field: StridedField
    block_ids: torch.Tensor | Sequence[int]
    num_blocks: int
    fmt: Quant | str
    group: int | None


@dataclass(frozen=True)
class UnpackItem:
    """Decode (payload, scales) into `field` of blocks `block_ids` of the region in `buffer`."""

    buffer: torch.Tensor
    field: StridedField
    block_ids: torch.Tensor | Sequence[int]
    num_blocks: int
    payload: torch.Tensor
    scales: torch.Tensor
    fmt: Quant | str
    group: int | None


@dataclass(frozen=True)
class Geometry:
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
        return torch.empty((), dtype=self.dtype).element_size()


def _merge_leading(shape: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """Leading axes as (size, stride), size-1 axes dropped and row-major-adjacent axes merged."""
    axes = [(n, s) for n, s in zip(shape, strides) if n != 1]
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


def geometry(field: StridedField, fmt: Quant | str, group: int | None) -> Geometry:
    """Validate `field` for the Triton kernels and describe its groups."""
    fmt = Quant(fmt)
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
    if fmt is Quant.RAW:
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
    return Geometry(
        fmt=fmt,
        dtype=field.dtype,
        sizes=tuple(n for n, _ in leading),
        strides=tuple(s for _, s in leading),
        td=field.strides[-1],
        last=last,
        g=g,
        gpr=last // g,
        groups=numel // g,
        numel=numel,
        payload_per_block=payload_nbytes(fmt, numel, field.itemsize),
        columns=SCALE_COLUMNS[fmt],
    )


def tile_rows(geom: Geometry, block_g: int) -> int:
    """BLOCK_R: groups per program, a power of two of about `TILE_ELEMENTS` elements."""
    want = max(1, TILE_ELEMENTS // block_g)
    return min(want, max(1, 1 << (geom.groups - 1).bit_length()))


def check_ids(block_ids, num_blocks: int, *, distinct: bool = False) -> torch.Tensor:
    """Block ids as a CPU int64 vector, each in [0, num_blocks).

    Ids on a GPU are copied to the host (a synchronization): pass them as a list or a CPU tensor
    on the hot path.
    """
    ids = torch.as_tensor(block_ids, dtype=torch.int64).cpu()
    return reference.check_block_ids(ids, num_blocks, distinct=distinct)


def byte_address(t: torch.Tensor) -> int:
    """Address of the first byte of `t` (its storage start plus its storage offset)."""
    return t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()


def anchor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A one-element `dtype` alias at the start of `t`'s storage: the base of relative offsets."""
    view = torch.empty(0, dtype=dtype, device=t.device)
    view.set_(t.untyped_storage(), 0, (1,), (1,))
    return view


def element_offset(address: int, base: torch.Tensor, what: str) -> int:
    """`address - base`, in elements of `base`; both must be aligned to its element size."""
    size = base.element_size()
    delta = address - base.untyped_storage().data_ptr()
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


def signature(device: torch.device, field: StridedField, ids: torch.Tensor, fmt, group) -> tuple:
    """Items with equal signatures share one launch."""
    return (str(device), field.dtype, field.shape, field.strides, Quant(fmt), group, ids.numel())


def group_items(keys: Sequence[tuple]) -> list[list[int]]:
    """Indices of equal keys, in order of first appearance."""
    out: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        out.setdefault(key, []).append(i)
    return list(out.values())


def grid_check(programs_per_block: int, blocks: int) -> None:
    if blocks > 65535:
        raise ValueError(
            f"one launch handles at most 65535 (item, block) pairs, found {blocks}; "
            "split the batch"
        )
    if programs_per_block >= 2**31:
        raise ValueError(f"a field of {programs_per_block} tiles per block is too large for one launch")


def prod(values) -> int:
    return math.prod(values)
