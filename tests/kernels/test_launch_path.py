"""The launch path: alignment claims the host can prove, item tables that cross to the GPU
without a host synchronization, and a GPU run under `torch.cuda.set_sync_debug_mode("error")`."""

from __future__ import annotations

import ctypes
import random
import warnings

import numpy as np
import pytest
import torch

from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, CodecSpec, kimi_linear_layout
from anchorkv.kernels import PackItem, PackSet, PackTarget, UnpackItem, UnpackSet, batch, cuda_driver
from anchorkv.kernels.strided import StridedField


@pytest.mark.parametrize("seed", range(20))
def test_alignment_claim_divides_every_offset(seed):
    rng = random.Random(seed)
    field = StridedField(
        torch.bfloat16, (4, 64), (64, 1), 0, 4096)
    cut = batch.field_cut(field, CodecSpec("fp8", 32))
    offsets = [rng.choice([8, 16, 24, 40, 64, 2, 6, 4]) * rng.randint(1, 9) for _ in range(5)]
    anchor = rng.choice([0, 16, 48, 8, 256])
    a = batch.alignment(cut, anchor, offsets, 2)
    assert a in (1, 2, 4, 8) and a * 2 <= batch.VECTOR_BYTES
    if a > 1:
        assert anchor % 16 == 0 and all(o % a == 0 for o in offsets)
    if anchor % 16 == 0 and all(o % 8 == 0 for o in offsets):
        assert a == 8  # the widest claim is made whenever it holds


def test_alignment_makes_no_claim_for_a_misaligned_anchor():
    field = StridedField(
        torch.float32, (8, 128), (128, 1), 0, 8192)
    cut = batch.field_cut(field, CodecSpec("int8", 128))
    assert batch.alignment(cut, 1024 + 8, [128, 2048], 4) == 1
    assert batch.alignment(cut, 1024, [128, 2048], 4) == 4


def test_item_tables_cross_in_one_pinned_non_blocking_copy(monkeypatch):
    """On CUDA, all launches' tables go through page-locked memory and one non_blocking copy
    (a copy from pageable memory would block the CPU until the stream drains)."""
    calls = []

    def fake_pin(self):
        calls.append(("pin", self.numel()))
        return self

    def fake_to(self, *args, **kwargs):
        calls.append(("to", args, kwargs))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    cuda = torch.device("cuda", 0)
    tables = batch.stage_tables([(cuda, [1, 2, 3]), (cuda, [4, 5, 6, 7]), (cuda, [8])])
    assert calls == [("pin", 10), ("to", (cuda,), {"non_blocking": True})]
    assert [t.tolist() for t in tables] == [[1, 2, 3], [4, 5, 6, 7], [8]]
    # every table starts 16-byte aligned, so pointer specialization never changes per call
    assert [t.storage_offset() % 2 for t in tables] == [0, 0, 0]


class _Event:
    """Stands for a `torch.cuda.Event`: `record` marks it pending until the test completes it."""

    def __init__(self, log):
        self.log, self.done = log, True

    def record(self, stream):
        self.log.append(("record", self, stream))
        self.done = False

    def query(self):
        return self.done


def _ring_tables(monkeypatch):
    """A set's `TableArray` (two launches; items 0 and 2 read slot 0, 1 and 3 slot 1) with a
    `TableRing` of CPU stand-ins for its page-locked and device buffers, events and stream;
    `log` records allocations, copies (with their keywords) and event records."""
    log: list = []
    tables = batch.TableArray([([(10, 11), (12, 13), (14, 15)], [0, 1, 2], 1), ([(20, 21, 22)], [3], 1)],
                              slots=[0, 1, 0, 1])
    cuda = torch.device("cuda", 0)

    def alloc(size):
        log.append(("alloc", size))
        return torch.full((size,), -1, dtype=torch.int64), torch.full((size,), -1, dtype=torch.int64)

    tables.ring = batch.TableRing(tables.array.size, tables.segments, cuda, alloc=alloc,
                                  event=lambda: _Event(log), stream=lambda: "side stream")
    real_copy = torch.Tensor.copy_

    def copy_(self, src, **kwargs):
        log.append(("copy", kwargs))
        return real_copy(self, src, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pytest.fail("a pinned allocation"))
    return tables, cuda, log


def test_a_sets_tables_cross_from_its_own_page_locked_buffers(monkeypatch):
    """`batch.TableArray` (the tables of a PackSet's or UnpackSet's plan): the fixed columns are
    laid out once, a call writes each slot's ids into its members' rows, and on CUDA the array
    crosses in one non_blocking copy from a page-locked buffer of the set's `TableRing` into
    the slot's device buffer: no allocation per call; every table starts 16-byte aligned; the
    slot's event is recorded on the current stream when the launches are issued."""
    tables, cuda, log = _ring_tables(monkeypatch)
    ring = tables.ring
    assert log.count(("alloc", 14)) == batch.TableRing.SLOTS  # 9 + 1 padding + 4, made once
    log.clear()
    tables.write([(1,), (3,), (1,), (5,)])
    first, second = tables.stage(cuda)
    assert log == [("copy", {"non_blocking": True})]
    assert first.tolist() == [10, 11, 1, 12, 13, 3, 14, 15, 1] and second.tolist() == [20, 21, 22, 5]
    assert [t.storage_offset() % 2 for t in (first, second)] == [0, 0]
    assert first.data_ptr() == ring.devices[0].data_ptr()  # the slot's own device buffer
    tables.release()
    assert log[-1] == ("record", ring.events[0], "side stream")
    tables.write([(0,), (2,), (0,), (3,)])  # the next call: only the ids change, in the next slot
    assert tables.array.tolist()[:9] == [10, 11, 0, 12, 13, 2, 14, 15, 0]
    again, _ = tables.stage(cuda)
    assert again.tolist() == [10, 11, 0, 12, 13, 2, 14, 15, 0]
    assert first.tolist()[2] == 1  # what the earlier call staged is not overwritten
    assert again.data_ptr() == ring.devices[1].data_ptr() and ring.fallbacks == 0


