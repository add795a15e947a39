"""The entry format: arrays, chunk grids and the bytes of one chunk.

Axis letters: L layers of one field kind, T tokens, F the field's logical axes.

* A **state** field (``conv``, ``recurrent``) is stored as `[L, *F]`, one chunk per layer and
  per `1/MAX_TP` of the shard axis (``recurrent`` `[20, 32, 128, 128]` in chunks of
  `[1, 4, 128, 128]`), so the slice of any rank at tp in {1, 2, 4, 8} is whole chunks.
* A **paged** field (``latent``) is stored as `[L, T, *row]`, chunked by `token_chunk(T)`
  tokens (`TOKEN_CHUNK`, 1024, past 7680 tokens; for shorter entries the smallest multiple of 64
  that cuts T into at most 8 chunks, so the zero-padded edge chunk adds little to a short entry;
  format version 5): quantization groups lie within a row, so re-cutting token rows is a reshape
  and the entry does not depend on vLLM's block size (which changes with tp).

A chunk's bytes are exactly `anchorkv.kernels.reference.quantize` of the chunk's values in the
source dtype: the payload (codes) and, for a quantized codec, the fp32 little-endian scales
`[groups, C]`. Since format version 3 they are two standard Zarr v3 arrays (`Part`), so any Zarr
v3 reader (zarr-python, tensorstore) opens them with no plug-in:

* ``<field>``: the values (raw: ``float32`` / ``float16``; ``bfloat16`` as ``uint16`` bits, since
  zarr-python 3.1 has no bfloat16 data type) or the codes (``int8``; fp8 as ``uint8`` bits of
  float8 e4m3fn; int4 as ``uint8``, two codes a byte, the even element in the low nibble);
* ``<field>_scales`` (quantized only): ``float32`` `[*outer, groups, C]`, C = 1 (scale) or 2
  (int4: scale, minimum).

The array attributes say how to dequantize (`Part.attrs`). Edge chunks are padded with zero
bytes (zarr's fill value, 0) *before* encoding, as zarr does; zero scales decode to zero.

**Shards** (since format version 2): each array uses zarr v3's ``sharding_indexed`` codec. The chunks
above are its *inner* chunks; a *shard* (one file / object, the key of the outer chunk grid) is

* state field: `layer_span` layers x the *writer's* rank slice (`[S, *F]` with the shard axis
  divided by the tp the entry was written at), so every rank writes whole shards of its own, as
  in version 1 it wrote whole chunks of its own; a reader at any tp in {1, 2, 4, 8} reads only
  the inner chunks it needs by byte range. S is 1 up to version 6; from version 7 it is the most
  layers, a divisor of the field's layer count, whose rank slices fit in `LAYER_SHARD_BYTES`
  (a Kimi-Linear request's int8 conv state: all 20 layers in one file of 0.7 MB, where version 6
  wrote 20 files of 37 KB and 20 of its scales; each file a save writes costs it far more than
  its bytes: `bench_store.py`'s ``files-*`` rows);
* paged field (written by rank 0): one layer x up to `SHARD_TOKEN_CHUNKS` inner token chunks
  (`min(8, ceil(T / token_chunk(T)))` chunks: one shard per layer up to 8192 tokens, so a typical request
  is one file per layer, while a very long context is cut into 8192-token files, which keeps a
  save of a layer from building one huge file and bounds what a short window read has to skip).
  Inner chunks wholly past the last token (only in the last shard of an entry longer than 8192
  tokens) are *empty*: index entry ``(2**64-1, 2**64-1)``, exactly what zarr writes for a chunk it
  leaves out (and reads as the fill value, zero); every other inner chunk is written, as zarr does
  with ``write_empty_chunks=True``.

A shard is the encoded inner chunks concatenated in zarr's order (`shard_order`, zarr's morton
order of the chunks in the shard; a shard spanning layers: layer after layer, each in that
order), then the index (``index_location: end``): uint64
little-endian ``(offset, nbytes)`` per inner chunk, C order over the shard's chunk grid, followed
by its crc32c (``index_codecs: [bytes little, crc32c]``): for a shard of one layer byte for byte
what zarr-python's ``ShardingCodec`` writes for the same values and metadata; a shard spanning
layers holds the same chunks, in its own order, which the index gives any reader. A load of one
layer of such a shard reads and checks that layer's chunks, not the index (anchorkv's reads go
by the manifest's offsets); `Store.verify` checks the index of every shard.

**Codec plug-ins** (format version 4; an entry whose arrays all use built-in formats is still
written as version 3, byte for byte as before). A field may use any codec registered in the
``anchorkv.codecs`` entry-point group that says what one row (the field's last axis, always
whole in a chunk: plug-ins are refused for fields split along their last axis) encodes to
(`anchorkv.codec.registry.EncodedRow`): ``payload_bytes`` per row stored as a standard array
of ``payload_dtype`` (``<field>`` `[..., payload_bytes / itemsize]`), and optionally
``scale_groups`` x ``scale_columns`` fp32 scales per row (``<field>_scales``). A chunk's
bytes are the plug-in's `encode` of the chunk's rows; padding rows past an entry's end are
zero bytes (never restored). The manifest records the plug-in's id, its options as
`configure` resolved them (fitted parameters included) and the row geometry, so an entry is
listed, verified and its bytes read without the plug-in; only decoding needs it, and a load
of a field whose plug-in is not installed fails with `MissingCodec` before reading a byte.
`anchorkv.store.plugin_format` holds the plug-in side (`PluginChunkEncoding`, `MissingCodec`).

**Sliding-window fields** (format version 6): a field of sliding-window attention layers (a
layer `window`, the tokens a query attends to) keeps only the rows the entry's next query can
see: tokens `[first_token, T)`, `first_token = max(0, T - window + 1)` (block-independent: the
restoring engine's blocks may start anywhere before it), or a token before it where the writer
asks (`window_align`: whole blocks of an engine whose in-block token order is opaque, vLLM's
CPU attention). Stored as a paged field of
`T - first_token` rows, row 0 being token `first_token`; its array attributes name ``window``
and ``first_token``. Such a field restores only with the whole entry (a shorter prefix would
need rows the entry does not keep). An older anchorkv lists such an entry as ``newer-format``.

Group sizes are always stored resolved (a number, never "whole"), and for a field sharded along
its last axis "whole" means the chunk's last axis (`logical / MAX_TP`): any other choice would
make the groups depend on the tp the entry was written at.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from anchorkv.codec.layout import tp_slice
from anchorkv.codec.models import LayerKind, ModelLayout, window_start
from anchorkv.codec.packed import dtype_name
from anchorkv.codec.spec import CodecSpec
from anchorkv.kernels import reference
from anchorkv.kernels.quant import BF16_ITEMSIZE, ELEMENTWISE, SCALE_COLUMNS, Quant
from anchorkv.store.encoded import SOURCE_DTYPES, ChunkEncoding, Encoded
from anchorkv.store.errors import FormatError
from anchorkv.store.plugin_format import PluginChunkEncoding

#: The format version of an entry whose arrays all use built-in formats.
FORMAT_VERSION = 3
#: The format version of an entry with at least one array encoded by a codec plug-in (version 3
#: plus plug-in arrays; an older anchorkv lists such an entry as ``newer-format`` and leaves it
#: alone instead of calling it damaged).
PLUGIN_FORMAT_VERSION = 4
#: The format version of an entry whose paged fields are chunked by fewer than `TOKEN_CHUNK`
#: tokens (`token_chunk`: entries of up to 7680 tokens; version 4 plus chunks sized to the entry,
#: plug-in arrays allowed). Entries chunked as version 3 or 4 are still written as those.
SIZED_CHUNK_FORMAT_VERSION = 5
#: The format version of an entry with a sliding-window field (rows from its `first_token`;
#: version 5 plus such fields).
WINDOW_FORMAT_VERSION = 6
#: The format version of an entry whose state fields' shards span several layers
#: (`layer_span`; version 6 plus such shards). Entries whose every shard holds one layer (no
#: state field, or state layers of `LAYER_SHARD_BYTES` or more) are still written as before.
LAYER_SPAN_FORMAT_VERSION = 7
#: The format version new entries are cut for (`geometry`'s default): the lowest version that
#: represents an entry's arrays is what its manifest records (`entry_format_version`).
WRITE_FORMAT_VERSION = LAYER_SPAN_FORMAT_VERSION
#: Format versions this anchorkv can read (older ones are listed as ``old-format``, never loaded).
READABLE_VERSIONS = (3, 4, 5, 6, 7)
#: The largest tensor-parallel size whose rank slices are whole chunks.
MAX_TP = 8
#: Tokens per chunk of a paged field, at most (and always, in format versions 3 and 4).
TOKEN_CHUNK = 1024
#: A paged field's token chunk is a multiple of this many tokens (format version 5).
TOKEN_CHUNK_STEP = 64
#: Inner token chunks per shard of a paged field (at most).
SHARD_TOKEN_CHUNKS = 8
#: A state field's shard holds as many layers as fit in this many bytes (its codes and scales
#: together, the writer's rank slice), the most that divides the field's layer count
#: (`layer_span`, format version 7): a quantized Kimi-Linear request's conv state is 2 files
#: instead of 40 (codes, scales), its recurrent state 8 instead of 40. Part of the format: the
#: manifest checks recompute it, so another value needs another version.
LAYER_SHARD_BYTES = 4 << 20
#: zarr's marker of an empty inner chunk in a shard index.
EMPTY = 2**64 - 1
#: Suffix of the array holding a quantized field's scales.
SCALES_SUFFIX = "_scales"


def entry_format_version(arrays: dict[str, ArrayLayout]) -> int:
    """The version an entry of these arrays is written as: the lowest that can represent them."""
    if any(a.shards[0] > 1 for a in arrays.values()):
        return LAYER_SPAN_FORMAT_VERSION
    if any(a.window is not None for a in arrays.values()):
        return WINDOW_FORMAT_VERSION
    if any(a.kind == "paged" and a.chunks[1] != TOKEN_CHUNK for a in arrays.values()):
        return SIZED_CHUNK_FORMAT_VERSION
    return PLUGIN_FORMAT_VERSION if any(a.codec.plugin for a in arrays.values()) else FORMAT_VERSION


def describe_version(version: int) -> str:
    """What sets an entry's format version apart (for the manifest checks' messages)."""
    return {FORMAT_VERSION: "built-in codecs, 1024-token chunks",
            PLUGIN_FORMAT_VERSION: "codec plug-in arrays, 1024-token chunks",
            SIZED_CHUNK_FORMAT_VERSION: "token chunks sized to the entry",
            WINDOW_FORMAT_VERSION: "sliding-window fields",
            LAYER_SPAN_FORMAT_VERSION: "state shards spanning layers"}.get(version, "unknown")


def token_chunk(num_tokens: int, version: int = SIZED_CHUNK_FORMAT_VERSION) -> int:
    """Tokens per inner chunk of the paged fields of an entry of `num_tokens` tokens.

    Format version 5: the smallest multiple of `TOKEN_CHUNK_STEP` that cuts the entry into at
    most `SHARD_TOKEN_CHUNKS` chunks, at most `TOKEN_CHUNK`; the edge chunk, padded as zarr pads
    it, then holds fewer than min(512, num_tokens / 8 + 64) rows past the entry's end instead of
    up to 1023 (a 280-token entry stored 1024 rows). Entries of more than 7680 tokens keep
    `TOKEN_CHUNK`, and every entry up to 8192 tokens stays one shard per layer. Versions 3 and 4:
    always `TOKEN_CHUNK`."""
    if version < SIZED_CHUNK_FORMAT_VERSION:
        return TOKEN_CHUNK
    per_chunk = -(-max(num_tokens, 1) // SHARD_TOKEN_CHUNKS)
    return min(TOKEN_CHUNK, -(-per_chunk // TOKEN_CHUNK_STEP) * TOKEN_CHUNK_STEP)


@dataclass(frozen=True)
class QuantChunkEncoding(ChunkEncoding):
    """How the values of one chunk become bytes through a built-in format (`Quant`): the
    format, its group, the source dtype.

    `group` is the resolved group size (None only for raw). Values are given and returned as
    the *logical* float32 array; `source_dtype` is the field's dtype in the cache (bf16 values
    are exact in float32, so nothing is lost in presenting them as float32).
    """

    format: Quant
    group: int | None
    source_dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", Quant(self.format))
        if self.source_dtype not in SOURCE_DTYPES:
            raise FormatError(
                f"source dtype {self.source_dtype!r} cannot be stored; expected one of {SOURCE_DTYPES}"
            )
        if self.format in ELEMENTWISE:  # raw, bf16: no groups
            object.__setattr__(self, "group", None)
        elif not isinstance(self.group, int) or self.group <= 0:
            raise FormatError(f"{self.format} needs a resolved positive group size, found {self.group!r}")
        elif self.format is Quant.INT4 and self.group % 2:
            raise FormatError(f"int4 needs an even group size, found {self.group}")

    # -- serialization
    def to_config(self) -> dict[str, Any]:
        return {"format": self.format.value, "group": self.group, "source_dtype": self.source_dtype}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantChunkEncoding:
        """A manifest's codec entry of a built-in format (`encoding_from_config`: of any)."""
        unknown = set(config) - {"format", "group", "source_dtype"}
        if unknown:
            raise FormatError(f"unknown codec options {sorted(unknown)}; expected format, group, source_dtype")
        return cls(Quant(config["format"]), config.get("group"), config["source_dtype"])

    @classmethod
    def for_field(cls, spec: CodecSpec, dtype: torch.dtype, chunk_last: int, *, where: str) -> QuantChunkEncoding:
        """Resolve the spec of a built-in format for chunks whose last axis has `chunk_last`
        elements (`encoding_for_field`: of any codec)."""
        fmt = Quant(spec.id)
        group = None if fmt in ELEMENTWISE else (chunk_last if spec.group is None else spec.group)
        if group is not None and chunk_last % group:
            raise FormatError(
                f"{where}: group size {group} must divide the chunk's last axis ({chunk_last} "
                f"elements); pick a divisor (e.g. {fmt.value}:{math.gcd(chunk_last, 128)})"
            )
        return cls(fmt, group, dtype_name(dtype))

    #: a built-in format (`PluginChunkEncoding` says True)
    plugin: ClassVar[Literal[False]] = False

    @property
    def id(self) -> str:
        return self.format.value

    @property
    def spec(self) -> CodecSpec:
        return CodecSpec(self.format.value, self.group)

    @property
    def columns(self) -> int:
        return SCALE_COLUMNS[self.format]


    # -- geometry
    def row_bytes(self, width: int) -> int:
        """Payload bytes of `width` consecutive elements of the last axis."""
        if self.format is Quant.RAW:
            return width * self.source_itemsize
        if self.format is Quant.INT4:
            return width // 2
        if self.format is Quant.BF16:
            return width * BF16_ITEMSIZE
        return width

    def groups(self, width: int) -> int:
        return 0 if self.group is None else width // self.group  # None: elementwise (raw, bf16)


    # -- values
    def encode(self, values: np.ndarray) -> bytes:
        """Encode logical float32 `values` (one chunk, zero-padded by the caller)."""
        x = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(self.torch_dtype)
        payload, scales = reference.quantize(x, self.spec)
        return payload.numpy().tobytes() + scales.contiguous().numpy().astype("<f4", copy=False).tobytes()

    def decode(self, data: bytes | bytearray | memoryview | np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The logical float32 values of one encoded chunk of `shape`."""
        enc = self.split(data, shape)
        payload = torch.from_numpy(np.require(enc.payload, requirements=["C", "W"]).reshape(-1))
        if self.columns:
            scales = torch.from_numpy(np.require(enc.scales, requirements=["C", "W"]).reshape(-1, self.columns))
        else:
            scales = torch.from_numpy(np.empty((0, 0), np.float32))
        values = reference.dequantize(payload, scales, self.spec, tuple(shape), self.torch_dtype)
        return values.to(torch.float32).numpy()

    def zeros(self, shape: tuple[int, ...]) -> Encoded:
        """The encoding of a zero block (zarr's fill value): what padding rows hold."""
        return self.split(self.encode(np.zeros(shape, np.float32)), shape)


def encoding_from_config(config: dict[str, Any]) -> QuantChunkEncoding | PluginChunkEncoding:
    """A manifest's codec entry: a built-in format's, or a plug-in's (`PluginChunkEncoding`)."""
    if "plugin" in config:
        return PluginChunkEncoding.from_config(config)
    return QuantChunkEncoding.from_config(config)


def encoding_for_field(spec: CodecSpec | str, dtype: torch.dtype, chunk_last: int, *, where: str,
                       field_last: int | None = None) -> QuantChunkEncoding | PluginChunkEncoding:
    """Resolve a codec spec for chunks whose last axis has `chunk_last` elements (of a field
    whose last axis has `field_last`, default the same): a built-in format's id gives a
    `QuantChunkEncoding`, a plug-in's a `PluginChunkEncoding`."""
    spec = CodecSpec.parse(spec)
    try:
        Quant(spec.id)
    except ValueError:
        return PluginChunkEncoding.for_field(spec, dtype, chunk_last, where=where,
                                             field_last=chunk_last if field_last is None else field_last)
    return QuantChunkEncoding.for_field(spec, dtype, chunk_last, where=where)


@functools.lru_cache(maxsize=64)
def zero_chunk(encoding: ChunkEncoding, shape: tuple[int, ...]) -> Encoded:
    """Zero bytes of a block of `shape` (zarr's fill value 0 in every part; they decode to zero):
    what padding rows hold. Read-only views: copy before writing."""
    pn, sn = encoding.nbytes(tuple(shape))
    z = encoding.views(np.zeros(pn, np.uint8), np.zeros(sn // 4, np.float32), tuple(shape))
    z.payload.flags.writeable = False
    z.scales.flags.writeable = False
    return z


# ----------------------------------------------------------------------------- arrays


#: The zarr v3 data type of a field's values (raw, by source dtype) or codes (by format).
#: bfloat16 and float8 are stored as their bits: zarr-python 3.1 has neither data type.
_CODE_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "uint16",
                "int8": "int8", "fp8": "uint8", "int4": "uint8", "bf16": "uint16"}

_DEQUANTIZE = {
    "fp8": "x[..., j] = float32(codes[..., j] as float8_e4m3fn bits) * scales[..., j // G, 0]",
    "int8": "x[..., j] = float32(codes[..., j]) * scales[..., j // G, 0]",
    "int4": ("q[..., 2i] = codes[..., i] & 15; q[..., 2i+1] = codes[..., i] >> 4; "
             "x[..., j] = float32(q[..., j]) * scales[..., j // G, 0] + scales[..., j // G, 1]"),
    "bf16": "x[..., j] = float32(codes[..., j] as bfloat16 bits) (shift left by 16 and view as float32: exact)",
}


@dataclass(frozen=True)
class Part:
    """One standard Zarr v3 array of a field (see the module docstring): `scales` parts have
    a trailing axis of C columns, always one chunk, so their chunk and shard keys are the
    values' keys plus ``.0``."""

    name: str  # the array's name in the entry group
    role: str  # "values" (raw), "codes" or "scales"
    dtype: str  # zarr v3 data type
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    shards: tuple[int, ...]
    columns_axis: bool

    def _coords(self, coords: tuple[int, ...]) -> str:
        tail = (0,) if self.columns_axis else ()
        return ".".join(str(int(i)) for i in (*coords, *tail))

    def chunk_key(self, coords: tuple[int, ...]) -> str:
        """An inner chunk's name (zarr's key of it without sharding), by the field's chunk coordinates."""
        return f"{self.name}/c." + self._coords(coords)

    def shard_key(self, shard: tuple[int, ...]) -> str:
        """A shard's key (file / object), by the field's shard coordinates."""
        return f"{self.name}/c." + self._coords(shard)

    def local(self, local: tuple[int, ...]) -> tuple[int, ...]:
        return (*local, 0) if self.columns_axis else tuple(local)

    def chunks_per_shard(self, field_k: tuple[int, ...]) -> tuple[int, ...]:
        return (*field_k, 1) if self.columns_axis else tuple(field_k)

    def chunk_nbytes(self) -> int:
        return math.prod(self.chunks) * np.dtype(self.dtype).itemsize


def part_attrs(array: ArrayLayout, part: Part) -> dict[str, Any]:
    """The ``anchorkv`` attributes of one stored array: what it holds and how to read values."""
    c = array.codec
    out: dict[str, Any] = {**array.to_attrs(), "role": part.role, "codec": c.id,
                           "source_dtype": c.source_dtype}
    if c.plugin:
        out.update(plugin=c.id, config=c.options, row=c.to_config()["row"], codes=array.field,
                   decode=c.decode_text)
        if c.columns:
            out["scales"] = array.field + SCALES_SUFFIX
        return out
    if part.role == "values":
        if c.source_dtype == "bfloat16":
            out["bits"] = ("bfloat16 bits: view as ml_dtypes.bfloat16, or shift left by 16 and view "
                           "as float32 (exact)")
        return out
    if c.format is Quant.BF16:  # elementwise: no group, no scales
        out.update(codes=array.field, dequantize=f"{_DEQUANTIZE['bf16']}, then rounded to "
                                                 f"{c.source_dtype} (round half to even)")
        return out
    out.update(group=c.group, codes=array.field, scales=array.field + SCALES_SUFFIX,
               dequantize=f"{_DEQUANTIZE[c.format.value]} with G = {c.group}, then rounded to "
                          f"{c.source_dtype} (round half to even)")
    return out



@dataclass(frozen=True)
class ArrayLayout:
    """One stored array: a field kind of the entry, `[L, *F]` (state) or `[L, T, *row]` (paged)."""

    field: str
    kind: str  # LayerKind value
    layers: tuple[str, ...]
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    shard_axis: int | None  # axis of `shape` split by tp (None: replicated)
    codec: QuantChunkEncoding | PluginChunkEncoding  # how a chunk's values become bytes
    shards: tuple[int, ...]  # shard shape (a multiple of `chunks` on every axis)
    #: a sliding-window field: the layers' window, and the token of row 0 (`window_first`)
    window: int | None = None
    first: int = 0

    def __hash__(self) -> int:  # made once: arrays key the readers' plan caches, a hash per load
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash((self.field, self.kind, self.layers, self.shape, self.chunks,
                                               self.shard_axis, self.codec, self.shards, self.window, self.first))
        return h

    def __post_init__(self) -> None:
        windowed = self.window is not None
        if (not windowed and self.first) or (windowed and (self.kind != "paged" or self.first < 0)):
            raise FormatError(f"field {self.field!r}: rows from token {self.first} (window {self.window}) need a "
                              "paged sliding-window field")
        if (len(self.shards) != len(self.chunks)
                or any(s % c or s <= 0 for s, c in zip(self.shards, self.chunks, strict=True))):
            raise FormatError(
                f"field {self.field!r}: shard shape {list(self.shards)} must be a positive multiple of "
                f"the chunk shape {list(self.chunks)} on every axis"
            )

    @property
    def grid(self) -> tuple[int, ...]:
        """The grid of inner chunks."""
        return tuple(-(-n // c) for n, c in zip(self.shape, self.chunks, strict=True))

    @property
    def shard_grid(self) -> tuple[int, ...]:
        return tuple(-(-n // s) for n, s in zip(self.shape, self.shards, strict=True))

    @property
    def chunks_per_shard(self) -> tuple[int, ...]:
        return tuple(s // c for s, c in zip(self.shards, self.chunks, strict=True))

    def chunk_key(self, coords: tuple[int, ...]) -> str:
        """The name of an inner chunk of the values / codes (zarr's key of it without sharding)."""
        return self.parts[0].chunk_key(coords)

    def shard_key(self, shard: tuple[int, ...]) -> str:
        """The key (file / object) of a shard of the values / codes, by its coordinates."""
        return self.parts[0].shard_key(shard)

    @cached_property
    def parts(self) -> tuple[Part, ...]:
        """The stored zarr arrays of this field: values or codes, then scales (quantized)."""
        c = self.codec
        *outer, last = self.shape
        *couter, clast = self.chunks
        *souter, slast = self.shards
        raw = not c.plugin and c.format is Quant.RAW
        if c.plugin:
            dtype = c.payload_dtype
        else:
            dtype = _CODE_DTYPES[c.source_dtype if raw else c.format.value]
        item = np.dtype(dtype).itemsize
        code = Part(self.field, "values" if raw else "codes", dtype,
                    (*outer, c.row_bytes(last) // item), (*couter, c.row_bytes(clast) // item),
                    (*souter, c.row_bytes(slast) // item), False)
        if raw or not c.columns:  # raw values, bf16 codes, a plug-in without scales
            return (code,)
        cols = c.columns
        scales = Part(self.field + SCALES_SUFFIX, "scales", "float32", (*outer, c.groups(last), cols),
                      (*couter, c.groups(clast), cols), (*souter, c.groups(slast), cols), True)
        return (code, scales)

    def shard_of(self, coords: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(int(i) // k for i, k in zip(coords, self.chunks_per_shard, strict=True))

    def all_chunks(self) -> list[tuple[int, ...]]:
        """Every inner chunk that holds part of the array (not the empty ones past its end)."""
        return [tuple(int(v) for v in c) for c in np.ndindex(*self.grid)]

    def all_shards(self) -> list[tuple[int, ...]]:
        return [tuple(int(v) for v in c) for c in np.ndindex(*self.shard_grid)]

    def in_bounds(self, coords: tuple[int, ...]) -> bool:
        return all(i * c < n for i, c, n in zip(coords, self.chunks, self.shape, strict=True))

    def shard_chunks(self, shard: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The inner chunks of a shard in the order their bytes lie in it (zarr's order)."""
        base = [s * k for s, k in zip(shard, self.chunks_per_shard, strict=True)]
        return [tuple(b + i for b, i in zip(base, local, strict=True)) for local in shard_order(self.chunks_per_shard)]

    def layer_index(self, layer: str) -> int:
        try:
            return self.layers.index(layer)
        except ValueError:
            raise KeyError(f"layer {layer!r} has no field {self.field!r} in this entry") from None

    def rank_range(self, tp_size: int, tp_rank: int) -> tuple[int, int]:
        """Chunk indices [start, stop) along the shard axis that rank `tp_rank` of `tp_size` owns."""
        if self.shard_axis is None:
            return 0, 1
        per_axis = self.grid[self.shard_axis]
        if tp_size <= 0 or per_axis % tp_size or not 0 <= tp_rank < tp_size:
            raise FormatError(
                f"field {self.field!r}: tp_size {tp_size} / rank {tp_rank} cannot read "
                f"{per_axis} chunks along axis {self.shard_axis}; tp must divide {per_axis}"
            )
        own = tp_slice(per_axis, tp_size, tp_rank)
        return own.start, own.stop

    def to_attrs(self) -> dict[str, Any]:
        window = {} if self.window is None else {"window": self.window, "first_token": self.first}
        return {"field": self.field, "kind": self.kind, "layers": list(self.layers),
                "shard_axis": self.shard_axis, **window}


@functools.lru_cache(maxsize=256)
def array_keys(array: ArrayLayout) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(every shard key, every inner chunk key that holds part of the array) of `array`, over
    all its parts."""
    return (tuple(p.shard_key(s) for p in array.parts for s in array.all_shards()),
            tuple(p.chunk_key(c) for p in array.parts for c in array.all_chunks()))


@functools.lru_cache(maxsize=256)
def shard_order(chunks_per_shard: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Local coordinates of a shard's inner chunks in the order their bytes lie in it: zarr-python's
    (its `morton_order_iter`, taken from zarr itself so the two never differ) for a shard of one
    layer; for a shard spanning layers (format version 7) layer after layer, each in zarr's
    order, so one layer's chunks are one run of bytes (a restore reads a layer at a time; the
    index, not the order, is what any zarr reader goes by)."""
    from zarr.core.indexing import morton_order_iter

    k = tuple(chunks_per_shard)
    if k[0] > 1:
        return tuple((j, *rest[1:]) for j in range(k[0]) for rest in shard_order((1, *k[1:])))
    return tuple(tuple(int(v) for v in c) for c in morton_order_iter(k))


def shard_index(chunks_per_shard: tuple[int, ...], slots: dict[tuple[int, ...], tuple[int, int]]) -> bytes:
    """The encoded index of a shard (``index_location: end``): uint64 little-endian `(offset,
    nbytes)` per inner chunk (local coordinates; absent ones `EMPTY`), C order, then its crc32c
    (uint32 little-endian), as zarr's ``[bytes(little), crc32c]`` index codecs encode it."""
    index = np.full((*chunks_per_shard, 2), EMPTY, dtype="<u8")
    for local, (offset, nbytes) in slots.items():
        index[local] = (offset, nbytes)
    data = index.tobytes()
    return data + np.array([crc32c(data)], dtype="<u4").tobytes()


def index_nbytes(chunks_per_shard: tuple[int, ...]) -> int:
    return 16 * math.prod(chunks_per_shard) + 4


def parse_shard_index(data: bytes, chunks_per_shard: tuple[int, ...]) -> np.ndarray:
    """The `(offset, nbytes)` array of an encoded shard index; ValueError if its crc32c fails."""
    n = index_nbytes(chunks_per_shard)
    if len(data) != n:
        raise ValueError(f"a shard index of {list(chunks_per_shard)} chunks is {n} bytes, found {len(data)}")
    body, crc = data[:-4], int(np.frombuffer(data[-4:], dtype="<u4")[0])
    if crc32c(body) != crc:
        raise ValueError(f"the shard index fails its crc32c (stored {crc:#010x}, computed {crc32c(body):#010x})")
    return np.frombuffer(body, dtype="<u8").reshape(*chunks_per_shard, 2)


def _gil_free_crc32c() -> tuple[str, Callable[..., int]] | None:
    """The first installed library that computes crc32c without holding the GIL, as
    `(name, fn(data, value))`: `fastcrc` (MIT, a main dependency; its `crc32.iscsi` is CRC-32C
    with carry-less multiplication, ~2x the `crc32c` package's speed, and releases the GIL from
    16 KiB), else the `crc32c` package when it uses the CPU's crc32 instruction (the `fast-crc`
    extra, LGPL-2.1-or-later; releases the GIL from 32 KiB). Both take any C-contiguous buffer
    as it is and refuse others. None: only google-crc32c (zarr's), which holds the GIL."""
    try:
        from fastcrc import crc32 as fast
    except ImportError:  # a platform without a fastcrc wheel (it has them for CPython 3.10-3.14 on
        pass             # Linux x86_64/aarch64, macOS and Windows) and no Rust to build one
    else:
        return "fastcrc", fast.iscsi
    try:
        import crc32c as icrar
    except ImportError:
        return None
    return ("crc32c", icrar.crc32c) if getattr(icrar, "hardware_based", False) else None


#: Which library computes crc32c here, by preference "fastcrc", "crc32c" (the package), then
#: "google-crc32c"; all give the same values (tests/store/test_crc32c.py). The first two release
#: the GIL, so a checksum thread overlaps the writing thread (see `store.CHUNK_THREADS`);
#: google-crc32c holds the GIL for each call, so a thread computing it stalls the others.
CRC32C_LIB, _CRC_FREE = _gil_free_crc32c() or ("google-crc32c", None)
#: The libraries that release the GIL while they compute (`store.chunk_threads`).
GIL_FREE_CRC32C = frozenset({"fastcrc", "crc32c"})


def crc32c(data: bytes | bytearray | memoryview | np.ndarray, value: int = 0) -> int:
    """The crc32c of `data` (any C-contiguous buffer), continuing from `value` (`CRC32C_LIB`)."""
    if _CRC_FREE is not None:  # takes the buffer as it is (a load checks ~1,700 a request)
        return _CRC_FREE(data, value)
    buf = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)  # no copy
    import google_crc32c

    return google_crc32c.extend(value, buf) if value else google_crc32c.value(buf)


# crc32c of a concatenation from the parts' crcs (zlib's crc32_combine, CRC-32C polynomial): the
# writer checks each inner chunk and the whole shard without reading the bytes twice.
_POLY = 0x82F63B78


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=1024)
def _x8n(n: int) -> int:
    """x^(8n) mod p: the operator that shifts a crc over n zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c(a + b) from crc32c(a), crc32c(b) and len(b)."""
    return _multmodp(_x8n(len2), crc1) ^ crc2 if len2 else crc1


@functools.lru_cache(maxsize=256)
def _shift_tables(n: int) -> tuple[list[int], ...]:
    """`crc -> x^(8n) * crc mod p` as 4 byte tables (the map is linear in crc)."""
    op = _x8n(n)
    basis = [_multmodp(op, 1 << j) for j in range(32)]
    tables = []
    for t in range(4):
        table = [0] * 256
        for b in range(1, 256):
            low = (b & -b).bit_length() - 1
            table[b] = table[b & (b - 1)] ^ basis[8 * t + low]
        tables.append(table)
    return tuple(tables)


def crc32c_combine_fixed(crc1: int, crc2: int, len2: int) -> int:
    """`crc32c_combine` by table lookups, for lengths that repeat (uncompressed chunks of one
    array): a table costs about 40 `crc32c_combine` calls to build, once per length."""
    t0, t1, t2, t3 = _shift_tables(len2)
    return t0[crc1 & 255] ^ t1[(crc1 >> 8) & 255] ^ t2[(crc1 >> 16) & 255] ^ t3[crc1 >> 24] ^ crc2


def window_first(num_tokens: int, window: int | None, align: int = 1) -> int:
    """The first token a sliding-window field of an entry of `num_tokens` tokens keeps (0
    without a window): the first one the entry's next query attends to, down to a multiple of
    `align` (whole blocks where the engine's in-block token order is opaque)."""
    return 0 if window is None else window_start(num_tokens, window, align)


def shard_chunk(n: int) -> int:
    """Chunk length of a shard axis of `n`: n / the largest tp <= MAX_TP that divides it."""
    tp = max(t for t in (1, 2, 4, 8, 16, 32, 64) if t <= MAX_TP and n % t == 0)
    return n // tp


def geometry(name: str, kind: str, num_layers: int, logical: tuple[int, ...], axis: int | None,
             num_tokens: int, tp_size: int, version: int = WRITE_FORMAT_VERSION,
             encoding: ChunkEncoding | None = None,
             ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(shape, chunks, shards) of the array of a field (see the module docstring) in an entry of
    format `version`: `logical` is the field's logical shape (paged: the per-token row), `axis`
    the array axis tp splits; from version 7 a state field's shard spans `layer_span` layers,
    which needs the field's `encoding` (without one, one layer a shard)."""
    rows = token_chunk(num_tokens, version)
    if kind == "state":
        shape = (num_layers, *logical)
        chunks = [1, *logical]
    else:
        shape = (num_layers, num_tokens, *logical)
        chunks = [1, rows, *logical]
    if axis is not None:
        chunks[axis] = shard_chunk(shape[axis])
    shards = list(chunks)
    if kind == "state":
        shards[1:] = logical
        if axis is not None:
            per_axis = shape[axis] // chunks[axis]
            if tp_size <= 0 or per_axis % tp_size:
                raise FormatError(
                    f"field {name!r}: tp_size {tp_size} cannot write {per_axis} chunks along "
                    f"axis {axis}; tp must divide {per_axis}"
                )
            shards[axis] = shape[axis] // tp_size
        if version >= LAYER_SPAN_FORMAT_VERSION and encoding is not None:
            shards[0] = layer_span(num_layers, sum(encoding.nbytes(tuple(shards[1:]))))
    else:
        shards[1] = rows * min(SHARD_TOKEN_CHUNKS, -(-num_tokens // rows))
    return tuple(shape), tuple(chunks), tuple(shards)


def layer_span(num_layers: int, layer_bytes: int) -> int:
    """Layers a state field's shard holds (format version 7): the most that divide `num_layers`
    and fit, at `layer_bytes` a layer, in `LAYER_SHARD_BYTES` (at least 1). A divisor, so no
    shard runs past the last layer and every shard of the field has the same shape."""
    fit = max(1, LAYER_SHARD_BYTES // max(layer_bytes, 1))
    return max(d for d in range(1, min(fit, num_layers) + 1) if num_layers % d == 0)


def array_layouts(layout: ModelLayout, codecs: Mapping[str, CodecSpec | str],
                  num_tokens: int, *, window_align: int = 1) -> dict[str, ArrayLayout]:
    """The arrays of an entry of `layout` holding `num_tokens` tokens, with shards cut for the
    writer's tp (`layout.tp_size`); sliding-window fields from `window_first(..., window_align)`."""
    out: dict[str, ArrayLayout] = {}
    fields: dict[str, tuple] = {}
    for layer in layout.layers:
        for f in layer.page.fields:
            prev = fields.get(f.name)
            full = f.logical_shape
            assert full is not None  # Field.__post_init__ resolves it (default: the field's shape)
            logical = full[1:] if layer.kind is LayerKind.PAGED else full
            key = (layer.kind, f.dtype, logical, f.shard_axis, layer.window)
            if prev is None:
                fields[f.name] = (key, f, [layer.name])
            elif prev[0] != key:
                raise FormatError(
                    f"field {f.name!r} of layer {layer.name!r} differs from layer "
                    f"{prev[2][0]!r} ({key} vs {prev[0]}); the store keeps one array per field name"
                )
            else:
                prev[2].append(layer.name)
    for name, ((kind, dtype, logical, shard, window), _, layers) in fields.items():
        if name.endswith(SCALES_SUFFIX) and name[: -len(SCALES_SUFFIX)] in fields:
            raise FormatError(f"field {name!r} would share its array name with the scales of field "
                              f"{name[: -len(SCALES_SUFFIX)]!r}; rename one of them")
        if kind is LayerKind.PAGED and shard == 0:
            raise FormatError(f"paged field {name!r} cannot be sharded along its token axis")
        axis = None if shard is None else shard + 1
        first = window_first(num_tokens, window, window_align)
        shape, chunks, _ = geometry(name, kind.value, len(layers), logical, axis, num_tokens - first,
                                    layout.tp_size)
        if name not in codecs:
            raise FormatError(f"no codec given for field {name!r}; codecs were given for {sorted(codecs)}")
        encoding = encoding_for_field(codecs[name], dtype, chunks[-1], where=f"field {name!r}", field_last=shape[-1])
        shape, chunks, shards = geometry(name, kind.value, len(layers), logical, axis, num_tokens - first,
                                         layout.tp_size, encoding=encoding)
        out[name] = ArrayLayout(name, kind.value, tuple(layers), shape, tuple(chunks), axis, encoding, tuple(shards),
                                window, first)
    unknown = set(codecs) - set(out)
    if unknown:
        raise FormatError(f"codecs given for fields {sorted(unknown)} that the layout lacks ({sorted(out)})")
    return out
