"""The store's side of codec plug-ins: `PluginChunkEncoding`, what a plug-in's chunks are, and
`MissingCodec`, the error of a load whose plug-in is not installed (format version 4; see
`anchorkv.store.format` for the entry format and `anchorkv.codec.registry.Codec` for the
plug-in protocol)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch

from anchorkv.codec.packed import dtype_name
from anchorkv.codec.spec import CodecSpec, canonical_json
from anchorkv.store.encoded import SOURCE_DTYPES, ChunkEncoding
from anchorkv.store.errors import FormatError, StoreError

if TYPE_CHECKING:
    from anchorkv.codec.registry import Codec


class MissingCodec(StoreError):
    """An entry's field is encoded by a codec plug-in that is not installed (or failed to load)."""

    def __init__(self, entry: str, field: str, codec_id: str, reason: str) -> None:
        super().__init__(f"entry {entry}: field {field!r} is encoded by the codec plug-in {codec_id!r}, which "
                         f"is not available here ({reason}); it cannot be restored until that plug-in is "
                         "installed (the connector recomputes)")
        self.entry, self.field, self.codec_id = entry, field, codec_id


#: Zarr v3 data types a plug-in's payload may be stored as (little-endian; numpy names).
PAYLOAD_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float16", "float32", "float64")


