"""The layout model: regions of raw bytes, pages of blocks, named fields inside a page.

A *region* is one raw byte buffer. The page of block `b` starts at `b * block_stride` bytes
from the region's start. A *page layout* lists named *fields*, each `(name, dtype, shape,
element strides, byte offset in the page)`. Several page layouts may be laid over one region
at once (vLLM's hybrid allocator lets a KDA layer and an MLA layer share the same bytes, each
with its own strides); a `CacheView` is one such pairing, and every read or write goes through
the strides of its own field, never another view's.

A field's `shape` is in *logical* axis order: for a field that tensor parallelism shards, it
is the rank's slice of the TP-independent `logical_shape` (cut along `shard_axis`), so a
gathered field is exactly the rank's slice of the logical array the store keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from anchorkv.kernels.strided import StridedField, field_view


@dataclass(frozen=True)
class Field:
    """One named tensor inside every page.

    shape/strides: the rank-local shape in logical axis order and its element strides within
    the page; offset: bytes from the page start. logical_shape: the TP-independent shape
    (default: `shape`); shard_axis: the axis of `logical_shape` that `tp_size` ranks split
    evenly (None: replicated on every rank). role: what the field holds (`Role`, e.g.
    ``"conv_state"``, ``"ssm_state"``, ``"k"``, ``"v"``, ``"latent"``); it keys the codec
    config and is not part of what an entry must agree with.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int = 0
    logical_shape: tuple[int, ...] = None  # type: ignore[assignment]  # None: the same as shape (__post_init__)
    shard_axis: int | None = None
    tp_size: int = 1
    tp_rank: int = 0
    role: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "strides", tuple(int(s) for s in self.strides))
        if self.logical_shape is None:
            object.__setattr__(self, "logical_shape", self.shape)
        object.__setattr__(self, "logical_shape", tuple(int(s) for s in self.logical_shape))
        where = f"field {self.name!r}"
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"{where}: dtype must be a torch.dtype, found {self.dtype!r}")
        if len(self.shape) != len(self.strides) or not self.shape:
            raise ValueError(
                f"{where}: shape {list(self.shape)} and strides {list(self.strides)} must be "
                "non-empty and of the same length"
            )
        if any(s <= 0 for s in self.shape) or any(s <= 0 for s in self.strides):
            raise ValueError(
                f"{where}: sizes and strides must be positive, found shape {list(self.shape)} "
                f"strides {list(self.strides)}"
            )
        if self.offset < 0 or self.offset % self.dtype.itemsize:
            raise ValueError(
                f"{where}: byte offset {self.offset} must be a non-negative multiple of "
                f"{self.dtype.itemsize} (the size of {self.dtype})"
            )
        _check_no_self_overlap(where, self.shape, self.strides)
        if not 1 <= self.tp_size or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"{where}: tp_rank {self.tp_rank} must lie in [0, tp_size={self.tp_size})")
        if len(self.logical_shape) != len(self.shape):
            raise ValueError(
                f"{where}: logical shape {list(self.logical_shape)} must have as many axes as "
                f"shape {list(self.shape)}"
            )
        expected = list(self.logical_shape)
        if self.shard_axis is not None:
            if not 0 <= self.shard_axis < len(expected):
                raise ValueError(f"{where}: shard axis {self.shard_axis} out of range")
            full = expected[self.shard_axis]
            if full % self.tp_size:
                raise ValueError(
                    f"{where}: tp_size {self.tp_size} does not divide axis {self.shard_axis} "
                    f"of logical shape {list(self.logical_shape)} ({full})"
                )
            expected[self.shard_axis] = full // self.tp_size
        elif self.tp_size != 1 and self.logical_shape != self.shape:
            raise ValueError(f"{where}: a replicated field must have shape == logical shape")
        if tuple(expected) != self.shape:
            raise ValueError(
                f"{where}: at tp_size {self.tp_size} the rank-local shape should be {expected}, "
                f"found {list(self.shape)}"
            )

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of one block's field when packed densely."""
        return self.numel * self.itemsize

    @property
    def extent(self) -> int:
        """One past the last byte of the page this field touches."""
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))
        return self.offset + (last + 1) * self.itemsize

    def rank_slice(self) -> tuple[slice, ...]:
        """The slice of `logical_shape` this rank owns (all of it when replicated)."""
        out = [slice(0, n) for n in self.logical_shape]
        if self.shard_axis is not None:
            out[self.shard_axis] = tp_slice(self.logical_shape[self.shard_axis], self.tp_size, self.tp_rank)
        return tuple(out)

    def strided(self, block_stride: int) -> StridedField:
        # one object per block stride, kept on the instance (outside the dataclass fields, so
        # equality and hashing do not see it): the connector asks for it every step, and the
        # kernels' launch plans compare it to the one they were built from (identity first)
        cache = self.__dict__.setdefault("_strided", {})
        out = cache.get(block_stride)
        if out is None:
            out = cache[block_stride] = StridedField(self.dtype, self.shape, self.strides,
                                                     self.offset, block_stride)
        return out


def tp_slice(length: int, tp_size: int, tp_rank: int) -> slice:
    """The part of an axis of `length` that rank `tp_rank` of `tp_size` owns: the `tp_rank`-th of
    `tp_size` equal parts. The one rule of tensor-parallel slicing, in elements or in chunks
    (the store's arrays use it too); the caller checks that `tp_size` divides `length`."""
    n = length // tp_size
    return slice(tp_rank * n, (tp_rank + 1) * n)


