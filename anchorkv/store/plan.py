"""Which chunks and shards a rank's slice of an array touches, and where each lands.

A *region* is a list of slices over every axis of an array (the layer axis included). The
writer cuts a rank's block into shards of whole inner chunks (`shards_plan`); a load reads the
inner chunks its region covers (`chunk_plan`). Both plans are cached per array and region,
since every layer of a field repeats them.
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

from anchorkv.codec.layout import tp_slice
from anchorkv.store.errors import FormatError
from anchorkv.store.format import ArrayLayout

Region = list[slice]
Coords = tuple[int, ...]


class ChunkSlice(NamedTuple):
    """One inner chunk that a region covers, whole or in part."""

    key: str  # the chunk's key (of the values / codes; `ArrayLayout.chunk_key`)
    coords: Coords  # its coordinates in the array's chunk grid
    into_chunk: tuple[slice, ...]  # the covered part, as slices into the chunk
    into_region: tuple[slice, ...]  # the same part, as slices into the region's block
    whole: bool  # the region covers the whole chunk


class ShardSlot(NamedTuple):
    """One inner chunk of a shard a rank writes: where it comes from and where it goes."""

    chunk: ChunkSlice
    local: Coords  # the chunk's coordinates within its shard
    lead: int | None  # an edge chunk whose covered part is its first rows (axis 1): that row count


class ShardPlan(NamedTuple):
    """One shard a rank fills: its coordinates, its chunks per shard, its slots in zarr's order
    (empty slots past the array's end left out)."""

    shard: Coords
    chunks_per_shard: Coords
    slots: tuple[ShardSlot, ...]


def rank_region(array: ArrayLayout, layer: int, tp_size: int, tp_rank: int) -> Region:
    """The region of `array` (all axes, layer axis included) that a rank's slice covers."""
    region = [slice(layer, layer + 1)] + [slice(0, n) for n in array.shape[1:]]
    if array.shard_axis is not None:
        region[array.shard_axis] = tp_slice(array.shape[array.shard_axis], tp_size, tp_rank)
    return region


def chunks_in(array: ArrayLayout, region: Region) -> list[Coords]:
    """Chunk coordinates that intersect `region` (none for an empty one: a load of 0 blocks from
    a token inside a chunk named that chunk, and its plan failed an assertion)."""
    ranges = [range(s.start // c, -(-min(s.stop, n) // c)) if s.start < s.stop else range(0)
              for s, c, n in zip(region, array.chunks, array.shape, strict=True)]
    return list(itertools.product(*ranges))


def chunk_region(array: ArrayLayout, coords: Coords) -> Region:
    return [slice(i * c, (i + 1) * c) for i, c in zip(coords, array.chunks, strict=True)]


def overlap(a: Region, b: Region) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """(slices into a's block, slices into b's block) of a ∩ b, or None if empty."""
    ia, ib = [], []
    for x, y in zip(a, b, strict=True):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        ia.append(slice(lo - x.start, hi - x.start))
        ib.append(slice(lo - y.start, hi - y.start))
    return tuple(ia), tuple(ib)


@functools.lru_cache(maxsize=8192)
def _plan(array: ArrayLayout, bounds: tuple[tuple[int, int], ...]) -> tuple[ChunkSlice, ...]:
    out = []
    region = [slice(a, b) for a, b in bounds]
    for coords in chunks_in(array, region):
        both = overlap(chunk_region(array, coords), region)
        assert both is not None, f"chunk {coords} of {array.field!r} does not meet the region {region}"
        into_chunk, into_region = both
        whole = all(s.stop - s.start == c for s, c in zip(into_chunk, array.chunks, strict=True))
        out.append(ChunkSlice(array.chunk_key(coords), coords, into_chunk, into_region, whole))
    return tuple(out)


def chunk_plan(array: ArrayLayout, region: Region) -> tuple[ChunkSlice, ...]:
    """Every chunk that intersects `region` (`ChunkSlice`); cached per array and region."""
    return _plan(array, tuple((s.start, s.stop) for s in region))


@functools.lru_cache(maxsize=4096)
def _shards_plan(array: ArrayLayout, bounds: tuple[tuple[int, int], ...]) -> tuple[ShardPlan, ...]:
    rows = {item.coords: item for item in _plan(array, bounds)}
    k = array.chunks_per_shard
    out = []
    for shard in sorted({array.shard_of(c) for c in rows}):
        slots = []
        for coords in array.shard_chunks(shard):
            item = rows.get(coords)
            if item is None:
                if array.in_bounds(coords):
                    raise FormatError(
                        f"field {array.field!r}: shard {array.shard_key(shard)} would miss chunk "
                        f"{array.chunk_key(coords)}; a rank writes whole shards of its slice"
                    )
                continue  # past the array's end: an empty slot, as zarr leaves it
            into_chunk = item.into_chunk
            lead = None
            pairs = enumerate(zip(into_chunk, array.chunks, strict=True))
            if not item.whole and len(into_chunk) > 2 and into_chunk[1].start == 0 and all(
                    s.start == 0 and s.stop == c for i, (s, c) in pairs if i != 1):
                lead = into_chunk[1].stop
            slots.append(ShardSlot(item, tuple(c % n for c, n in zip(coords, k, strict=True)), lead))
        out.append(ShardPlan(shard, k, tuple(slots)))
    return tuple(out)


def shards_plan(array: ArrayLayout, region: Region) -> tuple[ShardPlan, ...]:
    """The shards a rank's region fills (`ShardPlan`), in order; cached per array and region.
    `FormatError` if the region would fill a shard only in part (a rank writes whole shards)."""
    return _shards_plan(array, tuple((s.start, s.stop) for s in region))
