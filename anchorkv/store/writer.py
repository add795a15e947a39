"""Writing an entry: each TP rank streams its chunks, then one commit publishes the entry.

Protocol (multi-process safe; ranks may be separate processes or machines):

1. every rank calls `Store.begin_entry(...)` with the same arguments and the same `write_id`
   (the connector derives it from the request), then `write_layer` once per (layer, field)
   with its own slice, written as whole shards (one file per layer and rank slice; see
   `anchorkv.store.format`). Shards land in a place no reader looks at: the staging directory
   ``.staging/<write id>/data`` (local) or ``entries/<key>/<name>.<write id>/`` (object store);
2. `finish_rank` puts the rank's part marker ``.staging/<write id>/parts/rank-R-of-T.json``
   (the entry header plus the crc32c, size and offset of each inner chunk the rank wrote and
   the crc32c and size of each shard file), atomically;
3. one process (rank 0, or the scheduler with `Store.commit_staged`) calls `commit`: it
   checks that all T markers are there and that together they cover every shard and inner
   chunk of every array, writes the arrays' ``zarr.json`` and last the group ``zarr.json`` holding the
   manifest, and publishes (local: one directory rename; object store: the manifest put).

A kill -9 anywhere before the publication leaves only staging garbage, which lookups never
see and `Store.gc` removes. Two writers of the same entry: locally the second rename fails and
that writer keeps the first's entry; on an object store both become complete and lookup takes
the oldest (gc removes the other).
"""

from __future__ import annotations

import functools
import itertools
import json
from typing import TYPE_CHECKING, Any

import numpy as np

from anchorkv.codec.packed import Packed
from anchorkv.codec.spec import canonical_json
from anchorkv.kernels.formats import ELEMENTWISE, Quant
from anchorkv.store.errors import FormatError, IncompleteEntry
from anchorkv.store.format import (
    ArrayLayout,
    Encoded,
    array_keys,
    crc32c,
    entry_format_version,
    crc32c_combine,
    crc32c_combine_fixed,
    shard_index,
    zero_chunk,
)
from anchorkv.store.manifest import (
    ENTRIES,
    EntryInfo,
    array_json,
    group_json,
    numcodecs_compressor,
    manifest_checksum,
    now,
    parse_group,
)

if TYPE_CHECKING:
    from anchorkv.codec.models import ModelLayout
    from anchorkv.store.store import Store

STAGING = ".staging"


def parts_prefix(write_id: str) -> str:
    return f"{STAGING}/{write_id}/parts"


def rank_region(array: ArrayLayout, layer: int, tp_size: int, tp_rank: int) -> list[slice]:
    """The region of `array` (all axes, layer axis included) that a rank's slice covers."""
    region = [slice(layer, layer + 1)] + [slice(0, n) for n in array.shape[1:]]
    if array.shard_axis is not None:
        n = array.shape[array.shard_axis] // tp_size
        region[array.shard_axis] = slice(tp_rank * n, (tp_rank + 1) * n)
    return region


