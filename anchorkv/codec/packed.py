"""`Packed`: one field of some blocks, encoded, with everything needed to decode it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from anchorkv.codec.spec import CodecSpec
from anchorkv.kernels.packset import may_hold_nan

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The serialized name of a torch dtype ("bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


@dataclass(eq=False)
class Packed:
    """Encoded values of a `[N, *F]` field slice.

    payload: uint8 `[bytes]`, the codec's output; scales: fp32 `[groups, C]` (C = 0 for raw).
    `shape` and `dtype` describe the decoded tensor (the field's own dtype).
    """

    codec: CodecSpec
    shape: tuple[int, ...]
    dtype: torch.dtype
    payload: torch.Tensor
    scales: torch.Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Stored bytes: payload plus scales."""
        return self.payload.numel() + self.scales.numel() * 4

    @property
    def source_nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def poisoned_groups(self) -> int:
        """Groups whose source held NaN/Inf (their scale is NaN); 0 for raw."""
        if not may_hold_nan(self.scales):
            return 0
        return int(torch.isnan(self.scales[:, 0]).sum())

    def _per_leading(self) -> tuple[int, int]:
        """(payload bytes, scale rows) per index of the leading axis."""
        n = self.shape[0]
        scale_rows = self.scales.shape[0] if self.scales.numel() else 0
        if n == 0 or self.payload.numel() % n or scale_rows % n:
            raise ValueError(f"packed {list(self.shape)} cannot be split along its leading axis")
        return self.payload.numel() // n, scale_rows // n

    def narrow(self, start: int, length: int) -> Packed:
        """Indices [start, start + length) of the leading axis (groups never straddle them)."""
        if not 0 <= start <= start + length <= self.shape[0]:
            raise IndexError(f"rows [{start}, {start + length}) out of range for leading axis {self.shape[0]}")
        pb, sr = self._per_leading()
        scales = self.scales[start * sr : (start + length) * sr] if sr else self.scales
        return Packed(self.codec, (length, *self.shape[1:]), self.dtype,
                      self.payload[start * pb : (start + length) * pb], scales)

    def reshape(self, *shape: int) -> Packed:
        """Same bytes, another shape with the same last axis (e.g. [N, bs, D] <-> [N*bs, D])."""
        if math.prod(shape) != self.numel or shape[-1] != self.shape[-1]:
            raise ValueError(f"cannot reshape packed {list(self.shape)} to {list(shape)}: the element "
                             "count and the last axis (the quantization rows) must stay")
        return Packed(self.codec, tuple(shape), self.dtype, self.payload, self.scales)

    @staticmethod
    def cat(parts: list[Packed]) -> Packed:
        """Concatenate along the leading axis (same codec, dtype and trailing shape)."""
        first = parts[0]
        for p in parts[1:]:
            if (p.codec, p.dtype, p.shape[1:]) != (first.codec, first.dtype, first.shape[1:]):
                raise ValueError(f"cannot concatenate packed {p.codec} {p.dtype} {list(p.shape)} "
                                 f"to {first.codec} {first.dtype} {list(first.shape)}")
        return Packed(first.codec, (sum(p.shape[0] for p in parts), *first.shape[1:]), first.dtype,
                      torch.cat([p.payload for p in parts]), torch.cat([p.scales for p in parts]))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Packed:
        return Packed(
            self.codec,
            self.shape,
            self.dtype,
            self.payload.to(device, non_blocking=non_blocking),
            self.scales.to(device, non_blocking=non_blocking),
        )

    def meta(self) -> dict[str, Any]:
        """JSON-serializable description (no data)."""
        return {
            "codec": self.codec.to_dict(),
            "shape": list(self.shape),
            "dtype": dtype_name(self.dtype),
            "payload_bytes": int(self.payload.numel()),
            "scales_shape": list(self.scales.shape),
        }

    def to_dict(self) -> dict[str, Any]:
        """Metadata plus the payload and scales as `bytes` (for pickling, msgpack, tests)."""
        data = self.meta()
        data["payload"] = self.payload.cpu().numpy().tobytes()
        data["scales"] = self.scales.cpu().contiguous().numpy().tobytes()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Packed:
        payload = torch.from_numpy(np.frombuffer(bytearray(data["payload"]), dtype=np.uint8))
        scales = torch.from_numpy(np.frombuffer(bytearray(data["scales"]), dtype=np.float32))
        if payload.numel() != data["payload_bytes"]:
            raise ValueError(
                f"packed payload should hold {data['payload_bytes']} bytes, found {payload.numel()}"
            )
        return cls(
            CodecSpec.from_dict(data["codec"]),
            tuple(data["shape"]),
            dtype_from_name(data["dtype"]),
            payload,
            scales.reshape(data["scales_shape"]),
        )
