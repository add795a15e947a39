"""anchorkv's quantization codec for zarr v3 (`AnchorQuantCodec`) and numcodecs (`AnchorQuant`).

Both encode exactly as `anchorkv.store.format.ChunkCodec` (``payload || scales``), which is
what the store's fast path writes from `Packed` objects, so a plain zarr-python script reads an
entry with ``zarr.open_group(path)["recurrent"][3]`` (the dequantized layer, as float32).

zarr finds the codec after `register()`; ``import anchorkv.store`` calls it, as zarr's own
codec modules do. (A ``zarr.codecs`` entry point ``anchorkv.quant`` would spare even that
import; pyproject.toml does not declare it yet.)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numcodecs
from numcodecs.abc import Codec as NumcodecsCodec
import numpy as np
from zarr.abc.codec import ArrayBytesCodec
from zarr.core.common import parse_named_configuration

from anchorkv.kernels.formats import Quant
from anchorkv.store.format import CODEC_NAME, ChunkCodec

if TYPE_CHECKING:
    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer, NDBuffer


@dataclass(frozen=True)
class AnchorQuantCodec(ArrayBytesCodec):
    """zarr v3 array->bytes codec: float32 chunk <-> anchorkv ``payload || scales`` bytes."""

    is_fixed_size = True

    format: str
    group: int | None
    source_dtype: str

    def __init__(self, *, format: str, group: int | None = None, source_dtype: str = "float32") -> None:
        chunk = ChunkCodec(Quant(format), group, source_dtype)  # validates
        object.__setattr__(self, "format", chunk.format.value)
        object.__setattr__(self, "group", chunk.group)
        object.__setattr__(self, "source_dtype", chunk.source_dtype)

    @property
    def chunk_codec(self) -> ChunkCodec:
        return ChunkCodec(Quant(self.format), self.group, self.source_dtype)

    @classmethod
    def from_chunk_codec(cls, codec: ChunkCodec) -> "AnchorQuantCodec":
        return cls(**codec.to_config())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AnchorQuantCodec":
        _, config = parse_named_configuration(data, CODEC_NAME)
        return cls(**config)

    def to_dict(self) -> dict[str, Any]:
        return {"name": CODEC_NAME, "configuration": self.chunk_codec.to_config()}

    def validate(self, *, shape, dtype, chunk_grid) -> None:
        if dtype.to_native_dtype() != np.dtype("float32"):
            raise ValueError(f"{CODEC_NAME} arrays are float32 (logical values), found {dtype}")
        chunk_shape = getattr(chunk_grid, "chunk_shape", None)
        if chunk_shape is not None and self.group is not None and chunk_shape[-1] % self.group:
            raise ValueError(
                f"{CODEC_NAME}: group {self.group} must divide the chunk's last axis ({chunk_shape[-1]})"
            )

    def compute_encoded_size(self, input_byte_length: int, chunk_spec: ArraySpec) -> int:
        return sum(self.chunk_codec.nbytes(tuple(chunk_spec.shape)))

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        values = self.chunk_codec.decode(chunk_bytes.as_numpy_array(), tuple(chunk_spec.shape))
        return chunk_spec.prototype.nd_buffer.from_numpy_array(values)

    def _encode_sync(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        data = self.chunk_codec.encode(chunk_array.as_numpy_array())
        return chunk_spec.prototype.buffer.from_bytes(data)

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        return await asyncio.to_thread(self._encode_sync, chunk_array, chunk_spec)


class AnchorQuant(NumcodecsCodec):
    """The same bytes as a numcodecs codec (for zarr v2 tools and plain numcodecs users).

    numcodecs hands codecs flat buffers, so `encode` needs an array whose last axis the group
    divides, and `decode` returns a flat float32 array (the caller reshapes, as zarr v2 does).
    """

    codec_id = CODEC_NAME

    def __init__(self, format: str, group: int | None = None, source_dtype: str = "float32") -> None:
        self.chunk = ChunkCodec(Quant(format), group, source_dtype)
        self.format, self.group, self.source_dtype = self.chunk.format.value, self.chunk.group, source_dtype

    def encode(self, buf):
        values = np.asarray(buf, dtype=np.float32)
        if values.ndim == 0:
            values = values.reshape(1)
        if self.group is not None and values.shape[-1] % self.group:
            raise ValueError(f"{CODEC_NAME}: group {self.group} must divide the last axis ({values.shape[-1]})")
        return self.chunk.encode(values)

    def decode(self, buf, out=None):
        data = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.view(np.uint8).reshape(-1)
        c = self.chunk
        per_group = c.group or 1
        unit_p, unit_s = c.nbytes((per_group,))  # bytes of one group of elements
        if data.size % (unit_p + unit_s):
            raise ValueError(f"{CODEC_NAME}: {data.size} bytes are not a whole number of groups")
        n = data.size // (unit_p + unit_s) * per_group
        values = c.decode(data, (n // per_group, per_group)).reshape(-1)
        if out is not None:
            np.copyto(np.asarray(out).reshape(-1), values)
            return out
        return values

    def get_config(self) -> dict[str, Any]:
        return {"id": CODEC_NAME, **self.chunk.to_config()}


_registered = False


def register() -> None:
    """Register both codecs under ``anchorkv.quant`` (idempotent)."""
    global _registered
    if _registered:
        return
    from zarr.registry import register_codec

    register_codec(CODEC_NAME, AnchorQuantCodec)
    numcodecs.register_codec(AnchorQuant)
    _registered = True
