"""Kernels: fused strided gather + quantize (`pack`) and dequantize + scatter (`unpack`).

Each op has a Triton kernel (`triton_pack.py`, `triton_unpack.py`; not `pack.py`: importing a
submodule named like a function of this package would replace that function) and a plain-torch
oracle in `reference.py` that defines its exact bytes. Every entry point takes items: a
`PackItem` (region, field, block ids, spec) or an `UnpackItem` (the same plus payload and
scales). `pack` and `unpack` here pick a backend per call with
`anchorkv.kernels.dispatch.backend_for`: Triton for CUDA tensors, the reference on CPU.
`pack_many` / `unpack_many` do the same for a batch of items (all the (layer, field) pairs of
one request) in as few launches as possible. A `PackSet` packs the same targets call after call
(a connector's every save), only the block ids changing, into one `PackedBatch`; an
`UnpackSet` writes such a batch back into fixed targets.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from anchorkv.kernels import reference
from anchorkv.kernels.batch import BatchLayout
from anchorkv.kernels.dispatch import backend_for
from anchorkv.kernels.items import PackItem, PackTarget, Span, UnpackItem
from anchorkv.kernels.packset import PackedBatch, PackSet, UnpackSet
from anchorkv.kernels.quant import Quant, QuantSpec
from anchorkv.kernels.strided import StridedField, field_view

__all__ = [
    "BatchLayout", "PackItem", "PackSet", "PackTarget", "PackedBatch", "Quant", "QuantSpec", "Span", "StridedField",
    "UnpackItem", "UnpackSet", "backend_for", "field_view", "pack", "pack_many", "reference", "unpack", "unpack_many",
]


def pack(item: PackItem) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the selected blocks of the item's field once and encode them with its spec.

    Returns (payload, scales):

    * payload: uint8 `[bytes]`, the codes of `[N, *F]` in row-major order (raw: the source
      bytes; fp8/int8: one byte a value; int4: two values a byte, the even one low; bf16: two
      bytes a value);
    * scales: fp32 `[N * numel(F) / G, C]`, C = 1 (scale) for fp8/int8, 2 (scale, min) for
      int4, 0 for raw and bf16.

    The spec's id is raw, fp8, int8, int4 or bf16; its group is G, a divisor of D (None: all of
    D). Source dtypes bf16, fp16 and fp32 (raw: any 1/2/4/8-byte dtype). Groups holding NaN or
    +-Inf are poisoned (scale NaN 0x7FC00000, zero payload, min 0). Block ids on a GPU cost one
    host synchronization; pass them as a list or CPU tensor.
    """
    return pack_many([item])[0]


def unpack(item: UnpackItem) -> None:
    """Decode the item's (payload, scales) of `[N, *F]` straight into its selected blocks.

    payload and scales are as `pack` made them (from any blocks; N = len(block_ids)). Each value
    is code * scale (+ min for int4, never fused into an FMA), rounded once to the field's dtype
    (RNE); NaN results are written as the dtype's canonical NaN. Only the selected blocks' field
    elements are written; the block ids must be distinct.
    """
    unpack_many([item])


def _split_by_backend(items) -> tuple[list[int], list[int]]:
    """Indices of the items the Triton kernels take, and of those the reference takes."""
    triton_idx: list[int] = []
    reference_idx: list[int] = []
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

        for i, result in zip(triton_idx, triton_pack_many([items[i] for i in triton_idx]), strict=True):
            out[i] = result
    for i in reference_idx:
        out[i] = reference.pack(items[i])
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
        reference.unpack(items[i])
