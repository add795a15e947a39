"""A backend whose writes are round trips (`write_concurrency` > 1, an object store's puts) gets
a save's shard writes several at once; the entry is the same, and a failed write fails the save
once every write in flight has ended, leaving no entry."""

from __future__ import annotations

import threading

import pytest
import torch

from anchorkv.store.store import Store
from tests.store.helpers import CODECS, all_packed, tiny_layout, tokens

N = 130  # tokens: three latent blocks of 64, the last partial


class InFlight:
    """`backend` with `write_concurrency` = `n`: the first `n` writes made on the store's put
    threads wait for each other (a barrier), so a save gets past them only with `n` of its
    shard writes in flight at once; `fail` (a path fragment) makes the shard writes to it raise."""

    def __init__(self, backend, n: int, fail: str | None = None) -> None:
        self._backend = backend
        self.write_concurrency = n
        self.fail = fail
        self.barrier = threading.Barrier(n, timeout=30)
        self.met = 0  # put-thread writes that passed the barrier
        self.put_writes = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def write(self, path, buffers, *, atomic=False):
        if threading.current_thread().name.startswith("anchorkv-put"):
            with self._lock:
                self.put_writes += 1
                wait = self.put_writes <= self.write_concurrency
            if wait:
                self.barrier.wait()  # BrokenBarrierError after 30 s unless n writes are in flight
                with self._lock:
                    self.met += 1
            if self.fail is not None and self.fail in path:
                raise OSError(f"injected: the write of {path} failed")
        return self._backend.write(path, buffers, atomic=atomic)


def test_shard_writes_are_in_flight_together_and_the_entry_is_exact(store_url):
    url, options = store_url
    layout = tiny_layout()
    packed = all_packed(layout, CODECS, N)
    with Store.open(url, **options) as opened:
        backend = InFlight(opened.backend, 4)
        with Store(backend) as store:
            info = store.save(layout, CODECS, tokens(N), packed, anchor="in-flight")
            # every shard on a put thread (codes and scales; a state field's span layers: format 7)
            assert backend.met == 4 and backend.put_writes == len(info.manifest["shards"]) >= len(packed)
            assert Store(opened.backend).verify(info) == []  # every chunk's and shard's crc32c recorded
            for (layer, field), p in packed.items():
                got = store.load(info.id, layout, layer, field)
                if layout.layer(layer).kind.value == "paged":  # the stored rows: the saved tokens
                    p, got = (t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).narrow(0, N) for t in (p, got))
                assert torch.equal(got.payload, p.payload) and torch.equal(got.scales, p.scales), (layer, field)


def test_a_failed_shard_write_fails_the_save_and_leaves_no_entry(store_url):
    url, options = store_url
    layout = tiny_layout()
    with Store.open(url, **options) as opened:
        backend = InFlight(opened.backend, 2, fail="latent")
        with Store(backend) as store:
            with pytest.raises(OSError, match="injected: the write of .*latent"):
                store.save(layout, CODECS, tokens(N), all_packed(layout, CODECS, N), anchor="in-flight")
            assert store.list() == [] and Store(opened.backend).list() == []
            assert backend.put_writes >= 2  # (the writes went on, several at once, until the save failed)


def test_local_put_threads_are_for_the_local_directory_only(tmp_path, monkeypatch):
    """`LOCAL_PUT_THREADS` (4 from 8 cores on) is anchorkv's local directory's: there a save's
    shards go to put threads; any other backend that says `write_concurrency` 1 (its writes
    one at a time) gets them on the saving thread, whatever the host's cores."""
    from anchorkv.store import store as store_module

    monkeypatch.setattr(store_module, "LOCAL_PUT_THREADS", 4)
    layout = tiny_layout()
    packed = all_packed(layout, CODECS, N)
    with Store.open(str(tmp_path / "local")) as store:
        threads: set[str] = set()
        write = store.backend.write
        monkeypatch.setattr(store.backend, "write", lambda path, buffers, **kw: (
            threads.add(threading.current_thread().name), write(path, buffers, **kw))[1])
        store.save(layout, CODECS, tokens(N), packed, anchor="local")
        assert any(name.startswith("anchorkv-put") for name in threads), threads
    with Store.open(str(tmp_path / "other")) as opened:
        backend = InFlight(opened.backend, 1)
        with Store(backend) as store:
            info = store.save(layout, CODECS, tokens(N), packed, anchor="one-at-a-time")
            assert backend.put_writes == 0  # every shard written by the saving thread
            assert Store(opened.backend).verify(info) == []
