"""`Packed`: one field of some blocks, encoded, with everything needed to decode it."""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Any

import numpy as np
import torch

from anchorkv.codec.spec import CodecSpec

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
        if self.scales.numel() == 0:
            return 0
        return int(torch.isnan(self.scales[:, 0]).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Packed":
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
    def from_dict(cls, data: dict[str, Any]) -> "Packed":
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
