"""Codecs by id: the built-in formats (raw, fp8, int8, int4, bf16) plus any plug-in from the `anchorkv.codecs` group.

A plug-in is a class (built without arguments) or an object with `id`, `encode` and `decode`
(see `Codec`), registered with `register_codec` or advertised as an entry point whose name is
its id::

    [project.entry-points."anchorkv.codecs"]
    lowrank = "lowrank_codec:LowRankCodec"

Entry points are read once, the first time an id is not found; nothing happens at import. A
plug-in that fails to load is reported (logged once, and named by `get_codec`'s error for its
id), never fatal to the others. `examples/lowrank_codec` is a complete plug-in.
"""

from __future__ import annotations

import logging
import threading
from importlib.metadata import entry_points
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from anchorkv.codec.spec import CodecSpec
from anchorkv.kernels import reference
from anchorkv.kernels.quant import Quant

ENTRY_POINT_GROUP = "anchorkv.codecs"
log = logging.getLogger("anchorkv.codec")


class EncodedRow(NamedTuple):
    """What a plug-in makes of one row (the last axis) of a field: what the store needs to cut
    its output into chunks and lay it out as standard Zarr arrays.

    payload_bytes: payload bytes per row (a multiple of the itemsize of `payload_dtype`);
    payload_dtype: the Zarr v3 data type the payload bytes are stored as (``uint8``, ``int8``,
    ``float16``, ``float32``, ...: little-endian values other readers can open);
    scale_groups, scale_columns: fp32 scales per row, `[scale_groups, scale_columns]` (0, 0: none).
    """

    payload_bytes: int
    payload_dtype: str = "uint8"
    scale_groups: int = 0
    scale_columns: int = 0


@runtime_checkable
class Codec(Protocol):
    """A codec plug-in.

    Required (enough for `anchorkv.codec.pack` / `unpack`):

    * ``id``: its name (what specs, manifests and the entry point use);
    * ``encode(values, spec) -> (payload, scales)``: `values` `[*outer, W]` in the field's dtype
      (on the cache's device) to a uint8 payload of ``prod(outer) * payload_bytes`` bytes, row
      after row, and fp32 scales `[prod(outer) * scale_groups, scale_columns]` (`torch.empty(0,
      0)` without scales);
    * ``decode(payload, scales, spec, shape, dtype) -> values``: the inverse, `shape` `[*outer, W]`.

    For the store (saving entries, the connector), also:

    * ``encoded_row(width, dtype, spec) -> EncodedRow``: the bytes one row of `width` values
      of `dtype` encodes to; it must depend only on these (never on the values), and rows must
      be encoded independently: encoding any subset of rows gives exactly those rows' bytes
      (the store re-cuts rows into chunks and a load reads any token range);

    Optional:

    * ``configure(spec, width, dtype) -> CodecSpec``: the spec as entries record it, called once
      per field when a store resolves its codecs: validate options, fill defaults, load fitted
      parameters (e.g. from a file named in an option) into the options, so an entry carries
      everything its decode needs. Default: the spec as given;
    * ``describe(spec) -> str``: how to decode the stored arrays without the plug-in (stored in
      the arrays' attributes for other Zarr readers);
    * ``lossless = True`` if decode(encode(x)) == x bit for bit (default: lossy).
    """

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
    """A built-in format. `anchorkv.codec.pack` / `unpack` move it with the fused kernels (one
    pass over the cache); `encode` / `decode` are the same bytes from dense values."""

    lossless = False

    def __init__(self, fmt: Quant) -> None:
        self.fmt = Quant(fmt)
        self.id = self.fmt.value
        self.lossless = self.fmt is Quant.RAW

    def encode(self, values, spec):
        return reference.quantize(values, spec)

    def decode(self, payload, scales, spec, shape, dtype):
        return reference.dequantize(payload, scales, spec, shape, dtype)

    def __repr__(self) -> str:
        return f"QuantCodec({self.id!r})"


_lock = threading.Lock()
_codecs: dict[str, Codec] = {fmt.value: QuantCodec(fmt) for fmt in Quant}
_entry_points_loaded = False
#: Entry points of the group that failed to load: name -> why (one line).
_broken: dict[str, str] = {}


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
    """Register every plug-in of the entry-point group; one that fails is recorded in `_broken`
    (and logged) instead of breaking the lookup of every other codec."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _codecs:
            continue
        try:
            loaded = ep.load()
            instance = loaded() if isinstance(loaded, type) else loaded
            if getattr(instance, "id", None) != ep.name:
                raise ValueError(f"its codec's id is {getattr(instance, 'id', None)!r}, the entry point "
                                 f"is named {ep.name!r}; they must be equal")
            register_codec(instance)
        except Exception as e:  # a broken plug-in must not break the others
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            _broken[ep.name] = f"entry point {ep.name} = {getattr(ep, 'value', '?')} failed to load ({why})"
            log.warning("anchorkv: codec plug-in %s", _broken[ep.name])


def get_codec(codec_id: str) -> Codec:
    if codec_id not in _codecs:
        _load_entry_points()
    try:
        return _codecs[codec_id]
    except KeyError:
        raise KeyError(missing_codec_reason(codec_id)) from None


def missing_codec_reason(codec_id: str) -> str:
    """Why `codec_id` is not available, in one line (what was expected, what was found, the fix)."""
    if codec_id in _broken:
        return (f"codec plug-in {codec_id!r} is installed but its {_broken[codec_id]}; fix or reinstall "
                "the package that provides it")
    return (f"no codec {codec_id!r}; known: {sorted(_codecs)} (plug-ins register with "
            f"anchorkv.codec.register_codec or the {ENTRY_POINT_GROUP!r} entry-point group: install "
            "the package that provides it)")


def has_codec(codec_id: str) -> bool:
    """Whether `get_codec(codec_id)` would succeed (loads the entry points once)."""
    if codec_id not in _codecs:
        _load_entry_points()
    return codec_id in _codecs


def available_codecs() -> list[str]:
    _load_entry_points()
    return sorted(_codecs)
