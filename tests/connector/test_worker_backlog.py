"""`save_backlog` bounds the host memory of saves waiting for the store: a save that finds the
queued ones holding that much is dropped (counted `save_dropped`, warned once, its blocks
released at once when the request finished), one always goes, and saves go again once the store
has caught up. Without the bound a store slower than the engine's saves would queue page-locked
copies of every save until the host ran out of memory."""

from __future__ import annotations

import logging

import pytest

from anchorkv.connector.config import DEFAULT_SAVE_BACKLOG, ConnectorConfig
from anchorkv.connector.plan import Metadata, SaveSpec
from tests.connector.kimi_worker import gated, kimi_worker

SAVED = ((1,), (2,), (3,), (4, 5))  # three KDA groups, then the MLA group's two blocks


def _spec(salt: int, tokens: int, *, release: bool = False) -> SaveSpec:
    return SaveSpec(f"r{salt}", None, tuple(range(salt, salt + tokens)), tokens, SAVED, release_blocks=release)


def _worker(tmp_path, backlog):
    return kimi_worker(tmp_path, 6, SAVED, {"save_backlog": backlog})


def test_saves_past_the_backlog_are_dropped_until_the_store_catches_up(tmp_path, monkeypatch, caplog):
    w, _, _, _, layout, store = _worker(tmp_path, 1)  # one byte: one save queued at a time
    bs = layout.block_size
    try:
        with gated(monkeypatch, store, "save_part") as (gate, entered):
            w.save(Metadata(saves=[_spec(1, bs)]))  # none queued: it goes, however large
            assert entered.wait(30)
            held = w._backlog
            assert held > 10**6  # its packed bytes (a Kimi-Linear request's KDA state, at least)
            with caplog.at_level(logging.WARNING, logger="anchorkv.connector"):
                w.save(Metadata(saves=[_spec(2, bs), _spec(3, bs)]))
            assert w._backlog == held  # nothing packed, nothing queued
            warned = [r.getMessage() for r in caplog.records if "store is behind" in r.getMessage()]
            assert len(warned) == 1 and "save_backlog" in warned[0], warned  # once, not per save
            gate.set()
            w.flush()
        assert w._backlog == 0
        w.save(Metadata(saves=[_spec(4, bs)]))  # the store caught up: saves go again
        w.flush()
        counts = w.stats.take() or {}
        assert counts.get("saves") == 2 and counts.get("save_dropped") == 2, counts
        stored = sorted(e.num_tokens for e in store.store.list())
        assert stored == [bs, bs]
        assert store.lookup(anchor=None, token_ids=list(range(2, 2 + bs)), max_tokens=bs, multiple_of=1,
                            mode="exact") is None  # the dropped ones were not written
    finally:
        w.shutdown()
        store.close()


def test_a_dropped_finishing_save_releases_its_blocks(tmp_path, monkeypatch):
    """vLLM frees a finished request's blocks once it is reported in finished_sending: a
    dropped save reads none, so it is reported at the next call, before the held save is."""
    w, _, _, _, layout, store = _worker(tmp_path, 1)
    bs = layout.block_size
    try:
        with gated(monkeypatch, store, "save_part") as (gate, entered):
            w.save(Metadata(saves=[_spec(1, bs)]))
            assert entered.wait(30)
            held = w._backlog
            w.save(Metadata(saves=[_spec(2, bs, release=True)]))
            assert w._backlog == held  # not packed, not queued
            sending, _, _ = w.transfer_results({"r2"})
            assert sending == {"r2"}
            assert (w.stats.take() or {}).get("save_dropped") == 1
    finally:
        w.shutdown()
        store.close()


def test_under_the_backlog_nothing_is_dropped(tmp_path, monkeypatch):
    """The default bound (4 GiB) holds several queued saves of this request."""
    w, _, _, _, layout, store = kimi_worker(tmp_path, 6, SAVED)
    assert w.config.save_backlog == DEFAULT_SAVE_BACKLOG == 4 << 30
    bs = layout.block_size
    try:
        with gated(monkeypatch, store, "save_part") as (gate, entered):
            w.save(Metadata(saves=[_spec(k, bs) for k in range(1, 4)]))
            assert entered.wait(30)
            assert w._backlog > 0
            gate.set()
            w.flush()
        counts = w.stats.take() or {}
        assert counts.get("saves") == 3 and not counts.get("save_dropped"), counts
    finally:
        w.shutdown()
        store.close()


@pytest.mark.parametrize("value, bytes_", [("512MiB", 512 << 20), (10**9, 10**9), ("2GB", 2 * 10**9)])
def test_save_backlog_is_a_size(value, bytes_):
    assert ConnectorConfig.from_extra_config({"save_backlog": value}).save_backlog == bytes_


@pytest.mark.parametrize("value", [0, -5, "lots", True])
def test_a_bad_save_backlog_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match="save_backlog"):
        ConnectorConfig.from_extra_config({"save_backlog": value})
