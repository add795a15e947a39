"""The items every kernel entry point takes: one (region, field, blocks, spec) to pack, and the
same plus its packed bytes to unpack. One type per entry point, so the reference, the Triton
backend and the dispatching functions in `anchorkv.kernels` never repeat a positional signature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from anchorkv.kernels.quant import QuantSpec
from anchorkv.kernels.strided import StridedField


@dataclass(frozen=True)
class PackItem:
    """The argument of every pack entry point (`kernels.pack`, `pack_many`, the reference and
    Triton backends): pack `field` of blocks `block_ids` of the region in `buffer` (`num_blocks`
    blocks) with the format and group of `spec`."""

    buffer: torch.Tensor
    field: StridedField
    block_ids: torch.Tensor | Sequence[int]
    num_blocks: int
    spec: QuantSpec


@dataclass(frozen=True)
class PackTarget:
    """A `PackItem` without its block ids: what a `kernels.PackSet` packs call after call
    (the connector packs the same (layer, field) pairs every step; only the blocks change)."""

    buffer: torch.Tensor
    field: StridedField
    num_blocks: int
    spec: QuantSpec


@dataclass(frozen=True)
class UnpackItem:
    """The argument of every unpack entry point: decode (`payload`, `scales`), packed with
    `spec`, into `field` of blocks `block_ids` of the region in `buffer`."""

    buffer: torch.Tensor
    field: StridedField
    block_ids: torch.Tensor | Sequence[int]
    num_blocks: int
    spec: QuantSpec
    payload: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True)
class Span:
    """Where one item's outputs lie in a call's two output tensors: its payload bytes
    `[payload_at, payload_at + payload_bytes)` of the uint8 payload, and its `scale_rows` x
    `columns` scales from fp32 element `scales_at` (`columns` 0: no scales, raw and bf16)."""

    payload_at: int
    payload_bytes: int
    scales_at: int
    scale_rows: int
    columns: int