def test_a_set_kernels_tables_cross_as_one_table(monkeypatch):
    """A plan whose launches run in one set kernel stages its array as one table
    (`TableArray.whole`): on CUDA the ring, made at the first stage, copies it into its slot's
    device buffer once and hands out that whole buffer (each launch's table at its segment's
    start, where the set kernel's TAB_k points); on the CPU the array itself."""
    log: list = []
    tables = batch.TableArray([([(10, 11), (12, 13), (14, 15)], [0, 1, 2], 1), ([(20, 21, 22)], [3], 1)],
                              slots=[0, 1, 0, 1])
    tables.whole = True
    tables.write([(1,), (3,), (1,), (5,)])
    (host,) = tables.stage(torch.device("cpu"))
    assert host.tolist() == tables.array.tolist() and np.shares_memory(host.numpy(), tables.array)

    def alloc(device, size):
        log.append(("alloc", size))
        return torch.full((size,), -1, dtype=torch.int64), torch.full((size,), -1, dtype=torch.int64)

    monkeypatch.setattr(batch, "_cuda_table_buffers", alloc)
    monkeypatch.setattr(torch.cuda, "Event", lambda: _Event(log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "side stream")
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_",
                        lambda self, src, **kw: log.append(("copy", kw)) or real_copy(self, src, **kw))
    cuda = torch.device("cuda", 0)
    (staged,) = tables.stage(cuda)
    ring = tables.ring
    assert ring is not None and ring.segments == [(0, tables.array.size)]
    assert staged.data_ptr() == ring.devices[0].data_ptr() and staged.numel() == tables.array.size
    assert staged.tolist() == [10, 11, 1, 12, 13, 3, 14, 15, 1, 0, 20, 21, 22, 5]
    assert [start for start, _ in tables.segments] == [0, 10]  # the set kernel's TAB_0, TAB_1
    assert log.count(("copy", {"non_blocking": True})) == 1
    tables.release()
    assert log[-1] == ("record", ring.events[0], "side stream")


@pytest.mark.parametrize("slots", [[0, 0, 0, 0, 1], [0, 1, 0, 1, 1], [0, 0, 1, 0, 1]],
                         ids=["rows", "every-other", "uneven"])
def test_table_writes_through_views_equal_writes_by_index(slots):
    """`TableArray.write` assigns each slot's ids through a view of the rows that read it when
    those rows are evenly spaced (one conversion of the ids, broadcast), else by an index array;
    either way the array is what writing each cell by its index gives."""
    heads = [(10 + k, 20 + k) for k in range(4)]
    tables = batch.TableArray([(heads, [0, 1, 2, 3], 3), ([(30, 31)], [4], 3)], slots)
    want_counts = {"rows": (2, 0), "every-other": (3, 0), "uneven": (0, 3)}
    name = {(0, 0, 0, 0, 1): "rows", (0, 1, 0, 1, 1): "every-other"}.get(tuple(slots), "uneven")
    assert (len(tables.views), len(tables.writes)) == want_counts[name]
    ids = {0: (4, 5, 6), 1: (7, 8, 9)}
    want = tables.array.copy()
    for m in range(5):
        want[5 * m + 2:5 * m + 5] = ids[slots[m]]  # (rows of 5: 2 fixed columns, 3 ids)
    tables.write([ids[s] for s in slots])
    assert tables.array.tolist() == want.tolist()
    assert tables.array[[0, 1, 5, 6, 10, 11, 15, 16, 20, 21]].tolist() == [10, 20, 11, 21, 12, 22, 13, 23, 30, 31]


def test_release_with_a_stream_handle_records_on_that_handles_stream(monkeypatch):
    """`TableRing.release(site)`: the stream is asked for once per raw handle of a launch
    site on the ring's device (`launch_site()`) and kept; without a site, or with another
    device's, it is asked for at every release."""
    tables, cuda, log = _ring_tables(monkeypatch)
    ring = tables.ring
    asked = []
    ring.stream = lambda: asked.append(1) or f"stream {len(asked)}"
    for _ in range(3):
        tables.write([(1,), (3,), (1,), (5,)])
        tables.stage(cuda)
        tables.release((0, 0xAB))
    assert asked == [1] and [e[2] for e in log if e[0] == "record"][-3:] == ["stream 1"] * 3
    tables.write([(1,), (3,), (1,), (5,)])
    tables.stage(cuda)
    tables.release()
    assert len(asked) == 2 and log[-1][2] == "stream 2"
    ring.events[0].done = True  # (slot 0 again, its last use complete)
    tables.write([(1,), (3,), (1,), (5,)])
    tables.stage(cuda)
    tables.release((1, 0xAB))  # (another device's site: not this ring's stream)
    assert len(asked) == 3 and log[-1][2] == "stream 3"


def test_a_busy_slot_is_never_written_the_call_takes_torchs_allocators(monkeypatch):
    """A slot is written again only once the event of its last use has completed; a call that
    finds it pending (or staged and never released) does not wait: it stages through torch's
    page-locked and device allocators, and the busy slot keeps its bytes."""
    tables, cuda, log = _ring_tables(monkeypatch)
    ring = tables.ring
    staged = []
    for k in range(batch.TableRing.SLOTS):
        tables.write([(k,), (k,), (k,), (k,)])
        staged.append(tables.stage(cuda)[0])
        if k != 1:
            tables.release()  # slot 1: staged, never released (its launches raised)
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self.clone())
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: calls.append(("to", a, kw)) or self)
    tables.write([(7,), (7,), (7,), (7,)])
    fallback, _ = tables.stage(cuda)  # slot 0's event is still pending
    assert calls == ["pin", ("to", (cuda,), {"non_blocking": True})] and ring.fallbacks == 1
    assert fallback.tolist()[2] == 7 and staged[0].tolist()[2] == 0  # slot 0 untouched
    tables.release()  # (nothing of the ring's to record)
    ring.events[0].done = True
    tables.write([(8,), (8,), (8,), (8,)])
    assert tables.stage(cuda)[0].data_ptr() == ring.devices[0].data_ptr()  # complete: reused
    tables.release()
    tables.write([(9,), (9,), (9,), (9,)])
    tables.stage(cuda)  # slot 1: staged and never released, skipped
    assert ring.fallbacks == 2 and staged[1].tolist()[2] == 1


