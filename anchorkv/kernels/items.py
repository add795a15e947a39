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
