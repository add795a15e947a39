"""A local save's large shards written by the store's help thread (`store.HELP_WRITES`,
`writer.HELP_BYTES`) while the saving thread checksums them and goes on: the same files byte
for byte as a save without it, a failed help write fails the save with nothing committed, and
the help thread takes a shard only when idle (no save waits behind another's write)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from anchorkv.store import store as store_module
from anchorkv.store import writer as writer_module
from anchorkv.store.store import Store, chunk_threads
from tests.store.helpers import CODECS, RAW_CODECS, all_packed, tiny_layout, tokens

N = 300


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "entries").rglob("*")) if p.is_file()}


def _writers(store: Store, fail_on_help: bool = False, gate: threading.Event | None = None) -> list[tuple[str, str]]:
    """(thread name, path) of each file the store writes; `fail_on_help`: a write on the help
    thread raises; `gate`: a write on the help thread waits for it."""
    seen: list[tuple[str, str]] = []
    real = store.backend.write

    def write(path, buffers, **kw):
        name = threading.current_thread().name
        seen.append((name, path))
        if name.startswith("anchorkv-help"):
            if gate is not None:
                assert gate.wait(10)
            if fail_on_help:
                raise OSError(28, "No space left on device (a test)")
        return real(path, buffers, **kw)

    store.backend.write = write  # type: ignore[method-assign]
    return seen


def _save(store: Store, codecs, write_id: str = "w1"):
    layout = tiny_layout()
    return store.save(layout, codecs, tokens(N), all_packed(layout, codecs, N), anchor="help", write_id=write_id)


@pytest.fixture
def helping(monkeypatch):
    """Every shard large enough for the help thread (which only a save without put threads
    uses: `LOCAL_PUT_THREADS` is 4 from 8 cores on)."""
    monkeypatch.setattr(store_module, "HELP_WRITES", True)
    monkeypatch.setattr(store_module, "LOCAL_PUT_THREADS", 1)
    monkeypatch.setattr(writer_module, "HELP_BYTES", 1)
    monkeypatch.setattr("anchorkv.store.commit.now", lambda: 1700000000.0)
    monkeypatch.setattr("anchorkv.store.store.now", lambda: 1700000000.0)


@pytest.mark.parametrize("codecs", [RAW_CODECS, CODECS], ids=["raw", "quant"])
def test_help_writes_store_the_same_bytes(tmp_path, monkeypatch, helping, codecs):
    helped = Store.open(tmp_path / "helped")
    seen = _writers(helped)
    info = _save(helped, codecs)
    by_help = [p for name, p in seen if name.startswith("anchorkv-help")]
    assert by_help and all("/c." in p for p in by_help), seen  # shards only, never metadata
    monkeypatch.setattr(store_module, "HELP_WRITES", False)
    alone = Store.open(tmp_path / "alone")
    assert not [n for n, _ in _writers(alone) if n.startswith("anchorkv-help")]
    _save(alone, codecs)
    assert _files(tmp_path / "helped") == _files(tmp_path / "alone")
    layout = tiny_layout()
    for (layer, field), ref in all_packed(layout, codecs, N).items():
        got = Store.open(tmp_path / "helped", create=False).load(info.id, layout, layer, field)
        paged = layout.layer(layer).kind.value == "paged"
        k = N * got.payload.numel() // got.shape[0] // got.shape[1] if paged else got.payload.numel()  # stored rows
        assert torch.equal(got.payload[:k], ref.payload[:k]), (layer, field)
    assert Store.open(tmp_path / "helped", create=False).verify(info.id) == []


def test_a_failed_help_write_fails_the_save_and_commits_nothing(tmp_path, helping):
    store = Store.open(tmp_path / "s")
    _writers(store, fail_on_help=True)
    with pytest.raises(OSError, match="No space left"):
        _save(store, RAW_CODECS)
    assert store.scan() == [] and list((tmp_path / "s" / "entries").rglob("c.*")) == []
    store.backend.write = type(store.backend).write.__get__(store.backend)  # type: ignore[method-assign]
    assert _save(store, RAW_CODECS, write_id="w2") is not None  # the store still saves


def test_the_help_thread_takes_a_shard_only_when_idle(tmp_path, helping):
    """While the help thread's write is held, the other shards are written by the saving
    thread (none queues behind it); once it ends the save commits every byte."""
    store = Store.open(tmp_path / "s")
    gate = threading.Event()
    seen = _writers(store, gate=gate)
    done: list = []
    saver = threading.Thread(target=lambda: done.append(_save(store, RAW_CODECS)), name="saver")
    saver.start()
    while not [1 for name, _ in seen if name.startswith("anchorkv-help")]:
        saver.join(0.01)
    deadline = 0
    while len([1 for name, p in seen if name == "saver" and "/c." in p]) < 3 and deadline < 500:
        saver.join(0.01)
        deadline += 1
    by_saver = [p for name, p in seen if name == "saver" and "/c." in p]
    by_help = [p for name, p in seen if name.startswith("anchorkv-help") and "/c." in p]
    assert len(by_saver) >= 3 and len(by_help) == 1, seen  # none queued behind the held write
    assert not done, "the save committed with a shard write still in flight"
    gate.set()  # (shards after this may go to the help thread again: it is idle)
    saver.join(10)
    shards = [(name, p) for name, p in seen if "/c." in p]
    assert len(shards) == len({p for _, p in shards}) and done and store.verify(done[0].id) == []


def test_a_help_write_is_waited_for_whatever_fails_after_it(tmp_path, helping, monkeypatch):
    """The saving thread's checksums of a shard the help thread writes failing (found by
    review): the write is still waited for, so nothing of the aborted save lands after its
    abort, and the store holds no file of it."""
    store = Store.open(tmp_path / "s")
    gate = threading.Event()
    _writers(store, gate=gate)
    monkeypatch.setattr(writer_module, "_checksums", lambda *a: _boom())
    opener = threading.Timer(0.3, gate.set)  # the help write ends a while after the failure
    opener.start()
    with pytest.raises(MemoryError):
        _save(store, RAW_CODECS)
    assert store._helping is not None
    store._helping.result(timeout=10)  # (ended before the save raised, or now)
    opener.join()
    assert [p for p in (tmp_path / "s").rglob("c.*") if p.is_file()] == []


def _boom():
    raise MemoryError("a test")


@pytest.mark.parametrize("cores,help_writes,want", [(2, True, 1), (2, False, 2), (16, True, 2), (1, True, 1)])
def test_the_saving_thread_checksums_beside_the_help_thread_on_two_cores(cores, help_writes, want):
    assert chunk_threads(cores, "fastcrc", help_writes) == want
