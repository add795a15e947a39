"""Reading an entry's bytes: the inner chunks a load needs (a shard it reads every byte of by
one range, checked against the shard's crc32c; others by byte ranges, each chunk checked against
its own) and the whole-shard check `Store.verify` runs (sizes, crc32c of the shard and of each
chunk, zarr's index against the manifest).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from typing import Any, NamedTuple, NoReturn

import numpy as np

from anchorkv.store.backends import Backend
from anchorkv.store.errors import CorruptEntry
from anchorkv.store.format import (
    EMPTY,
    ArrayLayout,
    Encoded,
    Part,
    crc32c,
    crc32c_combine,
    crc32c_combine_fixed,
    index_nbytes,
    parse_shard_index,
)
from anchorkv.store.manifest import EntryInfo, numcodecs_compressor
from anchorkv.store.plan import ChunkSlice, chunk_plan

#: A chunk read straight into a load's output whose place there is more than this many
#: contiguous runs goes through a buffer of its own instead (one `preadv` takes <= 1024 buffers).
MAX_RUNS = 64
#: Chunks that follow each other in a shard file are read together (one range of
#: `Backend.read_ranges_into`: one `preadv` of a local file) up to this many bytes, and checked
#: right after it, their bytes still in the CPU's cache; a larger chunk is read alone. Small
#: chunks (a conv state's, a quantized field's scales) then cost one system call and one check
#: call a few dozen, not one each.
GROUP_BYTES = 256 * 1024
#: ... and up to this many buffers (one `preadv` takes <= 1024; `MAX_RUNS` a chunk)
GROUP_BUFFERS = 1024


class _Chunk(NamedTuple):
    """One inner chunk a planned read reads and checks."""

    offset: int  # in the shard (from the manifest)
    key: str  # the inner chunk's key in this array
    size: int  # its size, from the manifest (its crc32c: `_ShardRead.crcs`)
    #: read straight into the load's output: its place there, as contiguous runs (start, bytes),
    #: the starts counted from the first byte of the output's payload (codes) or scales; None: a
    #: buffer of its own (`item`)
    runs: tuple[tuple[int, int], ...] | None
    item: int  # a buffered chunk's index in `ReadPlan.scratch` (-1: read straight in)


class _ShardRead(NamedTuple):
    """The inner chunks a load reads of one shard file of one stored array (codes or scales)."""

    key: str  # the shard's key
    path: str  # its path in the store
    size: int  # its size in the manifest
    part: int  # 0: values / codes (into the payload), 1: scales
    chunks: tuple[_Chunk, ...]  # by offset
    crcs: tuple[int, ...]  # theirs, from the manifest
    groups: tuple[_Group, ...]  # the chunks read together (`GROUP_BYTES`)
    #: when the load reads every byte of the shard (all its chunks, one after another from its
    #: start, then its index): the crc32c its chunks' checksums in the manifest make together,
    #: and the shard's own there; the whole file is read by one range and checked by one
    #: running crc32c against both (`_read_whole`: the shard's alone would pass a chunk whose
    #: checksum in a re-signed manifest is not its bytes'). When it reads one run of
    #: neighbouring chunks that is not the whole file (a layer of a shard spanning layers,
    #: format version 7): the first alone, (crc, None), the run read and checked alike, without
    #: the index. None: by groups, each chunk by its own
    crc: tuple[int, int | None] | None


#: `_steps`: (the first chunk's first row's start, rows a chunk, bytes a row, step between
#: chunks, step between rows)
_Steps = tuple[int, int, int, int, int]


class _Group(NamedTuple):
    """Chunks that follow each other in a shard file, read by one range and checked after it."""

    first: int  # [first, stop): indices into `_ShardRead.chunks`
    stop: int
    nbytes: int
    #: chunks whose places lie in rows at regular steps (`_steps`): read into a buffer of their
    #: own, checked there by one crc32c call each, then copied into the output by one strided
    #: copy of this byte view of it, `(start, shape, strides)` from the output's first byte:
    #: [chunk, row, byte]. None: read straight in
    strided: tuple[int, tuple[int, int, int], tuple[int, int, int]] | None


class ReadPlan(NamedTuple):
    """What a load of one region of a field reads (`bind_reads`): every shard it touches, each
    with its chunks' offsets, checksums and places, and the chunks that go through buffers of
    their own (compressed, or covered in part), decoded and copied into their place. Made from
    the manifest and the output's geometry only: a load of the same region of the same entry
    into an output of the same shape reuses it (`Store._load_plan` keeps it)."""

    shards: tuple[_ShardRead, ...]
    scratch: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]  # (into the region, into the chunk)


def copy_into(dst: Encoded, src: Encoded) -> None:
    """Copy an encoded block into another's place (`src` broadcasts, e.g. one zero row to many)."""
    np.copyto(dst.payload, src.payload)
    if dst.scales.size:
        np.copyto(dst.scales, src.scales)


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _runs(a: np.ndarray, base: int) -> tuple[tuple[int, int], ...] | None:
    """The bytes of the view `a` in C order as contiguous runs `(start - base, bytes)` (None:
    more than `MAX_RUNS`). A chunk of a field split along its last axis (the conv state at
    tp=1) lies in the output as one run per row."""
    if a.size == 0:
        return ()
    start = _address(a) - base
    if a.flags.c_contiguous:
        return ((start, a.nbytes),)
    k, inner = a.ndim, a.itemsize
    while k > 0 and (a.shape[k - 1] == 1 or a.strides[k - 1] == inner):  # the contiguous trailing axes
        inner *= a.shape[k - 1]
        k -= 1
    if math.prod(a.shape[:k]) > MAX_RUNS:
        return None
    starts = np.array([start], np.int64)
    for n, stride in zip(a.shape[:k], a.strides[:k], strict=True):
        starts = (starts[:, None] + np.arange(n, dtype=np.int64) * stride).reshape(-1)
    return tuple((s, inner) for s in starts.tolist())