@dataclass(frozen=True)
class PluginChunkEncoding(ChunkEncoding):
    """How the values of one chunk become bytes through a codec plug-in (see the module
    docstring): its id, its options as canonical JSON (`config`), the source dtype, the row
    width it was resolved for and what one row encodes to. Everything but encoding and
    decoding works without the plug-in installed."""

    id: str
    config: str  # canonical JSON of the options (`CodecSpec.params`), fitted parameters included
    source_dtype: str
    width: int
    payload_bytes: int
    payload_dtype: str = "uint8"
    scale_groups: int = 0
    scale_columns: int = 0
    decode_text: str = ""  # the plug-in's `describe(spec)`: how other readers decode the arrays

    plugin: ClassVar[Literal[True]] = True
    group: ClassVar[None] = None  # plug-ins have no group of the store's own

    def __post_init__(self) -> None:
        where = f"codec plug-in {self.id!r}"
        if self.source_dtype not in SOURCE_DTYPES:
            raise FormatError(f"source dtype {self.source_dtype!r} cannot be stored; expected one of {SOURCE_DTYPES}")
        if self.payload_dtype not in PAYLOAD_DTYPES:
            raise FormatError(f"{where}: payload dtype {self.payload_dtype!r} is not one of {PAYLOAD_DTYPES}")
        ints = (self.width, self.payload_bytes, self.scale_groups, self.scale_columns)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
            raise FormatError(f"{where}: row geometry must be integers, found {ints}")
        item = np.dtype(self.payload_dtype).itemsize
        if self.width <= 0 or self.payload_bytes <= 0 or self.payload_bytes % item:
            raise FormatError(f"{where}: a row of {self.width} values encodes to {self.payload_bytes} payload bytes; "
                              f"expected a positive multiple of {item} (the itemsize of {self.payload_dtype})")
        if min(self.scale_groups, self.scale_columns) < 0 or (self.scale_groups == 0) != (self.scale_columns == 0):
            raise FormatError(f"{where}: scales per row [{self.scale_groups}, {self.scale_columns}]; expected both "
                              "positive, or both 0 (no scales)")

    # -- resolution (needs the plug-in)
    @classmethod
    def for_field(cls, spec: CodecSpec, dtype: torch.dtype, chunk_last: int, *, where: str,
                  field_last: int) -> PluginChunkEncoding:
        from anchorkv.codec.registry import get_codec

        try:
            impl = get_codec(spec.id)
        except KeyError as e:
            raise FormatError(f"{where}: {e.args[0]}") from None
        if chunk_last != field_last:
            raise FormatError(
                f"{where}: codec plug-in {spec.id!r} encodes whole rows of the last axis, but this field is split "
                f"along its last axis ({field_last} values in chunks of {chunk_last}, so a rank's rows depend on "
                "tp); use a built-in codec for it"
            )
        encoded_row = getattr(impl, "encoded_row", None)  # optional in `Codec`: the store's part
        if not callable(encoded_row):
            raise FormatError(
                f"{where}: codec plug-in {spec.id!r} has no encoded_row(width, dtype, spec) method, so the store "
                "cannot size its chunks; add one (see anchorkv.codec.registry.Codec) or use it with pack/unpack only"
            )
        configure = getattr(impl, "configure", None)
        try:
            if callable(configure):
                spec = CodecSpec.parse(configure(spec, chunk_last, dtype))
            row = encoded_row(chunk_last, dtype, spec)
            payload_bytes, payload_dtype, groups, columns = (tuple(row) + ("uint8", 0, 0))[:4]
            describe = getattr(impl, "describe", None)
            text = str(describe(spec)) if callable(describe) else ""
        except (ValueError, TypeError, KeyError, OSError) as e:
            raise FormatError(f"{where}: codec plug-in {spec.id!r} refused {spec} for rows of {chunk_last} "
                              f"{dtype_name(dtype)} values: {e}") from None
        default = (f"decoded by the anchorkv codec plug-in {spec.id!r} (entry-point group anchorkv.codecs) from "
                   "these codes (and scales) with the options in 'config'")
        return cls(spec.id, canonical_json(spec.options), dtype_name(dtype), chunk_last, int(payload_bytes),
                   str(payload_dtype), int(groups), int(columns), text or default)

    def impl(self, entry: str = "?", field: str = "?") -> Codec:
        """The installed plug-in; `MissingCodec` (one line, naming it) when it is not."""
        from anchorkv.codec.registry import get_codec, has_codec, missing_codec_reason

        if not has_codec(self.id):
            raise MissingCodec(entry, field, self.id, missing_codec_reason(self.id))
        return get_codec(self.id)

    @property
    def installed(self) -> bool:
        from anchorkv.codec.registry import has_codec

        return has_codec(self.id)

    # -- serialization
    def to_config(self) -> dict[str, Any]:
        return {"plugin": self.id, "config": self.options, "source_dtype": self.source_dtype,
                "row": {"width": self.width, "payload_bytes": self.payload_bytes, "payload_dtype": self.payload_dtype,
                        "scale_groups": self.scale_groups, "scale_columns": self.scale_columns},
                "decode": self.decode_text}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PluginChunkEncoding:
        unknown = set(config) - {"plugin", "config", "source_dtype", "row", "decode"}
        row = config.get("row")
        if unknown or not isinstance(row, dict) or not isinstance(config.get("config"), dict):
            raise FormatError(f"a plug-in codec entry needs plugin, config (object), source_dtype, row (object), "
                              f"decode; found {sorted(config)}")
        extra = set(row) - {"width", "payload_bytes", "payload_dtype", "scale_groups", "scale_columns"}
        if extra:
            raise FormatError(f"unknown row geometry keys {sorted(extra)}")
        CodecSpec(config["plugin"], None, tuple(config["config"].items()))  # validates id and options
        return cls(config["plugin"], canonical_json(config["config"]), config["source_dtype"], row["width"],
                   row["payload_bytes"], row.get("payload_dtype", "uint8"), row.get("scale_groups", 0),
                   row.get("scale_columns", 0), str(config.get("decode", "")))

    @property
    def options(self) -> dict[str, Any]:
        return json.loads(self.config)

    @property
    def spec(self) -> CodecSpec:
        return CodecSpec(self.id, None, tuple(self.options.items()))

    @property
    def columns(self) -> int:
        return self.scale_columns

    # -- geometry: rows are whole (a region of a block never cuts the last axis)
    def _whole(self, width: int, per_row: int) -> int:
        if width == 0:
            return 0
        if width != self.width:
            raise FormatError(f"codec plug-in {self.id!r} encodes rows of {self.width} values, asked for {width}")
        return per_row

    def row_bytes(self, width: int) -> int:
        return self._whole(width, self.payload_bytes)

    def groups(self, width: int) -> int:
        return self._whole(width, self.scale_groups)

    # -- values (need the plug-in)
    def encode(self, values: np.ndarray) -> bytes:
        """Encode logical float32 `values` (one chunk) with the plug-in."""
        x = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(self.torch_dtype)
        payload, scales = self.impl().encode(x, self.spec)
        pn, sn = self.nbytes(tuple(values.shape))
        if payload.numel() != pn or scales.numel() * 4 != sn:
            raise FormatError(f"codec plug-in {self.id!r} encoded a {list(values.shape)} block to {payload.numel()} "
                              f"payload bytes and {scales.numel()} scales; its encoded_row says {pn} and {sn // 4}")
        return (payload.cpu().contiguous().view(torch.uint8).numpy().tobytes()
                + scales.cpu().contiguous().to(torch.float32).numpy().astype("<f4", copy=False).tobytes())

    def decode(self, data: bytes | bytearray | memoryview | np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The logical float32 values of one encoded chunk of `shape` (with the plug-in)."""
        enc = self.split(data, shape)
        payload = torch.from_numpy(np.require(enc.payload, requirements=["C", "W"]).reshape(-1))
        scales = (torch.from_numpy(np.require(enc.scales, requirements=["C", "W"]).reshape(-1, self.columns))
                  if self.columns else torch.empty(0, 0))
        values = self.impl().decode(payload, scales, self.spec, tuple(shape), self.torch_dtype)
        return values.to(torch.float32).numpy()