class _Lib:
    """Stands for libcuda's two calls (`cuda_driver.Driver`): the copy moves the bytes between
    CPU addresses (the stand-in buffers are CPU tensors); each call is logged; `fail` makes the
    next call return that CUDA error, queuing nothing."""

    def __init__(self, log):
        self.log = log
        self.fail = 0

    def cuMemcpyHtoDAsync_v2(self, dst, src, nbytes, stream):
        self.log.append(("driver copy", dst, src, nbytes, stream))
        err, self.fail = self.fail, 0
        if not err:
            ctypes.memmove(dst, src, nbytes)
        return err

    def cuEventRecord(self, event, stream):
        self.log.append(("driver record", event, stream))
        err, self.fail = self.fail, 0
        return err


def _driver_ring(monkeypatch):
    tables, cuda, log = _ring_tables(monkeypatch)
    ring = tables.ring
    lib = _Lib(log)
    ring.driver = cuda_driver.Driver(lib)
    for k, e in enumerate(ring.events):
        e.cuda_event = 0x1000 + k  # (a torch event has its handle once first recorded)
    return tables, cuda, log, ring, lib


def test_with_a_launch_site_the_tables_copy_and_event_go_to_the_driver(monkeypatch):
    """Given the call's launch site on the ring's device, a slot's copy is one driver copy of
    the whole array from the slot's page-locked buffer into its device buffer, on the site's
    stream, and its release one driver record of the slot's event on that stream: no torch copy
    nor record. The bytes staged are the array's, slot after slot."""
    tables, cuda, log, ring, lib = _driver_ring(monkeypatch)
    site = (0, 0xAB)
    before = dict(cuda_driver.counts)
    for k, ids in enumerate([[(1,), (3,), (1,), (5,)], [(2,), (4,), (2,), (6,)]]):
        log.clear()
        tables.write(ids)
        first, second = tables.stage(cuda, site)
        assert log == [("driver copy", ring.device_ptrs[k], ring.host_ptrs[k], 14 * 8, 0xAB)]
        assert first.tolist() == [10, 11, ids[0][0], 12, 13, ids[1][0], 14, 15, ids[0][0]]
        assert second.tolist() == [20, 21, 22, ids[3][0]]
        assert first.data_ptr() == ring.devices[k].data_ptr()
        tables.release(site)
        assert log[1:] == [("driver record", 0x1000 + k, 0xAB)] and not ring.staged[k] and ring.current is None
    assert cuda_driver.counts["copy"] - before["copy"] == 2 and cuda_driver.counts["record"] - before["record"] == 2
    assert ring.fallbacks == 0


def test_without_a_site_on_its_device_the_ring_uses_torch(monkeypatch):
    """No site, or another device's: torch's copy and record (the driver would queue on the
    wrong context's stream); an event not yet made (no handle) is recorded by torch too."""
    tables, cuda, log, ring, lib = _driver_ring(monkeypatch)
    for site in (None, (1, 0xAB)):
        log.clear()
        tables.write([(1,), (3,), (1,), (5,)])
        tables.stage(cuda, site)
        tables.release(site)
        assert [e[0] for e in log] == ["copy", "record"], site
    ring.events[2].cuda_event = 0
    log.clear()
    tables.write([(1,), (3,), (1,), (5,)])
    tables.stage(cuda, (0, 0xAB))
    tables.release((0, 0xAB))
    assert [e[0] for e in log] == ["driver copy", "record"]


@pytest.mark.parametrize("call", ["copy", "record"])
def test_a_driver_error_turns_the_driver_path_off_and_the_call_goes_through_torch(monkeypatch, caplog, call):
    """A driver call that returns an error queued nothing: the same call copies (or records)
    through torch, one warning names the call and the error, and every later call, of any
    ring, goes through torch."""
    tables, cuda, log, ring, lib = _driver_ring(monkeypatch)
    site = (0, 0xAB)
    tables.write([(1,), (3,), (1,), (5,)])
    if call == "record":
        tables.stage(cuda, site)
    lib.fail = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    log.clear()
    with caplog.at_level("WARNING", logger="anchorkv.kernels.cuda_driver"):
        if call == "copy":
            first, _ = tables.stage(cuda, site)
            assert first.tolist()[2] == 1  # the bytes arrived all the same
        tables.release(site)
    want = ["driver copy", "copy", "record"] if call == "copy" else ["driver record", "record"]
    assert [e[0] for e in log] == want
    assert not ring.driver.on and len(caplog.records) == 1 and "700" in caplog.text
    log.clear()
    tables.write([(2,), (4,), (2,), (6,)])
    tables.stage(cuda, site)
    tables.release(site)
    assert [e[0] for e in log] == ["copy", "record"]


def test_no_current_context_sends_that_call_through_torch_and_keeps_the_driver_path(monkeypatch, caplog):
    """CUDA_ERROR_INVALID_CONTEXT (a thread's first CUDA work, before torch made a context
    current there): that copy and record go through torch, without a warning, and the next
    call goes to the driver again."""
    tables, cuda, log, ring, lib = _driver_ring(monkeypatch)
    site = (0, 0xAB)
    with caplog.at_level("WARNING", logger="anchorkv.kernels.cuda_driver"):
        for fail in (cuda_driver.NO_CONTEXT, 0):
            log.clear()
            lib.fail = fail
            tables.write([(1,), (3,), (1,), (5,)])
            first, _ = tables.stage(cuda, site)
            assert first.tolist()[2] == 1
            lib.fail = fail
            tables.release(site)
            want = (["driver copy", "copy", "driver record", "record"] if fail
                    else ["driver copy", "driver record"])
            assert [e[0] for e in log] == want
    assert ring.driver.on and not caplog.records


