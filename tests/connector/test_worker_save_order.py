"""The order a save's GPU work is queued in, checked on the CPU with recording streams and
events standing for CUDA's: the side stream waits for the forward pass, packs, marks the cache
read, copies to the host, marks the copies done; the step's stream (the next forward) waits for
the *read* mark only, not for the copies over PCIe, and a finished request's blocks are released
at that mark. A pack that fails part way leaves the step's stream waiting for all the side
stream was given. (`test_worker_cuda.py` runs the real stream path on a GPU.)"""

from __future__ import annotations

import dataclasses
import threading
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from anchorkv.codec import pack_many
from anchorkv.codec.api import PackedParts
from anchorkv.connector.plan import Metadata, SaveSpec
from tests.connector.kimi_worker import kimi_worker

BLOCKS = ((1,), (2,), (3,), (4, 5))
CODECS = {"conv": "int8:128", "recurrent": "int4:32", "latent": "fp8:64"}  # scales behind the payloads


class _Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.device, self.device_index = name, log, torch.device("cpu"), 0

    def wait_stream(self, other: _Stream) -> None:
        self.log.append((self.name, "waits for stream", other.name))

    def wait_event(self, event: _Event) -> None:
        self.log.append((self.name, "waits for", event.name))


class _Event:
    made: list[_Event] = []
    gate = threading.Event()  # the host copies "complete" when it is set

    def __init__(self) -> None:
        self.name = f"event {len(_Event.made)}"
        self.done = False
        _Event.made.append(self)

    def record(self, stream: _Stream) -> None:
        stream.log.append((stream.name, "records", self.name))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        _Event.gate.wait(10)
        self.done = True


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """(worker, log, store): the worker's side stream and the step's stream record what is
    queued on them; the pack and the host copies are logged on the stream current then. The
    copies go on the side stream (`worker.SAVE_COPY_STREAM` off; the copy-stream test below
    turns it on, the worker's default)."""
    from anchorkv.connector import worker as worker_module

    monkeypatch.setattr(worker_module, "SAVE_COPY_STREAM", False)
    w, _, _, _, layout, store = kimi_worker(tmp_path, 7, BLOCKS, {"codec": CODECS})
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

    fork = _Event()  # the worker's one fork event (made with its side stream at `register`)
    fork.name = "fork"
    _Event.made = []
    _Event.gate.set()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(worker_module, "on_stream", on)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    w._streams = SimpleNamespace(current=lambda device: current[-1])
    w._fork = fork

    def to_host(self, *, pin, host=None):  # CPU "device" tensors: copy into the buffer as a GPU batch would
        log.append((current[-1].name, "copies to the host"))
        assert pin and host is not None and host.numel() >= self.host_bytes
        return dataclasses.replace(self, quant=self.quant.copy_into(host))

    monkeypatch.setattr(PackedParts, "to_host", to_host)
    packer, _ = w._packer()
    pack = packer.pack
    monkeypatch.setattr(packer, "pack", lambda blocks: (log.append((current[-1].name, "packs")), pack(blocks))[1])
    w._stream = side
    yield w, log, store, 2 * layout.block_size
    _Event.gate.set()
    w.shutdown()
    store.close()


def _spec(tokens: int, req: str = "r1", salt: int = 0) -> SaveSpec:
    return SaveSpec(req, None, tuple(range(salt, salt + tokens)), tokens, BLOCKS, release_blocks=True)


