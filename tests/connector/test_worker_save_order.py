"""The order a save's GPU work is queued in, checked on the CPU with recording streams and
events standing for CUDA's: the side stream waits for the forward pass, packs, marks the cache
read, copies to the host, marks the copies done; the step's stream (the next forward) waits for
the *read* mark only, not for the copies over PCIe, and a finished request's blocks are released
at that mark. A pack that fails part way leaves the step's stream waiting for all the side
stream was given. (`test_worker_cuda.py` runs the real stream path on a GPU.)"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from anchorkv.codec.api import PackedParts
from anchorkv.connector.plan import Metadata, SaveSpec
from tests.connector.kimi_worker import kimi_worker

BLOCKS = ((1,), (2,), (3,), (4, 5))


class _Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.device = name, log, torch.device("cpu")

    def wait_stream(self, other: _Stream) -> None:
        self.log.append((self.name, "waits for stream", other.name))

    def wait_event(self, event: _Event) -> None:
        self.log.append((self.name, "waits for", event.name))


class _Event:
    made: list[_Event] = []

    def __init__(self) -> None:
        self.name = f"event {len(_Event.made)}"
        self.done = False
        _Event.made.append(self)

    def record(self, stream: _Stream) -> None:
        stream.log.append((stream.name, "records", self.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """(worker, log, store): the worker's side stream and the step's stream record what is
    queued on them; the pack and the host copies are logged on the stream current then."""
    w, _, _, _, layout, store = kimi_worker(tmp_path, 7, BLOCKS)
    log: list = []
    step, side = _Stream("step", log), _Stream("side", log)
    current = [step]

    @contextmanager
    def on(stream):
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    _Event.made = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    to_host = PackedParts.to_host
    monkeypatch.setattr(PackedParts, "to_host", lambda self, **kw: (
        log.append((current[-1].name, "copies to the host")), to_host(self, **kw))[1])
    packer, _ = w._packer()
    pack = packer.pack
    monkeypatch.setattr(packer, "pack", lambda blocks: (log.append((current[-1].name, "packs")), pack(blocks))[1])
    w._stream = side
    yield w, log, store, 2 * layout.block_size
    w.shutdown()
    store.close()


def _spec(tokens: int) -> SaveSpec:
    return SaveSpec("r1", None, tuple(range(tokens)), tokens, BLOCKS, release_blocks=True)


def test_the_next_forward_waits_for_the_pack_not_for_the_host_copies(recorded):
    w, log, store, tokens = recorded
    w.save(Metadata(saves=[_spec(tokens)]))
    read, ready = _Event.made
    assert log == [("side", "waits for stream", "step"), ("side", "packs"), ("side", "records", read.name),
                   ("side", "copies to the host"), ("side", "records", ready.name),
                   ("step", "waits for", read.name)], log
    # the blocks are released when the pack has read them, the copies still running
    assert w.transfer_results({"r1"})[0] == set()
    read.done = True
    assert w.transfer_results({"r1"})[0] == {"r1"}
    w.flush()  # the writer waited for the copies (`ready`), then stored the entry
    assert ready.done and len(list(store.store.list())) == 1 and w.stats.take().get("saves") == 1


def test_a_pack_that_fails_leaves_the_step_waiting_for_the_whole_side_stream(recorded, monkeypatch):
    w, log, store, tokens = recorded
    packer, _ = w._packer()

    def fails(blocks):
        log.append(("side", "packs"))
        raise RuntimeError("a launch failed")

    monkeypatch.setattr(packer, "pack", fails)
    w.save(Metadata(saves=[_spec(tokens)]))
    assert log == [("side", "waits for stream", "step"), ("side", "packs"),
                   ("step", "waits for stream", "side")], log
    assert w.stats.take().get("save_failed") == 1
    assert w.transfer_results({"r1"})[0] == {"r1"}  # nothing to wait for: the step's stream does
    w.flush()
    assert list(store.store.list()) == []