@pytest.mark.parametrize("sweep", ["stage", "new ring"])
def test_a_dead_rings_buffers_live_until_its_queued_work_has_run(monkeypatch, sweep):
    """A ring dropped while a slot's copy and kernel are still queued (its event pending) keeps
    its page-locked and device buffers: torch's allocators do not know which stream reads them,
    and handing the page-locked block to another allocation would change the ids the queued
    copy moves. Once every event has completed, the next ring made or slot staged frees them."""
    import gc
    import weakref

    monkeypatch.setattr(batch, "_BURIED", [])  # (other tests' rings die with stand-in events pending)
    tables, cuda, log, ring, lib = _driver_ring(monkeypatch)
    tables.write([(1,), (3,), (1,), (5,)])
    tables.stage(cuda, (0, 0xAB))
    tables.release((0, 0xAB))  # (recorded by the driver stand-in, which knows no stand-in event:)
    pending = ring.events[0]
    pending.done = False  # slot 0's copy and kernel still queued
    host, device = weakref.ref(ring.host_tensors[0]), weakref.ref(ring.devices[0])
    other = _driver_ring(monkeypatch)[0]  # a ring that lives on
    del ring, lib
    tables.ring = None
    gc.collect()
    assert host() is not None and device() is not None  # buried, not freed
    other.write([(2,), (4,), (2,), (6,)])
    other.stage(cuda, (0, 0xAB))  # (a sweep: the event still pending)
    other.release((0, 0xAB))
    assert host() is not None
    pending.done = True
    if sweep == "stage":
        other.write([(2,), (4,), (2,), (6,)])
        other.stage(cuda, (0, 0xAB))  # the sweep finds it complete
        other.release((0, 0xAB))
    else:
        _driver_ring(monkeypatch)  # a new ring sweeps too
    gc.collect()
    assert host() is None and device() is None and not batch._BURIED


def test_a_dead_rings_slot_staged_and_never_released_keeps_its_buffers(monkeypatch):
    """A slot staged whose release never came (release itself raised): no event covers its
    copy, so the dead ring's buffers are never freed (a few hundred bytes, kept for good)."""
    import gc
    import weakref

    monkeypatch.setattr(batch, "_BURIED", [])
    tables, cuda, log, ring, lib = _driver_ring(monkeypatch)
    tables.write([(1,), (3,), (1,), (5,)])
    tables.stage(cuda, (0, 0xAB))  # (never released)
    host = weakref.ref(ring.host_tensors[0])
    del ring, lib
    tables.ring = None
    gc.collect()
    batch._sweep()
    assert host() is not None and len(batch._BURIED) == 1


def test_a_dead_rings_buffers_go_at_once_when_nothing_is_queued(monkeypatch):
    import gc
    import weakref

    monkeypatch.setattr(batch, "_BURIED", [])  # (other tests' rings die with stand-in events pending)
    tables, cuda, log, ring, lib = _driver_ring(monkeypatch)
    host = weakref.ref(ring.host_tensors[0])
    del ring, lib
    tables.ring = None
    gc.collect()
    assert host() is None and not batch._BURIED


@pytest.mark.skipif(not torch.cuda.is_available(), reason="queued copies need CUDA; the CPU tests above check "
                    "the burial with stand-in events")
@pytest.mark.parametrize("driver", [True, False], ids=["driver", "torch"])
def test_a_ring_dropped_with_its_copy_queued_still_copies_its_own_bytes(monkeypatch, driver):
    """A ring dropped while its copy waits behind other GPU work: the page-locked blocks that
    pinned allocations get next are not the ones the queued copy reads, and the device buffer
    receives the ring's bytes, through the driver or torch's `copy_` (review of stop 42)."""
    import gc

    from anchorkv.kernels import launch

    monkeypatch.setattr(batch, "_BURIED", [])  # (the CPU tests' rings die with stand-in events pending)
    dev = torch.device("cuda", torch.cuda.current_device())
    drv = cuda_driver.driver() if driver else None
    assert drv is not None or not driver, "libcuda did not load"
    ring = batch.TableRing(64, [(0, 64)], dev, driver=drv)
    site = launch.launch_site()
    torch.cuda._sleep(200_000_000)  # (GPU work ahead of the copy on the same stream, ~0.1 s)
    ring.stage(np.arange(64, dtype=np.int64), site)
    ring.release(site)
    device_buffer, host_block = ring.devices[0], ring.host_ptrs[0]
    del ring
    gc.collect()
    fresh = [torch.full((64,), -7, dtype=torch.int64, pin_memory=True) for _ in range(2 * batch.TableRing.SLOTS)]
    assert all(t.data_ptr() != host_block for t in fresh)
    torch.cuda.synchronize()
    assert device_buffer.tolist() == list(range(64))
    batch._sweep()
    assert not batch._BURIED  # (its event complete: the next sweep lets the buffers go)


