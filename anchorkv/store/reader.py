"""Reading an entry's bytes: the inner chunks a load needs (by byte range, each checked against
its crc32c) and the whole-shard check `Store.verify` runs (sizes, crc32c of the shard and of each
chunk, zarr's index against the manifest).
"""

from __future__ import annotations

import numpy as np

from anchorkv.store.errors import CorruptEntry
from anchorkv.store.format import EMPTY, ArrayLayout, Encoded, crc32c, index_nbytes, parse_shard_index
from anchorkv.store.manifest import EntryInfo, numcodecs_compressor


def copy_into(dst: Encoded, src: Encoded) -> None:
    np.copyto(dst.payload, src.payload)
    if dst.scales.size:
        np.copyto(dst.scales, src.scales)


def read_chunks(backend, info: EntryInfo, array: ArrayLayout, shard: tuple[int, ...], items: list[tuple],
                out: Encoded) -> None:
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
    plans = []  # per item: (key, into_chunk, dst, direct?)
    for key, coords, into_chunk, into_out, whole in items:
        dst = out.region(into_out)
        direct = (comp is None and whole and dst.payload.flags.c_contiguous
                  and dst.scales.flags.c_contiguous)
        plans.append((key, coords, into_chunk, dst, direct))
    scratch: dict[int, list[bytes | bytearray]] = {}
    for pi, part in enumerate(parts):
        skey = part.shard_key(shard)
        want_shard = info.manifest["shards"].get(skey)
        if want_shard is None:
            raise CorruptEntry(info.id, f"the manifest has no checksum for shard {skey}")
        jobs = []
        for ii, (key, coords, into_chunk, dst, direct) in enumerate(plans):
            ckey = part.chunk_key(coords)
            expected = sums.get(ckey)
            if expected is None:
                raise CorruptEntry(info.id, f"the manifest has no checksum for chunk {ckey}")
            crc, size, offset = expected
            buf = None
            if direct:
                target = dst.payload if pi == 0 else dst.scales
                views = [memoryview(target).cast("B")]
                if views[0].nbytes != size:
                    raise CorruptEntry(info.id, f"chunk {ckey} is {size} bytes in the manifest, its "
                                       f"shape and codec make {views[0].nbytes}")
            else:
                buf = bytearray(size)
                views = [memoryview(buf)]
            jobs.append((offset, ckey, crc, size, views, buf, ii))
        jobs.sort(key=lambda j: j[0])
        try:
            fsize, got = backend.read_ranges_into(f"{info.path}/{skey}", [(j[0], j[4]) for j in jobs])
        except FileNotFoundError:
            raise CorruptEntry(info.id, f"shard {skey} is missing (it holds chunk {jobs[0][1]})") from None
        if fsize != want_shard[1]:
            raise CorruptEntry(
                info.id,
                f"shard {skey} (holding chunk {jobs[0][1]}) is {fsize} bytes, expected {want_shard[1]} bytes: "
                "truncated or overwritten; delete the entry (anchorkv rm) and recompute",
            )
        for (offset, ckey, want_crc, size, views, buf, ii), n in zip(jobs, got):
            crc = 0
            for v in views:
                crc = crc32c(v, value=crc)
            if n != size or crc != want_crc:
                raise CorruptEntry(
                    info.id,
                    f"chunk {ckey} fails its check: expected {size} bytes with crc32c {want_crc:#010x} at "
                    f"bytes {offset}-{offset + size} of shard {skey}, found {n} bytes with crc32c {crc:#010x}; "
                    "delete the entry (anchorkv rm) and recompute",
                )
            if buf is not None:
                scratch.setdefault(ii, []).append(comp.decode(buf) if comp is not None else buf)
    for ii, bufs in scratch.items():
        key, coords, into_chunk, dst, _ = plans[ii]
        pn, sn = array.codec.nbytes(array.chunks)
        sizes = [len(memoryview(b).cast("B")) for b in bufs]
        if sizes != [pn, sn][: len(parts)]:
            raise CorruptEntry(info.id, f"chunk {key} decodes to {sizes} bytes, its shape and codec make "
                               f"{[pn, sn][: len(parts)]}")
        scales = np.frombuffer(bufs[1], np.float32) if len(bufs) > 1 else np.empty(0, np.float32)
        enc = array.codec.views(np.frombuffer(bufs[0], np.uint8), scales, array.chunks)
        copy_into(dst, enc.region(into_chunk))

def verify_shard(backend, info: EntryInfo, array: ArrayLayout, part, shard: tuple[int, ...]) -> list[str]:
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
        local = part.local(tuple(c % n for c, n in zip(coords, array.chunks_per_shard)))
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
