"""Writing an entry: each TP rank streams its chunks, then one commit publishes the entry.

Protocol (multi-process safe; ranks may be separate processes or machines):

1. every rank calls `Store.begin_entry(...)` with the same arguments and the same `write_id`
   (the connector derives it from the request), then `write_layer` once per (layer, field)
   with its own slice, written as whole shards (one file per rank slice of a layer, or of
   `layer_span` layers of a state field: see `anchorkv.store.format`). Shards land in a place no
   reader looks at: the staging directory ``.staging/<write id>/data`` (local) or
   ``entries/<key>/<name>.<write id>/`` (object store);
2. `finish_rank` waits for the rank's shard writes still in flight (an object store's puts),
   then puts the rank's part marker ``.staging/<write id>/parts/rank-R-of-T.json``
   (the entry header plus the crc32c, size and offset of each inner chunk the rank wrote and
   the crc32c and size of each shard file), atomically;
3. one process (rank 0, or the scheduler with `Store.commit_staged`) calls `commit`
   (`anchorkv.store.commit`): it checks that all T markers are there and that together they
   cover every shard and inner chunk of every array, writes the arrays' ``zarr.json`` and last
   the group ``zarr.json`` holding the manifest, and publishes (local: one directory rename;
   object store: the manifest put).

Paths are those of `anchorkv.store.paths`; which chunks and shards a rank writes, those of
`anchorkv.store.plan`. The writer knows nothing of `Store`: it gets a `Backend`, where to compute
checksums (`chunk_submit`), where to write shards several at once when the backend's writes are
round trips (`put_submit`) and what to call once the entry is committed (`on_commit`).

A kill -9 anywhere before the publication leaves only staging garbage, which lookups never
see and `Store.gc` removes. Two writers of the same entry: locally the second rename fails and
that writer keeps the first's entry; on an object store both become complete and lookup takes
the oldest (gc removes the other).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from anchorkv.codec.layout import Field
from anchorkv.codec.models import ModelLayout
from anchorkv.codec.packed import Packed
from anchorkv.codec.spec import canonical_json
from anchorkv.kernels.quant import ELEMENTWISE
from anchorkv.store.backends import Backend
from anchorkv.store.commit import OnCommit, commit_parts, commit_staged
from anchorkv.store.errors import FormatError
from anchorkv.store.format import (
    ArrayLayout,
    Encoded,
    crc32c,
    crc32c_combine,
    crc32c_combine_fixed,
    entry_format_version,
    shard_index,
    zero_chunk,
)
from anchorkv.store.manifest import EntryInfo, numcodecs_compressor
from anchorkv.store.paths import (  # noqa: F401 (STAGING: re-exported)
    STAGING,
    entry_path,
    part_marker,
    staging_path,
    zarr_json,
)
from anchorkv.store.plan import rank_region, shards_plan

#: Runs `fn(*args)` on a thread of the store's and returns its future (`Store.begin_entry`
#: passes its chunk threads): the writer computes checksums there while it writes a shard.
ChunkSubmit = Callable[..., Future]
#: `fn(*args)` on the store's help thread, or None (busy)
HelpSubmit = Callable[..., "Future | None"]
#: Shards of at least this many bytes are written by the store's help thread when it is idle
#: (`EntryWriter`'s `help_submit`): two threads copy a save into the page cache, a large shard
#: on one while the saving thread checksums it and writes the small ones (each `writev` of
#: MiBs gives up the GIL for its whole copy; many small ones on a second thread did not pay:
#: `store.LOCAL_PUT_THREADS`). A Kimi-Linear request's 8.8 MB latent shards go there, its 2 MB
#: recurrent and 73 KB conv shards stay (measured in `bench_store.py`'s save rows).
HELP_BYTES = 4 << 20
#: Shards smaller than this are checksummed by the writing thread after their write rather than
#: on a chunk thread during it: the hand-off to a thread and back costs more than the crc32c
#: of a few hundred KB (at several GB/s).
INLINE_CRC_BYTES = 256 << 10


class _Written:
    """A shard written by the help thread: its write, and its checksums made meanwhile (what
    `_wait_puts` records once the write has ended)."""

    def __init__(self, write: Future) -> None:
        self.write = write
        self.sums: tuple[dict[str, list[int]], int] | None = None

    def result(self) -> tuple[dict[str, list[int]], int]:
        self.write.result()
        if self.sums is None:
            raise RuntimeError("the shard's checksums were never made (their computation failed)")
        return self.sums


@functools.lru_cache(maxsize=1024)
def _index(k: tuple[int, ...], slots: tuple) -> bytes:
    return shard_index(k, dict(slots))


def _checksums(placed: list, index: bytes, combine: Callable[[int, int, int], int]) -> tuple[dict[str, list[int]], int]:
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


@functools.lru_cache(maxsize=4096)
def _shard_cuts(array: ArrayLayout, bounds: tuple[tuple[int, int], ...]) -> tuple[tuple[tuple, tuple], ...]:
    """`shards_plan` of a rank's region (by its bounds) with what every layer of a field repeats
    worked out once: per shard, ((shard key, chunks per shard) of each part, and per slot
    (the `ShardSlot`, the region's layer j it lies in, its payload and scales slices of that
    layer's block (`Encoded.region`), (chunk key, coordinates in the shard) of each part))."""
    parts = array.parts
    e = array.codec
    out = []
    for plan in shards_plan(array, [slice(a, b) for a, b in bounds]):
        shards = tuple((p.shard_key(plan.shard), p.chunks_per_shard(plan.chunks_per_shard)) for p in parts)
        slots = []
        for slot in plan.slots:
            layer, *inner, last = slot.chunk.into_region  # (a chunk holds one layer)
            outer = (slice(0, 1), *inner)  # into the block of that layer
            pl = (*outer, slice(e.row_bytes(last.start), e.row_bytes(last.stop)))
            gl = (*outer, slice(e.groups(last.start), e.groups(last.stop)))
            names = tuple((p.chunk_key(slot.chunk.coords), p.local(slot.local)) for p in parts)
            slots.append((slot, layer.start, pl, gl, names))
        out.append((shards, tuple(slots)))
    return tuple(out)


def _gather_recipe(shape: tuple[int, ...], cuts: list[tuple[slice, ...]]) -> tuple | None:
    """How one layer block (`shape`) becomes its chunks' bytes one after another, when `cuts`
    (each chunk's slices into the block, in shard order; trailing axes left out are whole) tile
    a box of it with equal chunks on the chunk grid (from its origin, or from further on: a
    paged field's second and later shards of a layer, past 8192 tokens): (that box's slices,
    None for the whole block; the box reshaped to chunk grid and chunk axes interleaved; the
    transpose putting the grid axes first; the grid order of the cuts, None where it is the C
    order). None where they do not tile such a box."""
    ext = None
    at = []
    for cut in cuts:
        cut = (*cut, *(slice(0, n) for n in shape[len(cut):]))
        e = tuple(c.stop - c.start for c in cut)
        if ext is None:
            ext = e
        if e != ext or any(c.start % n for c, n in zip(cut, e, strict=True)):
            return None
        at.append(tuple(c.start // n for c, n in zip(cut, e, strict=True)))
    if ext is None:
        return None
    first = tuple(min(a) for a in zip(*at, strict=True))  # the box's first chunk along each axis
    at = [tuple(x - f for x, f in zip(a, first, strict=True)) for a in at]
    counts = tuple(max(a) + 1 for a in zip(*at, strict=True))  # chunks along each axis (rows past them stay out)
    start = tuple(f * e for f, e in zip(first, ext, strict=True))
    extent = tuple(n * e for n, e in zip(counts, ext, strict=True))
    if any(a + x > n for a, x, n in zip(start, extent, shape, strict=True)):
        return None
    order = [int(np.ravel_multi_index(a, counts)) for a in at]
    c_order = list(range(int(np.prod(counts))))
    if sorted(order) != c_order:
        return None  # (not every chunk of the box, or one twice)
    box = None if extent == tuple(shape) else tuple(slice(a, a + x) for a, x in zip(start, extent, strict=True))
    inter = tuple(x for c, e in zip(counts, ext, strict=True) for x in (c, e))
    axes = (*range(0, 2 * len(counts), 2), *range(1, 2 * len(counts), 2))
    return box, inter, axes, None if order == c_order else np.array(order)


def _gather(src: np.ndarray, recipe: tuple) -> memoryview:
    """A layer block's chunks' bytes in shard order (`_gather_recipe`): a view where they lie
    so in the block already, else one copy."""
    box, inter, axes, order = recipe
    out = np.ascontiguousarray((src if box is None else src[box]).reshape(inter).transpose(axes))
    if order is not None:
        out = out.reshape(len(order), -1)[order]
    return out.data.cast("B")


@functools.lru_cache(maxsize=4096)
def _gathers(array: ArrayLayout, bounds: tuple[tuple[int, int], ...],
             blocks: tuple[tuple[tuple[int, ...], int], ...]) -> tuple | None:
    """The shards of a rank's region written from its layer blocks (`_gather`), one buffer per
    layer and part instead of one per inner chunk, where each layer's whole chunks tile a box
    of its block from the origin and at most one edge chunk of leading rows (`ShardSlot.lead`,
    a paged field's last) follows them; None otherwise. `blocks`: (shape, item size) of a
    layer block's payload and scales. Per shard and part: (shard key, its index, its size,
    per layer its `_gather_recipe` (None: no whole chunk) and its edge chunk (None, or its
    payload and scales slices and rows), per inner chunk (name, layer, offset in that layer's
    buffer or None for the edge chunk, size, offset in the shard))."""
    out = []
    zero = zero_chunk(array.codec, array.chunks)
    for shards, slots in _shard_cuts(array, bounds):
        layers = [j for _, j, *_ in slots]
        if layers != sorted(layers):
            return None  # (the layer-major order `format.shard_order` gives)
        parts = []
        for i, (skey, k) in enumerate(shards):
            shape, itemsize = blocks[i]
            size = (zero.payload if i == 0 else zero.scales).nbytes  # (a chunk's, padded or not)
            per_layer, chunks, index_slots = {}, [], []
            offset = 0
            for j in dict.fromkeys(layers):
                mine = [s for s in slots if s[1] == j]
                whole = [s for s in mine if s[0].chunk.whole]
                edge = None
                if len(whole) < len(mine):
                    last = mine[-1][0]
                    if len(whole) + 1 < len(mine) or last.chunk.whole or last.lead is None:
                        return None
                    edge = (mine[-1][2], mine[-1][3], last.lead)
                recipe = None
                if whole:
                    recipe = _gather_recipe(shape, [s[2 + i] for s in whole])
                    if recipe is None or int(np.prod(recipe[1][1::2])) * itemsize != size:
                        return None
                per_layer[j] = (recipe, edge)
                for n, (slot, *_, names) in enumerate(mine):
                    name, local = names[i]
                    chunks.append((name, j, n * size if slot.chunk.whole else None, size, offset))
                    index_slots.append((local, (offset, size)))
                    offset += size
            index = _index(k, tuple(index_slots))
            parts.append((skey, index, offset + len(index), per_layer, tuple(chunks)))
        out.append(tuple(parts))
    return tuple(out)


class EntryWriter:
    """One rank's writer of one entry (see the module docstring for the protocol)."""

    def __init__(self, backend: Backend, layout: ModelLayout, header: dict[str, Any],
                 arrays: dict[str, ArrayLayout], *, chunk_submit: ChunkSubmit, on_commit: OnCommit,
                 put_submit: ChunkSubmit | None = None, help_submit: HelpSubmit | None = None) -> None:
        """`chunk_submit`: where checksums are computed while a shard is written; `on_commit`:
        called with the entry once `commit` publishes it (see `anchorkv.store.commit`);
        `put_submit`: where each shard is checksummed and written while the caller goes on (a
        backend whose writes are round trips); None: by the calling thread, one after the other;
        `help_submit` (without `put_submit`): a thread that writes a large shard
        (`HELP_BYTES`) while this one checksums it and goes on, when that thread is idle (None
        from it: busy; the shard is written here)."""
        self.backend = backend
        self.layout = layout
        # the lowest version that represents these arrays: 3 for built-in formats, byte for
        # byte as before; 4 when a codec plug-in encodes a field
        self.header = {**header, "format_version": entry_format_version(arrays)}
        self.arrays = arrays
        self.write_id: str = self.header["write_id"]
        self.final = entry_path(f"{header['key']}/{header['name']}")
        self.data = backend.data_prefix(self.final, self.write_id)
        self.checksums: dict[str, list[int]] = {}  # inner chunk -> [crc32c, nbytes, offset]
        self.shards: dict[str, list[int]] = {}  # shard file -> [crc32c, nbytes]
        self._compressor = numcodecs_compressor(header["compressor"])
        self._chunk_submit = chunk_submit
        self._put_submit = put_submit
        self._help_submit = help_submit if put_submit is None else None
        self._puts: list[tuple[str, int, Any]] = []  # (shard, size, its write) in flight (`put_submit`, help)
        # (format 7) blocks of state layers by (field, shard of layers): held until the shard's
        # last layer comes, then kept (a layer written again rewrites the shard) until the
        # commit, an abort or a settle drops them
        self._held: dict[tuple[str, int], dict[int, Encoded]] = {}
        self._on_commit = on_commit
        self._finished = False  # (this writer put its part marker: `finish_rank`, and wrote nothing since)

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    # ------------------------------------------------------------------ chunks
    def write_layer(self, layer: str, field: str, packed: Packed, *, first_token: int = 0) -> int:
        """Write this rank's chunks of `field` of `layer`; returns the bytes written.

        State fields: `packed` is `[1, *rank shape]` (one block). Paged fields: `[N, block_size,
        *row]` of tokens from `first_token` (0, or for a sliding-window field any token up to
        the field's `first`: rows before it are dropped) with N * block_size reaching the
        entry's last token; rows past it are dropped. A replicated field is written by rank 0
        only (other ranks' calls return 0). `packed` should live in host memory (a CUDA tensor
        is copied here, synchronously). A layer may be written again (a retry) until the entry
        is committed; after `finish_rank` that takes the rank's marker back until it is put
        again. Once another rank has committed the entry, a write lands in its published data
        on an object store (loads then refuse that layer as damaged, and the entry is repaired
        by a new save): retry before the commit, or save anew.
        """
        array = self._array(field)
        where = f"entry {self.final}, layer {layer!r}, field {field!r}"
        lf = self.layout.layer(layer).page.field(field)
        index = array.layer_index(layer)
        if array.shard_axis is None and self.tp_rank != 0:
            return 0
        if first_token and not (array.kind == "paged" and 0 <= first_token <= array.first):
            raise FormatError(f"{where}: rows from token {first_token} given, the field keeps tokens from "
                              f"{array.first}; give rows from a token up to {array.first}")
        self._check_packed(array, lf, packed, where, first_token)
        enc = self._encoded(array, packed)
        region = rank_region(array, index, self.tp_size, self.tp_rank)
        if array.kind == "paged":  # the rank block covers tokens [first_token, N*block_size)
            skip = array.first - first_token
            if skip:
                enc = Encoded(enc.encoding, enc.payload[:, skip:], enc.scales[:, skip:])
            region[1] = slice(0, min(enc.payload.shape[1], array.shape[1]))
        span = array.shards[0]
        if span == 1:
            return self._write_region(array, region, (enc,))
        # (format 7) a state field's shard spans `span` layers: each layer's block is held (a
        # view of the caller's Packed, which must not change before `finish_rank` returns) until
        # the last layer of its shard comes, then the shard is written whole; a layer written
        # again replaces its block and, once its shard is whole, writes it again at once (as a
        # shard of one layer is written again). Layers that never come leave their shard
        # unwritten: the commit names its chunks, never written
        group = index // span
        held = self._held.setdefault((field, group), {})
        held[index] = enc
        if len(held) < span:
            return 0
        region[0] = slice(group * span, group * span + span)
        return self._write_region(array, region, tuple(held[group * span + j] for j in range(span)))

    def _write_region(self, array: ArrayLayout, region: list[slice], blocks: tuple[Encoded, ...]) -> int:
        """Write the shards of `region` (whole shards of this rank), from the blocks of its
        layers (`blocks[j]`: the block of the region's layer j, one layer each); the bytes
        written."""
        total = 0
        has_scales = blocks[0].scales.size != 0  # (raw, bf16 and plug-ins without scales: none in any chunk)
        bounds = tuple((s.start, s.stop) for s in region)
        if self._compressor is None:  # one buffer a layer block (`_gathers`), where it applies

            def kinds(b: Encoded) -> tuple:
                return tuple((a.shape, a.itemsize) for a in (b.payload, b.scales)[:1 + has_scales])

            fast = _gathers(array, bounds, kinds(blocks[0]))
            if fast is not None and all(kinds(b) == kinds(blocks[0]) for b in blocks[1:]):
                return sum(self._write_gathered(array, blocks, i, *part) for parts in fast
                           for i, part in enumerate(parts))
        for shards, slots in _shard_cuts(array, bounds):
            per_part: list[list] = [[] for _ in shards]
            for slot, j, pl, gl, names in slots:
                chunk = slot.chunk
                enc = blocks[j]
                if chunk.whole:  # `Encoded.buffers` of the chunk's region, without building it
                    bufs = [np.ascontiguousarray(enc.payload[pl]).data.cast("B")]
                    if has_scales:
                        bufs.append(np.ascontiguousarray(enc.scales[gl]).data.cast("B"))
                    for (name, local), chunks, b in zip(names, per_part, bufs, strict=False):
                        chunks.append((name, local, [b]))
                    continue
                part = Encoded(enc.encoding, enc.payload[pl], enc.scales[gl])
                if slot.lead is not None:
                    both = self._row_padded(array, part, slot.lead)
                else:
                    both = self._padded(array, part, chunk.into_chunk).buffers()
                # both is (payload, scales): no scales part (an empty list) for raw, bf16 and
                # plug-ins without scales, so it may be longer than the parts
                for (name, local), chunks, buffers in zip(names, per_part, both, strict=False):
                    chunks.append((name, local, buffers))
            for (skey, k), chunks in zip(shards, per_part, strict=True):
                total += self._put_shard(skey, k, chunks)
        return total

    def _write_gathered(self, array: ArrayLayout, blocks: tuple[Encoded, ...], i: int, skey: str, index: bytes,
                        size: int, per_layer: dict, chunks: tuple) -> int:
        """Write part `i` (payload, scales) of one shard of `_gathers`: each layer's whole
        chunks as one buffer (`_gather`), its edge chunk's rows and the cached zero rows after
        them (`_row_padded`), then the index; each chunk checksummed as its slice."""
        views: dict[int, memoryview] = {}
        edges: dict[int, list] = {}
        buffers: list[memoryview] = []
        for j, (recipe, edge) in per_layer.items():
            if recipe is not None:
                views[j] = _gather(blocks[j].payload if i == 0 else blocks[j].scales, recipe)
                buffers.append(views[j])
            if edge is not None:
                pl, gl, rows = edge
                enc = blocks[j]
                edges[j] = self._row_padded(array, Encoded(enc.encoding, enc.payload[pl], enc.scales[gl]), rows)[i]
                buffers += edges[j]
        placed = [(name, edges[j] if at is None else [views[j][at:at + n]], n, off) for name, j, at, n, off in chunks]
        buffers.append(memoryview(index))
        return self._submit_shard(skey, buffers, placed, index, crc32c_combine_fixed, size)

    def _array(self, field: str) -> ArrayLayout:
        try:
            return self.arrays[field]
        except KeyError:
            raise KeyError(f"entry {self.final} has no field {field!r}; it has {sorted(self.arrays)}") from None

    def _check_packed(self, array: ArrayLayout, lf: Field, packed: Packed, where: str, first_token: int) -> None:
        if array.kind == "state":
            expected = (1, *lf.shape)
            ok = tuple(packed.shape) == expected
        else:
            expected = (-1, *lf.shape)
            ok = (tuple(packed.shape[1:]) == tuple(lf.shape)
                  and first_token + packed.shape[0] * lf.shape[0] >= self.header["num_tokens"])
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
                    "resolved spec (PluginChunkEncoding.spec, ZarrEntryStore.codecs)"
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
        payload = [np.ascontiguousarray(part.payload).data.cast("B"), z.payload[:, rows:].data.cast("B")]
        scales = []
        if z.scales.size:
            scales = [np.ascontiguousarray(part.scales).data.cast("B"), z.scales[:, rows:].data.cast("B")]
        return payload, scales

    def _padded(self, array: ArrayLayout, part: Encoded, into_chunk: tuple[slice, ...]) -> Encoded:
        """A whole edge chunk: `part` in its place, the rest zero bytes (zarr's fill)."""
        z = zero_chunk(array.codec, array.chunks)
        full = Encoded(z.encoding, z.payload.copy(), z.scales.copy())
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
        to the manifest; os.writev releases the GIL, and so do fastcrc and the `crc32c` package,
        while google-crc32c holds it for each call: see `store.chunk_threads`). With `put_submit` (an object
        store's round trips, a local directory's `store.LOCAL_PUT_THREADS`) both run on a put
        thread, one shard after another, and this returns at once: `finish_rank` waits for every write in flight.
        The buffers stay referenced until then (views of the caller's `Packed`, which must not
        change before `finish_rank` returns)."""
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
        return self._submit_shard(skey, buffers, placed, index, combine, offset + len(index))

    def _submit_shard(self, skey: str, buffers: list[memoryview], placed: list, index: bytes,
                      combine: Callable[[int, int, int], int], size: int) -> int:
        """Write a shard file of `buffers` (its chunks `placed` as `_checksums` takes them, then
        `index`) and record its checksums: on a put thread, the help thread or here (see
        `_put_shard`); its size."""
        self._supersede(skey)
        if self._finished:  # a retry after `finish_rank`: its marker names the bytes this replaces
            # taken back before the write, so that no commit (this writer's, another rank's, the
            # scheduler's `commit_staged`) publishes its checksums over the new bytes: the rank is
            # unfinished again until it puts its marker anew (found by review: a damaged entry)
            self.backend.delete(part_marker(self.write_id, self.tp_rank, self.tp_size))
            self._finished = False
        if self._put_submit is not None:
            self._puts.append((skey, size, self._put_submit(self._put, skey, buffers, placed, index, combine)))
            return size
        if self._help_submit is not None and size >= HELP_BYTES:
            write = self._help_submit(self.backend.write, f"{self.data}/{skey}", buffers)
            if write is not None:  # written there while this thread checksums it, then goes on
                written = _Written(write)
                self._puts.append((skey, size, written))  # (first: settle / abort wait for it whatever follows)
                written.sums = _checksums(placed, index, combine)
                return size
        if size < INLINE_CRC_BYTES:  # (checksummed here: quicker than handing it to a chunk thread)
            self.backend.write(f"{self.data}/{skey}", buffers)
            self._record(skey, size, *_checksums(placed, index, combine))
            return size
        pending = self._chunk_submit(_checksums, placed, index, combine)
        try:
            self.backend.write(f"{self.data}/{skey}", buffers)
        finally:
            sums, whole = pending.result()
        self._record(skey, size, sums, whole)
        return size

    def _supersede(self, skey: str) -> None:
        """Wait for an earlier write of shard `skey` still in flight (a layer written again: a
        retry) and drop it, its outcome included: this write replaces the file, and its bytes
        must land last and its checksums be the ones recorded (found by review: the earlier
        write, landing last, left stale bytes under the new checksums, or under its own
        checksums recorded over the new ones)."""
        earlier = [p for p in self._puts if p[0] == skey]
        if not earlier:
            return
        self._puts = [p for p in self._puts if p[0] != skey]
        for _, _, write in earlier:
            try:
                write.result()
            except Exception:  # (superseded: this write's outcome is what counts)
                pass

    def _put(self, skey: str, buffers: list[memoryview], placed: list, index: bytes,
             combine: Callable[[int, int, int], int]) -> tuple[dict[str, list[int]], int]:
        """(a put thread) A shard's checksums, then its write."""
        sums = _checksums(placed, index, combine)
        self.backend.write(f"{self.data}/{skey}", buffers)
        return sums

    def _record(self, skey: str, size: int, sums: dict[str, list[int]], whole: int) -> None:
        self.checksums.update(sums)
        self.shards[skey] = [whole, size]

    def _wait_puts(self) -> None:
        """Wait for every shard write in flight and record their checksums; the first error,
        once all have ended."""
        puts, self._puts = self._puts, []
        error: BaseException | None = None
        for skey, size, write in puts:
            try:
                sums, whole = write.result()
            except BaseException as e:  # (every write ends before any is reported)
                error = error or e
            else:
                self._record(skey, size, sums, whole)
        if error is not None:
            raise error

    # ------------------------------------------------------------------ protocol
    def _part(self) -> dict[str, Any]:
        """This rank's part marker, once its writes in flight ended."""
        self._wait_puts()
        return {"header": self.header, "tp_rank": self.tp_rank, "chunks": self.checksums, "shards": self.shards}

    def finish_rank(self) -> None:
        """Publish this rank's part marker (atomically) once its chunks are written."""
        path = part_marker(self.write_id, self.tp_rank, self.tp_size)
        self.backend.write(path, [json.dumps(self._part()).encode()], atomic=True)
        self._finished = True

    def wait_writes(self) -> None:
        """Wait for this rank's shard writes still in flight (put threads, the help thread) and
        record their checksums; raises the first failure once all have ended. What `commit`
        and `finish_rank` do first: a caller that cleans up after a failed write calls it
        where the failure should surface."""
        self._wait_puts()

    def commit(self, replace: str | None = None) -> EntryInfo:
        """Publish the entry once every rank finished (this rank's part is finished here);
        `replace`: as `Store.commit_staged`'s.

        A single rank (tp_size 1) that has not put its marker (`finish_rank`) commits its part
        from memory (`commit_parts`: the same checks and the same files as from the marker,
        without writing the marker and reading it back: ~1 ms of a Kimi-Linear save's 50 kB of
        checksums encoded, written, listed, read and parsed; nor asking the store whether a
        marker is there: a round trip on an object store); with more ranks this rank's marker
        is put first unless it is in the store, and the commit reads every rank's from the
        store (`commit_staged`). A shard written after `finish_rank` (a retry) deletes this
        rank's marker first: the commit then goes from memory (tp_size 1) or puts it again.

        Raises `IncompleteEntry` naming the missing ranks or chunks; call it again later.
        """
        if self.tp_size == 1 and not self._finished:
            part = self._part()
            # the header as a marker's JSON gives it back (lists, not tuples): the manifest
            # handed to `on_commit` is then the one a reader parses
            part["header"] = json.loads(json.dumps(part["header"]))
            info = commit_parts(self.backend, self.write_id, [part], self._on_commit, replace)
        else:
            if not self.backend.exists(part_marker(self.write_id, self.tp_rank, self.tp_size)):
                self.finish_rank()
            info = commit_staged(self.backend, self.write_id, self._on_commit, replace)
        self._held.clear()  # (the caller's buffers: once committed, nothing writes them)
        return info

    def settle(self) -> None:
        """Wait for this rank's writes in flight, whatever their outcome (a failed write whose
        caller reuses the buffers it handed over: a write still reading them would stage
        another save's bytes); the state layers held for their shards are dropped."""
        self._held.clear()
        try:
            self._wait_puts()
        except Exception:  # (the failure being cleaned up is the caller's to report)
            pass

    def abort(self) -> None:
        """Drop everything this write staged (all ranks' parts), once no write of it is in
        flight; never an entry it published (an object store's data lies under the write's own
        prefix, published by its manifest's put: an interrupt after that put leaves the entry)."""
        self.settle()
        self.backend.delete_tree(staging_path(self.write_id))
        if not self.backend.atomic_publish and not self.backend.exists(zarr_json(self.data)):
            self.backend.delete_tree(self.data)
