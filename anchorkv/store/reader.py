"""Reading an entry's bytes: the inner chunks a load needs (by byte range, each checked against
its crc32c) and the whole-shard check `Store.verify` runs (sizes, crc32c of the shard and of each
chunk, zarr's index against the manifest).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from anchorkv.store.backends import Backend
from anchorkv.store.errors import CorruptEntry
from anchorkv.store.format import (
    EMPTY,
    ArrayLayout,
    Encoded,
    Part,
    crc32c,
    index_nbytes,
    parse_shard_index,
)
from anchorkv.store.manifest import EntryInfo, numcodecs_compressor
from anchorkv.store.plan import ChunkSlice


class _ChunkRead(NamedTuple):
    """Where one inner chunk a load needs goes."""

    chunk: ChunkSlice
    dst: Encoded  # its covered part's place in the load's output
    direct: bool  # read straight into `dst` (covered whole, uncompressed, contiguous there)


class _RangeRead(NamedTuple):
    """One byte range of a shard file to read and check: an inner chunk of one stored array."""

    offset: int  # in the shard (from the manifest)
    key: str  # the inner chunk's key in this array
    crc: int  # its crc32c and size, from the manifest
    size: int
    views: list[memoryview]  # where its bytes go
    buf: bytearray | None  # a buffer of its own (None: read straight into the output)
    item: int  # index of its `_ChunkRead`


def copy_into(dst: Encoded, src: Encoded) -> None:
    """Copy an encoded block into another's place (`src` broadcasts, e.g. one zero row to many)."""
    np.copyto(dst.payload, src.payload)
    if dst.scales.size:
        np.copyto(dst.scales, src.scales)


def read_chunks(backend: Backend, info: EntryInfo, array: ArrayLayout, shard: tuple[int, ...],
                items: list[ChunkSlice], out: Encoded) -> None:
    """Read the inner chunks `items` (`chunk_plan` rows) of one shard of the field into `out`
    by byte range (offsets from the manifest) from the shard of each stored array (codes,
    scales), each chunk checked against its crc32c and size.

    A chunk covered whole, uncompressed, whose place in `out` is contiguous is read straight
    into it (no intermediate bytes); the others go through buffers of their own. A field encoded
    by a codec plug-in that is not installed raises `MissingCodec` before anything is read."""
    if array.codec.plugin:  # no byte is read for a field nobody here can decode
        array.codec.impl(info.id, array.field)  # MissingCodec, one line naming the plug-in
    parts = array.parts
    comp = numcodecs_compressor(info.manifest.get("compressor"))
    sums = info.manifest["checksums"]
    plans = []
    for item in items:
        dst = out.region(item.into_region)
        direct = (comp is None and item.whole and dst.payload.flags.c_contiguous
                  and dst.scales.flags.c_contiguous)
        plans.append(_ChunkRead(item, dst, direct))
    scratch: dict[int, list[bytes | bytearray]] = {}
    for pi, part in enumerate(parts):
        skey = part.shard_key(shard)
        want_shard = info.manifest["shards"].get(skey)
        if want_shard is None:
            raise CorruptEntry(info.id, f"the manifest has no checksum for shard {skey}")
        jobs = []
        for ii, plan in enumerate(plans):
            ckey = part.chunk_key(plan.chunk.coords)
            expected = sums.get(ckey)
            if expected is None:
                raise CorruptEntry(info.id, f"the manifest has no checksum for chunk {ckey}")
            crc, size, offset = expected
            buf = None
            if plan.direct:
                target = plan.dst.payload if pi == 0 else plan.dst.scales
                views = [target.data.cast("B")]
                if views[0].nbytes != size:
                    raise CorruptEntry(info.id, f"chunk {ckey} is {size} bytes in the manifest, its "
                                       f"shape and codec make {views[0].nbytes}")
            else:
                buf = bytearray(size)
                views = [memoryview(buf)]
            jobs.append(_RangeRead(offset, ckey, crc, size, views, buf, ii))
        jobs.sort(key=lambda j: j.offset)
        try:
            fsize, got = backend.read_ranges_into(f"{info.path}/{skey}", [(j.offset, j.views) for j in jobs])
        except FileNotFoundError:
            raise CorruptEntry(info.id, f"shard {skey} is missing (it holds chunk {jobs[0].key})") from None
        if fsize != want_shard[1]:
            raise CorruptEntry(
                info.id,
                f"shard {skey} (holding chunk {jobs[0].key}) is {fsize} bytes, expected {want_shard[1]} bytes: "
                "truncated or overwritten; delete the entry (anchorkv rm) and recompute",
            )
        for job, n in zip(jobs, got, strict=True):
            crc = 0
            for v in job.views:
                crc = crc32c(v, value=crc)
            if n != job.size or crc != job.crc:
                raise CorruptEntry(
                    info.id,
                    f"chunk {job.key} fails its check: expected {job.size} bytes with crc32c {job.crc:#010x} at "
                    f"bytes {job.offset}-{job.offset + job.size} of shard {skey}, found {n} bytes with crc32c "
                    f"{crc:#010x}; delete the entry (anchorkv rm) and recompute",
                )
            if job.buf is not None:
                scratch.setdefault(job.item, []).append(comp.decode(job.buf) if comp is not None else job.buf)
    for ii, bufs in scratch.items():
        plan = plans[ii]
        pn, sn = array.codec.nbytes(array.chunks)
        sizes = [len(memoryview(b).cast("B")) for b in bufs]
        if sizes != [pn, sn][: len(parts)]:
            raise CorruptEntry(info.id, f"chunk {plan.chunk.key} decodes to {sizes} bytes, its shape and codec make "
                               f"{[pn, sn][: len(parts)]}")
        scales = np.frombuffer(bufs[1], np.float32) if len(bufs) > 1 else np.empty(0, np.float32)
        enc = array.codec.views(np.frombuffer(bufs[0], np.uint8), scales, array.chunks)
        copy_into(plan.dst, enc.region(plan.chunk.into_chunk))


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