class _Geometry(NamedTuple):
    """The layout part of a `ReadPlan`: the same for every layer of a field, and for every entry
    whose array is alike (a field's chunks, shards and places in the output). Per shard and
    stored array (codes, scales), its key and its chunks' keys, each as the text before and
    after the layer's coordinate, where each chunk goes: `(runs, bytes)` (read straight into
    the output) or an index into `scratch` (the chunk's covered part, as slices into the
    region's block and into the chunk), and the chunks' `_steps`."""

    shards: tuple[tuple[tuple[str, str], int, tuple[tuple[tuple[str, str], Any], ...], _Steps | None], ...]
    scratch: tuple[tuple[tuple[slice, ...], tuple[slice, ...]], ...]


#: `read_geometry`'s cache: (array, region less its layer, the output's shapes and strides,
#: compressed) -> it. Module wide, as `plan.chunk_plan`'s: every layer of a field, and entries of
#: one model and length, share one, whatever their Store.
_GEOMETRIES: dict[tuple, _Geometry] = {}
_GEOMETRIES_MAX = 4096


def _split(key: str, coords: tuple[int, ...], by_layer: bool) -> tuple[str, str]:
    """A chunk's or shard's key as (the text before its layer coordinate, after it): the key of
    the same chunk of another layer is the one joined by that layer's number."""
    if by_layer:
        head, _, tail = key.partition("/c.")
        layer, dot, rest = tail.partition(".")
        if layer == str(coords[0]) and dot:
            return f"{head}/c.", dot + rest
    return key, ""


def read_geometry(array: ArrayLayout, region: Sequence[slice], out: Encoded, compressed: bool) -> tuple[_Geometry, str]:
    """The geometry of a load of `region` of `array` into `out` (cached), and the text of its
    layer coordinate that joins its keys' halves."""
    bounds = tuple((s.start, s.stop) for s in region)
    # every layer alike: one layer a chunk and a shard along axis 0 (as `format.geometry` cuts them)
    by_layer = array.chunks[0] == 1 and array.shards[0] == 1 and bounds[0][1] - bounds[0][0] == 1
    for shared in (True, False) if by_layer else (False,):
        key = (array, bounds[1:] if shared else bounds, out.payload.shape, out.payload.strides,
               out.scales.shape, out.scales.strides, compressed)
        geometry = _GEOMETRIES.get(key)
        if geometry is None:
            geometry = _build_geometry(array, region, out, compressed, shared)
            if geometry is None:
                continue  # keys of another shape: one geometry per layer
            if len(_GEOMETRIES) >= _GEOMETRIES_MAX:
                _GEOMETRIES.clear()
            _GEOMETRIES[key] = geometry
        return geometry, str(bounds[0][0]) if shared else ""
    raise AssertionError("unreachable: a geometry of one layer always splits")


