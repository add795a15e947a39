"""Codecs by id: the built-in formats (raw, fp8, int8, int4, bf16) plus any plug-in from the `anchorkv.codecs` group.

A plug-in is a class or object with `id`, `encode(values, spec) -> (payload uint8, scales
fp32 [groups, C])` and `decode(payload, scales, spec, shape, dtype) -> Tensor`, registered
with `register_codec` or advertised as an entry point::

    [project.entry-points."anchorkv.codecs"]
    learned-proj = "mypkg.codecs:LearnedProjection"

Entry points are read once, the first time an id is not found; nothing happens at import.
"""

from __future__ import annotations

from importlib.metadata import entry_points
import threading
from typing import Protocol, runtime_checkable

import torch

from anchorkv import kernels
from anchorkv.codec.spec import CodecSpec
from anchorkv.kernels import reference
from anchorkv.kernels.formats import Quant
from anchorkv.kernels.geometry import StridedField

ENTRY_POINT_GROUP = "anchorkv.codecs"


@runtime_checkable
class Codec(Protocol):
    id: str

    def encode(self, values: torch.Tensor, spec: CodecSpec) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode(
        self,
        payload: torch.Tensor,
        scales: torch.Tensor,
        spec: CodecSpec,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> torch.Tensor: ...


class QuantCodec:
    """A built-in format; packs and unpacks with the fused kernels (one pass over the cache)."""

    lossless = False

    def __init__(self, fmt: Quant) -> None:
        self.fmt = Quant(fmt)
        self.id = self.fmt.value
        self.lossless = self.fmt is Quant.RAW

    def encode(self, values, spec):
        return reference.quantize(values, self.fmt, spec.group)

    def decode(self, payload, scales, spec, shape, dtype):
        return reference.dequantize(payload, scales, self.fmt, spec.group, shape, dtype)

    def pack(self, buffer, field: StridedField, block_ids, num_blocks, spec):
        return kernels.pack(buffer, field, block_ids, num_blocks, self.fmt, spec.group)

    def unpack(self, buffer, field: StridedField, block_ids, num_blocks, payload, scales, spec):
        kernels.unpack(buffer, field, block_ids, num_blocks, payload, scales, self.fmt, spec.group)

    def __repr__(self) -> str:
        return f"QuantCodec({self.id!r})"


_lock = threading.Lock()
_codecs: dict[str, Codec] = {fmt.value: QuantCodec(fmt) for fmt in Quant}
_entry_points_loaded = False


def register_codec(codec: Codec | type, *, replace: bool = False) -> Codec:
    """Make `codec` (an instance, or a class built without arguments) available by its id."""
    instance = codec() if isinstance(codec, type) else codec
    if not isinstance(instance, Codec):
        raise TypeError(
            f"a codec needs an `id` and encode(values, spec) / decode(payload, scales, spec, "
            f"shape, dtype); {instance!r} lacks some of them"
        )
    CodecSpec(instance.id)  # validates the id's spelling
    with _lock:
        if instance.id in _codecs and not replace:
            raise ValueError(
                f"codec id {instance.id!r} is taken by {_codecs[instance.id]!r}; "
                "pass replace=True to override it"
            )
        _codecs[instance.id] = instance
    return instance


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _codecs:
            register_codec(ep.load())


def get_codec(codec_id: str) -> Codec:
    if codec_id not in _codecs:
        _load_entry_points()
    try:
        return _codecs[codec_id]
    except KeyError:
        raise KeyError(
            f"no codec {codec_id!r}; known: {sorted(_codecs)} (plug-ins register with "
            f"anchorkv.codec.register_codec or the {ENTRY_POINT_GROUP!r} entry-point group)"
        ) from None


def available_codecs() -> list[str]:
    _load_entry_points()
    return sorted(_codecs)
