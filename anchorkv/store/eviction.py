"""Capacity: LRU eviction by last use, leases that keep entries being read, garbage collection.

Last use is recorded cheaply (`Backend.touch_entry`: a directory mtime locally, a tiny object
on an object store; at most once a minute per entry and process). A reader holds a *pin*
(in-process counter) during every `load`, and `Store.pin` adds a *lease* visible to other
processes: a file ``.leases/<key>.<name>.<pid>.<random>``. Eviction skips pinned and leased
entries; a lease whose process is gone (local) or older than `LEASE_TTL` is ignored.

Across processes, only `Store.pin` protects: a bare `Store.load` pins in its own process
(a lease per load call would cost two object writes per layer). The connector takes no lease
either (two object writes per restore on S3, on the restore's critical path): a restore whose
entry another process evicts meanwhile fails (`EntryNotFound`, or `CorruptEntry` for an entry
written again: every part of a restore is read from the write its lookup found) and vLLM
recomputes it. There is no lock between eviction and a reader that takes its lease just as
the entry is chosen either; that reader then gets `CorruptEntry` / `EntryNotFound` and
recomputes, never wrong state. On an object store a lease cannot be checked against a pid
(other machines), so a reader killed while pinning keeps its entry for up to `LEASE_TTL`.
Last use is at most a minute stale per process, which is fine for LRU at cache scale.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Set
from typing import NamedTuple, Protocol

from anchorkv.store.backends import Backend
from anchorkv.store.errors import CorruptEntry, EntryNotFound
from anchorkv.store.manifest import EntryInfo, Listing, parse_entry_name
from anchorkv.store.paths import (
    BEGUN,
    ENTRIES,
    LAST_USE,
    LEASES,
    STAGING,
    key_path,
    lease_path,
    staging_path,
    zarr_json,
)

log = logging.getLogger("anchorkv.store")

LEASE_TTL = 600.0
#: Seconds a `Store`'s usage estimate (its last scan plus its own commits and deletes) is
#: trusted after its scan: a commit below the capacity scans again only after this long, so
#: other processes' saves count toward the capacity within it (see `Store._may_be_over`).
RESCAN_AFTER = 60.0


class Pins:
    """Entries being read in this process (thread-safe counters)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: Counter[str] = Counter()

    @contextlib.contextmanager
    def pinned(self, entry_id: str) -> Iterator[None]:
        self.pin(entry_id)
        try:
            yield
        finally:
            self.unpin(entry_id)

    def pin(self, entry_id: str) -> None:
        """Count a read of the entry (`unpin` ends it; `pinned` as a context)."""
        with self._lock:
            self._count[entry_id] += 1

    def unpin(self, entry_id: str) -> None:
        with self._lock:
            n = self._count[entry_id] - 1
            if n <= 0:
                del self._count[entry_id]
            else:
                self._count[entry_id] = n

    def __contains__(self, entry_id: str) -> bool:
        with self._lock:
            return entry_id in self._count


class Entries(Protocol):
    """What eviction and gc use of a store (`anchorkv.store.Store` is one)."""

    backend: Backend
    capacity_bytes: int | None
    pins: Pins

    def scan(self, *, sizes_only: bool = False) -> list[Listing]: ...

    def delete(self, entry: EntryInfo | str) -> None: ...

    def verify(self, entry: EntryInfo | str, progress: Callable[[int], None] | None = None) -> list[str]: ...

    def get(self, entry: EntryInfo | str) -> EntryInfo: ...


class Lease(NamedTuple):
    """A lease file as gc and eviction see it."""

    name: str  # the file's name under `LEASES`
    entry_id: str
    stale: bool  # its process is gone (local) or it is older than `LEASE_TTL`


