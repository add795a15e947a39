"""The commit: publish an entry once every rank finished its part (step 3 of the protocol in
`anchorkv.store.writer`).

Any process may commit a write from its part markers alone: it checks that all T markers are
there and that together they cover every shard and inner chunk of every array, writes the
arrays' ``zarr.json`` and last the group ``zarr.json`` holding the manifest, and publishes
(local: one directory rename; object store: the manifest put). It needs only a `Backend`, and
tells its caller of the committed entry through `on_commit` (the `Store` caches it and evicts
down to its capacity).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import numpy as np

from anchorkv.store.backends import Backend
from anchorkv.store.errors import CorruptEntry, IncompleteEntry, OtherFormat
from anchorkv.store.format import array_keys
from anchorkv.store.manifest import (
    EntryInfo,
    array_json,
    arrays_from_manifest,
    group_json,
    manifest_checksum,
    now,
    parse_group,
)
from anchorkv.store.paths import (
    entry_path,
    key_path,
    parts_prefix,
    staging_path,
    zarr_json,
)

log = logging.getLogger("anchorkv.store")

#: What a commit tells its caller: the entry it published (or the one another write published
#: first, which the caller keeps).
OnCommit = Callable[[EntryInfo], None]


def ensure_key_group(backend: Backend, key: str) -> None:
    """The key's group ``zarr.json`` (checked at every commit: a delete removes the key's
    directory once its last entry is gone)."""
    path = zarr_json(key_path(key))
    if not backend.exists(path):
        backend.write(path, [group_json()], atomic=True)


def commit_staged(backend: Backend, write_id: str, on_commit: OnCommit) -> EntryInfo:
    """Commit the write `write_id` from its part markers alone (any process may call it).

    Raises `IncompleteEntry` naming the missing ranks or chunks; call it again later."""
    prefix = parts_prefix(write_id)
    parts = [json.loads(backend.read(f"{prefix}/{n}")) for n in backend.list_dir(prefix) if n.endswith(".json")]
    if not parts:
        raise IncompleteEntry(f"write {write_id}: no rank has finished its part (nothing under {prefix})")
    header = parts[0]["header"]
    final = entry_path(f"{header['key']}/{header['name']}")
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
        logical += int(np.prod(a.shape)) * a.codec.source_itemsize
    manifest = {**header, "created": now(), "checksums": dict(sorted(checksums.items())),
                "shards": dict(sorted(shards.items())),
                "stored_bytes": sum(v[1] for v in shards.values()), "logical_bytes": logical}
    manifest["checksum"] = manifest_checksum(manifest)
    data = backend.data_prefix(final, write_id)
    for a in arrays.values():
        for name, doc in array_json(a, header["compressor"]).items():
            backend.write(zarr_json(f"{data}/{name}"), [doc])
    ensure_key_group(backend, header["key"])
    backend.write(zarr_json(data), [group_json({"anchorkv": manifest})], atomic=True)
    entry_id = final.split("/", 1)[1] if backend.atomic_publish else data.split("/", 1)[1]
    try:
        info = _publish(backend, data, final, entry_id, manifest, header["key"])
    except CorruptEntry:  # this write's data is gone: a later commit of it must not publish its metadata alone
        backend.delete_tree(staging_path(write_id))
        raise
    backend.delete_tree(staging_path(write_id))
    on_commit(info)
    return info


#: Publishes a commit tries while the write that won each try is deleted before its manifest is read.
PUBLISH_TRIES = 3


def _publish(backend: Backend, data: str, final: str, entry_id: str, manifest: dict, key: str) -> EntryInfo:
    """Publish the staged entry at `data`; if another write of the same entry won, keep that
    one (its manifest is read before this write's data is deleted). A winner deleted meanwhile
    (evicted by another process) leaves the name free: publish again, at most `PUBLISH_TRIES`
    times (found by review: the loser deleted its own data, then failed on the winner's missing
    manifest with a bare FileNotFoundError, and the store kept neither)."""
    for _ in range(PUBLISH_TRIES):
        if backend.publish(data, final):
            return EntryInfo(entry_id, manifest)
        try:
            winner = backend.read(zarr_json(final))
        except FileNotFoundError:
            ensure_key_group(backend, key)  # (the winner's delete may have removed the key's group)
            continue
        try:
            info = parse_group(entry_id, winner)
        except CorruptEntry as e:
            if isinstance(e, OtherFormat) and e.newer:
                backend.delete_tree(data)  # a newer anchorkv's entry: its readers keep it
                raise
            # a damaged manifest (a crash before it reached the disk) or an older format's entry
            # of the same tokens: nothing restores it, and keeping it would refuse every save of
            # these tokens until `anchorkv gc`; this write replaces it
            log.warning("anchorkv: entry %s is replaced by a new write of its tokens: %s", entry_id,
                        str(e).removeprefix(f"entry {entry_id}: "))
            backend.delete_tree(final)
            continue
        backend.delete_tree(data)
        return info
    backend.delete_tree(data)
    raise CorruptEntry(entry_id, f"its name is held by a directory without a manifest ({PUBLISH_TRIES} publishes "
                                 "failed); `anchorkv gc` removes that damaged entry, the next save writes it")