def _build_geometry(array: ArrayLayout, region: Sequence[slice], out: Encoded, compressed: bool,
                    by_layer: bool) -> _Geometry | None:
    """`read_geometry`'s work (None: `by_layer` and a key does not split at the layer)."""
    parts = array.parts
    bases = (_address(out.payload), _address(out.scales))
    # per shard, its chunks: (item, (runs of its codes, of its scales)) when read straight into
    # `out`, else (item, its index in `scratch`)
    by_shard: dict[tuple[int, ...], list[tuple[ChunkSlice, Any]]] = {}
    scratch: list[tuple[tuple[slice, ...], tuple[slice, ...]]] = []
    for item in chunk_plan(array, list(region)):
        where: Any = None
        if not compressed and item.whole:
            dst = out.region(item.into_region)
            where = (_runs(dst.payload, bases[0]), _runs(dst.scales, bases[1]))
            if where[0] is None or (len(parts) > 1 and where[1] is None):
                where = None
        if where is None:
            where = len(scratch)
            scratch.append((item.into_region, item.into_chunk))
        by_shard.setdefault(array.shard_of(item.coords), []).append((item, where))
    shards = []
    for shard, rows in by_shard.items():
        for pi, part in enumerate(parts):
            chunks = []
            for item, where in rows:
                ckey = _split(part.chunk_key(item.coords), item.coords, by_layer)
                chunks.append((ckey, where if isinstance(where, int) else (where[pi], sum(n for _, n in where[pi]))))
            skey = _split(part.shard_key(shard), shard, by_layer)
            if by_layer and not all(k[1] for k in (skey, *(c[0] for c in chunks))):
                return None
            shards.append((skey, pi, tuple(chunks), _steps([None if isinstance(w, int) else w[0] for _, w in chunks])))
    return _Geometry(tuple(shards), tuple(scratch))


def bind_reads(info: EntryInfo, array: ArrayLayout, geometry: _Geometry, layer: str, compressed: bool) -> ReadPlan:
    """The plan of reading a region of the field (its `read_geometry`: what is read and where it
    goes, alike for every entry of a model and length) with this entry's offsets and checksums,
    from the shard files of each stored array (codes, scales), each chunk checked against its
    crc32c and size (`read_planned`).

    A chunk covered whole and uncompressed is read straight into its place in the output (no
    intermediate bytes), also where that place is a few runs apart (`_runs`: one buffer of the
    `preadv` each); the others go through buffers of their own. `CorruptEntry` if the manifest
    lacks a checksum, or gives a chunk read straight in another size than its place."""
    sums, sizes = info.manifest["checksums"], info.manifest["shards"]
    shards = []
    for (shead, stail), pi, places, steps in geometry.shards:
        skey = shead + layer + stail if stail else shead
        want_shard = sizes.get(skey)
        if want_shard is None:
            raise CorruptEntry(info.id, f"the manifest has no checksum for shard {skey}")
        pairs: list[tuple[_Chunk, int]] = []  # (chunk, its crc32c)
        for (head, tail), where in places:
            ckey = head + layer + tail if tail else head
            expected = sums.get(ckey)
            if expected is None:
                raise CorruptEntry(info.id, f"the manifest has no checksum for chunk {ckey}")
            crc, size, offset = expected
            if isinstance(where, int):
                pairs.append((_Chunk(offset, ckey, size, None, where), crc))
                continue
            runs, nbytes = where
            if nbytes != size:
                raise CorruptEntry(info.id, f"chunk {ckey} is {size} bytes in the manifest, its "
                                   f"shape and codec make {nbytes}")
            pairs.append((_Chunk(offset, ckey, size, runs, -1), crc))
        if any(a[0].offset > b[0].offset for a, b in pairwise(pairs)):  # not in the geometry's order
            pairs.sort(key=lambda p: p[0].offset)
            steps = None
        chunks = [c for c, _ in pairs]
        crcs = tuple(crc for _, crc in pairs)
        groups = _groups(chunks, steps)
        slots = array.parts[pi].chunks_per_shard(array.chunks_per_shard)
        whole = _whole_shard(chunks, groups, want_shard[1], slots)
        run = whole or (slots[0] > 1 and _one_run(chunks, groups))  # (a shard spanning layers: format 7)
        shards.append(_ShardRead(skey, f"{info.path}/{skey}", want_shard[1], pi, tuple(chunks), crcs, groups,
                                 _whole_crc(chunks, crcs, want_shard[0] if whole else None, compressed)
                                 if run else None))
    return ReadPlan(tuple(shards), geometry.scratch)


