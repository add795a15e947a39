"""Where one field of a paged cache lives in raw memory: the only layout fact kernels see.

Axis letters used across `anchorkv.kernels`:
    N  selected blocks (one per block id)
    F  the field's own axes, last axis last, e.g. [heads, dk, dv] for a recurrent state
    D  the last axis, along which quantization groups of G elements are cut

The kernels know nothing of models, vLLM or stores; `anchorkv.codec.layout` turns a layer's
page description into a `StridedField`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StridedField:
    """One field of every block of a region.

    Element ``idx`` (a tuple over `shape`) of block ``b`` is the `dtype` value at byte
    ``base + b * block_stride + offset + itemsize * sum(idx[i] * strides[i])`` of the buffer.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements of `dtype`
    offset: int  # bytes from the start of a page
    block_stride: int  # bytes from one page to the next

    def __post_init__(self) -> None:
        # Launch plans are keyed by the fields of every item of a call (`batch.plan_key`): the
        # hash is computed once here, not by the dataclass's generated method on every lookup.
        object.__setattr__(self, "_hash", hash((self.dtype, self.shape, self.strides, self.offset,
                                                 self.block_stride)))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    def __getstate__(self) -> dict:
        # hashes differ between processes (torch.dtype and str hashes): never ship one
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def last_dim(self) -> int:
        return self.shape[-1] if self.shape else 1


def field_view(buffer: torch.Tensor, field: StridedField, num_blocks: int) -> torch.Tensor:
    """A strided alias `[num_blocks, *F]` of `field` over the bytes of `buffer`.

    `buffer` is any tensor; its bytes from its own first element on are the region. The alias
    shares memory with `buffer` (writes through it land in the region).
    """
    itemsize = field.itemsize
    byte_start = buffer.storage_offset() * buffer.element_size() + field.offset
    if byte_start % itemsize or field.block_stride % itemsize:
        raise ValueError(
            f"field of dtype {field.dtype} needs {itemsize}-byte alignment, found region start + "
            f"field offset = {byte_start} bytes and block stride {field.block_stride} bytes"
        )
    view = torch.empty(0, dtype=field.dtype, device=buffer.device)
    view.set_(
        buffer.untyped_storage(),
        byte_start // itemsize,
        (num_blocks, *field.shape),
        (field.block_stride // itemsize, *field.strides),
    )
    return view
