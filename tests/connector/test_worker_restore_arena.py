"""A restore reads every part into the worker's host arena (`codec.HostArena`), so that on a
GPU its parts cross in one copy with no staging copy on the CPU: the store is asked for the
memory, every part of a restore lies in one slab from the second restore on, the same slab
restore after restore, and the restored bytes are the saved ones; a load through the worker's
own path restores them too."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from anchorkv.connector.plan import GroupKind, LoadSpec, Metadata, SaveSpec
from tests.connector.kimi_worker import assert_failed_restore_writes_nothing, kimi_worker

SAVED = ((1,), (2,), (3,), (4, 5))  # three KDA groups, then the MLA group's two blocks
RESTORED = ((6,), (7,), (8,), (9, 10))


def test_a_restore_reads_into_one_arena_slab_and_restores_the_saved_bytes(tmp_path):
    w, views, state, paged, layout, store = kimi_worker(tmp_path, 11, SAVED)
    groups = w.groups
    try:
        tokens = layout.block_size + 5  # a partial last MLA block
        w.save(Metadata(saves=[SaveSpec("r", None, tuple(range(tokens)), tokens, SAVED)]))
        w.flush()
        [entry] = store.store.list()
        hosts, real = [], store.load

        def spy(*args, **kwargs):
            hosts.append(kwargs.get("host"))
            return real(*args, **kwargs)

        store.load = spy
        slabs = []
        for attempt in range(3):
            hosts.clear()
            w._arena.reset()  # as `_load_once` does, under the arena's lock
            parts = w._read(LoadSpec("q", entry.id, 0, tokens, RESTORED))
            assert len(hosts) == len(parts) == 47 and all(h is w._arena for h in hosts)
            assert not w._arena.pin  # a CPU cache: pageable
            if attempt:  # the first restore's size is the hint: one slab holds them all
                [slab] = w._arena.slabs
                slabs.append(slab)
                lo, hi = slab.data_ptr(), slab.data_ptr() + slab.numel()
                for p in parts.values():
                    for t in (p.payload, p.scales):
                        assert not t.numel() or lo <= t.data_ptr() < t.data_ptr() + t.nbytes <= hi
        assert slabs[0] is slabs[1]  # the same (warm) memory restore after restore
        for name, v in views.items():  # stale bytes, then restored as vLLM drives a load
            for fname in v.page.names:
                v.tensor(fname)[list(RESTORED[3] if name in paged else (6, 7, 8))] = 1
        w.start_load(Metadata(loads=[LoadSpec("q", entry.id, 0, tokens, RESTORED, sync=True)]))
        assert slabs[0] is w._arena.slabs[0]
        for grp in groups:
            for name in grp.layers:
                for fname in views[name].page.names:
                    src = dst = views[name].tensor(fname)  # other blocks of one field
                    for a, b in zip(SAVED[grp.index], RESTORED[grp.index], strict=True):
                        if grp.kind is GroupKind.PAGED and a == SAVED[grp.index][-1]:
                            rows = tokens - layout.block_size
                            assert torch.equal(dst[b, :rows], src[a, :rows]), (name, fname)
                            assert not dst[b, rows:].any(), (name, fname)  # no stale row
                        else:
                            assert torch.equal(dst[b], src[a]), (name, fname, a, b)
    finally:
        w.shutdown()
        store.close()


def _saved_worker(tmp_path):
    w, _, _, _, layout, store = kimi_worker(tmp_path, 11, SAVED)
    tokens = 2 * layout.block_size
    w.save(Metadata(saves=[SaveSpec("r", None, tuple(range(tokens)), tokens, SAVED)]))
    w.flush()
    [entry] = store.store.list()
    return w, store, LoadSpec("q", entry.id, 0, tokens, RESTORED)


def test_a_restore_reads_its_parts_in_parallel(tmp_path, monkeypatch):
    """The first READ_THREADS reads of a restore (4 here, whatever the cores) are under way
    together (each waits for all of them to start: one read after another would time out)."""
    from anchorkv.connector import worker as worker_mod

    monkeypatch.setattr(worker_mod, "READ_THREADS", 4)
    READ_THREADS = 4
    w, store, load = _saved_worker(tmp_path)
    try:
        barrier, real = threading.Barrier(READ_THREADS, timeout=20), store.load
        calls = []

        def together(*args, **kwargs):
            with lock:
                calls.append(args[1:3])
                first = len(calls) <= READ_THREADS
            if first:
                barrier.wait()
            return real(*args, **kwargs)

        lock = threading.Lock()
        store.load = together
        w._arena.reset()
        parts = w._read(load)
        assert len(parts) == len(calls) == 47 and not barrier.broken
    finally:
        w.shutdown()
        store.close()


def test_a_failed_read_fails_the_restore_after_every_read_has_ended(tmp_path):
    """One part's read fails at once while the others are slow: `_read` raises that failure
    (the first in part order), and only once no read is left that could still write into the
    arena (the reads not yet begun are not begun at all); the restore through `start_load` then
    writes no byte into the cache."""
    w, store, load = _saved_worker(tmp_path)
    try:
        real, started, ended, lock = store.load, [], [], threading.Lock()
        keys = [(layer, f) for layer, f, _, _ in w._parts(load.blocks)]
        failing = [k for k in keys if k[1] == "recurrent"][5], [k for k in keys if k[1] == "latent"][2]
        assert keys.index(failing[0]) < keys.index(failing[1])

        def flaky(entry_id, layer, field, **kwargs):
            if (layer, field) in failing:
                raise OSError(f"read of {layer}.{field} failed")
            with lock:
                started.append(field)
            time.sleep(0.05)
            p = real(entry_id, layer, field, **kwargs)
            with lock:
                ended.append(field)
            return p

        store.load = flaky
        w._arena.reset()
        with pytest.raises(OSError, match=re.escape(f"read of {failing[0][0]}.recurrent failed")):
            w._read(load)
        assert len(ended) == len(started) < 45  # every read begun had ended; the rest never began
        assert_failed_restore_writes_nothing(w, load)
    finally:
        w.shutdown()
        store.close()