def _whole_crc(chunks: Sequence[_Chunk], crcs: Sequence[int], shard_crc: int | None,
               compressed: bool) -> tuple[int, int | None]:
    """`_ShardRead.crc` of a shard read whole: (its chunks' crc32c together, its own); of a run
    of it (`shard_crc` None): (its chunks' crc32c together, None)."""
    combine = crc32c_combine if compressed else crc32c_combine_fixed
    data = crcs[0]
    for c, crc in zip(chunks[1:], crcs[1:], strict=True):
        data = combine(data, crc, c.size)
    return data, shard_crc


def rebind_reads(plan: ReadPlan, info: EntryInfo, compressed: bool) -> ReadPlan | None:
    """`plan` (another entry's, of the same geometry) with this entry's paths and checksums,
    where its manifest puts every chunk at the same offset with the same size (so the same
    places, groups and whole-shard reads hold); None otherwise (`bind_reads` then plans it
    anew, raising what it finds). Reads only the chunks' checksums: a worker's first restore of
    an entry of a model and length restored before plans no read."""
    sums, sizes = info.manifest["checksums"], info.manifest["shards"]
    shards = []
    for shard in plan.shards:
        want_shard = sizes.get(shard.key)
        if want_shard is None or want_shard[1] != shard.size:
            return None
        got = [sums.get(c.key) for c in shard.chunks]
        try:
            if [(v[1], v[2]) for v in got] != [(c.size, c.offset) for c in shard.chunks]:
                return None
        except TypeError:  # a chunk without a checksum
            return None
        crcs = tuple(v[0] for v in got)
        shards.append(shard._replace(
            path=f"{info.path}/{shard.key}", crcs=crcs,
            crc=None if shard.crc is None else _whole_crc(
                shard.chunks, crcs, None if shard.crc[1] is None else want_shard[0], compressed)))
    return ReadPlan(tuple(shards), plan.scratch)


def _run_end(chunks: Sequence[_Chunk], groups: Sequence[_Group]) -> int | None:
    """Where `chunks` (by offset) end in their file when they lie one after another and are at
    most `GROUP_BUFFERS` buffers (a strided group's chunks: one), so one range reads them all;
    None otherwise."""
    end = chunks[0].offset if chunks else 0
    for c in chunks:
        if c.offset != end:
            return None
        end += c.size
    nbufs = sum(1 if g.strided is not None else sum(1 if c.runs is None else len(c.runs)
                                                      for c in chunks[g.first : g.stop]) for g in groups)
    return end if nbufs < GROUP_BUFFERS else None


def _whole_shard(chunks: Sequence[_Chunk], groups: Sequence[_Group], size: int, slots: tuple[int, ...]) -> bool:
    """Whether `chunks` (by offset) are every byte of their shard file of `size` bytes but its
    index: one run (`_run_end`) from byte 0, then the index of `slots` chunks."""
    end = _run_end(chunks, groups)
    return end is not None and (not chunks or chunks[0].offset == 0) and end + index_nbytes(slots) == size


def _one_run(chunks: Sequence[_Chunk], groups: Sequence[_Group]) -> bool:
    """Whether `chunks` are one run (`_run_end`) of more than one chunk: then one range reads
    them and one running crc32c checks them (`_read_whole`), not a range a group and a check a
    chunk (a quantized Kimi-Linear conv layer, 8 chunks in one group: 8 crc32c calls a load,
    ~16 us more than its shard of one layer read whole, when only groups of several were runs).
    Used for the layers of a shard spanning layers (format version 7; each layer's chunks lie
    together, `format.shard_order`), which a load of a layer reads as a load of a shard of one
    layer read it whole; a part of a shard of one layer is still read and checked group by group."""
    return len(chunks) > 1 and _run_end(chunks, groups) is not None


