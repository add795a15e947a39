"""Worker side: pack saves out of the cache, restore loads into it, on background threads.

Saves: `wait_for_save` runs the pack kernels through a `codec.Packer` of every (layer, field)
the worker saves, built once (on CUDA, on a side stream ordered after the forward pass: no host
sync in the forward pass), and queues two asynchronous copies of the packed bytes (one payload
and one scales allocation) to pinned host memory; a background thread then cuts them into parts
and writes this rank's part of the entry to the store.
Loads: every chunk a request needs is read and verified *before* a single cache byte is
written, each part straight into its span of one batch in the worker's host arena; the batch
crosses to the GPU in one copy and one `codec.Unpacker` call (built once) writes exactly the
request's blocks, the rows past the entry's end in its last paged block decoding from zero
bytes to zeros. (A restore the batch cannot hold, an entry saved with other codecs for one, is
unpacked part by part, those rows zeroed after.) Async loads run on a background thread; a load that fails or
times out is reported in `failed_recving` (vLLM recomputes) and never writes afterwards. Sync
loads (`async_load: false`) run inside `start_load_kv`, which vLLM calls before the forward
that reads them; they are never reported (vLLM asserts a running request gets no
`finished_recving`), and a failed one raises: vLLM 0.33 cannot recompute a running request of
a hybrid model, and computing on an unrestored state would be silently wrong.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from anchorkv.codec import (
    CacheView,
    HostArena,
    HostPool,
    ModelLayout,
    Packed,
    PackedParts,
    Packer,
    Unpacker,
    unpack_many,
)
from anchorkv.codec.api import stage_to_device
from anchorkv.codec.layout import Field, PageLayout
from anchorkv.connector.config import ConnectorConfig
from anchorkv.connector.counters import Counters, Miss, load_miss_of
from anchorkv.connector.plan import GroupInfo, GroupKind, LoadSpec, Metadata, SaveSpec, first_row
from anchorkv.connector.storage import EntryStore
from anchorkv.kernels import BatchLayout, PackedBatch
from anchorkv.kernels.dispatch import backend_for
from anchorkv.kernels.launch import Streams, on_stream
from anchorkv.store.settings import cores

log = logging.getLogger("anchorkv.connector")

PartKey = tuple[str, str]  # (layer name, field name)


#: A restore's parts are read this many at a time from a local directory. Reads from the page
#: cache are CPU work (copies, checksums) in Python threads that share the GIL, so more threads
#: than that work can use only wait for each other: a Kimi-Linear entry read warm on the H200
#: host of stop 41 (16 cores), 25 rounds interleaved
#: (`benchmarks/results/nvidia-h200-bd4efa5-store-threads.txt`), median ms for 1 / 2 / 3 / 4 / 8 threads:
#: raw, fresh `Store` 46.9 / 27.7 / 22.4 / 21.2 / 27.0, kept 38.8 / 20.9 / 15.6 / 13.9 / 17.3;
#: quant fresh 30.6 / 23.9 / 23.5 / 26.5 / 32.2, kept 21.2 / 13.5 / 13.4 / 15.6 / 20.3 (plain
#: files 25.8 / 14.1 / 10.5 / 9.3 / 10.6). On 2 busy cores 1, 2 and 8 threads read it in
#: 11.7-12.0, 11.6-13.5 and 12.0-12.5 ms (`python -m benchmarks.restore_reads --rounds 4`).
READ_THREADS = max(1, min(3, cores()))
#: ... and from a store whose reads are round trips (an object store, `write_concurrency` > 1):
#: 47 of them one after another (a Kimi-Linear request) add up, so more are in flight.
REMOTE_READ_THREADS = max(1, min(8, cores()))
#: Copy a save's packed bytes to the host on a stream of their own (CUDA), after the pack's
#: `read` event, instead of on the side stream after the pack: the next save's pack, and so the
#: step that waits for it, then never queues behind a PCIe copy (saves back to back, or a long
#: context's copy outlasting a step). On since the H200 runs of stop 41
#: (`benchmarks/results/nvidia-h200-{bd4efa5,086ba40}.md`, a Kimi-Linear save of 7680 tokens,
#: ratio to a D2H copy of its packed bytes, same run, side stream -> this): raw one save 0.759 ->
#: 0.814 and 0.838 -> 0.779, back to back 0.926 -> 0.952 and 0.933 -> 0.964; quant 0.575 ->
#: 0.570 and 0.620 -> 0.596, back to back 0.814 -> 0.845 and 0.815 -> 0.758: within the runs'
#: spread on that bench, which has no forward pass between saves for the copies to hold up.
#: `test_worker_cuda.py`'s saves back to back stored their own bytes both ways.
SAVE_COPY_STREAM = True
#: seconds a damaged write, once queued for a check, is not queued again (the scheduler's
#: bad-entry mark lasts as long)
REPAIR_TTL_S = 300.0


@dataclass
class _Packing:
    """A save's packed parts (on the host once `ready` has passed; in `host`, a buffer of the
    worker's `HostPool`, when given) and its events (CUDA only): `read` the cache is read."""

    packed: PackedParts
    host: torch.Tensor | None = None
    read: Any = None
    ready: Any = None

    @property
    def nbytes(self) -> int:
        """The host memory it holds until stored: its page-locked buffer, or its parts."""
        if self.host is not None:
            return self.host.numel()
        return self.packed.host_bytes + sum(p.nbytes for p in self.packed.custom.values())