def test_the_next_forward_waits_for_the_pack_not_for_the_host_copies(recorded):
    w, log, store, tokens = recorded
    w.save(Metadata(saves=[_spec(tokens)]))
    read, ready = _Event.made
    assert log == [("step", "records", "fork"), ("side", "waits for", "fork"), ("side", "packs"),
                   ("side", "records", read.name),
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
    assert log == [("step", "records", "fork"), ("side", "waits for", "fork"), ("side", "packs"),
                   ("step", "waits for stream", "side")], log
    assert w.stats.take().get("save_failed") == 1
    assert w.transfer_results({"r1"})[0] == {"r1"}  # nothing to wait for: the step's stream does
    w.flush()
    assert list(store.store.list()) == []


def _stored(w, store, spec: SaveSpec, layer: str, fname: str):
    ref = store.lookup(anchor=None, token_ids=list(spec.token_ids), max_tokens=spec.num_tokens, multiple_of=1,
                       mode="exact")
    assert ref is not None and ref.num_tokens == spec.num_tokens
    rows = None if fname != "latent" else (0, spec.num_tokens)
    return store.load(ref.entry_id, layer, fname, tp_size=1, tp_rank=0, rows=rows)


def test_saves_reuse_one_host_buffer_and_store_its_bytes(recorded):
    """Saves one after the other copy into the same page-locked buffer (`HostPool`: no pinned
    allocation per save), given back by the writer once stored; a save made while the writer
    still holds it (copies not complete) gets another buffer. Every entry holds the bytes the
    codec layer packs, so a reused buffer never leaks one save's bytes into another's."""
    w, log, store, tokens = recorded
    pool = w._save_host
    specs = [_spec(tokens, f"r{k}", salt=1000 * k) for k in range(3)]
    for spec in specs[:2]:
        w.save(Metadata(saves=[spec]))
        w.flush()
    assert pool.made == 1 and len(pool.free) == 1
    buffer = pool.free[0]
    _Event.gate.clear()  # the writer waits for the copies of the next save: it holds the buffer
    w.save(Metadata(saves=[specs[2]]))
    views = w.views
    layer = next(name for name in views if "latent" in [f.name for f in views[name].page.fields])
    views[layer].tensor("latent")[BLOCKS[3][0]] += 1  # the cache changes between the two saves
    w.save(Metadata(saves=[_spec(tokens, "r3", salt=3000)]))
    assert pool.made == 2  # the first buffer was in use
    _Event.gate.set()
    w.flush()
    assert pool.made == 2 and len(pool.free) == 2 and any(b is buffer for b in pool.free)
    assert w.stats.take().get("saves") == 4
    now = {(name, f.name): p for (name, f), p in zip(
        [(name, f) for g in w.groups for name in g.layers for f in views[name].page.fields],
        pack_many([(views[name], f.name, list(BLOCKS[g.index]), w.config.codec_for(f.name))
                   for g in w.groups for name in g.layers for f in views[name].page.fields]), strict=True)}
    for (name, fname), want in now.items():  # every part of the last save, as packed now
        got = _stored(w, store, _spec(tokens, "r3", salt=3000), name, fname)
        if fname == "latent":
            want = want.reshape(want.shape[0] * want.shape[1], *want.shape[2:]).narrow(0, tokens)
        assert torch.equal(got.payload, want.payload) and torch.equal(got.scales, want.scales), (name, fname)
    before = _stored(w, store, specs[2], layer, "latent")
    assert not torch.equal(before.payload, _stored(w, store, _spec(tokens, "r3", salt=3000), layer, "latent").payload)


def test_the_writer_cuts_the_parts_before_waiting_for_the_copies(recorded, monkeypatch):
    """The writer's views of a save (`_host_parts`: no byte read) are made while the host copies
    run; only the NaN check and the store wait for them."""
    w, log, store, tokens = recorded
    host_parts = w._host_parts
    monkeypatch.setattr(w, "_host_parts", lambda *a: (log.append(("writer", "cuts the parts")), host_parts(*a))[1])
    synchronize = _Event.synchronize
    monkeypatch.setattr(_Event, "synchronize", lambda self: (log.append(("writer", "waits for", self.name)),
                                                             synchronize(self))[1])
    _Event.gate.clear()
    w.save(Metadata(saves=[_spec(tokens)]))
    _, ready = _Event.made
    for _ in range(200):  # the writer thread: cut, then wait (held at the gate)
        if ("writer", "waits for", ready.name) in log:
            break
        threading.Event().wait(0.01)
    writer = [e for e in log if e[0] == "writer"]
    assert writer == [("writer", "cuts the parts"), ("writer", "waits for", ready.name)], writer
    _Event.gate.set()
    w.flush()
    assert len(list(store.store.list())) == 1 and w.stats.take().get("saves") == 1


def test_with_a_copy_stream_the_copies_wait_for_the_pack_and_the_next_pack_does_not_wait_for_them(
        recorded, monkeypatch):
    """`worker.SAVE_COPY_STREAM`: the host copies go on a stream of their own (made once), after
    the pack's `read` mark; the batch's device memory is recorded on it (the allocator must not
    reuse it before the copy has read it); the step's stream still waits for `read` only, and
    the next save's pack waits for the step, never for the last save's copies. The stored
    bytes are the codec layer's."""
    from anchorkv.connector import worker as worker_module

    w, log, store, tokens = recorded
    monkeypatch.setattr(worker_module, "SAVE_COPY_STREAM", True)
    made: list[_Stream] = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: made.append(_Stream("copy", log)) or made[-1])
    monkeypatch.setattr(PackedParts, "record_stream", lambda self, stream: log.append((stream.name, "recorded")))
    for k in range(2):
        log.clear()
        w.save(Metadata(saves=[_spec(tokens, f"r{k}", salt=1000 * k)]))
        read, ready = _Event.made[-2:]
        assert log == [("step", "records", "fork"), ("side", "waits for", "fork"), ("side", "packs"),
                       ("side", "records", read.name),
                       ("copy", "waits for", read.name), ("copy", "recorded"), ("copy", "copies to the host"),
                       ("copy", "records", ready.name),
                       ("step", "waits for", read.name)], log
    assert len(made) == 1  # one copy stream, kept
    w.flush()
    assert w.stats.take().get("saves") == 2
    views = w.views
    layer = next(name for name in views if "latent" in [f.name for f in views[name].page.fields])
    want = pack_many([(views[layer], "latent", list(BLOCKS[3]), w.config.codec_for("latent"))])[0]
    want = want.reshape(want.shape[0] * want.shape[1], *want.shape[2:]).narrow(0, tokens)
    got = _stored(w, store, _spec(tokens, "r1", salt=1000), layer, "latent")
    assert torch.equal(got.payload, want.payload) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("codecs", ["raw", "quant"])