def _groups(chunks: Sequence[_Chunk], steps: _Steps | None) -> tuple[_Group, ...]:
    """`chunks` (by offset) cut into runs of neighbours in the file of at most `GROUP_BYTES`
    and `GROUP_BUFFERS` (a chunk larger than that alone); `steps`: their `_steps`, in this
    order."""
    groups, first, nbytes, nbufs, end = [], 0, 0, 0, 0
    for i, c in enumerate(chunks):
        k = 1 if c.runs is None else len(c.runs)
        if i > first and (c.offset != end or nbytes + c.size > GROUP_BYTES or nbufs + k > GROUP_BUFFERS):
            groups.append(_group(first, i, nbytes, steps))
            first, nbytes, nbufs = i, 0, 0
        nbytes += c.size
        nbufs += k
        end = c.offset + c.size
    if chunks:
        groups.append(_group(first, len(chunks), nbytes, steps))
    return tuple(groups)


def _group(first: int, stop: int, nbytes: int, steps: _Steps | None) -> _Group:
    if steps is None:
        return _Group(first, stop, nbytes, None)
    start, rows, inner, spacing, step = steps
    return _Group(first, stop, nbytes, (start + first * spacing, (stop - first, rows, inner), (spacing, step, 1)))


def _steps(places: Sequence[tuple[tuple[int, int], ...] | None]) -> _Steps | None:
    """Where chunks read straight in lie in the output as rows of one size at one step, the
    chunks' first rows at one step too (a conv state's chunks of channels, a row of each per
    tap), given their places (runs; None: a buffer of its own), the steps of those rows (None
    otherwise): then a group of them is one strided byte view of the output (`_Group.strided`).
    Saves a memoryview and a crc32c call per row: 1,440 rows of a Kimi-Linear request's conv
    states."""
    first = places[0] if places else None
    if first is None or len(first) < 2:
        return None
    (start, inner), (second, _) = first[0], first[1]
    step, rows = second - start, len(first)
    spacing = places[1][0][0] - start if len(places) > 1 and places[1] else 0
    for i, runs in enumerate(places):
        at = start + i * spacing
        if runs != tuple((at + j * step, inner) for j in range(rows)):
            return None
    return start, rows, inner, spacing, step


def _crc_of(views: list[memoryview], n: int) -> int:
    """The crc32c of the first `n` bytes of `views` (what a read put there)."""
    crc = 0
    for v in views:
        if n <= 0:
            break
        crc = crc32c(v if v.nbytes <= n else v[:n], value=crc)
        n -= v.nbytes
    return crc