def test_unpack_set_kernel_launches_with_addresses_once_the_jit_has_launched_it():
    """`_SetPlan._launch_set` through `Launcher.by_address`: the first call goes through the
    `Launcher` with tensors (the JIT) and keeps its key; later calls pass the table's, payload's
    and scales' addresses under that key (a direct launch), the batch's own scales or the
    plan's `no_scales`; an address off 16 bytes, no launch site, or a direct launch refused goes
    through the `Launcher` again."""
    from types import SimpleNamespace

    from anchorkv.kernels import launch
    from anchorkv.kernels.triton_unpack import _SetPlan, _unpack_set_kernel

    calls = []

    class Fused(launch.Launcher):
        refuse = False

        def __call__(self, kernel, _at=None, **changing):
            calls.append(("jit", _at, {k: (v.dtype, v.data_ptr()) for k, v in changing.items()}))

        def _direct(self, kernel, key, at, values):
            assert kernel is _unpack_set_kernel
            calls.append(("direct", key, at, dict(values)))
            return not self.refuse

    buf = torch.zeros(64, dtype=torch.uint8)
    payload, scales = buf[:32], buf[32:48].view(torch.float32)
    table = torch.zeros(4, dtype=torch.int64)
    plan = SimpleNamespace(fused=Fused((1,), {}), no_scales=torch.zeros(4, dtype=torch.int32))
    packed = SimpleNamespace(payload=payload, scales=scales)
    site = (0, 0xAB)
    assert buf.data_ptr() % 16 == 0
    _SetPlan._launch_set(plan, packed, table, None)  # no site: the JIT, no key kept
    assert calls[-1][0] == "jit" and plan.fused.address_key is None
    _SetPlan._launch_set(plan, packed, table, site)
    assert calls[-1] == ("jit", site, {"tab": (torch.int64, table.data_ptr()),
                                       "payload": (torch.uint8, payload.data_ptr()),
                                       "scales": (torch.int32, scales.data_ptr())})
    want_key = launch.key_of({"tab": table, "payload": payload, "scales": scales.view(torch.int32)})
    assert plan.fused.address_key == want_key
    calls.clear()
    _SetPlan._launch_set(plan, packed, table, site)
    assert calls == [("direct", want_key, site, {"tab": table.data_ptr(), "payload": payload.data_ptr(),
                                                  "scales": scales.data_ptr()})]
    calls.clear()
    _SetPlan._launch_set(plan, SimpleNamespace(payload=payload, scales=scales.new_empty(0)), table, site)
    assert calls[0][3]["scales"] == plan.no_scales.data_ptr() and len(calls) == 1
    calls.clear()
    _SetPlan._launch_set(plan, SimpleNamespace(payload=payload, scales=buf[36:52].view(torch.float32)), table, site)
    assert [c[0] for c in calls] == ["jit"]  # scales 4 bytes off 16: not under the key
    calls.clear()
    _SetPlan._launch_set(plan, packed, table, None)
    assert [c[0] for c in calls] == ["jit"]
    calls.clear()
    plan.fused.refuse = True
    _SetPlan._launch_set(plan, packed, table, site)
    assert [c[0] for c in calls] == ["direct", "jit"] and plan.fused.address_key == want_key


def test_the_driver_path_is_off_by_the_environment_or_without_libcuda(monkeypatch):
    """`ANCHORKV_CUDA_DRIVER=0` turns it off; where libcuda does not load (this CPU machine)
    there is none, and a ring of real buffers falls back to torch's calls without an error."""
    monkeypatch.setenv("ANCHORKV_CUDA_DRIVER", "0")
    assert cuda_driver.driver() is None
    monkeypatch.delenv("ANCHORKV_CUDA_DRIVER")
    loaded = cuda_driver._loaded()
    if not torch.cuda.is_available():
        try:
            ctypes.CDLL("libcuda.so.1")
        except OSError:
            assert loaded is None and cuda_driver.driver() is None
    monkeypatch.setattr(cuda_driver, "_loaded", lambda: None)
    assert cuda_driver.driver() is None


@pytest.mark.parametrize("op", ["pack", "unpack"])
def test_a_plans_tables_are_released_even_when_a_launch_raises(monkeypatch, op):
    """Each set call releases its staged tables after its launches, also when one raises (the
    slot is then free once what was issued has run)."""
    from anchorkv.kernels import triton_pack, triton_unpack
    from tests.kernels.test_batched import BLOCKS, _page, _regions

    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")
    conv, recurrent, _ = _page()
    regions = _regions(2, seed=3)
    targets = [PackTarget(b, f, BLOCKS, CodecSpec.parse("int8:16")) for b in regions for f in (conv, recurrent)]
    slots = [0, 0, 0, 0]
    packed = PackSet(targets, slots).pack([(1,)])
    released = []
    monkeypatch.setattr(batch.TableArray, "release", lambda self, site=None: released.append(self))

    class Failing:
        def __getitem__(self, grid):
            def launch(**kwargs):
                raise RuntimeError("launch failed")
            return launch

    module = triton_pack if op == "pack" else triton_unpack
    monkeypatch.setattr(module, f"_{op}_kernel", Failing())
    monkeypatch.setattr(module, f"_{op}_set_kernel", Failing())
    for fused in (True, False):  # the set kernel's one launch, or the per-signature ones
        monkeypatch.setattr(triton_pack, "FUSED", fused)
        released.clear()
        with pytest.raises(RuntimeError, match="launch failed"):
            if op == "pack":
                set_ = PackSet(targets, slots)
                set_.pack([(2,)])
            else:
                set_ = UnpackSet(targets, slots)
                set_.unpack(packed, [(2,)])
        assert (set_._plans.newest().fused is not None) == fused
        assert len(released) == 1


def test_cpu_tables_are_not_copied(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pytest.fail("pinned on CPU"))
    (t,) = batch.stage_tables([(torch.device("cpu"), [1, 2])])
    assert t.tolist() == [1, 2]


def test_check_ids_accepts_lists_tuples_and_cpu_tensors():
    assert batch.check_ids([3, 1], 4) == (3, 1)
    assert batch.check_ids(torch.tensor([2, 0]), 4) == (2, 0)
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        batch.check_ids([4], 4)
    with pytest.raises(ValueError, match="distinct"):
        batch.check_ids([1, 1], 4, distinct=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="sync debug mode needs CUDA; the CPU "
                    "tests above check the staging contract")
