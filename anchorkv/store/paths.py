"""The store's path names: every key (file / object name) the store builds, in one place.

Paths are '/'-separated and relative to the store root; they are built from hex keys, entry
names (`anchorkv.store.manifest.entry_name`), write ids (lowercase letters and digits) and the
fixed names below only, so no name given by a user can address anything outside the store::

    zarr.json                                root group (attributes: the format version)
    entries/zarr.json                        group of all keys
    entries/<key>/zarr.json                  group of one key (anchor or first token block)
    entries/<key>/<name>/                    an entry (its group zarr.json holds the manifest)
    .staging/<write id>/begun-<rank>.json    a rank began a write (where its data goes)
    .staging/<write id>/parts/rank-R-of-T.json   a rank finished its part
    .staging/<write id>/data/                a local write's entry before its rename
    .leases/<key>.<name>.<pid>.<random>      a reader's lease on an entry
    .trash/<random>/                         a local directory being deleted
    .write-probe-<random>                    `Store.check_writable`'s probe (removed at once)
"""

from __future__ import annotations

#: The group of every key (and, under each key, its entries).
ENTRIES = "entries"
#: Writes in progress: begun and part markers (and, locally, the entry's data before publish).
STAGING = ".staging"
#: Readers' leases (see `anchorkv.store.eviction`).
LEASES = ".leases"
#: Where a local store moves directories it deletes (then removes them).
TRASH = ".trash"
#: Name prefix of the probe `Store.check_writable` writes at the store's root.
PROBE = ".write-probe-"
#: Name prefix of the marker a rank puts when it begins a write.
BEGUN = "begun-"
#: The name of a Zarr v3 node's metadata document.
ZARR_JSON = "zarr.json"
#: The object under an entry's prefix that records its last use on an object store
#: (`ObjectBackend.touch_entry`; locally the directory's mtime does).
LAST_USE = ".last_use"


def key_path(key: str) -> str:
    """The directory / prefix of one key's entries."""
    return f"{ENTRIES}/{key}"


def entry_path(entry_id: str) -> str:
    """The directory / prefix of an entry, by its id ``<key>/<name>``."""
    return f"{ENTRIES}/{entry_id}"


def staging_path(write_id: str) -> str:
    """Everything a write staged: its markers (and, locally, its data)."""
    return f"{STAGING}/{write_id}"


def begun_marker(write_id: str, tp_rank: int) -> str:
    """The marker a rank puts when it begins a write (it names where the rank's data goes)."""
    return f"{STAGING}/{write_id}/{BEGUN}{tp_rank:03d}.json"


def parts_prefix(write_id: str) -> str:
    """Where the ranks of a write put their part markers."""
    return f"{STAGING}/{write_id}/parts"


def part_marker(write_id: str, tp_rank: int, tp_size: int) -> str:
    """The marker a rank puts when its part of a write is finished."""
    return f"{parts_prefix(write_id)}/rank-{tp_rank:03d}-of-{tp_size:03d}.json"


def local_data_prefix(write_id: str) -> str:
    """Where a local write puts its entry's files before `publish` renames them into place."""
    return f"{STAGING}/{write_id}/data"


def lease_path(entry_id: str, pid: int, tag: str) -> str:
    """A lease file of an entry: its id with '/' as '.', the holder's pid and a random tag."""
    return f"{LEASES}/{entry_id.replace('/', '.')}.{pid}.{tag}"


def zarr_json(prefix: str) -> str:
    """The ``zarr.json`` of the node at `prefix`."""
    return f"{prefix}/{ZARR_JSON}"