def read_planned(backend: Backend, info: EntryInfo, array: ArrayLayout, plan: ReadPlan, out: Encoded | None,
                 payload: np.ndarray, scales: np.ndarray, bases: tuple[int, int]) -> None:
    """Read what `plan` says into `out` (views of the flat `payload` bytes and `scales` from
    `bases`, their first bytes' offsets there; only chunks copied in through buffers of their
    own, `ReadPlan.scratch`, use `out`, which may be None without them): one
    `read_ranges_into` per shard file. A shard the load reads whole (every shard of a load of
    all of an entry's tokens at its tp, or at a tp that splits its fields by shards) is one
    range, checked by the shard's crc32c (`_read_whole`); other shards a range per group of
    neighbouring chunks (`GROUP_BYTES`), each chunk checked against its crc32c and size as soon
    as its group is read (a local file: its bytes still in the CPU's cache), before the next
    group is read. `CorruptEntry` on the first chunk or shard that fails, on a shard file of
    another size than the manifest's, or a missing one. A
    field encoded by a codec plug-in that is not installed raises `MissingCodec` before anything
    is read."""
    if array.codec.plugin:  # no byte is read for a field nobody here can decode
        array.codec.impl(info.id, array.field)  # MissingCodec, one line naming the plug-in
    arrays = (payload, scales.view(np.uint8))
    flat = (payload.data.cast("B"), arrays[1].data.cast("B"))
    comp = numcodecs_compressor(info.manifest.get("compressor")) if plan.scratch else None
    scratch: dict[int, list[bytes | bytearray]] = {}
    scratch_keys: dict[int, str] = {}
    for shard in plan.shards:
        buf, base, dst = flat[shard.part], bases[shard.part], arrays[shard.part]
        if shard.crc is not None:
            _keep_scratch(scratch, scratch_keys, shard, _read_whole(backend, info, shard, buf, base, dst), comp)
            continue
        chunks = shard.chunks
        views: list[list[memoryview]] = []  # per chunk, where its bytes are read
        own: list[bytearray | None] = []  # per chunk, its buffer of its own (`ReadPlan.scratch`)
        staged: list[np.ndarray | None] = []  # per group, a strided group's buffer
        ranges: list[tuple[int, list[memoryview]]] = []
        for g in shard.groups:
            if g.strided is not None:
                stage = np.empty(g.nbytes, np.uint8)
                at, whole = 0, stage.data
                for c in chunks[g.first : g.stop]:
                    views.append([whole[at : at + c.size]])
                    own.append(None)
                    at += c.size
                ranges.append((chunks[g.first].offset, [whole]))
                staged.append(stage)
                continue
            for c in chunks[g.first : g.stop]:
                if c.runs is None:
                    b = bytearray(c.size)
                    views.append([memoryview(b)])
                    own.append(b)
                else:
                    views.append([buf[base + s : base + s + n] for s, n in c.runs])
                    own.append(None)
            ranges.append((chunks[g.first].offset, views[g.first] if g.stop == g.first + 1
                           else [v for vs in views[g.first : g.stop] for v in vs]))
            staged.append(None)
        checked = [False] * len(ranges)

        def check(fsize: int, i: int, n: int, shard: _ShardRead = shard, views: list[list[memoryview]] = views,
                  staged: list[np.ndarray | None] = staged, base: int = base, dst: np.ndarray = dst,
                  checked: list[bool] = checked) -> None:
            checked[i] = True
            _check_size(info, shard, fsize)
            g = shard.groups[i]
            start = shard.chunks[g.first].offset
            for k in range(g.first, g.stop):
                c, vs, want = shard.chunks[k], views[k], shard.crcs[k]
                got = min(c.size, max(0, n - (c.offset - start)))  # the group's bytes read into this chunk
                crc = crc32c(vs[0]) if got == c.size and len(vs) == 1 else _crc_of(vs, got)
                if got != c.size or crc != want:
                    raise _chunk_fails(info, shard, k, got, crc)
            _place(g, staged[i], dst, base)

        _read_ranges(backend, info, shard, ranges, check, checked)
        _keep_scratch(scratch, scratch_keys, shard, own, comp)
    for ii, bufs in scratch.items():
        assert out is not None, "a plan with chunks through buffers of their own needs the output's views"
        into_region, into_chunk = plan.scratch[ii]
        pn, sn = array.codec.nbytes(array.chunks)
        sizes = [len(memoryview(b).cast("B")) for b in bufs]
        if sizes != [pn, sn][: len(array.parts)]:
            raise CorruptEntry(info.id, f"chunk {scratch_keys[ii]} decodes to {sizes} bytes, its shape and codec "
                               f"make {[pn, sn][: len(array.parts)]}")
        sc = np.frombuffer(bufs[1], np.float32) if len(bufs) > 1 else np.empty(0, np.float32)
        enc = array.codec.views(np.frombuffer(bufs[0], np.uint8), sc, array.chunks)
        copy_into(out.region(into_region), enc.region(into_chunk))


def _keep_scratch(scratch: dict[int, list[bytes | bytearray]], keys: dict[int, str], shard: _ShardRead,
                  own: Sequence[bytearray | None], comp: Any) -> None:
    """Keep the chunks of `shard` read into buffers of their own (`own`, per chunk), decoded,
    for their copy into place (`read_planned`)."""
    for c, mine in zip(shard.chunks, own, strict=True):
        if mine is not None:
            scratch.setdefault(c.item, []).append(comp.decode(mine) if comp is not None else mine)
            keys.setdefault(c.item, c.key)