@pytest.mark.parametrize("tp", [1, 4])
def test_launch_path_never_synchronizes(tp):
    from anchorkv.kernels.strided import field_view
    from anchorkv.kernels.triton_pack import pack_many
    from anchorkv.kernels.triton_unpack import unpack_many

    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=tp)
    page = layout.layers[0].page.page_bytes
    blocks = 6
    regions = [torch.zeros(blocks * page, dtype=torch.uint8, device="cuda") for _ in range(3)]
    items = []
    for buf, layer in zip(regions, layout.layers, strict=False):  # the first 3 layers
        for f in layer.page.fields:
            strided = f.strided(page)
            view = field_view(buf, strided, blocks)
            view.copy_(torch.randn(view.shape, device="cuda").to(strided.dtype))
            ids = [2] if str(layer.kind) == "state" else [4, 1, 3]
            items.append(PackItem(buf, strided, ids, blocks, CodecSpec("fp8", None)))
    pack_set = PackSet([PackTarget(i.buffer, i.field, i.num_blocks, i.spec) for i in items],
                       [0 if len(i.block_ids) == 1 else 1 for i in items])
    unpack_set = UnpackSet(pack_set.targets, pack_set.slots)
    pack_many(items)  # compile outside the check
    for _ in range(batch.TableRing.SLOTS):  # (each slot's torch event is made at its first record)
        unpack_set.unpack(pack_set.pack([[2], [4, 1, 3]]), [[2], [4, 1, 3]])
    torch.cuda.synchronize()
    assert cuda_driver.driver() is not None, "libcuda did not load: the tables go through torch"
    before = dict(cuda_driver.counts)
    with warnings.catch_warnings():  # torch warns that the mode is a prototype (torch 2.11)
        warnings.filterwarnings("ignore", "Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode("error")
    try:
        packed = pack_many(items)
        unpack_many([UnpackItem(i.buffer, i.field, i.block_ids, i.num_blocks, i.spec, p, s)
                     for i, (p, s) in zip(items, packed, strict=True)])
        host = pack_set.pack([[2], [4, 1, 3]]).to_host(pin=True)  # the connector's save step
        unpack_set.unpack(pack_set.pack([[1], [3, 4, 2]]), [[2], [4, 1, 3]])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # the three set calls' tables crossed by the driver (pack_many's tables go through torch)
    assert [cuda_driver.counts[k] - before[k] for k in ("copy", "record")] == [3, 3]
    assert host.payload.is_pinned() and host.scales.is_pinned()
    assert host.whole is not None and pack_set.pack([[2], [4, 1, 3]]).whole is not None  # one allocation
    ring = next(iter(pack_set._plans._plans.values())).tables.ring
    assert ring is not None and ring.fallbacks == 0  # the tables crossed from the set's own buffers
    # the driver's copies (which sync debug mode cannot see) read page-locked memory: asynchronous
    assert all(t.is_pinned() for t in ring.host_tensors) and ring.driver is not None
    for k, (p, s) in enumerate(packed):
        hp, hs = host.part(k)
        assert torch.equal(hp, p.cpu()) and torch.equal(hs.view(torch.int32), s.cpu().view(torch.int32))


def test_cuda_without_triton_names_the_extra(monkeypatch):
    from anchorkv.kernels import dispatch

    monkeypatch.setattr(dispatch.importlib.util, "find_spec",
                        lambda name: None if name == "triton" else object())
    monkeypatch.delitem(dispatch.sys.modules, "triton", raising=False)  # not imported either
    monkeypatch.delenv("ANCHORKV_BACKEND", raising=False)
    with pytest.raises(ImportError, match=r"anchorkv\[gpu\]"):
        dispatch.backend_for(torch.device("cuda"))
    assert dispatch.backend_for(torch.device("cpu")) == "reference"


_REGION = torch.zeros(4 * 4096, dtype=torch.uint8)


def _items(n_ids: int, *, offset: int = 0, buf: torch.Tensor = _REGION):
    field = StridedField(torch.bfloat16, (4, 64), (64, 1), offset, 4096)
    items = [PackItem(buf, field, tuple(range(n_ids)), 4, CodecSpec("fp8", 32))]
    return items, batch.check_all_ids(items)


def test_plan_cache_reuses_a_plan_and_evicts_the_least_recently_used():
    built = []
    cache = batch.PlanCache(2, lambda items, ids: built.append(len(ids[0])) or object())
    one, two, three = _items(1), _items(2), _items(3)
    p1 = cache.get(*one)
    assert cache.get(*_items(1)) is p1  # equal items (a new list, new objects): the same plan
    p2 = cache.get(*two)
    assert cache.get(*one) is p1  # touched: `two` is now the oldest
    cache.get(*three)
    assert len(cache) == 2 and built == [1, 2, 3]
    assert cache.get(*one) is p1 and built == [1, 2, 3]
    assert cache.get(*two) is not p2 and built == [1, 2, 3, 2]  # evicted, rebuilt
    assert cache.newest() is cache.get(*two)


def test_plan_cache_keys_on_the_field_and_the_region():
    cache = batch.PlanCache(4, lambda items, ids: object())
    plan = cache.get(*_items(1))
    assert cache.get(*_items(1, offset=128)) is not plan
    assert cache.get(*_items(1, buf=_REGION.clone())) is not plan


def test_strided_field_hash_is_cached_and_never_pickled():
    """Plan keys hash every item's field; the hash is computed once per field object. Hashes
    differ between processes, so a pickled field recomputes its own in the process that loads it."""
    import pickle
    import subprocess
    import sys

    field = StridedField(torch.bfloat16, (4, 64), (64, 1), 128, 4096)
    same = StridedField(torch.bfloat16, (4, 64), (64, 1), 128, 4096)
    assert hash(field) == hash(same) and field == same
    assert hash(field) != hash(StridedField(torch.bfloat16, (4, 64), (64, 1), 0, 4096))
    data = pickle.dumps(field)
    assert b"_hash" not in data
    code = ("import pickle, sys, torch\n"
            "from anchorkv.kernels.strided import StridedField\n"
            "got = pickle.loads(sys.stdin.buffer.read())\n"
            "fresh = StridedField(torch.bfloat16, (4, 64), (64, 1), 128, 4096)\n"
            "print(got in {fresh}, hash(got) == hash(fresh))\n")
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, check=True)
    assert out.stdout.split() == [b"True", b"True"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="direct launches need compiled kernels (CUDA); "
                    "the CPU tests of kernels/launch.py check the logic")