class _Abandoned(Exception):
    """A restore's part not read: its load was cancelled, or another part failed."""


@dataclass
class _Load:
    spec: LoadSpec
    started: float = field(default_factory=time.monotonic)
    state: str = "reading"  # reading -> writing -> done | failed | cancelled
    lock: threading.Lock = field(default_factory=threading.Lock)
    ended: threading.Event = field(default_factory=threading.Event)  # no more writes
    after: Any = None  # CUDA event: the work vLLM queued before the load (block zeroing)


class WorkerSide:
    def __init__(self, config: ConnectorConfig, groups: list[GroupInfo], mode: str, store: EntryStore,
                 tp_size: int, tp_rank: int, *, granularity: int = 1) -> None:
        self.config = config
        #: saved lengths must be multiples of this (whole attention blocks where the platform's
        #: in-block token order is opaque, see `vllm_layout.opaque_kv_layout`)
        self.granularity = granularity
        self.groups = groups
        self._group_of = {name: g for g in groups for name in g.layers}
        self.mode = mode
        self.store = store
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.layout: ModelLayout | None = None
        self.views: dict[str, CacheView] = {}
        self._loads: dict[str, _Load] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._finished_sending: set[str] = set()
        self._releases: list[tuple[str, Any]] = []  # (req id, event or None) of finish saves
        self._lock = threading.Lock()
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="anchorkv-load")
        #: a restore's parts read at once (`ZarrEntryStore.remote`: an object store's round trips)
        self.read_threads = REMOTE_READ_THREADS if getattr(store, "remote", False) else READ_THREADS
        self._read_pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="anchorkv-read")
        self._save_pool = ThreadPoolExecutor(1, thread_name_prefix="anchorkv-save")
        #: entries a load found damaged, checked (and deleted) by one daemon thread off the load
        #: path, each write once (entry id, version -> when queued: failed loads of one write
        #: within `REPAIR_TTL_S` queue nothing more; a review saw 16 failures read it 16 times)
        self._repairs: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self._repaired: dict[tuple[str, str | None], float] = {}
        self._repair_thread: threading.Thread | None = None
        #: the last job queued on each one-thread pool (`flush` waits for it: its end is all of them)
        self._last_save: Future | None = None
        self._last_load: Future | None = None
        #: host bytes held by the saves queued for the writer (`save_backlog` bounds it)
        self._backlog = 0
        self._backlog_warned = -float("inf")  # when the last "store is behind" warning was logged
        self._stream: torch.cuda.Stream | None = None
        self._copy_stream: torch.cuda.Stream | None = None  # (`SAVE_COPY_STREAM`; made when first used)
        #: (CUDA) the step's stream objects by handle, and the one event a save's side stream waits
        #: on (recorded on the step's stream at each save: a wait takes the record made before it)
        self._streams: Streams | None = None
        self._fork: torch.cuda.Event | None = None
        #: the host memory restores are read into (page-locked for a GPU cache: parts cross in
        #: one copy as they lie), reused restore after restore; one restore at a time
        self._arena = HostArena(pin=False)
        self._arena_lock = threading.Lock()
        #: the page-locked host memory saves copy their packed bytes into, reused save after
        #: save (one buffer per save in flight: the writer gives it back when stored)
        self._save_host = HostPool(pin=False)
        self._save_set: tuple[Packer, list[tuple[str, str, GroupKind]]] | None = None
        self._load_set: Unpacker | None = None  # built at the first restore
        self._load_parts = True  # False: a custom codec; restores go part by part
        #: (group, rows of its blocks' fields; None: several) of the groups a restore writes,
        #: found with the Unpacker
        self._load_groups: list[tuple[GroupInfo, int | None]] = []
        self.stats = Counters(primary=tp_rank == 0)

    def register(self, layout: ModelLayout, views: dict[str, CacheView]) -> None:
        self.layout, self.views = layout, views
        self._save_set = None
        self._load_set, self._load_parts = None, True
        device = next(iter(views.values())).region.device
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device=device)
            self._copy_stream = None
            self._streams, self._fork = Streams(), torch.cuda.Event()
        with self._arena_lock:
            self._arena = HostArena(pin=device.type == "cuda")
        self._save_host = HostPool(pin=device.type == "cuda")
        try:
            backend = backend_for(device)
        except (ImportError, RuntimeError, ValueError) as e:  # every save and restore will say so too
            log.warning("anchorkv: worker rank %d cannot pack or unpack on %s: %s", self.tp_rank, device, e)
        else:
            log.info("anchorkv: worker rank %d packs and unpacks on %s with %s", self.tp_rank, device,
                     "the Triton kernels" if backend == "triton" else "the torch reference")

    # -------------------------------------------------------------------- what a spec touches

    def _parts(self, blocks: Sequence):
        """(layer, field, block ids, kind) of every field a load or save touches."""
        for g in self.groups:
            for name in g.layers:
                view = self.views.get(name)
                if view is None:
                    continue  # vLLM's padding layers hold nothing
                for f in view.page.fields:
                    yield name, f.name, blocks[g.index], g.kind  # one tuple per group

    # -------------------------------------------------------------------- saves

    def _whole_blocks(self, spec: SaveSpec) -> SaveSpec | None:
        """`spec` cut to whole attention blocks where only those can be saved: a model without
        state keeps its first whole blocks (K/V of a prefix stand alone); a state after a
        partial block cannot be saved (None)."""
        g = self.granularity
        if g == 1 or spec.num_tokens % g == 0:
            return spec
        if any(grp.kind is GroupKind.STATE or grp.window is not None for grp in self.groups):
            # (a state, or a sliding window's last rows, exists only after all the tokens)
            log.debug("anchorkv: request %s: %d tokens end inside an attention block whose token order "
                      "is opaque here; not saved", spec.req_id, spec.num_tokens)
            return None
        m = spec.num_tokens - spec.num_tokens % g
        if m == 0:
            return None
        return dataclasses.replace(spec, token_ids=tuple(spec.token_ids[:m]), num_tokens=m,
                                   blocks=tuple(tuple(b[: m // g]) for b in spec.blocks))

    def save(self, meta: Metadata) -> None:
        for full_spec in meta.saves:
            spec = self._whole_blocks(full_spec)
            if spec is None or self._behind(full_spec):
                if full_spec.release_blocks:  # nothing reads its blocks
                    self._releases.append((full_spec.req_id, None))
                continue
            try:
                packing = self._pack(spec)
            except Exception:
                log.exception("anchorkv: packing request %s failed; not saved", spec.req_id)
                self.stats.save_failed()
                packing = None
            if spec.release_blocks:  # the blocks are free once the pack has read them
                self._releases.append((spec.req_id, packing.read if packing is not None else None))
            if packing is not None:
                with self._lock:
                    self._backlog += packing.nbytes
                self._last_save = self._save_pool.submit(self._write, spec, packing)

    def _behind(self, spec: SaveSpec) -> bool:
        """Whether the saves queued for the store hold `save_backlog` bytes of host memory or
        more: then this one is dropped (counted; the request stays uncached), so a store slower
        than the saves cannot use up the host's (page-locked) memory. With none queued a save
        always goes, however large."""
        with self._lock:
            backlog = self._backlog
        if backlog == 0 or backlog < self.config.save_backlog:
            return False
        self.stats.save_dropped()
        now = time.monotonic()
        if now - self._backlog_warned >= 60.0:  # once a minute at most: it repeats while the store is behind
            self._backlog_warned = now
            log.warning("anchorkv: the store is behind: saves waiting for it hold %.1f MB of host memory "
                        "(save_backlog %.1f MB), so request %s is not saved; raise save_backlog, or give the "
                        "store more bandwidth", backlog / 1e6, self.config.save_backlog / 1e6, spec.req_id)
        return True

    def _packer(self) -> tuple[Packer, list[tuple[str, str, GroupKind]]]:
        """The `Packer` of every (layer, field) a save touches (one slot per KV-cache group) and
        those parts' (layer, field, kind); built at the first save: the views never change."""
        if self._save_set is None:
            slots = tuple(range(max((g.index for g in self.groups), default=-1) + 1))
            parts = list(self._parts(slots))  # each part's "blocks" is its slot: its group's index
            packer = Packer([(self.views[layer], fname, self.config.codec_for(fname), slot)
                             for layer, fname, slot, _ in parts])
            self._save_set = packer, [(layer, fname, kind) for layer, fname, _, kind in parts]
        return self._save_set

    def _pack(self, spec: SaveSpec) -> _Packing:
        """Pack every (layer, field) of the request in a few launches; on CUDA, on the side
        stream after the forward pass, then copy the packed bytes there too, in one copy, into
        a page-locked buffer of the worker's `HostPool` (reused save after save: no pinned
        allocation per save). Returns the packed parts, the buffer, and two events (None on a
        CPU): `read`, the cache blocks are read (the step's stream waits for it, and a finished
        request's blocks are released after it), and `ready`, the host copies are complete (the
        writer thread waits for it, then gives the buffer back). The next forward waits for the
        pack only, not for the copies over PCIe (~2 ms for a 100 MB request); with
        `SAVE_COPY_STREAM` the copies run on a stream of their own, so the next save's pack
        does not wait for them either. The parts are cut
        into `Packed` views by the writer thread (`_host_parts`): the step pays for the launches
        and the copies only."""
        packer, _ = self._packer()
        stream = self._stream
        if stream is None:
            return _Packing(packer.pack(spec.blocks))
        assert self._streams is not None and self._fork is not None  # (made with the stream)
        step = self._streams.current(stream.device_index)
        self._fork.record(step)  # order after the forward pass without blocking the host
        stream.wait_event(self._fork)
        read = None
        try:
            copy = self._copies(stream)
            with on_stream(stream):  # (`torch.cuda.stream`, in fewer host calls)
                packed = packer.pack(spec.blocks)
                read = torch.cuda.Event()
                read.record(stream)
                host = self._save_host.take(packed.host_bytes) if packed.host_bytes else None
                if copy is stream:  # (`SAVE_COPY_STREAM` off)
                    packed = packed.to_host(pin=True, host=host)
                    ready = torch.cuda.Event()
                    ready.record(stream)
            if copy is not stream:
                copy.wait_event(read)
                # its memory is not reused before what the copy stream is given has run (told
                # before the copies: whatever fails after them, they never read freed memory)
                packed.record_stream(copy)
                with on_stream(copy):
                    packed = packed.to_host(pin=True, host=host)
                    ready = torch.cuda.Event()
                    ready.record(copy)
        finally:
            # the next forward may write these blocks (vLLM frees and reuses align-mode state
            # blocks from the next step on): it runs after the packs have read them (after all
            # the side stream was given if the pack failed part way)
            if read is not None:
                step.wait_event(read)
            else:
                step.wait_stream(stream)
        return _Packing(packed, host, read, ready)

    def _copies(self, stream: torch.cuda.Stream) -> torch.cuda.Stream:
        """The stream a save's copies to the host run on: the side stream, or with
        `SAVE_COPY_STREAM` one of their own on its device."""
        if not SAVE_COPY_STREAM:
            return stream
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=stream.device)
        return self._copy_stream

    def _host_parts(self, spec: SaveSpec, packed: PackedParts) -> dict[PartKey, Packed]:
        """The request's parts as host `Packed`s, paged fields cut to the saved tokens."""
        _, keys = self._packer()
        out: dict[PartKey, Packed] = {}
        for (layer, fname, kind), p in zip(keys, packed.packed(), strict=True):
            if kind is GroupKind.PAGED:  # (a sliding window's part: its rows from `first_row` on)
                rows = spec.num_tokens - self._first_row(layer, 0, spec.num_tokens)
                p = p.reshape(p.shape[0] * p.shape[1], *p.shape[2:]).narrow(0, rows)
            out[(layer, fname)] = p.to("cpu") if p.payload.is_cuda else p  # (`_pack` copied them)
        return out

    def _write(self, spec: SaveSpec, packing: _Packing) -> None:
        try:
            self._store(spec, packing)
        finally:
            with self._lock:
                self._backlog -= packing.nbytes
            # the buffer is reused once its copies are complete (not if waiting for them failed)
            if packing.host is not None and (packing.ready is None or packing.ready.query()):
                self._save_host.give(packing.host)

    def _store(self, spec: SaveSpec, packing: _Packing) -> None:
        t0 = time.perf_counter()
        packed = packing.packed
        try:
            # the parts' views first: they read no byte, so they are cut while the copies run
            # (~0.15 ms of the writer's time for a Kimi-Linear request, after the copies before)
            host = self._host_parts(spec, packed)
            if packing.ready is not None:
                packing.ready.synchronize()  # the pinned host copies are complete
            # one reduction over the batch; a count per (trimmed) part only if it finds a NaN
            poisoned = sum(p.poisoned_groups() for p in host.values()) if packed.may_hold_nan() else 0
            if poisoned:
                log.warning("anchorkv: request %s has %d groups with NaN/Inf state; not saved",
                            spec.req_id, poisoned)
                self.stats.save_failed()
                return
            nbytes = self.store.save_part(spec, host, tp_size=self.tp_size, tp_rank=self.tp_rank)
            if nbytes == 0:  # already stored, or too short to key: nothing written
                log.debug("anchorkv: request %s: nothing to save for %d tokens", spec.req_id, spec.num_tokens)
                self.stats.save_skipped()
                return
            seconds = time.perf_counter() - t0
            self.stats.saved(tokens=spec.num_tokens, nbytes=nbytes, seconds=seconds)
            log.info("anchorkv: saved %d tokens of request %s (rank %d/%d, %.1f MB) in %.3f s",
                     spec.num_tokens, spec.req_id, self.tp_rank, self.tp_size, nbytes / 1e6, seconds)
        except Exception:
            log.exception("anchorkv: saving request %s failed; it stays uncached", spec.req_id)
            self.stats.save_failed()

    # -------------------------------------------------------------------- loads

    def start_load(self, meta: Metadata) -> None:
        for spec in meta.loads:
            job = _Load(spec)
            if self._stream is not None:  # write after what vLLM queued (zeroing the blocks)
                job.after = torch.cuda.Event()
                job.after.record(torch.cuda.current_stream(self._stream.device))
            if spec.sync:
                self._load(job)
                if job.state != "done":
                    raise RuntimeError(
                        f"anchorkv: synchronous load of request {spec.req_id} from entry "
                        f"{spec.entry_id} failed (see the warning above) and vLLM 0.33 cannot "
                        "recompute a running request of a hybrid model; set "
                        "kv_connector_extra_config 'async_load': true to have failed loads recomputed"
                    )
                continue
            with self._lock:
                self._loads[spec.req_id] = job
            self._last_load = self._load_pool.submit(self._load, job)

    def handle_preemptions(self, meta: Metadata) -> None:
        """vLLM is about to reuse the blocks of `meta.preempted`: cancel their loads that have
        not started writing, wait for those that have. (Saves need nothing: a save is packed
        in the `wait_for_save` of the step that planned it, ordered before later steps.)"""
        for req_id in meta.preempted:
            with self._lock:
                job = self._loads.get(req_id)
            if job is None:
                continue
            with job.lock:
                if job.state == "reading":
                    job.state = "cancelled"
                    self.stats.load_failed(Miss.PREEMPTED)
            job.ended.wait()

    def _load(self, job: _Load) -> None:
        try:
            self._load_once(job)
        finally:
            job.ended.set()

    def _load_once(self, job: _Load) -> None:
        spec = job.spec
        t0 = time.perf_counter()
        error: Exception | None = None
        try:
            with self._arena_lock:  # the arena is this load's until its copies are done
                if job.state != "reading":
                    return  # timed out (or preempted) while queued: read nothing
                self._arena.reset()
                batch = self._batch_for(spec)
                parts = self._read(spec, batch, job)  # every chunk read and verified before any write
                whole = batch is not None and batch.fill(parts)
                with job.lock:
                    if job.state != "reading":
                        return  # timed out meanwhile: its blocks may belong to someone else now
                    job.state = "writing"
                if whole:
                    assert batch is not None
                    self._restore_batch(batch, job.after)
                else:
                    self._restore(spec, parts, job.after)
        except _Abandoned:
            return  # cancelled while its parts were read: counted and reported then
        except Exception as e:
            log.warning("anchorkv: load of request %s from entry %s failed (%s); vLLM recomputes",
                        spec.req_id, spec.entry_id, e)
            error = e
        ok = error is None
        with job.lock:
            if job.state in ("reading", "writing"):
                job.state = "done" if ok else "failed"
                if error is not None:  # not when it was cancelled meanwhile (counted then)
                    self.stats.load_failed(load_miss_of(error))
        if error is not None and load_miss_of(error) is Miss.CORRUPT:
            # a damaged entry would fail every load and block every save of its tokens (a save
            # keeps an entry that exists): check it whole and delete it if its data is at fault
            self._queue_repair(spec.entry_id, spec.version)
        if ok:
            nbytes = sum(p.nbytes for p in parts.values())
            seconds = time.perf_counter() - t0
            self.stats.restored(tokens=spec.num_tokens - spec.start, nbytes=nbytes, seconds=seconds)
            log.info("anchorkv: restored %d tokens of request %s (rank %d/%d, %.1f MB) in %.3f s",
                     spec.num_tokens - spec.start, spec.req_id, self.tp_rank, self.tp_size,
                     nbytes / 1e6, seconds)

    def _read(self, spec: LoadSpec, batch: _Batch | None = None, job: _Load | None = None) -> dict[PartKey, Packed]:
        """Every part of the restore, read (`READ_THREADS` at a time) and checked, into the
        worker's host arena (the caller holds `_arena_lock` and has reset it): each part into
        its span of `batch` when there is one. Every read has ended when this returns or raises
        (the first failure, in part order): nothing writes into the arena after it. Once `job`
        is cancelled (timed out, preempted) or a part fails, the parts not yet begun are not
        read: a load vLLM recomputes anyway must not hold the load thread, and the loads queued
        behind it, for the rest of its entry."""
        wanted = []
        for layer, fname, _, kind in self._parts(spec.blocks):
            field_ = self.views[layer].page.field(fname)
            paged = kind is GroupKind.PAGED
            start = self._first_row(layer, spec.start, spec.num_tokens)
            wanted.append((layer, fname, (start, spec.num_tokens) if paged else None,
                           (spec.num_tokens - start, *field_.shape[1:]) if paged else (1, *field_.shape),
                           field_.dtype))
        hosts = batch.hosts(self._arena) if batch is not None else [self._arena] * len(wanted)
        prepare = getattr(self.store, "prepare", None)  # (an optional part of `EntryStore`)
        if prepare is not None and not getattr(self.store, "remote", False):
            # the manifest and the read plans here, before the reading threads: made there, they
            # held Python's lock against the reads (an object store's round trips: no matter)
            prepare(spec.entry_id, [(layer, fname, rows) for layer, fname, rows, _, _ in wanted],
                    tp_size=self.tp_size, tp_rank=self.tp_rank, version=spec.version)
        stop = threading.Event()  # a part failed: the others need not be read

        def read(layer: str, fname: str, rows: tuple[int, int] | None, host: Any) -> Packed:
            if stop.is_set() or (job is not None and job.state != "reading"):
                raise _Abandoned(f"load of request {spec.req_id} abandoned before {layer}.{fname} was read")
            try:
                return self.store.load(spec.entry_id, layer, fname, tp_size=self.tp_size, tp_rank=self.tp_rank,
                                       rows=rows, host=host, version=spec.version)
            except BaseException:
                stop.set()
                raise

        reads = [self._read_pool.submit(read, layer, fname, rows, host)
                 for (layer, fname, rows, _, _), host in zip(wanted, hosts, strict=True)]
        wait(reads)
        errors = [e for e in (f.exception() for f in reads) if e is not None]
        if errors:  # the first real failure (parts after it were abandoned), in part order
            raise next((e for e in errors if not isinstance(e, _Abandoned)), errors[0])
        parts = {}
        for (layer, fname, _, expected, dtype), done in zip(wanted, reads, strict=True):
            p = done.result()
            if tuple(p.shape) != expected or p.dtype != dtype:
                raise ValueError(f"entry {spec.entry_id}: {layer}.{fname} is {p.dtype} {list(p.shape)}, "
                                 f"this rank needs {dtype} {list(expected)}")
            if p.poisoned_groups():
                raise ValueError(f"entry {spec.entry_id}: {layer}.{fname} holds NaN/Inf groups")
            parts[(layer, fname)] = p
        return parts

    def _first_row(self, layer: str, start: int, num_tokens: int) -> int:
        """The first token of a paged layer's rows a load of [start, num_tokens) or a save
        (start 0) touches: `start`, later in a sliding-window layer (`plan.first_row`)."""
        g = self._group_of.get(layer)
        return start if g is None else first_row(g, start, num_tokens)

    def _restore(self, spec: LoadSpec, parts: dict[PartKey, Packed], after: Any = None) -> None:
        """Unpack every part into the request's blocks in a few launches (state fields: into
        each block the spec names; paged fields: whole blocks, then the first rows of a partial
        last block, whose other rows are zeroed: no stale byte for attention to read)."""
        work: list[tuple[Packed, CacheView, str, Sequence[int]]] = []
        zero: list[tuple[CacheView, str, int, int]] = []
        for layer, fname, ids, kind in self._parts(spec.blocks):
            view, p = self.views[layer], parts[(layer, fname)]
            if kind is GroupKind.STATE:
                work.extend((p, view, fname, [b]) for b in ids)
                continue
            bs = view.page.field(fname).shape[0]
            full, tail = divmod(p.shape[0], bs)
            if full:
                work.append((p.narrow(0, full * bs).reshape(full, bs, *p.shape[1:]), view, fname, ids[:full]))
            if tail:  # a partial last block: only its first `tail` rows
                rows = _leading_rows(view, fname, tail)
                work.append((p.narrow(full * bs, tail).reshape(1, tail, *p.shape[1:]), rows, fname,
                             ids[full:full + 1]))
                zero.append((view, fname, ids[full], tail))
        with self._writing(after):
            unpack_many(work)
            for view, fname, block, tail in zero:
                view.tensor(fname)[block, tail:] = 0

    @contextmanager
    def _writing(self, after: Any):
        """A restore's writes: on the worker's stream after `after` (what vLLM queued), and
        complete when this exits, also on an error (the copies out of the host arena are done)."""
        stream = self._stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if stream is not None and after is not None:  # `after` is only recorded with a stream
                stream.wait_event(after)
            try:
                yield
            finally:
                if stream is not None:
                    stream.synchronize()

    # -------------------------------------------------------------------- loads as one batch

    def _unpacker(self) -> Unpacker | None:
        """The `Unpacker` of every (layer, field) a restore touches with the configured codecs
        (one slot per KV-cache group), built at the first restore; None when a codec is a
        custom one (those restores go part by part)."""
        if self._load_set is None and self._load_parts:
            slots = tuple(range(max((g.index for g in self.groups), default=-1) + 1))
            parts = [(self.views[layer], fname, self.config.codec_for(fname), slot)
                     for layer, fname, slot, _ in self._parts(slots)]
            self._load_parts = bool(parts) and all(Unpacker.takes(c) for *_, c, _ in parts)
            if self._load_parts:
                self._load_set = Unpacker(parts)
                self._load_groups = []
                for g in self.groups:
                    rows = {view.page.field(f.name).shape[0] for view in (self.views.get(n) for n in g.layers)
                            if view is not None for f in view.page.fields}
                    if rows:  # (not padding layers only)
                        self._load_groups.append((g, rows.pop() if len(rows) == 1 else None))
        return self._load_set

    def _batch_for(self, spec: LoadSpec) -> _Batch | None:
        """Where this restore's parts go in one batch (allocated from the arena, which the
        caller has reset), or None when it is restored part by part: a custom codec, or a state
        group restored into other than one block."""
        unpacker = self._unpacker()
        if unpacker is None:
            return None
        slots = len(spec.blocks)
        lens = [0] * slots
        ids: list[tuple[int, ...]] = [()] * slots
        for g, block_rows in self._load_groups:
            index = g.index
            blocks = tuple(spec.blocks[index])
            rows = spec.num_tokens - first_row(g, spec.start, spec.num_tokens)
            if g.kind is GroupKind.STATE:
                n = len(blocks)
                if n != 1:
                    return None
            else:
                if block_rows is None:
                    return None
                n = -(-rows // block_rows)  # whole blocks, the last one maybe partial
                if n > len(blocks):
                    return None  # (the part-by-part path names the error)
            lens[index], ids[index] = n, blocks[:n]
        layout = unpacker.layout(lens)
        payload = self._arena(layout.payload_bytes)
        scales = self._arena(4 * layout.scale_values).view(torch.float32)
        return _Batch(unpacker, layout, payload, scales, ids)

    def _restore_batch(self, batch: _Batch, after: Any = None) -> None:
        """Unpack a restore read whole into its batch: the batch crosses to the GPU in one copy
        (its two tensors lie in one page-locked slab) and the kernels write every part; rows past
        the entry's end in a partial last block decode from zero bytes to zeros."""
        with self._writing(after):
            payload, scales = batch.payload, batch.scales
            if self._stream is not None:
                payload, scales = stage_to_device([payload, scales], batch.unpacker.device)
            batch.unpacker.unpack(PackedBatch(payload, scales, batch.layout.spans), batch.ids)

    # -------------------------------------------------------------------- completions

    def awaiting_release(self) -> set[str]:
        """Requests whose blocks a finish save still holds (released by `transfer_results`)."""
        return {req_id for req_id, _ in self._releases}

    def transfer_results(self, finished_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call.

        A finishing request's blocks are released once its pack has read them and vLLM has
        told this worker the request finished (`finished_ids`), as the contract requires.
        """
        sending = set()
        keep = []
        for req_id, ev in self._releases:
            if req_id in finished_ids and (ev is None or ev.query()):
                sending.add(req_id)
            else:
                keep.append((req_id, ev))
        self._releases = keep
        recving, failed = set(), set()
        now = time.monotonic()
        with self._lock:
            for req_id, job in list(self._loads.items()):
                with job.lock:
                    if job.state == "reading" and now - job.started > self.config.load_timeout_s:
                        job.state = "cancelled"
                        self.stats.load_failed(Miss.TIMEOUT)
                        log.warning("anchorkv: load of request %s timed out after %.0f s; vLLM recomputes",
                                    req_id, self.config.load_timeout_s)
                    if job.state in ("done", "failed", "cancelled"):
                        recving.add(req_id)
                        if job.state != "done":
                            failed.add(req_id)
                        del self._loads[req_id]
        return sending, recving, failed

    def flush(self) -> None:
        """Block until every queued save and load has finished (tests, shutdown, benchmarks).
        Each pool runs its jobs one at a time in the order queued, so its last job's end is all
        of them done: `flush` waits for those futures themselves. (It queued a no-op on each
        pool and waited for it: one more thread handoff per pool, waking an idle thread, ~90 us
        of every flush on a 2-core CPU and ~120 us on the H100's host with nothing queued.)"""
        wait([f for f in (self._last_save, self._last_load) if f is not None])

    def _queue_repair(self, entry_id: str, version: str | None) -> None:
        now = time.monotonic()
        with self._lock:
            for key in [k for k, t in self._repaired.items() if now - t > REPAIR_TTL_S]:
                del self._repaired[key]
            if (entry_id, version) in self._repaired:
                return
            self._repaired[(entry_id, version)] = now
            if self._repair_thread is None:  # a daemon: a check still reading never holds up exit
                self._repair_thread = threading.Thread(target=self._repair_loop, name="anchorkv-repair",
                                                       daemon=True)
                self._repair_thread.start()
        self._repairs.put((entry_id, version))

    def _repair_loop(self) -> None:
        while True:
            entry_id, version = self._repairs.get()
            try:
                self.store.discard_damaged(entry_id, version)
            except Exception as e:  # a store error: `anchorkv gc --verify` removes it later
                log.warning("anchorkv: could not check damaged entry %s (%s)", entry_id, e)
            finally:
                self._repairs.task_done()

    def repairs_done(self) -> None:
        """Wait until the entries queued for a check so far were checked (tests)."""
        self._repairs.join()

    def shutdown(self) -> None:
        self._save_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=False, cancel_futures=True)
        self._read_pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Batch:
    """A restore's parts as one `PackedBatch` in the worker's arena: part i at
    `layout.spans[i]` of `payload` and `scales`, written into blocks `ids` (per slot)."""

    unpacker: Unpacker
    layout: BatchLayout
    payload: torch.Tensor
    scales: torch.Tensor
    ids: list

    def spans(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Part i's payload bytes and its scales (flat fp32) in the batch."""
        s = self.layout.spans[i]
        return (self.payload.narrow(0, s.payload_at, s.payload_bytes),
                self.scales.narrow(0, s.scales_at, s.scale_rows * s.columns))

    def hosts(self, arena: HostArena) -> list:
        """Each part's `host` for `EntryStore.load`: its spans, then the arena."""
        return [_SpanHost(self.spans(i), arena) for i in range(len(self.layout.spans))]

    def fill(self, parts: dict[PartKey, Packed]) -> bool:
        """Complete the batch from the parts read (in part order): bytes a store did not read
        in place are copied there, and the rest of each span (rows past the entry's end in a
        partial last block) is zeroed. False, with nothing changed, when a part is not what the
        batch holds (an entry saved with other codecs): restore part by part then. (Addresses
        are compared, views made only where bytes move: this runs on every restore.)"""
        checked = []
        for p, spec, s in zip(parts.values(), self.unpacker.specs, self.layout.spans, strict=True):
            n, m = p.payload.numel(), p.scales.numel()
            if p.codec != spec or n > s.payload_bytes or m > s.scale_rows * s.columns:
                return False
            checked.append((p, s, n, m))
        payload_at, scales_at = self.payload.data_ptr(), self.scales.data_ptr()
        for p, s, n, m in checked:
            if n < s.payload_bytes or n and p.payload.data_ptr() != payload_at + s.payload_at:
                _place(self.payload.narrow(0, s.payload_at, s.payload_bytes), p.payload)
            values = s.scale_rows * s.columns
            if m < values or m and p.scales.data_ptr() != scales_at + 4 * s.scales_at:
                _place(self.scales.narrow(0, s.scales_at, values), p.scales)
        return True


def _place(span: torch.Tensor, have: torch.Tensor) -> None:
    """`have`'s values at the start of the 1-D `span` (unless they lie there already), zeros
    after them."""
    n = have.numel()
    if n and have.data_ptr() != span.data_ptr():
        span.narrow(0, 0, n).copy_(have.reshape(-1))
    span.narrow(0, n, span.numel() - n).zero_()


class _SpanHost:
    """`host` of one part's load: its payload span at the first call, its scales span at the
    second, when the asked size fits (a partial last block asks for less); anything else comes
    from the arena (and `_Batch.fill` copies it into place)."""

    def __init__(self, spans: tuple[torch.Tensor, torch.Tensor], arena: HostArena) -> None:
        self.spans = [spans[0], spans[1].view(torch.uint8)]
        self.arena = arena

    def __call__(self, nbytes: int) -> torch.Tensor:
        span = self.spans.pop(0) if self.spans else None
        if span is not None and nbytes <= span.numel() and span.data_ptr() % HostArena.ALIGN == 0:
            return span.narrow(0, 0, nbytes)
        return self.arena(nbytes)


def _leading_rows(view: CacheView, fname: str, rows: int) -> CacheView:
    """The same region seen through a page whose field keeps only its first `rows` rows."""
    f = view.page.field(fname)
    sub = Field(f.name, f.dtype, (rows, *f.shape[1:]), f.strides, f.offset, tp_size=f.tp_size,
                tp_rank=f.tp_rank)
    return CacheView(view.region, PageLayout((sub,), view.page.page_bytes), view.name)