def _read_whole(backend: Backend, info: EntryInfo, shard: _ShardRead, buf: memoryview, base: int,
                dst: np.ndarray) -> list[bytearray | None]:
    """Read a shard the load reads every byte of (`_ShardRead.crc`), or a run of its chunks, by
    one range, its chunks straight into their places (neighbouring places as one buffer), a
    strided group's into one buffer, others into buffers of their own, the index after them
    (a run: none), and check the whole file
    against the shard's crc32c: one system call and a few checksum calls a shard, not one of
    each a chunk or group (each call gives up Python's lock: with several threads reading, a
    call is also a wait to take it back, which dominated loads of many small calls). On a
    mismatch each chunk is checked to name the damaged one. Returns each chunk's buffer of its
    own (None: read in place)."""
    chunks = shard.chunks
    own: list[bytearray | None] = [None] * len(chunks)
    staged: list[np.ndarray | None] = []
    segments: list[memoryview] = []  # the file's bytes in order
    lo = hi = -1  # a run of neighbouring places in `buf` not yet cut
    for g in shard.groups:
        if g.strided is not None:
            stage = np.empty(g.nbytes, np.uint8)
            staged.append(stage)
            if hi >= 0:
                segments.append(buf[lo:hi])
                lo = hi = -1
            segments.append(stage.data)
            continue
        staged.append(None)
        for k in range(g.first, g.stop):
            c = chunks[k]
            if c.runs is None:
                b = own[k] = bytearray(c.size)
                if hi >= 0:
                    segments.append(buf[lo:hi])
                    lo = hi = -1
                segments.append(memoryview(b))
                continue
            for s, n in c.runs:
                s += base
                if s != hi:
                    if hi >= 0:
                        segments.append(buf[lo:hi])
                    lo = s
                hi = s + n
    if hi >= 0:
        segments.append(buf[lo:hi])
    assert shard.crc is not None
    want_data, want_shard = shard.crc
    start = chunks[0].offset  # (0 for the whole file)
    nbytes = sum(c.size for c in chunks)
    index = memoryview(bytearray(0 if want_shard is None else shard.size - nbytes))
    want = nbytes + len(index)

    checked = [False]

    def check(fsize: int, i: int, n: int) -> None:
        checked[i] = True
        _check_size(info, shard, fsize)
        crc = 0
        if n == want:
            for v in segments:
                crc = crc32c(v, value=crc)
        if n != want or crc != want_data:  # the chunks' bytes against their checksums
            _name_damage(info, shard, start + n, buf, base, own, staged)
        if want_shard is not None and crc32c(index, value=crc) != want_shard:
            raise CorruptEntry(info.id, f"shard {shard.key} fails its check: its chunks pass theirs, the whole "
                                        "file fails the shard's crc32c (its zarr index, which other Zarr readers "
                                        "use, is damaged); delete the entry (anchorkv rm) and recompute")
        for g, stage in zip(shard.groups, staged, strict=True):
            _place(g, stage, dst, base)

    _read_ranges(backend, info, shard, [(start, [*segments, index] if index.nbytes else segments)], check, checked)
    return own


def _read_ranges(backend: Backend, info: EntryInfo, shard: _ShardRead, ranges: list[tuple[int, list[memoryview]]],
                 check: Any, checked: list[bool]) -> None:
    """`read_ranges_into` of a shard's ranges with `check` after each (`checked[i]` set by it):
    `CorruptEntry` for a missing shard or ranges left unread; a backend that did not call
    `check` for every range has them checked here."""
    try:
        fsize, got = backend.read_ranges_into(shard.path, ranges, check=check)
    except FileNotFoundError:
        raise CorruptEntry(info.id, f"shard {shard.key} is missing (it holds chunk {shard.chunks[0].key})") \
            from None
    if len(got) != len(ranges):
        raise CorruptEntry(info.id, f"shard {shard.key}: {len(got)} of {len(ranges)} ranges were read")
    for i, done in enumerate(checked):
        if not done:
            check(fsize, i, got[i])


def _check_size(info: EntryInfo, shard: _ShardRead, fsize: int) -> None:
    if fsize != shard.size:
        raise CorruptEntry(
            info.id,
            f"shard {shard.key} (holding chunk {shard.chunks[0].key}) is {fsize} bytes, expected "
            f"{shard.size} bytes: truncated or overwritten; delete the entry (anchorkv rm) and recompute",
        )


