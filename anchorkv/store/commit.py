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
from anchorkv.store.errors import CorruptEntry, IncompleteEntry
from anchorkv.store.format import array_keys
from anchorkv.store.manifest import (
    READABLE_VERSIONS,
    EntryInfo,
    array_json,
    arrays_from_manifest,
    checksum_holds,
    group_json,
    load_group,
    now,
    parse_group,
    signed_group_json,
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


def commit_staged(backend: Backend, write_id: str, on_commit: OnCommit, replace: str | None = None) -> EntryInfo:
    """Commit the write `write_id` from its part markers alone (any process may call it).
    `replace`: the version of an entry of the same tokens to publish over (a load found its
    data damaged), see `_publish`.

    Raises `IncompleteEntry` naming the missing ranks or chunks; call it again later."""
    prefix = parts_prefix(write_id)
    parts = [json.loads(backend.read(f"{prefix}/{n}")) for n in backend.list_dir(prefix) if n.endswith(".json")]
    if not parts:
        raise IncompleteEntry(f"write {write_id}: no rank has finished its part (nothing under {prefix})")
    return commit_parts(backend, write_id, parts, on_commit, replace)


def commit_parts(backend: Backend, write_id: str, parts: list[dict], on_commit: OnCommit,
                 replace: str | None = None) -> EntryInfo:
    """`commit_staged` of the part markers `parts` (as parsed from their JSON) in hand: a
    single-process save (`EntryWriter.commit` at tp_size 1) passes its own part without
    writing it to the store and reading it back; the checks and what is written are the same."""
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
    group = signed_group_json(manifest)  # (sets manifest["checksum"])
    data = backend.data_prefix(final, write_id)
    for a in arrays.values():
        for name, doc in array_json(a, header["compressor"]).items():
            backend.write(zarr_json(f"{data}/{name}"), [doc])
    ensure_key_group(backend, header["key"])
    backend.write(zarr_json(data), [group], atomic=True)
    entry_id = final.split("/", 1)[1] if backend.atomic_publish else data.split("/", 1)[1]
    try:
        info = _publish(backend, data, final, entry_id, manifest, header["key"], replace)
    except CorruptEntry:  # this write's data is gone: a later commit of it must not publish its metadata alone
        backend.delete_tree(staging_path(write_id))
        raise
    # the entry is published: what follows cannot undo that, nor make the commit a failure (found
    # by review: a caller's clean-up after the "failed" save deleted the published entry's data
    # on an object store, where it lies under the write's own prefix); each step is tried alone
    try:
        backend.delete_tree(staging_path(write_id))
    except Exception as e:
        log.warning("anchorkv: entry %s is saved; its staging was not removed (`anchorkv gc` removes it): %s",
                    info.id, e)
    try:
        on_commit(info)
    except Exception as e:
        log.warning("anchorkv: entry %s is saved; what follows a commit (caching it, counting its bytes, evicting "
                    "down to the capacity) failed: %s", info.id, e)
    return info


#: Publishes a commit tries while the write that won each try is deleted before its manifest is read.
PUBLISH_TRIES = 3


def unusable(manifest: bytes | None) -> str | None:
    """Why no anchorkv can restore the entry whose group ``zarr.json`` holds `manifest` (None:
    absent), or None where one may: an intact manifest (its checksum holds) of this or a newer
    format, even one this release cannot parse. Only the former may be replaced by a write of
    the same tokens (a crash before the manifest reached the disk leaves it zero-filled, empty,
    cut or missing; an upgrade leaves older formats)."""
    if manifest is None:
        return "its directory has no zarr.json"  # (a local publish renames a complete directory)
    try:
        m = load_group(manifest)["attributes"]["anchorkv"]
        version = m["format_version"]
        if isinstance(version, int) and version < min(READABLE_VERSIONS):
            return f"format version {version}, older than any this anchorkv reads"
        if not checksum_holds(m, manifest):  # (as a read checks it: `parse_group`)
            return "its manifest fails its checksum"
    except (ValueError, KeyError, TypeError):
        return "its zarr.json holds no anchorkv manifest"
    return None


def manifest_version(manifest: bytes | None) -> str | None:
    """The write (`EntryInfo.version`, the manifest's checksum) a group ``zarr.json`` names;
    None where it names none."""
    try:
        return json.loads(manifest or b"")["attributes"]["anchorkv"]["checksum"]
    except (ValueError, KeyError, TypeError):
        return None


def _publish(backend: Backend, data: str, final: str, entry_id: str, manifest: dict, key: str,
             replace: str | None = None) -> EntryInfo:
    """Publish the staged entry at `data`; if another write of the same entry won, keep that
    one (its manifest is read before this write's data is deleted). A winner deleted meanwhile
    (evicted by another process) leaves the name free: publish again, at most `PUBLISH_TRIES`
    times (found by review: the loser deleted its own data, then failed on the winner's missing
    manifest with a bare FileNotFoundError, and the store kept neither). A winner no anchorkv
    can restore (`unusable`), or the write `replace` (a load found its data damaged), is
    replaced: deleted only if it is still what was judged (`Backend.remove_if`: a review found
    two committers of one write deleting each other's publish), then published over."""
    for _ in range(PUBLISH_TRIES):
        if backend.atomic_publish and not backend.exists(data):  # another committer of this write published it
            return _winner(backend, data, final, entry_id)
        if backend.publish(data, final):
            return EntryInfo(entry_id, manifest)
        try:
            winner: bytes | None = backend.read(zarr_json(final))
        except FileNotFoundError:
            winner = None
            if not backend.exists(final):  # deleted meanwhile
                ensure_key_group(backend, key)  # (the winner's delete may have removed the key's group)
                continue
        why = unusable(winner)
        if why is None and replace is not None and manifest_version(winner) == replace:
            why = "a load found its data damaged"
        if why is None:
            return _winner(backend, data, final, entry_id, winner)
        judged = winner

        def still(found: bytes | None, judged: bytes | None = judged) -> bool:
            return found == judged

        if backend.remove_if(final, still):
            log.warning("anchorkv: entry %s is replaced by a new write of its tokens: %s", entry_id, why)
    backend.delete_tree(data)
    raise CorruptEntry(entry_id, f"its name is held by a directory no write could replace ({PUBLISH_TRIES} "
                                 "publishes failed); `anchorkv gc` removes that damaged entry, the next save writes it")


def _winner(backend: Backend, data: str, final: str, entry_id: str, winner: bytes | None = None) -> EntryInfo:
    """The entry another write published at `final` (this write's data deleted): the caller
    keeps it. A newer format's (or an intact manifest this release cannot parse) raises."""
    backend.delete_tree(data)
    if winner is None:
        try:
            winner = backend.read(zarr_json(final))
        except FileNotFoundError:
            raise CorruptEntry(entry_id, "another committer of this write published it, and it is gone "
                                         "(evicted meanwhile)") from None
    return parse_group(entry_id, winner)
