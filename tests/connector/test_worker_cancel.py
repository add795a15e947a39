"""A load vLLM will recompute anyway reads nothing more: one that timed out while queued reads
no part, one cancelled midway stops before its next part, and a part that fails stops the
parts not yet begun (found by review: each cancelled load read its whole entry, so a slow store
kept the load thread on useless reads and the loads queued behind timed out in turn)."""

from __future__ import annotations

import threading
import time

import pytest

from anchorkv.connector import worker as worker_module
from anchorkv.connector.plan import LoadSpec, Metadata, SaveSpec
from anchorkv.store.errors import CorruptEntry
from tests.connector.kimi_worker import kimi_worker

SAVED = ((1,), (2,), (3,), (4, 5))
RESTORED = ((6,), (7,), (8,), (9, 10))


@pytest.fixture
def worker(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_module, "READ_THREADS", 2)  # as on a 2-core host, whatever this one has
    w, views, _, _, layout, store = kimi_worker(tmp_path, 11, SAVED, extra={"load_timeout_s": 0.3})
    bs = layout.block_size
    w.save(Metadata(saves=[SaveSpec("s", None, tuple(range(2 * bs)), 2 * bs, SAVED)]))
    w.flush()
    [entry] = store.store.list()
    yield w, store, LoadSpec("q0", entry.id, 0, 2 * bs, RESTORED)
    w.shutdown()
    store.close()


def _reads(monkeypatch, store, delay: float, fail_at: int | None = None) -> list[float]:
    """The times `store.load` calls start; each takes `delay`, the `fail_at`-th raises."""
    calls: list[float] = []
    real, lock = store.load, threading.Lock()

    def load(*args, **kwargs):
        with lock:
            calls.append(time.monotonic())
            n = len(calls)
        time.sleep(delay)
        if n == fail_at:
            raise CorruptEntry(args[0], "a damaged chunk")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "load", load)
    return calls


def test_loads_cancelled_for_their_timeout_stop_reading(worker, monkeypatch):
    w, store, spec = worker
    parts = len(list(w._parts(spec.blocks)))
    calls = _reads(monkeypatch, store, delay=0.05)  # a slow store: ~0.6 s a restore on 2 threads
    specs = [LoadSpec(f"q{i}", spec.entry_id, 0, spec.num_tokens, RESTORED) for i in range(4)]
    w.start_load(Metadata(loads=specs))
    time.sleep(0.45)  # past load_timeout_s: the first is midway, the others queued
    sending, recving, failed = w.transfer_results(set())
    cancelled_at = time.monotonic()
    assert failed == recving == {s.req_id for s in specs}  # all reported failed: vLLM recomputes them
    w.flush()
    after = [t for t in calls if t > cancelled_at]
    assert len(after) <= 2, (len(calls), len(after))  # at most the reads already begun (READ_THREADS)
    assert len(calls) < parts  # the first stopped midway; the queued three read nothing
    assert (w.stats.take() or {}).get("miss:timeout") == 4


def test_a_failed_part_stops_the_reads_not_yet_begun(worker, monkeypatch):
    w, store, spec = worker
    parts = len(list(w._parts(spec.blocks)))
    calls = _reads(monkeypatch, store, delay=0.01, fail_at=3)
    w.start_load(Metadata(loads=[spec]))
    w.flush()
    assert w.transfer_results(set()) == (set(), {"q0"}, {"q0"})
    assert len(calls) <= 3 + 2 < parts  # the failed one and those begun beside it
    stats = w.stats.take() or {}
    assert stats.get("miss:corrupt") == 1 and "restores" not in stats, stats  # the real cause, counted once
