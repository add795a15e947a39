"""A restore from a local store reads the entry's manifest and makes every part's read plan on
the load thread before its parts are read on `READ_THREADS` threads (`ZarrEntryStore.prepare`,
`Store.prepare`): made on the reading threads, that pure-Python work held Python's lock against
the reads. The reads then plan nothing; what the plans find wrong fails the restore as a read's
failure does (nothing written, vLLM recomputes); an object store's restore plans on its reading
threads as before (its reads are round trips the plans overlap)."""

from __future__ import annotations

import threading

import pytest
import torch

from anchorkv.connector.plan import LoadSpec, Metadata, SaveSpec
from anchorkv.connector.storage_zarr import ZarrEntryStore
from anchorkv.store.errors import CorruptEntry
from anchorkv.store.paths import entry_path, zarr_json
from anchorkv.store.store import Store
from tests.connector.kimi_worker import assert_failed_restore_writes_nothing, kimi_worker

SAVED = ((1,), (2,), (3,), (4, 5))  # three KDA groups, then the MLA group's two blocks
RESTORED = ((6,), (7,), (8,), (9, 10))


def _saved(tmp_path, extra=None):
    w, views, _, _, layout, store = kimi_worker(tmp_path, 11, SAVED, extra)
    tokens = layout.block_size + 5  # a partial last MLA block: paged parts load rows
    w.save(Metadata(saves=[SaveSpec("r", None, tuple(range(tokens)), tokens, SAVED)]))
    w.flush()
    [entry] = store.store.list()
    return w, views, store, LoadSpec("q", entry.id, 0, tokens, RESTORED)


def _plans_by_thread(monkeypatch) -> list[int]:
    """The threads `Store` makes read plans on (one id per plan), from now on (`monkeypatch`:
    until it is undone)."""
    threads, real = [], Store._make_load_plan

    def spy(self, *args):
        threads.append(threading.get_ident())
        return real(self, *args)

    monkeypatch.setattr(Store, "_make_load_plan", spy)
    return threads


def test_a_restore_plans_every_part_before_its_reads_and_reads_the_same_bytes(tmp_path, monkeypatch):
    w, _, store, load = _saved(tmp_path, {"codec": "compact"})
    try:
        store.store.forget(load.entry_id)  # a worker's first restore of the entry: its manifest read too
        w._arena.reset()
        unprepared = {k: (p.payload.clone(), p.scales.clone())
                      for k, p in _read_without_prepare(w, store, load, monkeypatch).items()}
        fresh = ZarrEntryStore(store.config, store.model_layout)  # a new Store: no manifest, no plan cached
        w.store = fresh
        threads = _plans_by_thread(monkeypatch)
        reads, real = [], fresh.store.load

        def spy(*args, **kwargs):
            reads.append(len(threads))  # the plans made when this part's read began
            return real(*args, **kwargs)

        fresh.store.load = spy
        w._arena.reset()
        parts = w._read(load)
        assert len(parts) == len(reads) == len(threads) == 47
        assert set(threads) == {threading.get_ident()}  # every plan on the calling thread...
        assert min(reads) == 47  # ...before any part was read
        for k, p in parts.items():
            assert torch.equal(p.payload, unprepared[k][0]) and torch.equal(p.scales, unprepared[k][1]), k
        fresh.close()
    finally:
        w.shutdown()
        store.close()


def _read_without_prepare(w, store, load, monkeypatch):
    """`w._read(load)` with a store that has no `prepare` (an `EntryStore` may lack it): the
    parts planned on the reading threads, as before."""
    class Plain:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            if name == "prepare":
                raise AttributeError(name)
            return getattr(self._inner, name)

    with monkeypatch.context() as m:
        threads = _plans_by_thread(m)
        w.store = Plain(store)
        try:
            parts = w._read(load)
        finally:
            w.store = store
    assert len(threads) == 47 and threading.get_ident() not in threads  # planned by the readers
    return parts


def test_a_damaged_manifest_found_while_planning_fails_the_restore_and_writes_nothing(tmp_path):
    """A manifest damaged since the lookup (one digit of a checksum) is found by the plan step
    now, not by a read: the restore fails as a read's failure does, with nothing written."""
    w, views, store, load = _saved(tmp_path)
    try:
        path = tmp_path / "store" / zarr_json(entry_path(load.entry_id))
        text = path.read_text()
        at = text.index('"checksums"') + text[text.index('"checksums"'):].index("[") + 1
        digit = text[at]
        path.write_text(text[:at] + ("1" if digit != "1" else "2") + text[at + 1:])
        store.store.forget(load.entry_id)
        reads, real = [], store.load
        store.load = lambda *a, **k: reads.append(a[:3]) or real(*a, **k)
        w._arena.reset()
        with pytest.raises(CorruptEntry, match="manifest damaged"):
            w._read(load)
        assert reads == []  # found by the plan step: no part's read began
        assert_failed_restore_writes_nothing(w, load)
    finally:
        w.shutdown()
        store.close()


def test_an_object_stores_restore_plans_on_its_reading_threads(tmp_path, monkeypatch):
    """(`remote`: each read a round trip, which the plans made on the reading threads overlap.)"""
    w, _, store, load = _saved(tmp_path)
    try:
        monkeypatch.setattr(ZarrEntryStore, "remote", property(lambda self: True))
        prepared = []
        monkeypatch.setattr(store, "prepare", lambda *a, **k: prepared.append(a), raising=False)
        w._arena.reset()
        assert len(w._read(load)) == 47 and prepared == []
    finally:
        w.shutdown()
        store.close()
