"""Kernels: fused strided gather + quantize (`pack`) and dequantize + scatter (`unpack`).

Each op has a Triton kernel (`triton_pack.py`, `triton_unpack.py`; not `pack.py`: importing a
submodule named like a function of this package would replace that function) and a plain-torch
oracle in `reference.py` that defines its exact bytes. `pack` and `unpack` here pick one per call with
`anchorkv.kernels.dispatch.backend_for`: Triton for CUDA tensors, the reference on CPU.
`pack_many` / `unpack_many` do the same for a batch of `PackItem` / `UnpackItem` (all the
(layer, field) pairs of one request) in as few launches as possible.
"""

from __future__ import annotations

import torch

from typing import Sequence

from anchorkv.kernels import reference
from anchorkv.kernels.batch import PackItem, UnpackItem
from anchorkv.kernels.dispatch import backend_for
from anchorkv.kernels.formats import Quant
from anchorkv.kernels.geometry import StridedField, field_view

__all__ = [
    "PackItem", "Quant", "StridedField", "UnpackItem", "backend_for", "field_view", "pack",
    "pack_many", "reference", "unpack", "unpack_many",
]


def pack(
    buffer: torch.Tensor,
    field: StridedField,
    block_ids: torch.Tensor,
    num_blocks: int,
    fmt: Quant | str,
    group: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the selected blocks of `field` once; return (payload uint8, scales fp32 `[groups, C]`)."""
    if backend_for(buffer.device) == "triton":
        from anchorkv.kernels.triton_pack import pack as triton_pack

        return triton_pack(buffer, field, block_ids, num_blocks, fmt, group)
    return reference.pack(buffer, field, block_ids, num_blocks, fmt, group)


def unpack(
    buffer: torch.Tensor,
    field: StridedField,
    block_ids: torch.Tensor,
    num_blocks: int,
    payload: torch.Tensor,
    scales: torch.Tensor,
    fmt: Quant | str,
    group: int | None,
) -> None:
    """Decode (payload, scales) straight into the selected blocks of `field`; nothing else changes."""
    if backend_for(buffer.device) == "triton":
        from anchorkv.kernels.triton_unpack import unpack as triton_unpack

        return triton_unpack(buffer, field, block_ids, num_blocks, payload, scales, fmt, group)
    return reference.unpack(buffer, field, block_ids, num_blocks, payload, scales, fmt, group)


def _split_by_backend(items) -> tuple[list[int], list[int]]:
    """Indices of the items the Triton kernels take, and of those the reference takes."""
    triton_idx, reference_idx = [], []
    backends: dict[torch.device, str] = {}  # one lookup per device, not per item
    for i, item in enumerate(items):
        device = item.buffer.device
        backend = backends.get(device) or backends.setdefault(device, backend_for(device))
        (triton_idx if backend == "triton" else reference_idx).append(i)
    return triton_idx, reference_idx


def _all_triton(items) -> bool:
    """Whether every item is a CUDA tensor that the Triton kernels take (the common case, checked
    without building a device object per item)."""
    return (bool(items) and all(it.buffer.is_cuda for it in items)
            and backend_for(items[0].buffer.device) == "triton")


def pack_many(items: Sequence[PackItem]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`pack` of every item, in order; Triton items share launches (see `kernels.triton_pack.pack_many`)."""
    items = list(items)
    if _all_triton(items):
        from anchorkv.kernels.triton_pack import pack_many as triton_pack_many

        return triton_pack_many(items)
    out: list = [None] * len(items)
    triton_idx, reference_idx = _split_by_backend(items)
    if triton_idx:
        from anchorkv.kernels.triton_pack import pack_many as triton_pack_many

        for i, result in zip(triton_idx, triton_pack_many([items[i] for i in triton_idx])):
            out[i] = result
    for i in reference_idx:
        it = items[i]
        out[i] = reference.pack(it.buffer, it.field, it.block_ids, it.num_blocks, it.fmt, it.group)
    return out


def unpack_many(items: Sequence[UnpackItem]) -> None:
    """`unpack` of every item; their targets must not overlap."""
    items = list(items)
    if _all_triton(items):
        from anchorkv.kernels.triton_unpack import unpack_many as triton_unpack_many

        return triton_unpack_many(items)
    triton_idx, reference_idx = _split_by_backend(items)
    if triton_idx:
        from anchorkv.kernels.triton_unpack import unpack_many as triton_unpack_many

        triton_unpack_many([items[i] for i in triton_idx])
    for i in reference_idx:
        it = items[i]
        reference.unpack(
            it.buffer, it.field, it.block_ids, it.num_blocks, it.payload, it.scales, it.fmt, it.group
        )
