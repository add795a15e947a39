"""Kernels: fused strided gather + quantize (`pack`) and dequantize + scatter (`unpack`).

Each op has a Triton kernel (`pack.py`, `unpack.py`) and a plain-torch oracle in
`reference.py` that defines its exact bytes. `pack` and `unpack` here pick one per call with
`anchorkv.kernels.dispatch.backend_for`: Triton for CUDA tensors, the reference on CPU.
"""

from __future__ import annotations

import torch

from anchorkv.kernels import reference
from anchorkv.kernels.dispatch import backend_for
from anchorkv.kernels.formats import Quant
from anchorkv.kernels.geometry import StridedField, field_view

__all__ = ["Quant", "StridedField", "field_view", "pack", "unpack", "backend_for", "reference"]


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
        from anchorkv.kernels.pack import pack as triton_pack

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
        from anchorkv.kernels.unpack import unpack as triton_unpack

        return triton_unpack(buffer, field, block_ids, num_blocks, payload, scales, fmt, group)
    return reference.unpack(buffer, field, block_ids, num_blocks, payload, scales, fmt, group)