def test_saves_back_to_back_store_their_own_bytes_on_the_cpu(tmp_path, codecs):
    """The CPU run of `test_worker_cuda.py`'s back-to-back saves (one KV block of tokens here):
    three saves of other blocks, issued without waiting, each stores the bytes `pack_many`
    gives for its blocks (the check the GPU run of the same helper makes of its streams)."""
    from tests.connector.test_worker_cuda import back_to_back_saves

    back_to_back_saves(tmp_path, codecs, "cpu", tokens=1920)


def test_a_copy_that_fails_after_it_is_queued_never_reads_freed_memory(recorded, monkeypatch):
    """With the copies on their own stream, the batch's device memory is recorded on that stream
    before the copies are queued: a failure after them (the NaN sum's allocations, an event)
    still leaves the allocator waiting for what the copy stream was given. The save fails
    (counted), the step's stream waits for the pack's `read` mark as always."""
    from anchorkv.connector import worker as worker_module

    w, log, store, tokens = recorded
    monkeypatch.setattr(worker_module, "SAVE_COPY_STREAM", True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream("copy", log))
    monkeypatch.setattr(PackedParts, "record_stream", lambda self, stream: log.append((stream.name, "recorded")))

    def fails(self, *, pin, host=None):
        log.append(("copy", "copies to the host"))
        raise RuntimeError("out of memory after the copy was queued")

    monkeypatch.setattr(PackedParts, "to_host", fails)
    w.save(Metadata(saves=[_spec(tokens)]))
    read = _Event.made[0]
    assert log == [("step", "records", "fork"), ("side", "waits for", "fork"), ("side", "packs"),
                   ("side", "records", read.name), ("copy", "waits for", read.name), ("copy", "recorded"),
                   ("copy", "copies to the host"), ("step", "waits for", read.name)], log
    assert w.stats.take().get("save_failed") == 1
    w.flush()
    assert list(store.store.list()) == []
