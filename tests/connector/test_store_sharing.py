"""One `Store` for the connectors of a one-process engine (tp 1: vLLM's engine core builds the
scheduler's connector and the worker's in one process): a manifest the scheduler's lookup
parsed is not read and parsed again by the worker's restore; closed with its last user."""

from __future__ import annotations

import gc
import logging
import weakref

import anchorkv.store.store as store_module
from anchorkv.connector import storage_zarr
from anchorkv.connector.config import ConnectorConfig
from anchorkv.connector.storage_zarr import ZarrEntryStore
from tests.connector.test_storage_zarr import TOKENS, raw_config, save, tiny


def look(es: ZarrEntryStore):
    return es.lookup(anchor="a", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact")


def test_connectors_sharing_a_store_parse_a_manifest_once(tmp_path, parses, caplog):
    cfg = raw_config(tmp_path)
    save(ZarrEntryStore(cfg, tiny()), 120)  # (another process's save: nothing cached here)
    with caplog.at_level(logging.INFO, logger="anchorkv"):
        scheduler = ZarrEntryStore(cfg, tiny(), share=True)
        worker = ZarrEntryStore(cfg, tiny(), share=True)
    assert worker.store is scheduler.store
    assert sum("share one store" in r.getMessage() for r in caplog.records) == 1
    assert ZarrEntryStore(cfg, tiny()).store is not scheduler.store  # share=False: its own
    assert ZarrEntryStore(raw_config(tmp_path / "b"), tiny(), share=True).store is not scheduler.store
    assert ZarrEntryStore(raw_config(tmp_path, capacity="1GB"), tiny(), share=True).store is not scheduler.store

    ref = look(scheduler)
    assert ref is not None and parses == [ref.entry_id]
    worker.store.get(ref.entry_id)  # the restore's read of the manifest
    assert parses == [ref.entry_id]
    # (two stores parse it twice)
    alone = ZarrEntryStore(cfg, tiny())
    look(alone)
    alone.store.get(ref.entry_id)
    assert parses == [ref.entry_id] * 2


def test_a_shared_store_closes_with_its_last_user(tmp_path, monkeypatch):
    cfg = raw_config(tmp_path)
    a = ZarrEntryStore(cfg, tiny(), share=True)
    b = ZarrEntryStore(cfg, tiny(), share=True)
    closes: list[object] = []
    real = store_module.Store.close
    monkeypatch.setattr(store_module.Store, "close", lambda self: (closes.append(self), real(self))[1])
    a.close()
    a.close()  # (idempotent: not a second user gone)
    assert closes == []
    save(b, 120)  # b's store still works, its pools open
    assert look(b).num_tokens == 120
    b.close()
    assert closes == [b.store]
    c = ZarrEntryStore(cfg, tiny(), share=True)  # after both closed: opened afresh
    assert c.store is not b.store
    c.close()
    assert closes == [b.store, c.store]


def test_a_shared_store_goes_with_its_users_unclosed(tmp_path):
    """vLLM may drop a connector without shutting it down: the process keeps no store of it
    (the registry holds stores weakly), and a later connector opens its own."""
    cfg = raw_config(tmp_path)
    a = ZarrEntryStore(cfg, tiny(), share=True)
    b = ZarrEntryStore(cfg, tiny(), share=True)
    gone = weakref.ref(a.store)
    del a, b
    gc.collect()
    assert gone() is None
    c = ZarrEntryStore(cfg, tiny(), share=True)
    key = storage_zarr._share_key(cfg)
    assert c.store is not gone() and storage_zarr._SHARED[key][0]() is c.store  # (registered again)
    c.close()
    assert key not in storage_zarr._SHARED  # (other tests' engines may hold theirs: only this key)


def test_options_that_cannot_be_compared_open_their_own_store(tmp_path):
    cfg = raw_config(tmp_path)
    assert storage_zarr._share_key(cfg) is not None
    plain = {"endpoint": "http://127.0.0.1:9000", "allow_http": True}
    assert storage_zarr._share_key(raw_config(tmp_path, storage_options=plain)) is not None
    unhashable = {**plain, "retry_config": {"max_retries": 2}}
    assert storage_zarr._share_key(raw_config(tmp_path, storage_options=unhashable)) is None
    odd = ConnectorConfig(store=str(tmp_path), storage_options={1: "a", "b": 2})  # (keys sort apart)
    assert storage_zarr._share_key(odd) is None


def test_a_relative_store_path_is_keyed_by_its_directory(tmp_path, monkeypatch):
    """`LocalBackend` resolves a relative path when it opens: after a chdir the same text is
    another store (found by review: it was handed the store of the directory before)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    first = ZarrEntryStore(ConnectorConfig(store="s", codec=raw_config(tmp_path).codec), tiny(), share=True)
    same = ZarrEntryStore(ConnectorConfig(store=str(tmp_path / "a" / "s"), codec=raw_config(tmp_path).codec),
                          tiny(), share=True)
    assert same.store is first.store
    monkeypatch.chdir(tmp_path / "b")
    other = ZarrEntryStore(ConnectorConfig(store="s", codec=raw_config(tmp_path).codec), tiny(), share=True)
    assert other.store is not first.store
    assert other.store.url == str(tmp_path / "b" / "s")