@pytest.mark.parametrize("driver", ["1", "0"], ids=["driver-tables", "torch-tables"])
@pytest.mark.parametrize("codecs", [("int8", "int8", "fp8"), ("raw", "int4", "bf16")])
def test_direct_launches_give_the_jit_bytes(monkeypatch, codecs, driver):
    """Calls after a plan's first go straight to the compiled kernels (`kernels.launch`); each
    call's bytes equal the reference's, for packs (`pack_many`, `PackSet`) and unpacks
    (`unpack_many`, `UnpackSet`), the sets' item tables staged through the driver or torch
    (`ANCHORKV_CUDA_DRIVER`, read when a set's plan makes its ring)."""
    from anchorkv.kernels import launch, reference
    from anchorkv.kernels.triton_pack import pack_many
    from anchorkv.kernels.triton_unpack import unpack_many
    from tests.kernels.test_batched import _regions, _request

    monkeypatch.delenv("ANCHORKV_DIRECT_LAUNCH", raising=False)
    monkeypatch.setenv("ANCHORKV_CUDA_DRIVER", driver)
    from anchorkv.kernels import cuda_driver as drv
    before_driver = dict(drv.counts)
    assert launch.enabled(), "this triton launches differently: see kernels/launch.py"
    regions = _regions(5, seed=11)
    items = _request(regions, codecs)
    pack_set = PackSet([PackTarget(i.buffer, i.field, i.num_blocks, i.spec) for i in items],
                       [0 if len(i.block_ids) == 1 else 1 for i in items])
    targets = [torch.empty_like(r) for r in regions]
    set_targets = [torch.empty_like(r) for r in regions]
    index = {id(r): j for j, r in enumerate(regions)}
    unpack_set = UnpackSet([PackTarget(set_targets[index[id(t.buffer)]], t.field, t.num_blocks, t.spec)
                            for t in pack_set.targets], pack_set.slots)
    before = dict(launch.counts)
    for rnd in range(4):
        state, latent = [rnd % 3], [[5, 3, 4], [3, 4, 5], [4, 5, 3], [5, 4, 3]][rnd]
        now = [type(i)(i.buffer, i.field, state if len(i.block_ids) == 1 else latent, i.num_blocks, i.spec)
               for i in items]
        want = [reference.pack(i) for i in now]
        got = pack_many(now)
        batch_ = pack_set.pack([state, latent])
        for k, ((wp, ws), (p, s)) in enumerate(zip(want, got, strict=True)):
            bp, bs = batch_.part(k)
            assert torch.equal(p, wp) and torch.equal(bp, wp), (rnd, k)
            assert torch.equal(s.view(torch.int32), ws.view(torch.int32))
            assert torch.equal(bs.view(torch.int32), ws.view(torch.int32))
        for t, u, r in zip(targets, set_targets, regions, strict=True):  # the same targets every round
            t.copy_(r)
            u.copy_(r)
        expect = [r.clone() for r in regions]
        moves = [UnpackItem(targets[index[id(i.buffer)]], i.field, i.block_ids, i.num_blocks, i.spec, p, s)
                 for i, (p, s) in zip(now, got, strict=True)]
        unpack_many(moves)
        unpack_set.unpack(batch_, [state, latent])
        for m in moves:
            reference.unpack(UnpackItem(expect[[id(t) for t in targets].index(id(m.buffer))], m.field,
                                        m.block_ids, m.num_blocks, m.spec, m.payload, m.scales))
        torch.cuda.synchronize()
        assert all(torch.equal(t, e) for t, e in zip(targets, expect, strict=True)), rnd
        assert all(torch.equal(t, e) for t, e in zip(set_targets, expect, strict=True)), rnd
    # 3 rounds after the first, direct: pack_many's and unpack_many's 3 launches (one a signature)
    # and each set call's own (one with its set kernel, else one a signature)
    pack_plan, unpack_plan = pack_set._plans.newest(), unpack_set._plans.newest()
    assert pack_plan is not None and unpack_plan is not None
    per_round = (3 + (1 if pack_plan.fused is not None else len(pack_plan.order))
                 + 3 + (1 if unpack_plan.fused is not None else len(unpack_plan.launches)))
    assert launch.counts["direct"] - before["direct"] >= 3 * per_round, (per_round, before, launch.counts)
    copies = drv.counts["copy"] - before_driver["copy"]
    assert (copies > 0) == (driver == "1"), (driver, copies)


@pytest.mark.parametrize("fused", [True, False], ids=["set-kernel", "per-signature"])
def test_profile_kernels_times_the_set_calls_own_steps(monkeypatch, fused):
    """`benchmarks.profile_kernels.set_steps` (the GPU profile's host breakdown of a
    `PackSet.pack` call) runs each step of the call on the plan's own objects: its launches
    are the plan's (its set kernel's one, or its per-signature ones in its order), on the
    tables the ring stages, with the batch's views."""
    from anchorkv.kernels import triton_pack
    from benchmarks.profile_kernels import set_steps
    from tests.kernels.test_batched import BLOCKS, _page, _regions

    monkeypatch.setenv("ANCHORKV_BACKEND", "triton")
    monkeypatch.setattr(triton_pack, "FUSED", fused)
    conv, recurrent, latent = _page()
    regions = _regions(2, seed=8)
    targets = [PackTarget(b, f, BLOCKS, CodecSpec.parse(c)) for b in regions
               for f, c in ((conv, "int8:16"), (recurrent, "raw"), (latent, "fp8:64"))]
    ps = PackSet(targets, [0, 0, 1] * 2)
    launched = []

    class Recording:
        def __getitem__(self, grid):
            return lambda **kw: launched.append((grid, kw))

    steps = set_steps(ps, [(1,), (3, 4)])
    monkeypatch.setattr(triton_pack, "_pack_kernel", Recording())
    monkeypatch.setattr(triton_pack, "_pack_set_kernel", Recording())
    for step in steps.values():
        step()
    plan = ps._plans.find((1, 2), lambda: None)
    want = [plan.launches[k] for k in plan.order]
    alone_name = (f"the set kernel's launch alone (for {len(want)} launches)" if fused
                  else f"the {len(want)} launches alone")
    assert list(steps) == ["check the ids (PackSet._ids)", "find the plan", "the batch's one allocation",
                           "write + stage the item tables (TableRing)", "launch_site()", alone_name,
                           "PackSet.pack (all of it)"]
    grids = [plan.fused.grid] if fused else [run.grid for run in want]
    alone, call = launched[:len(grids)], launched[len(grids):]
    assert [g for g, _ in alone] == [g for g, _ in call] == grids
    for (_, a), (_, c) in zip(alone, call, strict=True):
        assert torch.equal(a["tab"], c["tab"]) and a["payload"].dtype == c["payload"].dtype


