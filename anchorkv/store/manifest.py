"""An entry's manifest (its group attributes) and the ``zarr.json`` documents of its nodes.

On disk (paths relative to the store root)::

    zarr.json                          root group
    entries/zarr.json                  group
    entries/<key>/zarr.json            group: one key (anchor or first token block)
    entries/<key>/<name>/zarr.json     group: the entry; attributes["anchorkv"] = manifest
    entries/<key>/<name>/<field>/zarr.json, .../<field>/c.<layer>.<i>...   arrays and shards

Format version 3 (4: the same with codec plug-in arrays, `anchorkv.store.format`): each field is one
or two standard Zarr v3 arrays (values, or codes and ``<field>_scales``; see
`anchorkv.store.format`), each sharded (zarr's ``sharding_indexed``); the files ``<array>/c.<...>``
are shards, keyed by their coordinates in the shard grid. The manifest keeps ``checksums``: per
*inner* chunk of every array (named by its coordinates in the chunk grid, as zarr would name it
without sharding) ``[crc32c, nbytes, offset in its shard]``, so a reader that reads one inner chunk
by byte range verifies it; ``shards``: per shard file ``[crc32c, nbytes]`` of the whole file (index
included); and ``checksum``, the blake3 of the manifest's canonical JSON (`manifest_checksum`).
`check_manifest` cross-checks everything a load relies on before an entry is used.

`<name>` is ``t<prefix tokens, 8 digits>-<16 hex of the prefix hash>`` (object stores append
``.<write id>``). The manifest is JSON; its keys are the constants below.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from anchorkv.store.errors import CorruptEntry, OtherFormat
from anchorkv.store.format import (
    READABLE_VERSIONS,
    ArrayLayout,
    describe_version,
    encoding_from_config,
    entry_format_version,
    part_attrs,
)
from anchorkv.store.keys import HEX64, TOKEN_BLOCK
from anchorkv.store.paths import ENTRIES, entry_path  # noqa: F401 (ENTRIES: re-exported, its old home)

ATTR = "anchorkv"
_NAME = re.compile(r"^t(\d{8})-([0-9a-f]{16})(?:\.([0-9a-z]+))?$")


def entry_name(num_tokens: int, prefix_hash: str) -> str:
    return f"t{num_tokens:08d}-{prefix_hash[:16]}"


class EntryName(NamedTuple):
    """What an entry's name says: ``t<num_tokens>-<hash16>[.<write_id>]``."""

    num_tokens: int  # prefix tokens
    hash16: str  # the first 16 hex digits of the prefix hash
    write_id: str | None  # object stores: the write that made it (local: None)


def parse_entry_name(name: str) -> EntryName | None:
    """What an entry's name says, or None if `name` is not an entry's."""
    m = _NAME.match(name)
    return EntryName(int(m.group(1)), m.group(2), m.group(3)) if m else None


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
    import zarr
    from zarr.storage import MemoryStore

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
            # zarr's ArrayConfigParams takes NotRequired from `typing`, which the 3.10 target lacks,
            # so mypy reads its optional keys as required
            config={"write_empty_chunks": True},  # type: ignore[arg-type]
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
        return entry_path(self.id)

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
    def version(self) -> str:
        """Which write of the entry this is: another process may delete an entry and write the
        same id again (other bytes), and a restore must read all of it from one write."""
        return str(self.manifest["checksum"])

    @property
    def stored_bytes(self) -> int:
        return int(self.manifest["stored_bytes"])

    @property
    def logical_bytes(self) -> int:
        return int(self.manifest["logical_bytes"])

    @property
    def codecs(self) -> dict[str, str]:
        return {f: str(encoding_from_config(c).spec) for f, c in self.manifest["codecs"].items()}

    def arrays(self) -> dict[str, ArrayLayout]:
        return arrays_from_manifest(self.manifest)