def _chunk_fails(info: EntryInfo, shard: _ShardRead, k: int, got: int, crc: int) -> CorruptEntry:
    """The error of chunk `k` of `shard` read as `got` bytes with `crc`."""
    c, want = shard.chunks[k], shard.crcs[k]
    return CorruptEntry(
        info.id,
        f"chunk {c.key} fails its check: expected {c.size} bytes with crc32c {want:#010x} at "
        f"bytes {c.offset}-{c.offset + c.size} of shard {shard.key}, found {got} bytes with "
        f"crc32c {crc:#010x}; delete the entry (anchorkv rm) and recompute",
    )


def _place(g: _Group, stage: np.ndarray | None, dst: np.ndarray, base: int) -> None:
    """A strided group's chunks, checked in their buffer (`stage`), into their rows of `dst`."""
    if stage is not None:
        assert g.strided is not None
        at, shape, strides = g.strided
        np.copyto(np.ndarray(shape, np.uint8, dst, base + at, strides), stage.reshape(shape))


def _name_damage(info: EntryInfo, shard: _ShardRead, n: int, buf: memoryview, base: int,
                 own: Sequence[bytearray | None], staged: Sequence[np.ndarray | None]) -> NoReturn:
    """`_read_whole` read a shard's (or a run's) bytes up to offset `n` of its file, and its
    chunks fail their checksums together, or it read fewer than it asked: raise `CorruptEntry`
    naming the first chunk that fails its own (as a load by groups would), else saying the read
    came up short."""
    for g, stage in zip(shard.groups, staged, strict=True):
        at = 0
        for k in range(g.first, g.stop):
            c = shard.chunks[k]
            if stage is not None:
                views = [stage.data[at : at + c.size]]
                at += c.size
            elif c.runs is None:
                views = [memoryview(own[k] or b"")]
            else:
                views = [buf[base + s : base + s + m] for s, m in c.runs]
            got = min(c.size, max(0, n - c.offset))
            crc = _crc_of(views, got)
            if got != c.size or crc != shard.crcs[k]:
                raise _chunk_fails(info, shard, k, got, crc)
    raise CorruptEntry(info.id, f"shard {shard.key}: its bytes up to offset {n} of {shard.size} were read (it "
                                "changed while read); recompute")


def verify_shard(backend: Backend, info: EntryInfo, array: ArrayLayout, part: Part,
                 shard: tuple[int, ...]) -> list[str]:
    """Read a whole shard of one stored array and check everything a load relies on: its
    size and crc32c, each inner chunk's crc32c at the manifest's offset, and that zarr's
    index (what other readers use) holds the manifest's offsets and sizes. The problems
    found (empty: none), each naming the entry."""
    skey = part.shard_key(shard)
    head = f"entry {info.id}: shard {skey}"
    want = info.manifest["shards"].get(skey)
    if want is None:
        return [f"entry {info.id}: the manifest has no checksum for shard {skey}"]
    try:
        data = backend.read(f"{info.path}/{skey}")
    except FileNotFoundError:
        return [f"{head} is missing"]
    problems = []
    crc = crc32c(data)
    if len(data) != want[1] or crc != want[0]:
        problems.append(f"{head} fails its check: expected {want[1]} bytes with crc32c {want[0]:#010x}, "
                        f"found {len(data)} bytes with crc32c {crc:#010x}")
    bad = []
    sums = info.manifest["checksums"]
    k = part.chunks_per_shard(array.chunks_per_shard)
    slots = {}
    for coords in array.shard_chunks(shard):
        key = part.chunk_key(coords)
        local = part.local(tuple(c % n for c, n in zip(coords, array.chunks_per_shard, strict=True)))
        if key not in sums:
            slots[local] = (EMPTY, EMPTY)
            continue
        c, size, offset = sums[key]
        slots[local] = (offset, size)
        piece = data[offset : offset + size]
        if len(piece) != size or crc32c(piece) != c:
            bad.append(key)
    if bad:
        problems.append(f"{head}: damaged chunks: {', '.join(bad)} (their bytes do not match the manifest's "
                        "crc32c at its offsets)")
    try:
        index = parse_shard_index(data[-index_nbytes(k):], k)
    except ValueError as e:
        problems.append(f"{head}: its index is damaged ({e})")
    else:
        wrong = [local for local, slot in slots.items() if tuple(int(v) for v in index[local]) != slot]
        if wrong:
            problems.append(f"{head}: its zarr index disagrees with the manifest for {len(wrong)} chunks "
                            f"(e.g. local chunk {list(wrong[0])})")
    return problems
