"""Hypothesis strategies for cache layouts: reused by the codec and kernel tests.

A generated case is one region (random bytes), a field with random dtype, shape, axis order,
padding and byte offset, a second field of another dtype aliasing the same bytes through its
own strides (vLLM's HMA dual-purpose regions), and source / target block-id sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from anchorkv.codec import CacheView, Field, PageLayout, Region

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: last-axis sizes: powers of two up to 128 (groups 32/64/128 and the whole axis), and
#: non-powers of two (6, 12, 24, 96: groups such as 3, 6, 12, 48)
EVEN_LAST = (2, 4, 6, 8, 12, 16, 24, 32, 64, 96, 128)
#: odd sizes (only odd groups divide them: fp8 and int8 take them, int4 does not), and 64
ODD_LAST = (1, 3, 5, 7, 15, 21, 64)
#: every size above: for formats that take any group (fp8, int8) and those that ignore it
ANY_LAST = tuple(sorted(set(EVEN_LAST + ODD_LAST)))
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Case:
    buffer: torch.Tensor
    view: CacheView
    alias: CacheView  # another page layout over the same bytes
    src_ids: list[int]
    dst_ids: list[int]



def group_sizes(last: int, fmt: str) -> st.SearchStrategy[int | None]:
    """A group size that `fmt` accepts for a last axis of `last` elements: None (the whole
    axis) or any divisor of it; for int4 (two codes a byte) an even one, so `last` must be even.
    `raw` and `bf16` ignore the group; any divisor is drawn for them too."""
    if fmt == "int4" and last % 2:
        raise ValueError(f"int4 needs an even group, and no even group divides {last}")
    divisors = [g for g in range(1, last + 1) if last % g == 0 and (fmt != "int4" or g % 2 == 0)]
    return st.sampled_from([None, *divisors])


@st.composite
def strided_field(draw, name: str, dtype=None, last_dims: Sequence[int] = EVEN_LAST,
                  max_extent=None):
    """A field with a random axis order, gaps between axes, and an aligned byte offset; its
    last axis has one of the sizes `last_dims`."""
    dtype = dtype or draw(st.sampled_from(DTYPES))
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 5)) for _ in range(ndim - 1)]
    last = draw(st.sampled_from(last_dims))
    shape.append(last)
    order = draw(st.permutations(range(ndim)))  # order[0] is the innermost axis
    strides = [0] * ndim
    step = 1
    for axis in order:
        strides[axis] = step
        step *= shape[axis] + draw(st.integers(0, 2))  # optional gap after each axis
    offset = draw(st.integers(0, 16)) * dtype.itemsize
    return Field(name, dtype, tuple(shape), tuple(strides), offset)


@st.composite
def cases(draw, last_dims: Sequence[int] = EVEN_LAST):
    f = draw(strided_field("x", last_dims=last_dims))
    a = draw(strided_field("alias", dtype=draw(st.sampled_from(DTYPES))))
    block_stride = max(f.extent, a.extent) + draw(st.integers(0, 3)) * 8
    block_stride += (-block_stride) % 8  # keeps every dtype aligned on every block
    num_blocks = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    buffer = torch.randint(0, 256, (num_blocks * block_stride + draw(st.integers(0, 9)),),
                           dtype=torch.uint8, generator=g)
    # make the field hold finite values (random bytes can be NaN/Inf): write normal data
    region = Region(buffer, num_blocks, block_stride)
    view = CacheView(region, PageLayout((f,), block_stride))
    alias = CacheView(Region(buffer, num_blocks, block_stride), PageLayout((a,), block_stride))
    t = view.tensor("x")
    t.copy_(torch.randn(t.shape, generator=g) * draw(st.sampled_from([1e-3, 1.0, 300.0])))
    n = draw(st.integers(1, num_blocks))
    src = draw(st.permutations(range(num_blocks)))[:n]
    dst = draw(st.permutations(range(num_blocks)))[:n]
    return Case(buffer, view, alias, list(src), list(dst))


def touched_mask(case_view: CacheView, name: str, ids: list[int]) -> torch.Tensor:
    """Bool mask over the region's bytes: those of field `name` in blocks `ids`."""
    region = case_view.region
    marker = torch.zeros_like(region.buffer, dtype=torch.uint8)
    f = case_view.page.field(name)
    as_int = Field(f.name, _SAME_SIZE_INT[f.itemsize], f.shape, f.strides, f.offset)
    marked = CacheView(Region(marker, region.num_blocks, region.block_stride),
                       PageLayout((as_int,), case_view.page.page_bytes)).tensor(name)
    marked[ids] = -1 if as_int.dtype != torch.uint8 else 255
    return marker != 0