class _FakeStream:
    """Stands for a `torch.cuda.Stream` (what `on_stream` and `Streams` read of one)."""

    def __init__(self, stream_id: int, device_index: int = 0, cuda_stream: int = 0) -> None:
        self.stream_id, self.device_index, self.device_type, self.cuda_stream = stream_id, device_index, 1, cuda_stream


def _fake_stream_calls(monkeypatch, device: int = 0):
    """torch's C stream calls as stand-ins over a current stream per device; returns (the
    current (stream_id, device, type) per device, the calls made)."""
    from anchorkv.kernels import launch

    current = {0: (100, 0, 1), 1: (200, 1, 1)}
    calls: list = []

    def set_stream(*, stream_id, device_index, device_type):
        calls.append(("set", stream_id, device_index))
        current[device_index] = (stream_id, device_index, device_type)

    monkeypatch.setattr(launch, "_stream_calls", lambda: (lambda: device, lambda d: current[d], set_stream))
    return current, calls


def test_on_stream_switches_to_the_stream_and_back_even_on_an_error(monkeypatch):
    """`on_stream(s)` makes `s` current on the current device and restores the stream that was
    current there when it exits, by torch's C calls (what `torch.cuda.stream` does), also when
    the block raises; `torch.cuda.stream` is not called."""
    from anchorkv.kernels import launch

    current, calls = _fake_stream_calls(monkeypatch)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: pytest.fail("the lean path used torch.cuda.stream"))
    with launch.on_stream(_FakeStream(7)) as s:
        assert s.stream_id == 7 and current[0][0] == 7
    assert current[0] == (100, 0, 1) and calls == [("set", 7, 0), ("set", 100, 0)]
    with pytest.raises(RuntimeError, match="boom"), launch.on_stream(_FakeStream(8)):
        assert current[0][0] == 8
        raise RuntimeError("boom")
    assert current[0] == (100, 0, 1), "an error inside left the side stream current"


@pytest.mark.parametrize("why", ["other device", "no C calls", "switched off"])
def test_on_stream_takes_torch_cuda_stream_otherwise(monkeypatch, why):
    """A stream on another device than the current one (torch's context also keeps that
    device's stream), a torch without the C calls, or `LEAN_STREAMS` off: `torch.cuda.stream`,
    entered and exited once each."""
    from anchorkv.kernels import launch

    current, calls = _fake_stream_calls(monkeypatch)
    if why == "no C calls":
        monkeypatch.setattr(launch, "_stream_calls", lambda: None)
    if why == "switched off":
        monkeypatch.setattr(launch, "LEAN_STREAMS", False)
    used: list = []

    class Ctx:
        def __init__(self, s):
            used.append(("init", s.stream_id))

        def __enter__(self):
            used.append("enter")

        def __exit__(self, *exc):
            used.append("exit")

    monkeypatch.setattr(torch.cuda, "stream", Ctx)
    with launch.on_stream(_FakeStream(9, device_index=1 if why == "other device" else 0)):
        pass
    assert used == [("init", 9), "enter", "exit"] and calls == []


def test_streams_keeps_one_stream_object_per_handle():
    """`Streams.current` asks for the device's raw handle at every call and builds a `Stream`
    only for a handle it has not seen (one kept per handle, the handle checked against it)."""
    from anchorkv.kernels.launch import Streams

    handle = {0: 0xA}
    made: list = []

    def current(device):
        made.append(device)
        return _FakeStream(len(made), device, cuda_stream=handle[device])

    streams = Streams(current=current, handle=lambda d: handle[d])
    first = streams.current(0)
    assert streams.current(0) is first and made == [0]
    handle[0] = 0xB  # another stream made current (vLLM's, a context's)
    other = streams.current(0)
    assert other is not first and other.cuda_stream == 0xB and made == [0, 0]
    handle[0] = 0xA
    assert streams.current(0) is first and made == [0, 0]
    handle[1] = 0xA  # another device's stream of the same handle (every device's default stream is 0)
    on_one = streams.current(1)
    assert on_one is not first and on_one.device_index == 1 and made == [0, 0, 1]
    assert streams.current(1) is on_one and streams.current(0) is first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams; the CPU tests above check the calls")
def test_on_stream_matches_torch_cuda_stream_on_a_gpu():
    """On a GPU: inside `on_stream(s)` torch's current stream is `s` (kernels and allocations go
    there), after it the one before, on the current device; the stream cache finds the
    current stream by its handle."""
    from anchorkv.kernels.launch import Streams, on_stream

    side, before = torch.cuda.Stream(), torch.cuda.current_stream()
    with on_stream(side):
        assert torch.cuda.current_stream() == side
        x = torch.ones(1 << 20, device="cuda")
        y = x * 2
    assert torch.cuda.current_stream() == before
    torch.cuda.synchronize()
    assert bool((y == 2).all())
    streams = Streams()
    assert streams.current(torch.cuda.current_device()) == before
    with torch.cuda.stream(side):
        assert streams.current(torch.cuda.current_device()) == side