@contextlib.contextmanager
def lease(store: Entries, entry_id: str) -> Iterator[None]:
    path = lease_path(entry_id, os.getpid(), uuid.uuid4().hex[:8])
    store.backend.write(path, [json.dumps({"pid": os.getpid(), "t": time.time()}).encode()])
    try:
        yield
    finally:
        store.backend.delete(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _leases(store: Entries) -> list[Lease]:
    """(file name, entry id, stale?) of every lease (lease prefixes map back to '<key>/<name>')."""
    out = []
    local = store.backend.atomic_publish
    for name in store.backend.list_dir(LEASES):
        stem, _, rest = name.partition(".")  # key . name . pid . rand
        entry_name, _, tail = rest.partition(".")
        if tail.count(".") > 1:  # object-store names carry '.<write id>'
            wid, _, tail = tail.partition(".")
            entry_name = f"{entry_name}.{wid}"
        pid = int(tail.split(".")[0]) if tail.split(".")[0].isdigit() else -1
        mtime = store.backend.mtime(f"{LEASES}/{name}") or 0.0
        stale = (local and not _pid_alive(pid)) or time.time() - mtime > LEASE_TTL
        out.append(Lease(name, f"{stem}/{entry_name}", stale))
    return out


def _live_leases(store: Entries) -> set[str]:
    """Entry ids with a live lease."""
    return {lease.entry_id for lease in _leases(store) if not lease.stale}


def evict(store: Entries, capacity: int, keep: Set[str] = frozenset(), *, dry_run: bool = False) -> list[str]:
    """Delete entries until the total is <= `capacity`; returns their ids. Damaged and old-format
    entries go first (they are never loaded), then the least recently used.

    Every entry counts toward the total, whatever its state. Never removes an entry pinned in
    this process, leased by any process, or in `keep`. `dry_run`: only say what would go.
    """
    entries = store.scan(sizes_only=True)
    total = sum(e.stored_bytes for e in entries)
    if total <= capacity:
        return []
    leased = _live_leases(store)

    def order(e: Listing) -> tuple:
        useless = e.state in ("damaged", "old-format")
        return (not useless, (store.backend.last_use(e.path) or e.created) if not useless else e.created)

    evicted = []
    for e in sorted(entries, key=order):
        if total <= capacity:
            break
        if e.id in keep or e.id in store.pins or e.id in leased:
            continue
        if not dry_run:
            try:
                store.delete(e.id)
            except EntryNotFound:  # deleted by another process meanwhile
                continue
            except OSError as err:  # e.g. another user's entry: evict others (it stays listed; gc names it)
                log.warning("anchorkv: cannot evict %s from %s: %s", e.id, store.backend.url, err)
                continue
        total -= e.stored_bytes
        evicted.append(e.id)
    return evicted


def check_stale_after(stale_after: object) -> float:
    """`stale_after` as gc takes it: a number of seconds >= 0 (inf: never stale; NaN compared as
    "not younger" and a negative one as "older", so either removed every write in progress)."""
    import math

    if isinstance(stale_after, bool) or not isinstance(stale_after, (int, float)) or math.isnan(stale_after) \
            or stale_after < 0:
        raise ValueError(f"stale_after must be a number of seconds >= 0 (0: every unfinished write, alive or not), "
                         f"found {stale_after!r}; give the longest a save may take, e.g. 3600")
    return float(stale_after)


def gc(store: Entries, stale_after: float, progress: Callable[[str, int], None] | None = None, *,
       dry_run: bool = False, verify: bool = False) -> dict:
    """See `Store.gc`. `progress(step, n)` is called as work is done (for a progress bar)."""
    check_stale_after(stale_after)
    backend = store.backend
    report: dict = {"abandoned_writes": 0, "stale_leases": 0, "duplicates": 0, "orphans": 0, "trash": 0,
                    "damaged": 0, "old_format": 0, "empty_dirs": 0, "evicted": 0, "freed_bytes": 0,
                    "removed": [], "dry_run": dry_run}

    def remove(kind: str, what: str, nbytes: int, fn: Callable[[], object]) -> None:
        report[kind] += 1
        report["freed_bytes"] += nbytes
        report["removed"].append({"kind": kind, "what": what, "bytes": nbytes})
        if not dry_run:
            fn()
        if progress:
            progress(kind, 1)

    t = time.time()
    live_data: set[str] = set()  # data prefixes of writes still in progress (object store)
    for wid in backend.list_dir(STAGING):
        markers = [n for n in backend.list_dir(staging_path(wid)) if n.startswith(BEGUN)]
        times = [backend.mtime(f"{STAGING}/{wid}/{n}") or 0.0 for n in markers]
        newest = max(times, default=backend.mtime(staging_path(wid)) or 0.0)
        datas = []
        for n in markers:
            try:
                datas.append(json.loads(backend.read(f"{STAGING}/{wid}/{n}"))["data"])
            except (FileNotFoundError, ValueError, KeyError, TypeError):  # gone meanwhile, or torn
                pass
        if t - newest < stale_after:
            live_data.update(datas)
            continue

        def drop(wid: str = wid, datas: list[str] = datas) -> None:
            for data in datas:
                if not backend.atomic_publish and not backend.exists(zarr_json(data)):
                    backend.delete_tree(data)
            backend.delete_tree(staging_path(wid))

        nbytes = backend.tree_size(staging_path(wid)) + (0 if backend.atomic_publish else sum(
            backend.tree_size(d) for d in datas if not backend.exists(zarr_json(d))))
        remove("abandoned_writes", f"write {wid}", nbytes, drop)
    _remove_orphans(store, stale_after, live_data, t, remove)
    for lease in _leases(store):
        if lease.stale:
            remove("stale_leases", f"lease {lease.name}", 0,
                   functools.partial(backend.delete, f"{LEASES}/{lease.name}"))
    entries = store.scan()
    if not backend.atomic_publish:  # same entry committed twice: keep the oldest
        groups: dict[tuple, list] = {}
        for e in entries:
            parsed = parse_entry_name(e.id.split("/", 1)[1])  # never None: scan lists only entry names
            if e.info is not None and parsed is not None:
                groups.setdefault((e.key, parsed.num_tokens, parsed.hash16), []).append(e)
        for dup in groups.values():
            for e in sorted(dup, key=lambda e: (e.created, e.id))[1:]:
                remove("duplicates", f"entry {e.id} (a second copy)", e.stored_bytes,
                       functools.partial(store.delete, e.id))
    leased = _live_leases(store)
    for e in entries:
        if e.state not in ("damaged", "old-format") or e.id in store.pins or e.id in leased:
            continue
        kind = "damaged" if e.state == "damaged" else "old_format"
        remove(kind, f"entry {e.id} ({e.problem})", e.stored_bytes, functools.partial(_delete, store, e.id))
    if verify:  # entries whose manifest reads fine but whose shards fail their checks
        gone = {r["what"].split()[1] for r in report["removed"] if r["what"].startswith("entry ")}
        for e in entries:
            if e.info is None or e.id in gone or e.id in store.pins or e.id in leased:
                continue
            problems = store.verify(e.info, progress=(lambda n: progress("verify", n)) if progress else None)
            if problems and _still(store, e.info):  # (not evicted or written again while verifying)
                more = f"; {len(problems) - 1} more problems" if len(problems) > 1 else ""
                remove("damaged", f"entry {e.id} ({problems[0].removeprefix(f'entry {e.id}: ')}{more})",
                       e.stored_bytes, functools.partial(_delete, store, e.id))
    for key in backend.list_dir(ENTRIES):
        if len(key) == 64 and not [n for n in backend.list_dir(key_path(key)) if n != "zarr.json"]:
            if dry_run:
                remove("empty_dirs", f"key {key}", 0, lambda: None)
            elif backend.remove_empty_dir(key_path(key)):
                remove("empty_dirs", f"key {key}", 0, lambda: None)
    for path in backend.trash():
        remove("trash", path, backend.tree_size(path), functools.partial(backend.delete_tree, path))
    if store.capacity_bytes is not None:
        gone = {r["what"].split()[1] for r in report["removed"] if r["what"].startswith("entry ")}
        sizes = {e.id: e.stored_bytes for e in entries}
        for entry_id in evict(store, store.capacity_bytes, keep=gone if dry_run else frozenset(), dry_run=dry_run):
            remove("evicted", f"entry {entry_id} (least recently used)", sizes.get(entry_id, 0), lambda: None)
    return report


def _still(store: Entries, info: EntryInfo) -> bool:
    """Whether the entry is still the write `info` read (a serving process may have evicted it,
    or saved the same id again, since gc's scan: that one is judged at the next gc)."""
    try:
        return store.get(info.id).version == info.version
    except (EntryNotFound, CorruptEntry):
        return False


def _delete(store: Entries, entry_id: str) -> None:
    """Delete an entry gc chose; gone already (evicted meanwhile) is as good."""
    try:
        store.delete(entry_id)
    except EntryNotFound:
        pass


def _remove_orphans(store: Entries, stale_after: float, live_data: set[str], t: float,
                    remove: Callable[[str, str, int, Callable[[], object]], None]) -> None:
    """Remove what no entry owns under ``entries/<key>/``: on an object store, prefixes with
    chunks but no group ``zarr.json`` (a write or a delete killed half-way) that no write in
    progress claims, and at once those holding only ``.last_use`` (a deleted entry's use
    recorded by an older anchorkv: no write puts it first, so none is in progress); on both,
    temp files of atomic writes whose process died."""
    backend = store.backend
    for key in backend.list_dir(ENTRIES):
        if len(key) != 64:
            continue
        for name in backend.list_dir(key_path(key)):
            path = f"{ENTRIES}/{key}/{name}"
            if name.startswith(".") and name.endswith(".tmp"):
                if t - (backend.mtime(path) or t) >= stale_after:
                    remove("orphans", path, 0, functools.partial(backend.delete, path))
                continue
            if backend.atomic_publish or parse_entry_name(name) is None or path in live_data:
                continue
            if backend.exists(zarr_json(path)):
                continue
            if backend.list_dir(path) == [LAST_USE]:  # a use recorded as another process deleted it
                remove("orphans", f"{path} (only its last use left)", 0,
                       functools.partial(backend.delete, f"{path}/{LAST_USE}"))
                continue
            newest = backend.newest_mtime(path)
            if newest is not None and t - newest < stale_after:
                continue  # perhaps a write whose begun marker we have not seen yet
            remove("orphans", path, backend.tree_size(path), functools.partial(backend.delete_tree, path))
