"""`WorkerSide.flush` returns once every save and load queued before it has finished (its
writes stored, its bytes restored), and waits for those jobs themselves: it queues nothing of
its own (a no-op per pool woke an idle thread for every flush, ~90 us with nothing queued)."""

from __future__ import annotations

import threading

import pytest

from anchorkv.connector.plan import LoadSpec, Metadata, SaveSpec
from tests.connector.kimi_worker import gated, kimi_worker

SAVED = ((1,), (2,), (3,), (4, 5))  # three KDA groups, then the MLA group's two blocks
RESTORED = ((6,), (7,), (8,), (9, 10))


@pytest.fixture
def worker(tmp_path):
    w, views, _, _, layout, store = kimi_worker(tmp_path, 11, SAVED)
    yield w, views, layout.block_size, store
    w.shutdown()
    store.close()


def _flush_waits_until_released(w, gate: threading.Event, entered: threading.Event, what: str) -> None:
    """Once a job waits at `gate`: a flush on another thread does not return while it is held,
    and returns once the gate opens."""
    assert entered.wait(30)
    flushing = threading.Thread(target=w.flush, daemon=True)
    flushing.start()
    flushing.join(0.2)
    assert flushing.is_alive(), f"flush returned while a queued {what} was still held"
    gate.set()
    flushing.join(30)
    assert not flushing.is_alive()


def _spec(salt: int, tokens: int) -> SaveSpec:
    return SaveSpec(f"r{salt}", None, tuple(range(salt, salt + tokens)), tokens, SAVED)


def test_flush_waits_for_every_queued_save(worker, monkeypatch):
    w, _, bs, store = worker
    with gated(monkeypatch, store, "save_part") as (gate, entered):
        w.save(Metadata(saves=[_spec(1, bs)]))
        w.save(Metadata(saves=[_spec(2, bs)]))  # queued behind the held one
        _flush_waits_until_released(w, gate, entered, "save")
    assert len(list(store.store.list())) == 2  # both stored when flush returned
    assert (w.stats.take() or {}).get("saves") == 2


def test_flush_waits_for_a_queued_async_load(worker, monkeypatch):
    w, views, bs, store = worker
    tokens = 2 * bs
    w.save(Metadata(saves=[_spec(0, tokens)]))
    w.flush()
    [entry] = store.store.list()
    with gated(monkeypatch, store, "load") as (gate, entered):
        w.start_load(Metadata(loads=[LoadSpec("q", entry.id, 0, tokens, RESTORED)]))
        _flush_waits_until_released(w, gate, entered, "load")
    # restored when flush returned: the MLA blocks hold the saved rows
    name = next(n for n, v in views.items() if "latent" in v.page.names)
    latent = views[name].tensor("latent")
    for a, b in zip(SAVED[3], RESTORED[3], strict=True):
        assert latent[b].equal(latent[a])
    assert w.transfer_results(set()) == (set(), {"q"}, set())


def test_flush_queues_nothing(worker, monkeypatch):
    """A flush after saves and loads have finished, or before any, is one check of their last
    jobs: no job on either pool (an idle thread woken per flush)."""
    w, _, bs, _ = worker

    def refuse(*args, **kwargs):
        raise AssertionError("flush queued a job")

    with monkeypatch.context() as m:
        m.setattr(w._save_pool, "submit", refuse)
        m.setattr(w._load_pool, "submit", refuse)
        w.flush()  # nothing queued yet
    w.save(Metadata(saves=[_spec(3, bs)]))
    w.flush()
    with monkeypatch.context() as m:
        m.setattr(w._save_pool, "submit", refuse)
        m.setattr(w._load_pool, "submit", refuse)
        w.flush()  # the save has finished
