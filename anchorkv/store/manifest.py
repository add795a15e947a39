"""An entry's manifest (its group attributes) and the ``zarr.json`` documents of its nodes.

On disk (paths relative to the store root)::

    zarr.json                          root group
    entries/zarr.json                  group
    entries/<key>/zarr.json            group: one key (anchor or first token block)
    entries/<key>/<name>/zarr.json     group: the entry; attributes["anchorkv"] = manifest
    entries/<key>/<name>/<field>/zarr.json, .../<field>/c.<layer>.<i>...   arrays and shards

Format version 2: each array is sharded (zarr's ``sharding_indexed``, see `anchorkv.store.format`);
the files ``<field>/c.<...>`` are shards, keyed by their coordinates in the shard grid. The manifest
keeps ``checksums``: per *inner* chunk (named by its coordinates in the chunk grid, as zarr would
name it without sharding) ``[crc32c, nbytes, offset in its shard]``, so a reader that reads one
inner chunk by byte range verifies it; and ``shards``: per shard file ``[crc32c, nbytes]`` of the
whole file (index included), which `Store.verify` checks.

`<name>` is ``t<prefix tokens, 8 digits>-<16 hex of the prefix hash>`` (object stores append
``.<write id>``). The manifest is JSON; its keys are the constants below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import functools
import json
import re
import time
from typing import Any

from anchorkv.store.errors import CorruptEntry
from anchorkv.store.format import FORMAT_VERSION, ArrayLayout, ChunkCodec, part_attrs

ENTRIES = "entries"
ATTR = "anchorkv"
_NAME = re.compile(r"^t(\d{8})-([0-9a-f]{16})(?:\.([0-9a-z]+))?$")


def entry_name(num_tokens: int, prefix_hash: str) -> str:
    return f"t{num_tokens:08d}-{prefix_hash[:16]}"


def parse_entry_name(name: str) -> tuple[int, str, str | None] | None:
    """(prefix tokens, 16 hex of the prefix hash, write id or None), or None if not an entry."""
    m = _NAME.match(name)
    return (int(m.group(1)), m.group(2), m.group(3)) if m else None


def group_json(attributes: dict[str, Any] | None = None) -> bytes:
    doc = {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}
    # no indent: json's C encoder (an entry's manifest lists every inner chunk's checksum)
    return json.dumps(doc, sort_keys=True).encode()


def array_json(array: ArrayLayout, compressor: dict[str, Any] | None) -> dict[str, bytes]:
    """The ``zarr.json`` of each stored array of a field (`ArrayLayout.parts`), by array name,
    as zarr-python itself writes it (made by zarr; cached)."""
    return _array_json(array, json.dumps(compressor, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _array_json(array: ArrayLayout, compressor_key: str) -> dict[str, bytes]:
    compressor = json.loads(compressor_key)
    from zarr.storage import MemoryStore
    import zarr

    out = {}
    for part in array.parts:
        mem = MemoryStore()
        zarr.create_array(
            store=mem,
            shape=part.shape,
            chunks=part.chunks,
            shards=part.shards,
            dtype=part.dtype,
            fill_value=0,
            compressors=[compressor_codec(compressor)] if compressor else None,
            chunk_key_encoding={"name": "default", "separator": "."},
            attributes={ATTR: part_attrs(array, part)},
            config={"write_empty_chunks": True},
        )
        out[part.name] = mem._store_dict["zarr.json"].to_bytes()
    return out


def compressor_codec(config: dict[str, Any]):
    """The zarr v3 codec of a lossless stage (``{"id": "zstd", "level": 3}``)."""
    from zarr.codecs import ZstdCodec

    if config.get("id") != "zstd":
        raise ValueError(f"the store supports the lossless stage 'zstd' (level 1-22), found {config!r}")
    return ZstdCodec(level=int(config.get("level", 3)))


def numcodecs_compressor(config: dict[str, Any] | None):
    """The numcodecs codec that produces the same bytes as `compressor_codec(config)`."""
    if not config:
        return None
    from numcodecs import Zstd

    compressor_codec(config)  # validates
    return Zstd(level=int(config.get("level", 3)), checksum=False)


@dataclass(frozen=True)
class EntryInfo:
    """A committed entry, as `lookup` and `list` return it (read from its manifest)."""

    id: str  # "<key>/<name>": what load, delete, verify and the CLI take
    manifest: dict[str, Any] = field(repr=False)

    @property
    def path(self) -> str:
        return f"{ENTRIES}/{self.id}"

    @property
    def key(self) -> str:
        return self.id.split("/", 1)[0]

    @property
    def anchor(self) -> str | None:
        return self.manifest["anchor"]

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["num_tokens"])

    @property
    def prefix_hash(self) -> str:
        return self.manifest["prefix_hash"]

    @property
    def fingerprint_hash(self) -> str:
        return self.manifest["fingerprint_hash"]

    @property
    def tp_size(self) -> int:
        return int(self.manifest["tp_size"])

    @property
    def created(self) -> float:
        return float(self.manifest["created"])

    @property
    def stored_bytes(self) -> int:
        return int(self.manifest["stored_bytes"])

    @property
    def logical_bytes(self) -> int:
        return int(self.manifest["logical_bytes"])

    @property
    def codecs(self) -> dict[str, str]:
        return {f: str(ChunkCodec.from_config(c).spec) for f, c in self.manifest["codecs"].items()}

    def arrays(self) -> dict[str, ArrayLayout]:
        return arrays_from_manifest(self.manifest)


def arrays_from_manifest(manifest: dict[str, Any]) -> dict[str, ArrayLayout]:
    return {
        name: ArrayLayout(
            name, a["kind"], tuple(a["layers"]), tuple(a["shape"]), tuple(a["chunks"]),
            a["shard_axis"], ChunkCodec.from_config(manifest["codecs"][name]), tuple(a["shards"]),
        )
        for name, a in manifest["arrays"].items()
    }


def arrays_to_manifest(arrays: dict[str, ArrayLayout]) -> tuple[dict, dict]:
    """(manifest "arrays", manifest "codecs") of an entry's arrays."""
    return (
        {n: {**a.to_attrs(), "shape": list(a.shape), "chunks": list(a.chunks),
             "shards": list(a.shards)} for n, a in arrays.items()},
        {n: a.codec.to_config() for n, a in arrays.items()},
    )


def parse_group(entry_id: str, data: bytes) -> EntryInfo:
    """The `EntryInfo` of an entry's group ``zarr.json``; `CorruptEntry` if it is not one."""
    try:
        doc = json.loads(data)
        manifest = doc["attributes"][ATTR]
        version = manifest["format_version"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptEntry(entry_id, f"its zarr.json holds no anchorkv manifest ({e!r})") from None
    if version != FORMAT_VERSION:
        raise CorruptEntry(
            entry_id,
            f"format version {version}, this anchorkv reads version {FORMAT_VERSION}; "
            "upgrade anchorkv or delete the entry",
        )
    return EntryInfo(entry_id, manifest)


def now() -> float:
    return time.time()
