"""What every chunk encoding shares (`ChunkEncoding`: the byte layout of one stored chunk of a
codec's output, a block's byte sizes and views) and a block's encoded bytes as arrays
(`Encoded`); `anchorkv.store.format` (built-in formats, `QuantChunkEncoding`) and
`anchorkv.store.plugin_format` (codec plug-ins, `PluginChunkEncoding`) build on it."""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import numpy as np
import torch

from anchorkv.codec.packed import dtype_from_name
from anchorkv.codec.spec import CodecSpec
from anchorkv.store.errors import FormatError

#: The cache dtypes a field may have to be stored.
SOURCE_DTYPES = ("bfloat16", "float16", "float32")


class ChunkEncoding(abc.ABC):
    """The byte layout of one stored chunk of a codec's output, what built-in
    (`QuantChunkEncoding`) and plug-in (`PluginChunkEncoding`) encodings share: a block's byte
    sizes and its views, from `row_bytes`, `groups` and `columns`."""

    #: the cache dtype of the values (one of `SOURCE_DTYPES`)
    source_dtype: str
    #: whether a codec plug-in encodes the chunks (`PluginChunkEncoding`)
    plugin: ClassVar[bool]

    # -- what each encoding says (`QuantChunkEncoding`, `PluginChunkEncoding`)
    @property
    @abc.abstractmethod
    def spec(self) -> CodecSpec:
        """The codec spec that packs values into these chunks."""

    @property
    @abc.abstractmethod
    def columns(self) -> int:
        """Scale columns per group (0: no scales)."""

    @abc.abstractmethod
    def row_bytes(self, width: int) -> int:
        """Payload bytes of `width` consecutive elements of the last axis."""

    @abc.abstractmethod
    def groups(self, width: int) -> int:
        """Scale groups of `width` consecutive elements of the last axis."""

    # -- what follows from it
    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.source_dtype)

    @cached_property
    def source_itemsize(self) -> int:
        """Bytes per value in the cache (of `source_dtype`)."""
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def nbytes(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """(payload bytes, scale bytes) of a block of `shape`."""
        outer = math.prod(shape[:-1])
        return outer * self.row_bytes(shape[-1]), outer * self.groups(shape[-1]) * self.columns * 4

    def views(self, payload: np.ndarray, scales: np.ndarray, shape: tuple[int, ...]) -> Encoded:
        """`payload`/`scales` of a block of `shape` as arrays indexable by its axes."""
        pn, sn = self.nbytes(shape)
        if payload.size != pn or scales.size * 4 != sn:
            raise FormatError(f"a {list(shape)} block of {self.spec} {self.source_dtype} is {pn} payload bytes "
                              f"and {sn // 4} scales, found {payload.size} and {scales.size}")
        p = payload.reshape(*shape[:-1], self.row_bytes(shape[-1]))
        if self.columns:
            s = scales.reshape(*shape[:-1], self.groups(shape[-1]), self.columns)
        else:
            s = np.empty((*shape[:-1], 0, 0), np.float32)
        return Encoded(self, p, s)

    def split(self, data: bytes | bytearray | memoryview | np.ndarray, shape: tuple[int, ...]) -> Encoded:
        """The payload and scales of one encoded chunk (views, no copy)."""
        if isinstance(data, np.ndarray):
            buf = data.view(np.uint8).reshape(-1)
        else:
            buf = np.frombuffer(data, dtype=np.uint8)
        pn, sn = self.nbytes(shape)
        if buf.size != pn + sn:
            raise ValueError(f"a {list(shape)} chunk of {self.spec} {self.source_dtype} is {pn + sn} bytes, "
                             f"found {buf.size}")
        scales = buf[pn:].view(np.float32) if sn else np.empty(0, np.float32)
        return self.views(buf[:pn], scales, shape)


@dataclass(frozen=True)
class Encoded:
    """A block's payload `[*outer, row_bytes]` and scales `[*outer, groups, C]` (numpy views).

    Slicing a region of the logical block is slicing both arrays: along the last axis by
    `row_bytes` / `groups` of the start and stop (they are multiples of the group size).
    """

    encoding: ChunkEncoding  # a `QuantChunkEncoding` or a `PluginChunkEncoding`
    payload: np.ndarray
    scales: np.ndarray

    def region(self, sl: tuple[slice, ...]) -> Encoded:
        *outer, last = sl
        e = self.encoding
        pl = (*outer, slice(e.row_bytes(last.start), e.row_bytes(last.stop)))
        gl = (*outer, slice(e.groups(last.start), e.groups(last.stop)))
        return Encoded(e, self.payload[pl], self.scales[gl])

    def buffers(self) -> tuple[list[memoryview], list[memoryview]]:
        """The chunk bytes as ([payload], [scales]) buffers (one list per `Part`), copied only
        where not contiguous; no scales buffer for raw."""
        scales = [np.ascontiguousarray(self.scales).data.cast("B")] if self.scales.size else []
        return [np.ascontiguousarray(self.payload).data.cast("B")], scales