def chunks_in(array: ArrayLayout, region: list[slice]) -> list[tuple[int, ...]]:
    """Chunk coordinates that intersect `region`."""
    ranges = [range(s.start // c, -(-min(s.stop, n) // c)) for s, c, n in zip(region, array.chunks, array.shape)]
    return list(itertools.product(*ranges))


@functools.lru_cache(maxsize=8192)
def _plan(array: ArrayLayout, bounds: tuple[tuple[int, int], ...]) -> tuple:
    out = []
    region = [slice(a, b) for a, b in bounds]
    for coords in chunks_in(array, region):
        into_chunk, into_region = overlap(chunk_region(array, coords), region)
        whole = all(s.stop - s.start == c for s, c in zip(into_chunk, array.chunks))
        out.append((array.chunk_key(coords), coords, into_chunk, into_region, whole))
    return tuple(out)


def chunk_plan(array: ArrayLayout, region: list[slice]) -> tuple:
    """For each chunk that intersects `region`: (key, coords, slices into the chunk, slices
    into the region's block, whether the chunk is covered whole); cached per array and region."""
    return _plan(array, tuple((s.start, s.stop) for s in region))


@functools.lru_cache(maxsize=4096)
def _shards_plan(array: ArrayLayout, bounds: tuple[tuple[int, int], ...]) -> tuple:
    """The shards a rank's region fills: (shard coordinates, chunks per shard, slots), each slot a
    `chunk_plan` row plus the chunk's local coordinates in the shard and, for an edge chunk
    whose covered part is its first rows along axis 1, that row count (else None); in zarr's
    order, empty slots past the array's end left out. Cached per array and region."""
    rows = {item[1]: item for item in _plan(array, bounds)}
    k = array.chunks_per_shard
    out = []
    for shard in sorted({array.shard_of(c) for c in rows}):
        slots = []
        for coords in array.shard_chunks(shard):
            item = rows.get(coords)
            if item is None:
                if array.in_bounds(coords):
                    raise FormatError(
                        f"field {array.field!r}: shard {array.shard_key(shard)} would miss chunk "
                        f"{array.chunk_key(coords)}; a rank writes whole shards of its slice"
                    )
                continue  # past the array's end: an empty slot, as zarr leaves it
            into_chunk = item[2]
            lead = None
            if not item[4] and len(into_chunk) > 2 and into_chunk[1].start == 0 and all(
                    s.start == 0 and s.stop == c for i, (s, c) in enumerate(zip(into_chunk, array.chunks)) if i != 1):
                lead = into_chunk[1].stop
            slots.append((*item, tuple(c % n for c, n in zip(coords, k)), lead))
        out.append((shard, k, tuple(slots)))
    return tuple(out)


def shards_plan(array: ArrayLayout, region: list[slice]) -> tuple:
    return _shards_plan(array, tuple((s.start, s.stop) for s in region))


@functools.lru_cache(maxsize=1024)
def _index(k: tuple[int, ...], slots: tuple) -> bytes:
    return shard_index(k, dict(slots))


def _checksums(placed: list, index: bytes, combine) -> tuple[dict[str, list[int]], int]:
    """({inner chunk: [crc32c, nbytes, offset]}, crc32c of the whole shard) of a shard's
    chunks `(name, buffers, nbytes, offset)` followed by its index."""
    sums: dict[str, list[int]] = {}
    whole = 0
    for name, parts, size, at in placed:
        crc = 0
        for b in parts:
            crc = crc32c(b, value=crc)
        sums[name] = [crc, size, at]
        whole = combine(whole, crc, size)
    return sums, combine(whole, crc32c(index), len(index))


def chunk_region(array: ArrayLayout, coords: tuple[int, ...]) -> list[slice]:
    return [slice(i * c, (i + 1) * c) for i, c in zip(coords, array.chunks)]


def overlap(a: list[slice], b: list[slice]) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """(slices into a's block, slices into b's block) of a ∩ b, or None if empty."""
    ia, ib = [], []
    for x, y in zip(a, b):
        lo, hi = max(x.start, y.start), min(x.stop, y.stop)
        if lo >= hi:
            return None
        ia.append(slice(lo - x.start, hi - x.start))
        ib.append(slice(lo - y.start, hi - y.start))
    return tuple(ia), tuple(ib)


class EntryWriter:
    """One rank's writer of one entry (see the module docstring for the protocol)."""

    def __init__(self, store: "Store", layout: "ModelLayout", header: dict[str, Any],
                 arrays: dict[str, ArrayLayout]) -> None:
        self.store = store
        self.layout = layout
        # the lowest version that represents these arrays: 3 for built-in formats, byte for
        # byte as before; 4 when a codec plug-in encodes a field
        self.header = {**header, "format_version": entry_format_version(arrays)}
        self.arrays = arrays
        self.write_id: str = self.header["write_id"]
        self.final = f"{ENTRIES}/{header['key']}/{header['name']}"
        self.data = store.backend.data_prefix(self.final, self.write_id)
        self.checksums: dict[str, list[int]] = {}  # inner chunk -> [crc32c, nbytes, offset]
        self.shards: dict[str, list[int]] = {}  # shard file -> [crc32c, nbytes]
        self._compressor = numcodecs_compressor(header["compressor"])

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    # ------------------------------------------------------------------ chunks
    def write_layer(self, layer: str, field: str, packed: Packed) -> int:
        """Write this rank's chunks of `field` of `layer`; returns the bytes written.

        State fields: `packed` is `[1, *rank shape]` (one block). Paged fields: `[N, block_size,
        *row]` with N * block_size >= the entry's tokens; rows past them are dropped. A
        replicated field is written by rank 0 only (other ranks' calls return 0). `packed`
        should live in host memory (a CUDA tensor is copied here, synchronously).
        """
        array = self._array(field)
        where = f"entry {self.final}, layer {layer!r}, field {field!r}"
        lf = self.layout.layer(layer).page.field(field)
        index = array.layer_index(layer)
        if array.shard_axis is None and self.tp_rank != 0:
            return 0
        self._check_packed(array, lf, packed, where)
        enc = self._encoded(array, packed)
        region = rank_region(array, index, self.tp_size, self.tp_rank)
        if array.kind == "paged":  # the rank block covers tokens [0, N*block_size)
            region[1] = slice(0, min(enc.payload.shape[1], array.shape[1]))
        total = 0
        parts = array.parts
        for shard, k, slots in shards_plan(array, region):
            per_part: list[list] = [[] for _ in parts]
            for key, coords, into_chunk, into_rank, whole, local, lead in slots:
                part = enc.region(into_rank)
                if whole:
                    bufs = part.buffers()
                elif lead is not None:
                    bufs = self._row_padded(array, part, lead)
                else:
                    bufs = self._padded(array, part, into_chunk).buffers()
                for p, chunks, b in zip(parts, per_part, bufs):
                    chunks.append((p.chunk_key(coords), p.local(local), b))
            for p, chunks in zip(parts, per_part):
                total += self._put_shard(p.shard_key(shard), p.chunks_per_shard(k), chunks)
        return total

    def _array(self, field: str) -> ArrayLayout:
        try:
            return self.arrays[field]
        except KeyError:
            raise KeyError(f"entry {self.final} has no field {field!r}; it has {sorted(self.arrays)}") from None

    def _check_packed(self, array: ArrayLayout, lf, packed: Packed, where: str) -> None:
        if array.kind == "state":
            expected = (1, *lf.shape)
            ok = tuple(packed.shape) == expected
        else:
            expected = (-1, *lf.shape)
            ok = tuple(packed.shape[1:]) == tuple(lf.shape) and packed.shape[0] * lf.shape[0] >= self.header["num_tokens"]
        if not ok or packed.dtype != lf.dtype:
            raise FormatError(
                f"{where}: expected a Packed of {lf.dtype} {list(expected)} (-1: enough blocks "
                f"for {self.header['num_tokens']} tokens), found {packed.dtype} {list(packed.shape)}"
            )
        c = array.codec
        if c.plugin:
            if packed.codec.id != c.id or canonical_json(packed.codec.options) != c.config:
                raise FormatError(
                    f"{where}: the entry stores codec plug-in {c.id!r} with the options it recorded at "
                    f"begin_entry ({c.spec}), but the Packed is {packed.codec}; pack with the store's "
                    "resolved spec (ChunkCodec.spec, ZarrEntryStore.codecs)"
                )
            return
        group = packed.codec.group if packed.codec.group is not None else packed.shape[-1]
        if packed.codec.id != c.format.value or (c.format not in ELEMENTWISE and group != c.group):
            raise FormatError(
                f"{where}: the entry stores {c.spec} but the Packed is {packed.codec} (group "
                f"{group}); pack with {c.spec} (a field sharded along its last axis needs a "
                "fixed group, not 'whole')"
            )

    def _encoded(self, array: ArrayLayout, packed: Packed) -> Encoded:
        payload, scales = packed.payload, packed.scales
        if payload.device.type != "cpu":
            payload, scales = payload.cpu(), scales.cpu()
        shape = tuple(packed.shape)
        if array.kind == "state":
            block = shape  # [1, *F]: the layer axis is the block axis
        else:
            block = (1, shape[0] * shape[1], *shape[2:])
        return array.codec.views(payload.numpy(), scales.contiguous().numpy(), block)

    def _row_padded(self, array: ArrayLayout, part: Encoded, rows: int) -> tuple[list, list]:
        """The (payload, scales) buffers of an edge chunk whose first `rows` rows (axis 1) are
        `part`: its rows then cached zero rows (no copy; exactly `_padded`)."""
        z = zero_chunk(array.codec, array.chunks)
        payload = [memoryview(np.ascontiguousarray(part.payload)).cast("B"), memoryview(z.payload[:, rows:]).cast("B")]
        scales = []
        if z.scales.size:
            scales = [memoryview(np.ascontiguousarray(part.scales)).cast("B"), memoryview(z.scales[:, rows:]).cast("B")]
        return payload, scales

    def _padded(self, array: ArrayLayout, part: Encoded, into_chunk: tuple[slice, ...]) -> Encoded:
        """A whole edge chunk: `part` in its place, the rest zero bytes (zarr's fill)."""
        z = zero_chunk(array.codec, array.chunks)
        full = Encoded(z.codec, z.payload.copy(), z.scales.copy())
        dst = full.region(into_chunk)
        np.copyto(dst.payload, part.payload)
        if dst.scales.size:
            np.copyto(dst.scales, part.scales)
        return full

    def _put_shard(self, skey: str, k: tuple[int, ...], chunks: list[tuple[str, tuple, list]]) -> int:
        """Write one shard file: its inner chunks `(name, local coordinates, buffers)` in zarr's
        order, then the index (see `anchorkv.store.format`); records the crc32c of each inner
        chunk and of the whole file.

        A chunk thread computes the checksums while this thread writes the file (they go only
        to the manifest; os.writev and crc32c release the GIL)."""
        buffers: list[memoryview] = []
        slots = []
        placed = []
        offset = 0
        comp = self._compressor
        for name, local, parts in chunks:
            if comp is not None:
                parts = [memoryview(comp.encode(b"".join(parts)))]
            size = sum(b.nbytes for b in parts)
            buffers += parts
            slots.append((local, (offset, size)))
            placed.append((name, parts, size, offset))
            offset += size
        index = _index(k, tuple(slots))
        buffers.append(memoryview(index))
        combine = crc32c_combine if comp is not None else crc32c_combine_fixed
        pending = self.store._chunk_submit(_checksums, placed, index, combine)
        try:
            self.store.backend.write(f"{self.data}/{skey}", buffers)
        finally:
            sums, whole = pending.result()
        self.checksums.update(sums)
        self.shards[skey] = [whole, offset + len(index)]
        return offset + len(index)

    # ------------------------------------------------------------------ protocol
    def finish_rank(self) -> None:
        """Publish this rank's part marker (atomically): its chunks are written."""
        marker = {"header": self.header, "tp_rank": self.tp_rank, "chunks": self.checksums,
                  "shards": self.shards}
        path = f"{parts_prefix(self.write_id)}/rank-{self.tp_rank:03d}-of-{self.tp_size:03d}.json"
        self.store.backend.write(path, [json.dumps(marker).encode()], atomic=True)

    def commit(self) -> EntryInfo:
        """Publish the entry once every rank finished (this rank's part is finished here).

        Raises `IncompleteEntry` naming the missing ranks or chunks; call it again later.
        """
        if not self.store.backend.exists(
            f"{parts_prefix(self.write_id)}/rank-{self.tp_rank:03d}-of-{self.tp_size:03d}.json"
        ):
            self.finish_rank()
        return commit_staged(self.store, self.write_id)

    def abort(self) -> None:
        """Drop everything this write staged (all ranks' parts)."""
        self.store.backend.delete_tree(f"{STAGING}/{self.write_id}")
        if not self.store.backend.atomic_publish:
            self.store.backend.delete_tree(self.data)


def commit_staged(store: "Store", write_id: str) -> EntryInfo:
    """Commit the write `write_id` from its part markers alone (any process may call it)."""
    backend = store.backend
    prefix = parts_prefix(write_id)
    parts = [json.loads(backend.read(f"{prefix}/{n}")) for n in backend.list_dir(prefix) if n.endswith(".json")]
    if not parts:
        raise IncompleteEntry(f"write {write_id}: no rank has finished its part (nothing under {prefix})")
    header = parts[0]["header"]
    final = f"{ENTRIES}/{header['key']}/{header['name']}"
    tp = header["tp_size"]
    ranks = {p["tp_rank"] for p in parts if p["header"]["tp_size"] == tp}
    for p in parts:
        h = p["header"]
        if {k: v for k, v in h.items() if k not in ("created", "layout_fingerprint")} != {
            k: v for k, v in header.items() if k not in ("created", "layout_fingerprint")}:
            raise IncompleteEntry(f"entry {final}: rank {p['tp_rank']}'s part was begun with different arguments")
    missing = sorted(set(range(tp)) - ranks)
    if missing:
        raise IncompleteEntry(f"entry {final}: ranks {missing} of {tp} have not finished their parts")
    checksums: dict[str, list[int]] = {}
    shards: dict[str, list[int]] = {}
    for p in parts:
        checksums.update(p["chunks"])
        shards.update(p.get("shards", {}))
    from anchorkv.store.manifest import arrays_from_manifest

    arrays = arrays_from_manifest(header)
    logical = 0
    for a in arrays.values():
        shard_keys, chunk_keys = array_keys(a)
        absent = [k for k in shard_keys if k not in shards] + [k for k in chunk_keys if k not in checksums]
        if absent:
            raise IncompleteEntry(
                f"entry {final}: {len(absent)} shards / chunks of field {a.field!r} were never written "
                f"(e.g. {absent[0]}); every rank must write every layer of its slice"
            )
        logical += int(np.prod(a.shape)) * a.codec._itemsize
    manifest = {**header, "created": now(), "checksums": dict(sorted(checksums.items())),
                "shards": dict(sorted(shards.items())),
                "stored_bytes": sum(v[1] for v in shards.values()), "logical_bytes": logical}
    manifest["checksum"] = manifest_checksum(manifest)
    data = backend.data_prefix(final, write_id)
    for a in arrays.values():
        for name, doc in array_json(a, header["compressor"]).items():
            backend.write(f"{data}/{name}/zarr.json", [doc])
    store._ensure_groups(header["key"])
    backend.write(f"{data}/zarr.json", [group_json({"anchorkv": manifest})], atomic=True)
    entry_id = final.split("/", 1)[1] if backend.atomic_publish else data.split("/", 1)[1]
    if backend.publish(data, final):
        info = EntryInfo(entry_id, manifest)
    else:  # another write of the same entry won the rename: keep that one
        backend.delete_tree(data)
        info = parse_group(entry_id, backend.read(f"{final}/zarr.json"))
    backend.delete_tree(f"{STAGING}/{write_id}")
    store._after_commit(info)
    return info