@dataclass(frozen=True)
class Listing:
    """An entry as `Store.scan` finds it: its state, and its manifest when it is loadable."""

    id: str
    state: str  # "ok", "damaged", "old-format", "newer-format", "unreadable"
    info: EntryInfo | None = None
    problem: str | None = None
    size: int | None = None  # bytes on disk (damaged / other-format: measured)
    mtime: float | None = None

    @property
    def stored_bytes(self) -> int:
        return self.info.stored_bytes if self.info is not None else int(self.size or 0)

    @property
    def created(self) -> float:
        return self.info.created if self.info is not None else float(self.mtime or 0.0)

    @property
    def key(self) -> str:
        return self.id.split("/", 1)[0]

    @property
    def path(self) -> str:
        return entry_path(self.id)


def arrays_from_manifest(manifest: dict[str, Any]) -> dict[str, ArrayLayout]:
    return {
        name: ArrayLayout(
            name, a["kind"], tuple(a["layers"]), tuple(a["shape"]), tuple(a["chunks"]),
            a["shard_axis"], encoding_from_config(manifest["codecs"][name]), tuple(a["shards"]),
            a.get("window"), a.get("first_token", 0),
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


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """blake3 of the manifest's canonical JSON (sorted keys, no spaces), its ``checksum`` left out."""
    import blake3

    body = {k: v for k, v in manifest.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return "blake3:" + blake3.blake3(text.encode()).hexdigest()


def signed_group_json(manifest: dict[str, Any]) -> bytes:
    """The entry's group ``zarr.json`` for `manifest`, whose ``checksum`` it sets (what
    `manifest_checksum` gives) from one encoding of the manifest: the canonical JSON is made in
    two halves, the keys before and after ``checksum``, and the group document is those halves
    with the checksum between them inside the group's own (sorted, compact) JSON. The bytes are
    ``json.dumps`` of the group with sorted keys and no spaces; for a Kimi-Linear request's
    manifest (752 inner chunks) that saves a second ~0.3 ms encoding on every commit."""
    import blake3

    def canonical(d: dict[str, Any]) -> str:
        return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)

    lo = canonical({k: v for k, v in manifest.items() if k < "checksum"})[1:-1]
    hi = canonical({k: v for k, v in manifest.items() if k > "checksum"})[1:-1]
    checksum = "blake3:" + blake3.blake3(("{" + ",".join(filter(None, (lo, hi))) + "}").encode()).hexdigest()
    manifest["checksum"] = checksum
    inner = ",".join(filter(None, (lo, f'"checksum":"{checksum}"', hi)))
    return _GROUP_HEAD + inner.encode() + _GROUP_TAIL


_GROUP_HEAD = b'{"attributes":{"' + ATTR.encode() + b'":{'
_GROUP_TAIL = b'}},"node_type":"group","zarr_format":3}'


def signed_bytes_hold(data: bytes, checksum: Any) -> bool:
    """Whether `data`, a group ``zarr.json`` as `signed_group_json` writes it, holds the
    manifest that `checksum` signs: its bytes less the checksum's own entry are the text that
    was hashed (every byte of the file but that entry is signed; as `signed_group_json` writes
    it, the canonical JSON of exactly the manifest it parses to), checked without encoding
    the parsed manifest again (~0.45 ms of every manifest read of a Kimi-Linear entry, a
    lookup's or a restore's). False for anything else (files of other writers, spaced JSON,
    damage): the caller then compares `manifest_checksum` of what it parsed. `checksum` must be
    the top-level ``checksum`` of what `data` parses to (the signed text never holds its own
    checksum, so an entry of it anywhere else leaves it in the text hashed: no match).

    A file another writer signed over its own bytes that spells the manifest otherwise (an
    escaped character, a number's other digits) holds by this check and reads as it parses
    (the encoding compare refused it): anyone who can write the file can sign it, so the
    checksum guards against damage, not against writers; reads and `commit.unusable` judge such
    a file alike (`checksum_holds`)."""
    import blake3

    if not isinstance(checksum, str) or not checksum.startswith("blake3:"):
        return False
    if not (data.startswith(_GROUP_HEAD) and data.endswith(_GROUP_TAIL)):
        return False
    inner = data[len(_GROUP_HEAD): len(data) - len(_GROUP_TAIL)]
    entry = b'"checksum":' + json.dumps(checksum).encode()
    at = inner.find(entry)
    if at < 0:
        return False
    end = at + len(entry)
    if at > 0:  # (the entry and the comma before it)
        if inner[at - 1: at] != b",":
            return False
        text = inner[: at - 1] + inner[end:]
    else:  # (the first entry, and the comma after it if any)
        text = inner[end + 1:] if inner[end: end + 1] == b"," else inner[end:]
    return "blake3:" + blake3.blake3(b"{" + text + b"}").hexdigest() == checksum


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # (the writer encodes with allow_nan=False)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # (1e999)
        raise ValueError(f"{text} is not a finite number")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError(f"an object names a key twice ({sorted(k for k, _ in pairs)[:4]}...)")
    return out


def load_group(data: bytes) -> Any:
    """A group ``zarr.json`` parsed strictly: NaN, infinities and numbers past a float's range
    (which no anchorkv writes and JSON lacks) and a key named twice in one object (which parses
    to one value of two) raise ValueError. What the manifest's checksum check over the file's
    bytes (`signed_bytes_hold`) relies on: bytes that parse to one meaning, with no number that
    is not finite (~45 us more than a plain `json.loads` of a Kimi-Linear manifest)."""
    return json.loads(data, parse_constant=_no_constant, parse_float=_finite, object_pairs_hook=_unique_keys)


def checksum_holds(m: dict[str, Any], raw: bytes | None = None) -> bool:
    """Whether the manifest `m` holds its ``checksum``: over `raw`, the group ``zarr.json`` it
    was parsed from (by `load_group`), when that is as `signed_group_json` writes it
    (`signed_bytes_hold`), else by encoding `m` again (`manifest_checksum`)."""
    c = m.get("checksum")
    return (raw is not None and signed_bytes_hold(raw, c)) or c == manifest_checksum(m)


def parse_group(entry_id: str, data: bytes) -> EntryInfo:
    """The `EntryInfo` of an entry's group ``zarr.json``; `OtherFormat` for another format
    version, `CorruptEntry` naming every problem if anything a load relies on is inconsistent."""
    try:
        doc = load_group(data)
        manifest = doc["attributes"][ATTR]
        version = manifest["format_version"]
    except (ValueError, KeyError, TypeError) as e:
        # (a decode error's text quotes the whole file: a zero-filled manifest made a 60 kB line)
        what = (f"{len(data)} bytes that are not UTF-8 JSON" if isinstance(e, UnicodeDecodeError)
                else f"{type(e).__name__}: {str(e)[:120]}")
        raise CorruptEntry(entry_id, f"its zarr.json holds no anchorkv manifest ({what})") from None
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        raise CorruptEntry(entry_id, f"its zarr.json is not a Zarr v3 group (zarr_format {doc.get('zarr_format')!r}, "
                                     f"node_type {doc.get('node_type')!r}); delete the entry (anchorkv rm)")
    if version not in READABLE_VERSIONS:
        raise OtherFormat(entry_id, version, READABLE_VERSIONS)
    problems = check_manifest(entry_id, manifest, data)
    if problems:
        raise CorruptEntry(entry_id, "manifest damaged: " + "; ".join(problems[:8])
                           + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
                           + "; delete the entry (anchorkv rm) and recompute")
    return EntryInfo(entry_id, manifest)


def check_manifest(entry_id: str, m: dict[str, Any], raw: bytes | None = None) -> list[str]:
    """Every inconsistency of a manifest (empty: none): its checksum, and what a load relies on
    (token count, prefix hash, key, layer names, shapes, chunk and shard geometry, shard axes,
    chunk sizes and offsets) against the entry's id, the model fingerprint and the format rules.
    `raw`: the group ``zarr.json`` that `m` was parsed from by `load_group`, whose bytes may
    show the checksum holds without encoding `m` again (`checksum_holds`)."""
    try:
        problems = _check_manifest(entry_id, m, raw)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:  # a field of the wrong type
        return [f"malformed ({type(e).__name__}: {e})"]
    return problems


@functools.lru_cache(maxsize=256)
def _expected_slots(a: ArrayLayout) -> tuple:
    """Per shard file of every part of `a`: (shard key, index bytes, the keys of its inner chunks
    in the order their bytes lie in it (empty slots past the end left out), bytes of one
    uncompressed inner chunk). Cached: the same geometry recurs in every entry of a model."""
    from anchorkv.store.format import index_nbytes

    out = []
    for part in a.parts:
        k = part.chunks_per_shard(a.chunks_per_shard)
        for shard in a.all_shards():
            keys = tuple(part.chunk_key(c) for c in a.shard_chunks(shard) if a.in_bounds(c))
            out.append((part.shard_key(shard), index_nbytes(k), keys, part.chunk_nbytes()))
    return tuple(out)


def _regular_bytes(sums: dict[str, Any], keys: tuple[str, ...], nbytes: int) -> int | None:
    """The bytes of a shard's uncompressed chunks `keys` when each has a well-formed checksum
    `[crc32c, nbytes, offset]` (non-negative integers) of the size the format gives, one after
    another from 0 (what `_check_manifest` checks chunk by chunk, here in a few passes of
    comprehensions: ~400 chunks a Kimi-Linear entry, read at each lookup of it); None where any
    is not, or missing (the caller then checks them one by one, naming what is wrong)."""
    got = [sums.get(k) for k in keys]
    try:
        if [c[1:] for c in got] != _rows(nbytes, len(keys)):  # type: ignore[index]
            return None
    except (TypeError, KeyError):  # a missing checksum, or not a list
        return None
    ok = all(type(c) is list and len(c) == 3 and type(c[0]) is int and type(c[1]) is int and type(c[2]) is int
             and c[0] >= 0 for c in got)
    return nbytes * len(keys) if ok else None


@functools.lru_cache(maxsize=256)
def _rows(nbytes: int, n: int) -> list[list[int]]:
    """`[nbytes, offset]` of `n` chunks of `nbytes` one after another from 0 (compared, never changed)."""
    return [[nbytes, i * nbytes] for i in range(n)]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_boundaries(m: dict[str, Any], arrays: dict[str, ArrayLayout], n: int) -> list[str]:
    """Problems of the optional `boundary_hashes` (the prefix hash after each whole 256-token
    block, which a shared-prefix lookup trusts to restore an entry's first rows)."""
    hashes = m.get("boundary_hashes")
    if hashes is None:
        return []
    if any(a.kind != "paged" or a.window is not None for a in arrays.values()):
        return ["boundary_hashes recorded for an entry with recurrent state or a sliding window (which exist "
                "only after all its tokens)"]
    if (type(hashes) is not list or len(hashes) != n // TOKEN_BLOCK
            or not all(isinstance(h, str) and HEX64.match(h) for h in hashes)):
        return [f"boundary_hashes is not the {n // TOKEN_BLOCK} prefix hashes of its whole {TOKEN_BLOCK}-token blocks"]
    if n % TOKEN_BLOCK == 0 and hashes and hashes[-1] != m["prefix_hash"]:
        return ["the last of boundary_hashes is not the prefix hash of all its tokens"]
    return []



def _check_manifest(entry_id: str, m: dict[str, Any], raw: bytes | None = None) -> list[str]:
    import hashlib

    from anchorkv.store.format import MAX_TP, array_keys, geometry, window_first

    out = []
    if not checksum_holds(m, raw):
        out.append("checksum mismatch (the manifest changed after it was written)" if m.get("checksum")
                   else "no checksum")
    key, _, name = entry_id.partition("/")
    parsed = parse_entry_name(name)
    n = m["num_tokens"]
    if not _is_int(n) or n <= 0:
        return out + [f"num_tokens {n!r} is not a positive integer"]
    if parsed is None:
        out.append(f"entry name {name!r} is not t<tokens>-<hash>")
    else:
        if parsed[0] != n:
            out.append(f"num_tokens is {n}, the entry name says {parsed[0]}")
        if not str(m["prefix_hash"]).startswith(parsed[1]) or len(str(m["prefix_hash"])) != 64:
            out.append(f"prefix_hash {str(m['prefix_hash'])[:16]}... does not match the entry name's {parsed[1]}")
        if parsed[2] is not None and parsed[2] != m.get("write_id"):
            out.append(f"write_id {m.get('write_id')!r} does not match the entry name's {parsed[2]!r}")
    if m.get("name") != entry_name(n, str(m["prefix_hash"])):
        out.append(f"name {m.get('name')!r} does not match num_tokens {n} and the prefix hash")
    if m.get("key") != key:
        out.append(f"key {str(m.get('key'))[:16]}... is not the entry's key {key[:16]}...")
    fp = m["model_fingerprint"]
    text = json.dumps(fp, sort_keys=True, separators=(",", ":"))
    if hashlib.sha256(text.encode()).hexdigest() != m["fingerprint_hash"]:
        out.append("fingerprint_hash does not match model_fingerprint")
    tp = m["tp_size"]
    if not _is_int(tp) or tp <= 0 or tp > MAX_TP or MAX_TP % tp:
        return out + [f"tp_size {tp!r} is not a divisor of {MAX_TP}"]
    if set(m["arrays"]) != set(m["codecs"]):
        return out + [f"arrays {sorted(m['arrays'])} and codecs {sorted(m['codecs'])} name different fields"]
    by_field: dict[str, list] = {}
    for layer in fp["layers"]:
        for fname, f in layer["fields"].items():
            by_field.setdefault(fname, []).append((layer["name"], layer["kind"], f, layer.get("window")))
    if set(by_field) != set(m["arrays"]):
        out.append(f"arrays {sorted(m['arrays'])} are not the model's fields {sorted(by_field)}")
    try:
        arrays = arrays_from_manifest(m)
    except Exception as e:  # FormatError, bad types: the layout cannot even be built
        return out + [f"arrays cannot be read ({e})"]
    version = entry_format_version(arrays)
    if m["format_version"] != version:
        out.append(f"format_version is {m['format_version']}, its arrays make {version} (version {version}: "
                   f"{describe_version(version)})")
    out += _check_boundaries(m, arrays, n)
    sums, shards = m["checksums"], m["shards"]
    want_chunks: set[str] = set()
    want_shards: set[str] = set()
    logical, stored = 0, 0
    for fname, a in arrays.items():
        layers = by_field.get(fname, [])
        where = f"array {fname!r}"
        if list(a.layers) != [row[0] for row in layers]:
            model = [row[0] for row in layers]
            out.append(f"{where}: layers {list(a.layers)[:4]}... are not the model's {model[:4]}...")
            continue
        kinds = {row[1] for row in layers}
        if kinds != {a.kind}:
            out.append(f"{where}: kind {a.kind!r}, the model's layers are {sorted(kinds)}")
            continue
        fshape, fdtype = tuple(layers[0][2]["shape"]), layers[0][2]["dtype"]
        if a.codec.source_dtype != fdtype:
            out.append(f"{where}: source dtype {a.codec.source_dtype}, the model's is {fdtype}")
        if a.shard_axis is not None and not (1 + (a.kind == "paged") <= a.shard_axis < len(a.shape)):
            out.append(f"{where}: shard_axis {a.shard_axis} is not an axis tp can split")
            continue
        windows = {row[3] for row in layers}
        if windows != {a.window}:
            out.append(f"{where}: window {a.window}, the model's layers have {sorted(map(str, windows))}")
            continue
        if not 0 <= a.first <= window_first(n, a.window):
            out.append(f"{where}: first_token {a.first}, a window of {a.window} needs tokens from "
                       f"{window_first(n, a.window)} of {n}")
            continue
        try:
            geo = geometry(fname, a.kind, len(layers), fshape, a.shard_axis, n - a.first, tp, m["format_version"],
                           encoding=a.codec)
        except Exception as e:
            out.append(f"{where}: {e}")
            continue
        if (a.shape, a.chunks, a.shards) != geo:
            out.append(f"{where}: shape/chunks/shards {list(a.shape)}/{list(a.chunks)}/{list(a.shards)}, the format "
                       f"makes {[list(g) for g in geo]} for {n} tokens at tp {tp}")
            continue
        if a.codec.plugin and not a.codec.width == a.chunks[-1] == a.shape[-1]:
            out.append(f"{where}: codec plug-in {a.codec.id!r} encodes rows of {a.codec.width}, the array's last "
                       f"axis is {a.shape[-1]} in chunks of {a.chunks[-1]}")
            continue
        if a.codec.group is not None and a.chunks[-1] % a.codec.group:
            out.append(f"{where}: group {a.codec.group} does not divide the chunk's last axis {a.chunks[-1]}")
            continue
        skeys, ckeys = array_keys(a)
        want_chunks.update(ckeys)
        want_shards.update(skeys)
        logical += math.prod(a.shape) * a.codec.source_itemsize
        compressed = bool(m.get("compressor"))
        for skey, index_size, ckeys, nbytes in _expected_slots(a):
            regular = None if compressed else _regular_bytes(sums, ckeys, nbytes)
            offset = 0 if regular is None else regular
            for ckey in ckeys if regular is None else ():
                c = sums.get(ckey)
                if c is None:
                    continue
                if (type(c) is not list or len(c) != 3 or not (type(c[0]) is int and type(c[1]) is int
                                                               and type(c[2]) is int) or min(c) < 0):
                    out.append(f"checksum of {ckey} is {c!r}, expected [crc32c, nbytes, offset]")
                    break
                if c[2] != offset:
                    out.append(f"chunk {ckey} is at offset {c[2]} of its shard, expected {offset}")
                if not compressed and c[1] != nbytes:
                    out.append(f"chunk {ckey} is {c[1]} bytes, its shape and dtype make {nbytes}")
                offset += c[1]
            sh = shards.get(skey)
            if sh is not None:
                if type(sh) is not list or len(sh) != 2 or not all(_is_int(v) and v >= 0 for v in sh):
                    out.append(f"shard checksum of {skey} is {sh!r}, expected [crc32c, nbytes]")
                elif sh[1] != offset + index_size:
                    out.append(f"shard {skey} is {sh[1]} bytes, its chunks and index make {offset + index_size}")
                else:
                    stored += sh[1]
    for what, have, expected in (("chunk", set(sums), want_chunks), ("shard", set(shards), want_shards)):
        missing, extra = sorted(expected - have), sorted(have - expected)
        if missing:
            out.append(f"{len(missing)} {what} checksums missing (e.g. {missing[0]})")
        if extra:
            out.append(f"{len(extra)} {what} checksums for no {what} of the arrays (e.g. {extra[0]})")
    if not out and m.get("stored_bytes") != stored:
        out.append(f"stored_bytes is {m.get('stored_bytes')}, its shards sum to {stored}")
    if not out and m.get("logical_bytes") != logical:
        out.append(f"logical_bytes is {m.get('logical_bytes')}, its arrays make {logical}")
    return out


def now() -> float:
    """The time a manifest records, in whole microseconds: every digit written then means
    something. `time.time()`'s shortest repr carries a 17th digit that float64 cannot hold, so
    a changed last digit could parse to the same value and slip past the manifest checksum
    (which covers the parsed manifest)."""
    return round(time.time(), 6)