def _check_no_self_overlap(where: str, shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
    """Distinct indices must address distinct elements, or a round trip could not be exact."""
    span = 1
    for n, s in sorted(zip(shape, strides, strict=True), key=lambda p: p[1]):
        if n > 1 and s < span:
            raise ValueError(
                f"{where}: strides {list(strides)} make elements of shape {list(shape)} overlap"
            )
        span = max(span, s * (n - 1) + 1) if n > 1 else span


def _byte_runs(f: Field) -> list[tuple[int, int]]:
    """The [start, end) byte runs of one page that field `f` covers: its innermost axes that
    are contiguous fold into one run, the others enumerate run starts."""
    axes = sorted((stride, n) for stride, n in zip(f.strides, f.shape, strict=True) if n > 1)
    length, k = f.itemsize, 0
    while k < len(axes) and axes[k][0] * f.itemsize == length:
        length *= axes[k][1]
        k += 1
    starts = [f.offset]
    for stride, n in axes[k:]:
        starts = [s + i * stride * f.itemsize for s in starts for i in range(n)]
        if len(starts) > 1 << 20:
            raise ValueError(f"field {f.name!r}: too many separate byte runs to check for overlap")
    return [(s, s + length) for s in starts]


def _check_fields_disjoint(fields: tuple[Field, ...]) -> None:
    """No byte of the page belongs to two fields. Fields may interleave (the segments of a
    convolution state's channel axis are separate fields whose rows alternate), so fields
    whose spans overlap are compared run by run, not by span."""
    for i, a in enumerate(fields):
        for b in fields[i + 1:]:
            if a.offset >= b.extent or b.offset >= a.extent:
                continue  # disjoint spans: the common case
            runs = sorted([(s, e, a.name) for s, e in _byte_runs(a)] + [(s, e, b.name) for s, e in _byte_runs(b)])
            end, owner = -1, None
            for s, e, name in runs:
                if s < end and name != owner:
                    raise ValueError(f"fields {a.name!r} and {b.name!r} overlap in the page (both "
                                     f"cover byte {s})")
                if e > end:
                    end, owner = e, name


def dense_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


@dataclass(frozen=True)
class PageLayout:
    """The fields of one page; `page_bytes` is the page size (the block stride vLLM uses)."""

    fields: tuple[Field, ...]
    page_bytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", tuple(self.fields))
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"page fields must have distinct names, found {names}")
        for f in self.fields:
            if f.extent > self.page_bytes:
                raise ValueError(
                    f"field {f.name!r} ends at byte {f.extent} of the page, beyond the page "
                    f"size {self.page_bytes}"
                )
        _check_fields_disjoint(self.fields)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"unknown field {name!r}; this page has {list(self.names)}")


@dataclass(frozen=True, eq=False)
class Region:
    """`num_blocks` pages of `block_stride` bytes in the bytes of `buffer`.

    `buffer` may be any tensor (int8 in vLLM); its bytes from its first element on are the
    region. Views of the same storage with different strides are different `Region`s of the
    same bytes.
    """

    buffer: torch.Tensor
    num_blocks: int
    block_stride: int

    def __post_init__(self) -> None:
        if self.num_blocks < 0 or self.block_stride <= 0:
            raise ValueError(
                f"a region needs num_blocks >= 0 and block_stride > 0, found {self.num_blocks} "
                f"and {self.block_stride}"
            )

    @classmethod
    def from_view(cls, view: torch.Tensor) -> Region:
        """The region behind a per-layer cache view whose axis 0 is the block axis."""
        return cls(view, view.shape[0], view.stride(0) * view.element_size())

    @property
    def available_bytes(self) -> int:
        start = int(self.buffer.storage_offset()) * self.buffer.element_size()
        return int(self.buffer.untyped_storage().nbytes()) - start

    @property
    def device(self) -> torch.device:
        return self.buffer.device


@dataclass(frozen=True, eq=False)
class CacheView:
    """A page layout laid over a region: the only way anchorkv reads or writes cache bytes."""

    region: Region
    page: PageLayout
    name: str = ""

    def __post_init__(self) -> None:
        where = f"view {self.name!r}" if self.name else "view"
        if self.page.page_bytes > self.region.block_stride:
            raise ValueError(
                f"{where}: page of {self.page.page_bytes} bytes does not fit the region's block "
                f"stride of {self.region.block_stride} bytes"
            )
        if self.region.num_blocks:
            need = (self.region.num_blocks - 1) * self.region.block_stride + max(
                (f.extent for f in self.page.fields), default=0
            )
            if need > self.region.available_bytes:
                raise ValueError(
                    f"{where}: {self.region.num_blocks} blocks of {self.region.block_stride} bytes "
                    f"need {need} bytes, but the buffer holds {self.region.available_bytes}"
                )

    def strided(self, name: str) -> StridedField:
        return self.page.field(name).strided(self.region.block_stride)

    def tensor(self, name: str) -> torch.Tensor:
        """A strided alias `[num_blocks, *shape]` of field `name` (writes go to the cache)."""
        return field_view(self.region.buffer, self.strided(name), self.region.num_blocks)
