"""LRU eviction by last use under a capacity bound; entries being read are never evicted.

(The cross-process lease is tested with a real second process in test_commit_protocol.py.)
"""

from __future__ import annotations

import threading

import pytest

from anchorkv.store.paths import STAGING
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, all_packed, tiny_layout, tokens

N = 300


def save(store: Store, anchor: str):
    layout = tiny_layout()
    return store.save(layout, CODECS, tokens(N), all_packed(layout, CODECS, N), anchor=anchor)


def test_evicts_least_recently_used_first(store):
    a, b, c = (save(store, x) for x in "abc")
    # use a (the oldest by creation) from another Store, as another process would
    Store(store.backend).load(a.id, tiny_layout(), "model.layers.0.attn", "conv")
    size = a.stored_bytes
    assert store.evict(capacity_bytes=2 * size) == [b.id], "b is the least recently used"
    assert store.evict(capacity_bytes=size) == [c.id], "then c"
    assert [e.id for e in store.list()] == [a.id]
    assert store.usage() == size


def test_capacity_bound_applies_on_commit(store_url):
    url, options = store_url
    with Store.open(url, **options) as probe:
        size = save(probe, "probe").stored_bytes
        probe.delete(probe.list()[0])
    with Store.open(url, capacity_bytes=2 * size + size // 2, **options) as store:
        first = save(store, "first")
        save(store, "second")
        third = save(store, "third")  # over the bound: the oldest goes, the new one stays
        ids = {e.id for e in store.list()}
        assert first.id not in ids and third.id in ids and len(ids) == 2, ids
        assert store.usage() <= store.capacity_bytes


def test_a_save_whose_eviction_fails_is_saved(store_url, monkeypatch, caplog):
    """The eviction after a save's publish fails (an entry to evict that cannot be deleted):
    the save is still a save, its entry listed and whole, and the failure a warning (found by
    review: `Store.save` raised, and its clean-up of the "failed" save deleted the published
    entry's data on an object store)."""
    from anchorkv.store import eviction

    def evict(*args, **kwargs):
        raise PermissionError("cannot delete an entry")

    url, options = store_url
    with Store.open(url, capacity_bytes=1, **options) as store:
        monkeypatch.setattr(eviction, "evict", evict)
        with caplog.at_level("WARNING", logger="anchorkv.store"):
            info = save(store, "kept")
        assert "is saved; what follows a commit" in caplog.text and "cannot delete" in caplog.text
        assert [e.id for e in store.list()] == [info.id]
        with Store.open(url, **options) as fresh:
            assert fresh.verify(info.id) == []


def test_a_save_whose_staging_is_not_removed_still_evicts(store_url, caplog):
    """The staging delete after a publish fails: the save is saved and what follows a commit
    still runs (its eviction here: each save of a store of one byte's capacity evicts the
    entry before it), and the staging is a warning (a review found it skipping them both)."""
    url, options = store_url
    with Store.open(url, capacity_bytes=1, **options) as store:
        real = store.backend.delete_tree

        def delete_tree(prefix):
            if prefix.startswith(f"{STAGING}/"):
                raise OSError("the staging directory is busy")
            real(prefix)

        store.backend.delete_tree = delete_tree  # type: ignore[method-assign]
        with caplog.at_level("WARNING", logger="anchorkv.store"):
            save(store, "first")
            second = save(store, "second")
        assert "its staging was not removed" in caplog.text and "busy" in caplog.text
        assert [e.id for e in store.list()] == [second.id]


def test_entry_being_loaded_is_not_evicted(store):
    """A `load` in progress on another thread pins its entry (in-process, no lease)."""
    a, b = save(store, "a"), save(store, "b")
    reading, release = threading.Event(), threading.Event()
    real_read, real_read_ranges_into = store.backend.read, store.backend.read_ranges_into

    def hold(path):
        if path.startswith(a.path) and "/c." in path:
            reading.set()
            assert release.wait(30), "the test never released the reader"

    store.backend.read = lambda path: (hold(path), real_read(path))[1]
    store.backend.read_ranges_into = lambda path, *a, **k: (hold(path), real_read_ranges_into(path, *a, **k))[1]
    try:
        fut = store.load_async(a, tiny_layout(), "model.layers.0.attn", "recurrent")
        assert reading.wait(30), "the load never started reading"
        evicted = store.evict(capacity_bytes=0)
        assert evicted == [b.id], f"only the unpinned entry may go, evicted {evicted}"
        release.set()
        assert fut.result(timeout=30).shape == (1, 8, 16, 16)
    finally:
        release.set()
        store.backend.read, store.backend.read_ranges_into = real_read, real_read_ranges_into
    assert store.evict(capacity_bytes=0) == [a.id], "unpinned after the load"


def test_evict_needs_a_capacity(store):
    with pytest.raises(ValueError, match="no capacity"):
        store.evict()
