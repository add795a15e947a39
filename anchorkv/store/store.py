"""`Store`: save, look up, load, list, verify and delete entries.

Threading: every method may be called from any thread; `submit` / `load_async` run work on the
store's small I/O pool and return futures, so a serving loop never blocks on disk or network.
`lookup` reads at most one directory listing and one small manifest (cached), and changes
nothing.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import numbers
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, Literal, NamedTuple, TypeVar

import numpy as np
import torch

from anchorkv.codec.layout import Field
from anchorkv.codec.models import LayerKind, ModelLayout
from anchorkv.codec.packed import Packed, dtype_name
from anchorkv.codec.spec import CodecSpec
from anchorkv.store import eviction
from anchorkv.store.backends import Backend, LocalBackend, open_backend
from anchorkv.store.commit import commit_staged
from anchorkv.store.errors import (
    CorruptEntry,
    EntryNotFound,
    FingerprintMismatch,
    OtherFormat,
    StoreError,
    StoreUnavailable,
    explain,
)
from anchorkv.store.format import (
    CRC32C_LIB,
    FORMAT_VERSION,
    GIL_FREE_CRC32C,
    ArrayLayout,
    Encoded,
    PluginChunkEncoding,
    QuantChunkEncoding,
    array_layouts,
    zero_chunk,
)
from anchorkv.store.keys import (
    HEX64,
    TOKEN_BLOCK,
    PrefixHasher,
    anchor_key,
    check_key,
    normalize_anchor,
    token_key,
)
from anchorkv.store.manifest import (
    EntryInfo,
    Listing,
    array_json,
    arrays_to_manifest,
    entry_name,
    group_json,
    now,
    numcodecs_compressor,
    parse_entry_name,
    parse_group,
)
from anchorkv.store.paths import (
    ENTRIES,
    LEASES,
    PROBE,
    STAGING,
    TRASH,
    ZARR_JSON,
    begun_marker,
    entry_path,
    key_path,
    zarr_json,
)
from anchorkv.store.plan import rank_region
from anchorkv.store.reader import (
    ReadPlan,
    bind_reads,
    copy_into,
    read_geometry,
    read_planned,
    rebind_reads,
    verify_shard,
)
from anchorkv.store.settings import cores
from anchorkv.store.writer import EntryWriter

log = logging.getLogger("anchorkv.store")
Mode = Literal["exact", "semantic"]


def chunk_threads(cores: int, crc_lib: str, help_writes: bool = False) -> int:
    """Threads that compute a shard's crc32c while the writing thread writes it; below 2 the
    writing thread computes them itself, before the write. On 2 cores with the help thread
    writing large shards (`HELP_WRITES`, set by hand there) the saving thread computes them: a
    third thread cost more than it gave (`bench_store.py`'s `:help` vs `:help+crc-thread` save
    rows; raw Kimi-Linear saves 19.9 / 20.2 ms against 24.3 / 24.9, plain files 21.0 / 22.1,
    quant 23.1 vs 24.0 against 23.5: `/tmp/p40/ab_help.py`, interleaved, a quiet spell).
    os.writev releases the GIL; fastcrc and the `crc32c` package (`format.GIL_FREE_CRC32C`)
    release it too, so on 2 cores the thread is faster (measured with the `crc32c` package:
    `bench_store.py`'s `crc-thread` / `crc-inline` rows with it, two runs: raw 31.1 / 30.4 vs 38.9 / 38.9 ms a
    Kimi-Linear save, plain files 23.4 / 22.8). google-crc32c holds the GIL for each call, so a
    checksum thread overlaps only the write in flight and, on 2 cores, costs more than it gives
    (raw 41.5 vs 40.6 ms, quant 44.1 vs 30.3 in an earlier run): there the thread is used only
    with more cores."""
    if help_writes and cores <= 2:
        return 1
    if crc_lib in GIL_FREE_CRC32C:
        return 2 if cores >= 2 else 1
    return 2 if cores > 2 else 1


#: Threads that write a save's shards to a local directory at once, each computing its
#: shard's crc32c and then writing it, while the saving thread prepares the next (1: the
#: saving thread writes each shard itself, its checksums on `CHUNK_THREADS`). On this 2-core
#: machine two were no faster: a raw Kimi-Linear save 36-37 vs 27-28 ms in rounds of one kind
#: (`bench_store.py`'s `:put-2` vs `:crc-thread` rows: 42.9 vs 30.2 ms), 30.2 vs 30.9 ms
#: interleaved with other saves, and faster only beside other busy processes (26.3 vs 35.0 ms).
#: On the H200 host of stop 41 (16 cores; `benchmarks/results/nvidia-h200-bd4efa5-store-threads.txt`,
#: 25 rounds interleaved, median ms and ratio to plain files of the same bytes): raw plain
#: 36.9, put threads 1 (help + chunk thread, the default then) 42.0 (0.88x), 2 39.0, 3 32.8, 4
#: 28.9 (1.28x), 6 27.1, 8 28.7; quant plain 37.5, 1
#: 39.0 (0.96x), 2 34.5, 3 31.7, 4 31.8 (1.18x), 6 36.0, 8 36.7; again with the setting made
#: (`-086ba40-threads.txt`, `python -m benchmarks.store_save_threads ... put-N`): raw 3 / 4 / 6
#: at 1.11 / 1.23 / 1.33x, quant 1.12 / 1.13 / 1.10x of plain files. Raw was fastest with 6,
#: quant with 3-4: 4 from 8 cores on, close to the best of both (between 3 and 7 cores
#: unmeasured: 1, with the help thread). Only anchorkv's `LocalBackend` uses it: an object
#: store, or any other backend, writes `write_concurrency` shards at once.
LOCAL_PUT_THREADS = 4 if cores() >= 8 else 1
#: A local save's large shards written by a help thread while the saving thread goes on
#: (`writer.HELP_BYTES`; only with LOCAL_PUT_THREADS 1: put threads write every shard anyway),
#: from 3 cores on. On this 2-vCPU machine a raw Kimi-Linear save's median went from 0.82-0.85x
#: of plain files to 1.04-1.10x in quiet spells (`/tmp/p40/ab_help.py`, interleaved), but a
#: quarter to two fifths of the rounds stalled: the help thread's 8.8 MB write took 16-20 ms
#: instead of 1.6 while the saving thread's ran at full speed (`/tmp/p40/trace.py`), so over
#: 40 rounds the mean was worse (31.5 vs 27.6 ms; `python -m benchmarks.store_save_threads`):
#: two busy threads on two shared vCPUs. `gpu_validate`'s store step runs the `:help` rows on
#: its 16-core host.
HELP_WRITES = cores() > 2

#: `chunk_threads` of this machine and crc32c library.
CHUNK_THREADS = chunk_threads(cores(), CRC32C_LIB, HELP_WRITES)


def _check_slice(start_token: object, num_blocks: object) -> None:
    """`Store.load`'s `start_token` and `num_blocks` are whole numbers >= 0 (num_blocks: or None)."""
    for name, value in (("start_token", start_token), ("num_blocks", num_blocks)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0):
            raise ValueError(f"{name} must be a whole number >= 0, found {value!r}")


def _check_args(capacity_bytes: object, io_threads: object) -> None:
    """`Store`'s arguments, checked where given (they failed later: a TypeError at the first
    eviction, every entry evicted, no I/O thread at the first task)."""
    if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int)
                                       or capacity_bytes < 0):
        raise ValueError(f"capacity_bytes must be a whole number of bytes >= 0 or None (no bound), found "
                         f"{capacity_bytes!r}; for a size such as '200GB' use anchorkv.store.settings.parse_size")
    if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
        raise ValueError(f"io_threads must be a whole number >= 1, found {io_threads!r}")


class Store:
    """A capacity-bounded cache of entries in a local directory or an S3-compatible bucket."""

    def __init__(self, backend: Backend, *, capacity_bytes: int | None = None, io_threads: int = 4) -> None:
        _check_args(capacity_bytes, io_threads)
        self.backend = backend
        self.capacity_bytes = capacity_bytes
        self._io_threads = io_threads
        #: thread pools by name ("io", "chunk", "put", "help"), each made at its first task (`_executor`)
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._lock = threading.Lock()
        self._helping: Future | None = None  # the help thread's write in flight (`_help_submit`)
        # what this process learned of entries, bounded: a serving process looks up, saves and
        # loads entries for as long as it runs (a manifest costs ~240 KiB of memory for a
        # Kimi-Linear entry); what drops out is read again when needed
        self._infos: _Recent[str, EntryInfo] = _Recent(CACHED_MANIFESTS)
        #: entry id -> the backend's `stamp` of its manifest when it was read (see `_cached`);
        #: set and read together with `_infos` under `_cache_lock`, so no thread pairs one
        #: write's manifest with another's stamp
        self._stamps: _Recent[str, object] = _Recent(CACHED_MANIFESTS)
        self._cache_lock = threading.Lock()
        # arrays and layout checks are kept with the manifest object they came from: an entry
        # re-read (its manifest dropped out, the id written again by another process meanwhile)
        # is never decoded with the arrays or checks of the one before
        self._arrays: _Recent[str, tuple[EntryInfo, dict[str, ArrayLayout]]] = _Recent(CACHED_MANIFESTS)
        self._fingerprints: dict[int, tuple[Any, str]] = {}
        self._checked: _Recent[tuple, EntryInfo] = _Recent(8 * CACHED_MANIFESTS)
        #: plans of loads (`_load_plan`), with the manifest and layout objects each came from
        self._plans: _Recent[tuple, tuple[EntryInfo, ModelLayout, _LoadPlan]] = _Recent(READ_PLANS)
        self._warned: set[str] = set()
        self.pins = eviction.Pins()
        self._touched: _Recent[str, float] = _Recent(8 * CACHED_MANIFESTS)
        self._reading: dict[str, Future] = {}  # `get`'s: entry id -> the manifest read in flight
        #: (stored bytes, created) of every ok entry the last scan found: eviction's scan after
        #: each save needs no manifest again (~200 bytes an entry)
        self._sizes: dict[str, tuple[int, float]] = {}
        #: the bytes this process believes the store holds: the last scan's total, plus its own
        #: commits since, minus its own deletes (None: no scan yet), and when that scan ran
        #: (`time.monotonic`). A commit scans to evict only when this reaches the capacity or
        #: the scan is older than `eviction.RESCAN_AFTER` (other processes' saves): a scan
        #: lists every key, one round trip each on an object store
        self._usage: int | None = None
        self._scanned_at = 0.0
        self._usage_lock = threading.Lock()
        self._warned_semantic = False

    @classmethod
    def open(cls, url: str | os.PathLike, *, capacity_bytes: int | None = None, io_threads: int = 4,
             create: bool = True, **options: Any) -> Store:
        """Open the store at a local path or ``s3://bucket/prefix``.

        create=True (what a writer needs): create it if needed and check that it is writable
        (`check_writable`), so a read-only or unreachable store fails here, not at every save.
        create=False (read-only tools): write nothing; `StoreUnavailable` if there is no store.
        Every failure is a `StoreUnavailable` whose message says what to do.
        """
        text = os.fspath(url)
        _check_args(capacity_bytes, io_threads)  # (a ValueError of its own, not the backend's)
        try:
            store = cls(open_backend(text, **options), capacity_bytes=capacity_bytes, io_threads=io_threads)
            if not create:
                store.backend.check_store()
                store._check_root(create)
                return store
            store.backend.ensure_root()
            store._check_root(create)
            for path in (ZARR_JSON, zarr_json(ENTRIES)):
                if not store.backend.exists(path):
                    attrs = {"anchorkv": {"format_version": FORMAT_VERSION}} if path == ZARR_JSON else {}
                    store.backend.write(path, [group_json(attrs)], atomic=True)
            store.check_writable()
        except StoreError:
            raise
        except Exception as e:
            raise StoreUnavailable(explain(e, text)) from None
        return store

    def _check_root(self, create: bool) -> None:
        """`StoreUnavailable` where the path is not an anchorkv store and must not become one: its
        zarr.json is another Zarr hierarchy's (no ``anchorkv`` attribute), or (`create`, a local
        directory without a zarr.json) it holds files of its own: a mistyped path (a home
        directory, ``""`` for the current one) was made a store, and gc then emptied a ``.trash``
        folder there. A root zarr.json that does not parse is tolerated (the store's entries are
        what matter)."""
        try:
            raw = self.backend.read(ZARR_JSON)
        except FileNotFoundError:
            raw = None
        except OSError:  # (unreadable: the writability probe or the reads that follow say why)
            return
        if raw is not None:
            try:
                root = json.loads(raw)
            except ValueError:
                return
            attrs = root.get("attributes") if isinstance(root, dict) else None
            ours = isinstance(attrs, dict) and "anchorkv" in attrs
            if isinstance(root, dict) and "zarr_format" in root and not ours:
                raise StoreUnavailable(f"{self.url} is a Zarr store but not an anchorkv one (its zarr.json has no "
                                       "'anchorkv' attribute); pass another directory or prefix (--store / 'store')")
            return
        if create and isinstance(self.backend, LocalBackend):
            # zarr.json: another process created the store between the read above and this listing;
            # sha256: the connector's weight-hash cache, which shares the default store's directory
            own = {ZARR_JSON, ENTRIES, STAGING, LEASES, TRASH, "lost+found", "sha256"}
            # (another process creating the store at once: its probe, its zarr.json's temporary file)
            other = sorted(n for n in os.listdir(self.backend.root)
                           if n not in own and not n.startswith((PROBE, f".{ZARR_JSON}.")))
            if other:
                shown = ", ".join(other[:3]) + (f" and {len(other) - 3} more" if len(other) > 3 else "")
                raise StoreUnavailable(f"{self.url} is not an anchorkv store and holds other files ({shown}); pass "
                                       "an empty or new directory for the store (--store / 'store')")

    def check_writable(self) -> None:
        """Write and delete a small probe object: `StoreUnavailable` (saying why and what to do)
        if the store is read-only, unwritable or unreachable."""
        probe = f"{PROBE}{uuid.uuid4().hex}"
        try:
            self.backend.write(probe, [b"anchorkv write probe"])
            self.backend.delete(probe)
        except Exception as e:
            raise StoreUnavailable(f"cannot write to the store: {explain(e, self.url)}") from None

    @property
    def url(self) -> str:
        return self.backend.url

    def __repr__(self) -> str:
        return f"Store({self.url!r}, capacity_bytes={self.capacity_bytes})"

    # ------------------------------------------------------------------ keys
    def _fingerprint(self, layout: ModelLayout) -> str:
        hit = self._fingerprints.get(id(layout))
        if hit is None or hit[0] is not layout:
            hit = (layout, layout.fingerprint_hash())
            self._fingerprints[id(layout)] = hit
        return hit[1]

    @staticmethod
    def key_for(fingerprint_hash: str, *, anchor: str | None = None, tokens: Sequence[int] | np.ndarray | None = None,
                scope: str | None = None) -> str:
        """The key of an anchor (or, without one, of the prompt's first token block), within
        `scope` (an opaque isolation scope, e.g. a digest of a tenant's salt; None: unscoped)."""
        if anchor is not None:
            return anchor_key(anchor, fingerprint_hash, scope)
        if tokens is None:
            raise ValueError("a key needs an anchor or the prompt's tokens")
        return token_key(tokens, fingerprint_hash, scope)

    def entry_id_for(self, fingerprint_hash: str, tokens: Sequence[int] | np.ndarray, num_tokens: int, *,
                     anchor: str | None = None, scope: str | None = None) -> str:
        """The id `begin_entry` gives the entry of the first `num_tokens` of `tokens` (under
        `anchor` and `scope`), for a model of `fingerprint_hash`."""
        hasher = PrefixHasher(tokens, fingerprint_hash, scope)
        norm = None if anchor is None else normalize_anchor(anchor)
        key = self.key_for(fingerprint_hash, anchor=norm, tokens=hasher.tokens[:num_tokens], scope=scope)
        return f"{key}/{entry_name(num_tokens, hasher.hash(num_tokens))}"

    # ------------------------------------------------------------------ writing
    def begin_entry(self, layout: ModelLayout, codecs: Mapping[str, CodecSpec | str],
                    tokens: Sequence[int] | np.ndarray, *,
                    num_tokens: int | None = None, anchor: str | None = None, write_id: str | None = None,
                    compressor: dict[str, Any] | None = None, scope: str | None = None,
                    window_align: int = 1) -> EntryWriter:
        """Start writing this rank's part of the entry for the first `num_tokens` of `tokens`.

        layout: this rank's `ModelLayout` (its tp_size/tp_rank say which slice it writes);
        codecs: per field name (``{"conv": "raw", "recurrent": "int8:128", "latent":
        "fp8:whole"}``); tokens: the prompt's token ids (hashed, never stored); anchor: the
        anchor or None for a token-keyed entry; write_id: the same string on every rank of one
        save (default: a fresh one, enough when tp_size == 1); compressor: an optional lossless
        stage, ``{"id": "zstd", "level": 3}``; scope: an isolation scope folded into the key and
        prefix hash (never stored in clear; a lookup must pass the same scope to see the entry);
        window_align: a sliding-window field keeps rows from a multiple of this (whole blocks of
        an engine whose in-block token order is opaque) at or before its window's first token.
        """
        fp = self._fingerprint(layout)
        hasher = PrefixHasher(tokens, fp, scope)
        n = len(hasher) if num_tokens is None else int(num_tokens)
        if not 0 < n <= len(hasher):
            raise ValueError(f"num_tokens {n} must lie in [1, {len(hasher)}] (the tokens given)")
        if anchor is None and n < TOKEN_BLOCK:
            raise ValueError(f"an entry without an anchor needs >= {TOKEN_BLOCK} tokens, found {n}")
        norm = None if anchor is None else normalize_anchor(anchor)
        key = self.key_for(fp, anchor=norm, tokens=hasher.tokens[:n], scope=scope)
        phash = hasher.hash(n)
        numcodecs_compressor(compressor)  # validates
        arrays = array_layouts(layout, dict(codecs), n, window_align=window_align)
        for a in arrays.values():
            a.rank_range(layout.tp_size, layout.tp_rank)  # the rank's slice must be whole chunks
        wid = write_id or uuid.uuid4().hex
        if not re.fullmatch(r"[0-9a-z]{1,64}", wid):  # ASCII only: str.isalnum() takes 'é' and '٣'
            raise ValueError(f"write_id must be 1-64 ASCII lowercase letters or digits (a-z, 0-9), found {write_id!r}")
        manifest_arrays, manifest_codecs = arrays_to_manifest(arrays)
        header: dict[str, Any] = {
            "format_version": FORMAT_VERSION, "anchor": norm, "key": key,
            "name": entry_name(n, phash), "num_tokens": n, "prefix_hash": phash,
            "model_fingerprint": layout.fingerprint(), "fingerprint_hash": fp,
            "layout_fingerprint": layout.layout_fingerprint(), "tp_size": layout.tp_size,
            "arrays": manifest_arrays, "codecs": manifest_codecs, "compressor": compressor,
            "write_id": wid, "created": now(),
        }
        if all(layer.kind is LayerKind.PAGED and layer.window is None for layer in layout.layers):
            # no recurrent state nor sliding window: the state after any k tokens is the
            # entry's first k rows, so a prompt that shares only the first whole 256-token
            # blocks can restore them (`match`)
            header["boundary_hashes"] = hasher.boundaries(n)
        writer = EntryWriter(self.backend, layout, header, arrays, chunk_submit=self._chunk_submit,
                             on_commit=self._after_commit,
                             put_submit=self._put_submit if self._put_threads() > 1 else None,
                             help_submit=self._help_submit if HELP_WRITES else None)
        self.backend.write(begun_marker(wid, layout.tp_rank), [json.dumps({"data": writer.data}).encode()])
        return writer

    def commit_staged(self, write_id: str, replace: str | None = None) -> EntryInfo:
        """Commit a write whose ranks all called `finish_rank` (e.g. from the scheduler);
        `replace`: publish over the entry of the same tokens if it is that write (a version: a
        load found its data damaged)."""
        return commit_staged(self.backend, write_id, self._after_commit, replace)

    def save(self, layout: ModelLayout, codecs: Mapping[str, CodecSpec | str], tokens: Sequence[int] | np.ndarray,
             packed: Mapping[tuple[str, str], Packed], **kwargs: Any) -> EntryInfo:
        """Write and commit a whole entry from one process (tp_size 1, or tests)."""
        writer = self.begin_entry(layout, codecs, tokens, **kwargs)
        try:
            for (layer, field), p in packed.items():
                writer.write_layer(layer, field, p)
            return writer.commit()
        except BaseException:
            try:
                writer.abort()
            except Exception as cleanup:  # never hide why the save failed; gc removes the rest
                log.warning("anchorkv: cleaning up the failed save %s failed too: %s", writer.write_id, cleanup)
            raise

    def _after_commit(self, info: EntryInfo) -> None:
        """A commit published `info` (the writers' and `commit_staged`'s `on_commit`): cache it
        and, if the store may be over its capacity (`_may_be_over`), evict down to it, keeping it."""
        self._remember(info, self.backend.stamp(zarr_json(entry_path(info.id))))
        with self._usage_lock:
            before = self._sizes.get(info.id)
            self._sizes[info.id] = (info.stored_bytes, info.created)
            if self._usage is not None:
                self._usage += info.stored_bytes - (before[0] if before else 0)
        if self.capacity_bytes is not None and self._may_be_over(self.capacity_bytes):
            eviction.evict(self, self.capacity_bytes, keep={info.id})

    def _may_be_over(self, capacity: int) -> bool:
        """Whether a commit must scan the store to evict: no scan yet, this process's estimate
        (`_usage`) over `capacity`, or the last scan older than `eviction.RESCAN_AFTER` (so other
        processes' saves count within that long). Far below the capacity a save lists nothing
        (found by review: a scan per save cost 2.4 s on S3 with 300 anchors)."""
        with self._usage_lock:
            return (self._usage is None or self._usage > capacity
                    or time.monotonic() - self._scanned_at > eviction.RESCAN_AFTER)

    # ------------------------------------------------------------------ lookup
    def lookup(self, *, fingerprint_hash: str, tokens: Sequence[int] | np.ndarray | None = None,
               anchor: str | None = None, mode: Mode = "exact", max_tokens: int | None = None,
               multiple_of: int = 1, scope: str | None = None,
               why: list[str] | None = None) -> EntryInfo | None:
        """The best committed entry for a request, or None (`match` without shared prefixes)."""
        found = self.match(fingerprint_hash=fingerprint_hash, tokens=tokens, anchor=anchor, mode=mode,
                           max_tokens=max_tokens, multiple_of=multiple_of, scope=scope, why=why)
        return None if found is None else found.info

    def match(self, *, fingerprint_hash: str, tokens: Sequence[int] | np.ndarray | None = None,
              anchor: str | None = None, mode: Mode = "exact", max_tokens: int | None = None,
              multiple_of: int = 1, scope: str | None = None, shared: bool = False,
              exclude: Collection[str] = (), why: list[str] | None = None) -> Match | None:
        """The best committed entry for a request and the tokens of it the request can use, or
        None. No side effects.

        exact (default): the longest entry under the key whose prefix hash equals the hash of
        the same number of the request's tokens. semantic (opt-in, needs an anchor): the
        longest entry of the anchor whatever its tokens; LOSSY, the anchor is trusted to
        summarize the context. Either way only entries of at most `max_tokens` tokens (default:
        no bound) and a multiple of `multiple_of` count (a caller that can restore only some
        boundaries, e.g. block-aligned ones, gets the longest it can use). `scope`: only
        entries written with the same scope (see `begin_entry`); others live under other keys,
        so they are neither listed nor read. `why`, if given, gets one reason appended when
        nothing is found: ``"no_entry"`` (nothing under the key), ``"prefix_mismatch"`` (the
        key's entries hold other tokens: an anchor's conversation that was edited) or
        ``"too_long"`` (its entries are longer than `max_tokens` or off `multiple_of`).

        `shared` (exact mode): an entry that records its boundary hashes (a model without
        recurrent state) also counts for the first k x 256 tokens it shares with the request
        (k x 256 <= `max_tokens`, floored to `multiple_of`), when that is more than the longest
        whole match gives: a prompt sharing a system prompt or the start of an edited
        conversation with a saved one. Manifests not read before are read for it, at most
        `SHARED_READS` a lookup (the longest candidates first); one that cannot be read (a store
        error) is passed over. `exclude`: entry ids never to return (e.g. ones that failed to
        load, or need a codec plug-in this host lacks).
        """
        if mode not in ("exact", "semantic"):
            raise ValueError(f"mode must be 'exact' or 'semantic', found {mode!r}")
        if multiple_of <= 0:
            raise ValueError(f"multiple_of must be positive, found {multiple_of}")
        if mode == "semantic":
            if anchor is None:
                raise ValueError("semantic lookup needs an anchor")
            if not self._warned_semantic:
                log.warning("semantic lookup: entries are reused for other prompts with the same anchor (lossy)")
                self._warned_semantic = True
        hasher = None
        if tokens is not None:
            hasher = PrefixHasher(tokens, fingerprint_hash, scope)
        elif mode == "exact":
            raise ValueError("exact lookup needs the request's tokens")
        exact = hasher if mode == "exact" else None  # never None in exact mode (raised above)
        key_tokens = None
        if anchor is None:  # exact mode (semantic lookups need an anchor): the tokens were hashed
            assert hasher is not None
            if len(hasher) < TOKEN_BLOCK:
                return None
            key_tokens = hasher.tokens
        key = self.key_for(fingerprint_hash, anchor=anchor, tokens=key_tokens, scope=scope)
        names = [(parse_entry_name(n), n) for n in self.backend.list_dir(key_path(key))]
        cands = sorted((_Candidate(p.num_tokens, p.hash16, n) for p, n in names
                        if p and f"{key}/{n}" not in exclude), key=lambda c: -c.num_tokens)
        reason = "no_entry"
        for n, h16, name in cands:
            if (max_tokens is not None and n > max_tokens) or n % multiple_of:
                reason = "too_long" if reason == "no_entry" else reason
                continue
            if exact is not None and (n > len(exact) or exact.hash(n)[:16] != h16):
                reason = "prefix_mismatch"
                continue
            info = self._try_info(f"{key}/{name}")
            if info is None or info.fingerprint_hash != fingerprint_hash:
                continue
            if exact is not None and info.prefix_hash != exact.hash(n):
                reason = "prefix_mismatch"
                continue
            same = [self._try_info(f"{key}/{c.name}") for c in cands
                    if c.num_tokens == n and c.hash16 == h16 and c.name != name]
            best = Match(min([info, *[s for s in same if s is not None]], key=lambda e: (e.created, e.id)), n)
            break
        else:
            best = None
        if shared and exact is not None:
            best = self._shared_match(key, cands, exact, fingerprint_hash, max_tokens, multiple_of, best)
        if best is None and why is not None:
            why.append(reason)
        return best

    def _shared_match(self, key: str, cands: list[_Candidate], exact: PrefixHasher, fingerprint_hash: str,
                      max_tokens: int | None, multiple_of: int, best: Match | None) -> Match | None:
        """`best`, or an entry whose first whole 256-token blocks the request shares if that
        gives more tokens (see `match`)."""
        limit = len(exact) if max_tokens is None else min(max_tokens, len(exact))

        def blocks(c: _Candidate) -> int:  # the most whole 256-token blocks it could share
            return min(c.num_tokens, limit) // TOKEN_BLOCK

        def beats(k: int) -> bool:  # k shared blocks restore more than `best`
            return k * TOKEN_BLOCK // multiple_of * multiple_of > (0 if best is None else best.tokens)

        # the manifests not read before, longest first, at most SHARED_READS: read at once from an
        # object store (a round trip each), in turn from a local one
        known: dict[str, EntryInfo | None] = {}  # the cached ones, taken now (reads may push them out)
        new: list[str] = []
        for c in cands:
            entry_id = f"{key}/{c.name}"
            if beats(blocks(c)):
                known[entry_id] = self._cached(entry_id)
                if known[entry_id] is None and len(new) < SHARED_READS:
                    new.append(entry_id)
        if len(new) > 1 and self.backend.write_concurrency > 1:
            known.update(zip(new, self._executor("manifest", SHARED_READS).map(self._shared_info, new), strict=True))
        else:
            known.update((entry_id, self._shared_info(entry_id)) for entry_id in new)
        mine: list[str] | None = None  # the request's own boundary hashes, made when first needed
        for c in cands:  # longest first
            top = blocks(c)
            if not beats(top):
                continue
            info = known.get(f"{key}/{c.name}")
            if info is None or info.fingerprint_hash != fingerprint_hash:
                continue
            hashes = info.manifest.get("boundary_hashes")
            if not hashes:
                continue
            if mine is None:
                mine = exact.boundaries(limit)
            k = next((k for k in range(min(top, len(hashes)), 0, -1) if hashes[k - 1] == mine[k - 1]), 0)
            if beats(k):
                best = Match(info, k * TOKEN_BLOCK // multiple_of * multiple_of)
        return best

    def _shared_info(self, entry_id: str) -> EntryInfo | None:
        """`_try_info` for a shared match's extra candidates: a store error reading one passes it
        over (the lookup keeps what it found), never fails the lookup."""
        try:
            return self._try_info(entry_id)
        except Exception as e:
            log.debug("anchorkv: could not read the manifest of %s for a shared match (%s)", entry_id, e)
            return None

    def _try_info(self, entry_id: str) -> EntryInfo | None:
        """The entry, or None if it is gone or unusable (a damaged one is logged once)."""
        try:
            return self.get(entry_id)
        except EntryNotFound:
            return None
        except CorruptEntry as e:
            if entry_id not in self._warned:
                self._warned.add(entry_id)
                log.warning("anchorkv: skipping an unusable entry (recompute): %s", e)
            return None

    def get(self, entry: EntryInfo | str) -> EntryInfo:
        """The `EntryInfo` of an entry id (cached while its manifest file is unchanged: another
        process may delete an entry and write the same id again; see `_cached`)."""
        if isinstance(entry, EntryInfo):
            return entry
        info = self._cached(entry)
        if info is not None:
            return info
        key, _, name = entry.partition("/")
        check_key(key)
        if parse_entry_name(name) is None:
            raise EntryNotFound(f"{entry!r} is not an entry id ('<64 hex key>/t<tokens>-<hash>')")
        # one thread reads a manifest, the others asking for it at once (a restore's parts,
        # read on several threads) wait for its outcome, not read and check it again; other entries'
        # manifests are read meanwhile (an object store's round trips overlap); a read that
        # fails fails them all at once (found by review: each waiter read again in turn, k
        # waiters on a timing-out object store k timeouts)
        with self._cache_lock:
            pending = self._reading.get(entry)
            if pending is None:
                self._reading[entry] = mine = Future[EntryInfo]()
        if pending is not None:
            return pending.result()
        try:
            info = self._read_manifest(entry)
        except BaseException as e:
            mine.set_exception(e)
            raise
        else:
            mine.set_result(info)
            return info
        finally:
            with self._cache_lock:
                del self._reading[entry]

    def _read_manifest(self, entry: str) -> EntryInfo:
        """`get`'s read and check of an entry's manifest (then cached)."""
        path = zarr_json(entry_path(entry))
        stamp = self.backend.stamp(path)  # before the read: a replace between them reads it again next time
        try:
            data = self.backend.read(path)
        except FileNotFoundError:
            raise EntryNotFound(f"entry {entry} does not exist in {self.url} "
                                f"(deleted, evicted or never committed)") from None
        info = parse_group(entry, data)
        self._remember(info, stamp)
        return info

    def _remember(self, info: EntryInfo, stamp: object) -> None:
        """Cache a manifest with the stamp its file had before it was read; not one whose file
        was missing then (committed between the stat and the read: a later deletion would
        stamp alike)."""
        if stamp == ():
            return
        with self._cache_lock:
            self._infos[info.id] = info
            self._stamps[info.id] = stamp

    def _cached(self, entry_id: str) -> EntryInfo | None:
        """The cached manifest of an entry, if it is still the one in the store: on a local
        store another process may have deleted the entry and written the same id again (one
        `stat`, `Backend.stamp`); an object store's ids are unique per write."""
        with self._cache_lock:
            info = self._infos.get(entry_id)
            recorded = self._stamps.get(entry_id, _UNKNOWN)
        if info is None:
            return None
        stamp = self.backend.stamp(zarr_json(entry_path(entry_id)))
        if stamp is None or stamp == recorded:
            return info
        with self._cache_lock:
            self._infos.pop_if(entry_id, info)
        return None

    def forget(self, entry_id: str) -> None:
        """Drop what this process caches of an entry's manifest (the next `get` reads it again):
        for a caller that learned it is stale (a load of it failed; `EntryInfo.version`)."""
        self._infos.pop(entry_id)

    def scan(self, *, sizes_only: bool = False) -> list[Listing]:
        """Every entry in the store, whatever its state (`Listing.state`): ``ok``, ``damaged``
        (its manifest is missing, cut or inconsistent), ``old-format`` / ``newer-format`` (another
        format version), ``unreadable`` (its manifest could not be read by this process: another
        user's, an I/O error; never judged damaged, so gc keeps it). Entries not ``ok`` are never
        loaded, but they are listed, counted toward usage and capacity, and removable. Newest first.

        `sizes_only` (eviction, usage): an ``ok`` entry whose manifest this process has read
        before comes without it (`Listing.info` None; its size and creation time from memory),
        so a scan after every save does not read again the manifests that fell out of the
        bounded cache."""
        out = []
        seen: dict[str, tuple[int, float]] = {}
        for key in self.backend.list_dir(ENTRIES):
            if not HEX64.match(key):
                continue
            try:
                names = self.backend.list_dir(key_path(key))
            except OSError as e:  # e.g. another user's key directory: list the rest of the store
                log.warning("anchorkv: cannot list the entries of key %s in %s (%s); they are not counted",
                            key, self.url, e)
                continue
            for name in names:
                parsed = parse_entry_name(name)
                if not parsed:
                    continue
                entry_id = f"{key}/{name}"
                known = self._sizes.get(entry_id) if sizes_only else None
                if known is not None:
                    seen[entry_id] = known
                    out.append(Listing(entry_id, "ok", None, size=known[0], mtime=known[1]))
                    continue
                try:
                    info = self.get(entry_id)
                    seen[entry_id] = (info.stored_bytes, info.created)
                    out.append(Listing(entry_id, "ok", info))
                except EntryNotFound:
                    if not self.backend.atomic_publish:
                        continue  # an object prefix without a manifest: a write in progress (gc: orphan)
                    out.append(self._broken(entry_id, "damaged", "its zarr.json (the manifest) is missing"))
                except OtherFormat as e:
                    newer = isinstance(e.version, int) and e.version > FORMAT_VERSION
                    out.append(self._broken(entry_id, "newer-format" if newer else "old-format", str(e)))
                except CorruptEntry as e:
                    out.append(self._broken(entry_id, "damaged", str(e)))
                except (IsADirectoryError, NotADirectoryError) as e:  # its zarr.json a directory, its name a
                    # file: no write of anchorkv's (found by review: one such entry made every ls, verify, gc
                    # and save raise)
                    out.append(self._broken(entry_id, "damaged", f"its zarr.json (the manifest) cannot be read: "
                                            f"{type(e).__name__}: {e.strerror or e}"))
                except OSError as e:  # another user's, an I/O error, no file handles left: nothing known of
                    # its bytes, so it is listed and kept (gc and eviction's damaged-first pass never take it)
                    out.append(self._broken(entry_id, "unreadable", f"its zarr.json (the manifest) cannot be read "
                                            f"here: {type(e).__name__}: {e.strerror or e}; check its permissions "
                                            "or the disk (it is kept: gc removes only entries it can judge)"))
        with self._usage_lock:
            self._sizes = seen  # (entries gone from the store drop out)
            self._usage = sum(e.stored_bytes for e in out)
            self._scanned_at = time.monotonic()
        return sorted(out, key=lambda e: -e.created)

    def _broken(self, entry_id: str, state: str, problem: str) -> Listing:
        """The listing of an entry that cannot be loaded. Its size and time are what can be
        read of it: an unreadable one (another user's) counts 0 bytes rather than failing the
        scan that lists it."""
        path = entry_path(entry_id)
        problem = problem.removeprefix(f"entry {entry_id}: ")
        created = 0.0
        for p in (zarr_json(path), path):
            with contextlib.suppress(OSError):
                created = self.backend.mtime(p) or 0.0
            if created:
                break
        try:
            size = self.backend.tree_size(path)
        except OSError:
            size = 0
        return Listing(entry_id, state, None, problem, size, created)

    def list(self) -> list[EntryInfo]:
        """Every loadable (``ok``) entry, newest first; `scan` lists the others too."""
        return [e.info for e in self.scan() if e.info is not None]

    # ------------------------------------------------------------------ loading
    def check_fingerprint(self, entry: EntryInfo, layout: ModelLayout) -> None:
        fp = self._fingerprint(layout)
        if entry.fingerprint_hash != fp:
            written = entry.manifest["model_fingerprint"]
            if written.get("weights") != layout.weights:
                differs = (f"the model's weights differ (content {written.get('weights')!r} vs "
                           f"{layout.weights!r})")
            elif written.get("model") != layout.model:
                differs = "the model's weights differ (model_id)"
            elif written.get("model_config") != layout.model_config:
                differs = "the model's config, dtype or quantization differ"
            else:
                differs = "layers, field shapes or dtypes differ"
            raise FingerprintMismatch(
                f"entry {entry.id} was written for model fingerprint {entry.fingerprint_hash[:16]} "
                f"({written['architecture']}, model {written.get('model')!r}), the reader's layout is "
                f"{fp[:16]} ({layout.architecture}, model {layout.model!r}); {differs}, so it "
                "cannot be restored: recompute"
            )

    def load(self, entry: EntryInfo | str, layout: ModelLayout, layer: str, field: str, *, start_token: int = 0,
             num_blocks: int | None = None, host: Callable[[int], torch.Tensor] | None = None) -> Packed:
        """This rank's slice of `field` of `layer`, as a host `Packed` ready for `unpack`.

        `host(nbytes)` gives the host memory the payload and the scales are read into (a 1-D
        uint8 CPU tensor of `nbytes` at a 16-byte aligned address; `codec.HostArena`: one
        page-locked buffer for a whole restore, which crosses to the GPU as it is); default:
        new pageable tensors.

        State fields: `[1, *rank shape]` at the reader's tp (any tp dividing the chunk count).
        Paged fields: `[num_blocks, block_size, *row]` of tokens from `start_token` (default:
        enough blocks for the stored tokens); rows past the stored tokens hold the encoding of
        zeros, so the caller restores only the first `num_tokens - start_token` rows' worth.
        Raises `EntryNotFound`, `FingerprintMismatch`, `CorruptEntry` (checksum, size).

        A load of an entry given by id that fails its checks forgets the entry's manifest, so
        the next `get` reads it again: the cache's stamp check (`_cached`) cannot see every
        change (an object store's deleted entry; a filesystem with coarse timestamps). The
        failed load is not retried with a new manifest: the other fields of the same restore may
        have been read from the old write (a restore is one write or a failure, never two mixed).
        """
        _check_slice(start_token, num_blocks)
        info = self.get(entry)
        with self._forgotten_if_corrupt(entry, info):
            return self._load(info, layout, layer, field, start_token, num_blocks, host)

    def prepare(self, entry: EntryInfo | str, layout: ModelLayout,
                loads: Iterable[tuple[str, str, int, int | None]]) -> EntryInfo:
        """Read the entry's manifest and make the read plans of `loads` (each `(layer, field,
        start_token, num_blocks)` as `load` takes them) here, on the calling thread, so that
        those loads, made next on several threads (a restore's parts), only read. Made on the
        reading threads, the plans (pure Python) and the manifest's parse held Python's lock
        against the reads' returns: a first restore of an entry cost ~5 ms more than a repeat
        one on 2 threads, ~3 ms of it on one (benchmarks/README, "Stop 48"). Raises what the
        loads would raise for their plans (and forgets the manifest alike); reads no chunk."""
        loads = list(loads)
        for _, _, start_token, num_blocks in loads:
            _check_slice(start_token, num_blocks)
        info = self.get(entry)
        with self._forgotten_if_corrupt(entry, info):
            for layer, field, start_token, num_blocks in loads:
                self._load_plan(info, layout, layer, field, start_token, num_blocks)
        return info

    @contextlib.contextmanager
    def _forgotten_if_corrupt(self, entry: EntryInfo | str, info: EntryInfo) -> Iterator[None]:
        """A `CorruptEntry` raised inside drops `info`, the cached manifest of `entry` when it
        is given by id (`load`'s docstring: why), and goes on."""
        try:
            yield
        except CorruptEntry:
            if not isinstance(entry, EntryInfo):
                self._infos.pop_if(entry, info)
            raise

    def _load(self, info: EntryInfo, layout: ModelLayout, layer: str, field: str, start_token: int,
              num_blocks: int | None, host: Callable[[int], torch.Tensor] | None) -> Packed:
        plan = self._load_plan(info, layout, layer, field, start_token, num_blocks)
        encoding = plan.array.codec
        pn, sn = plan.nbytes
        payload_t = _host_bytes(host, pn)
        scales_t = _host_bytes(host, sn).view(torch.float32) if sn else torch.empty(0, dtype=torch.float32)
        payload, scales = payload_t.numpy(), scales_t.numpy()
        # the output's views: made only where a chunk is copied in through a buffer, zero rows
        # are written or a lead zeroed (most loads read every chunk straight into place)
        out = (_output(encoding, payload, scales, plan.whole, plan.lead)
               if plan.read.scratch or plan.tail is not None or plan.lead else None)
        self.pins.pin(info.id)
        try:
            read_planned(self.backend, info, plan.array, plan.read, out, payload, scales, plan.bases)
            if plan.tail is not None:  # rows past the entry's last chunk: zeros, broadcast over the rows
                assert out is not None
                copy_into(out.region(plan.tail), zero_chunk(encoding, (1, 1, *plan.whole[2:])))
        finally:
            self.pins.unpin(info.id)
        self._touch(info.id)
        cols = encoding.columns
        return Packed(plan.spec, plan.shape, plan.dtype, payload_t,
                      scales_t.view(-1, cols) if cols else torch.empty(0, 0, dtype=torch.float32))

    def _load_plan(self, info: EntryInfo, layout: ModelLayout, layer: str, field: str, start_token: int,
                   num_blocks: int | None) -> _LoadPlan:
        """What a load of a slice of `field` of `layer` derives from the entry's manifest and the
        reader's layout alone, checked (`_make_load_plan`), kept with the manifest object and the
        layout object it came from (as `_arrays`): the loads of the same slice again (a restore
        of the entry again, another request's) reuse it; an entry written again (another
        manifest object) never meets the plan of the write before."""
        key = (info.id, id(layout), layer, field, start_token, num_blocks)
        cached = self._plans.get(key)
        if cached is not None and cached[0] is info and cached[1] is layout:
            return cached[2]
        plan = self._make_load_plan(info, layout, layer, field, start_token, num_blocks)
        self._plans[key] = (info, layout, plan)
        return plan

    def _make_load_plan(self, info: EntryInfo, layout: ModelLayout, layer: str, field: str, start_token: int,
                        num_blocks: int | None) -> _LoadPlan:
        self.check_fingerprint(info, layout)
        array = self._array(info, field)
        lf = layout.layer(layer).page.field(field)
        self._check_array(info, array, layout, lf)
        # what follows depends on the array's geometry and the reader's, not on the entry's
        # checksums: made once for every entry of a model and length (a worker's first restore
        # of an entry reads only its checksums into a plan)
        compressed = bool(info.manifest.get("compressor"))  # (as `numcodecs_compressor` decides; no codec made)
        key = (array, self._fingerprint(layout), layout.tp_size, layout.tp_rank, layout.block_size, layer, field,
               start_token, num_blocks, info.num_tokens, compressed)
        shaped = _SHAPED.get(key)
        if shaped is None:
            shaped = self._shape_load(info, layout, array, lf, layer, field, start_token, num_blocks, compressed)
            _SHAPED[key] = shaped
        geometry, layer_text, plan = shaped
        read = rebind_reads(plan.read, info, compressed) if plan.read.shards else None
        if read is None:  # the first entry of this geometry, or one whose chunks lie otherwise
            read = bind_reads(info, array, geometry, layer_text, compressed)
            if not plan.read.shards:
                _SHAPED[key] = (geometry, layer_text, plan._replace(read=read))
        return plan._replace(read=read)

    def _shape_load(self, info: EntryInfo, layout: ModelLayout, array: ArrayLayout, lf: Field, layer: str,
                    field: str, start_token: int, num_blocks: int | None, compressed: bool) -> _Shaped:
        """`_make_load_plan`'s geometry: what the load reads of the array (`read_geometry`)
        and the plan less its reads."""
        index = array.layer_index(layer)
        if array.kind == "paged" and not 0 <= start_token < info.num_tokens:
            raise ValueError(f"entry {info.id} holds tokens [0, {info.num_tokens}): a load of field {field!r} from "
                             f"token {start_token} reads none of them; load from a token below {info.num_tokens}")
        array.rank_range(layout.tp_size, layout.tp_rank)
        region = rank_region(array, index, layout.tp_size, layout.tp_rank)
        encoding = array.codec
        lead = 0  # a sliding-window field: rows before its first token (zeros, see `_output`)
        if array.kind == "paged":
            bs = layout.block_size
            if num_blocks is None:
                num_blocks = max(0, -(-(info.num_tokens - start_token) // bs))
            stop = start_token + num_blocks * bs
            if array.window is not None and stop < info.num_tokens:
                raise ValueError(f"field {field!r} of entry {info.id} is a sliding window's last rows: it restores "
                                 f"only with the whole entry ({info.num_tokens} tokens), not up to token {stop}")
            lead = max(0, min(array.first, stop) - start_token)
            region[1] = slice(start_token + lead - array.first, stop - array.first)
            shape = (num_blocks, bs, *lf.shape[1:])
        else:
            shape = (1, *lf.shape)
        block = tuple(s.stop - s.start for s in region)
        whole = (block[0], lead + block[1], *block[2:]) if array.kind == "paged" else block
        pn, sn = encoding.nbytes(whole)
        if (pn, sn) != encoding.nbytes(shape):  # never hand out a payload its shape does not describe
            raise CorruptEntry(info.id, f"field {field!r}: the entry's slice {list(whole)} is {pn + sn} bytes, the "
                               f"reader's {list(shape)} needs {sum(encoding.nbytes(shape))}; recompute")
        tail = None
        if array.kind == "paged":
            end = -(-array.shape[1] // array.chunks[1]) * array.chunks[1]
            if region[1].stop > end:
                lo = max(0, end - region[1].start)
                tail = (slice(0, 1), slice(lo, block[1]), *[slice(0, n) for n in block[2:]])
        # the read plan depends on the output's geometry only (offsets from its first byte)
        payload, scales = np.empty(pn, np.uint8), np.empty(sn // 4, np.float32)
        out = _output(encoding, payload, scales, whole, lead, zero=False)
        bases = (out.payload.ctypes.data - payload.ctypes.data, out.scales.ctypes.data - scales.ctypes.data)
        return (*read_geometry(array, region, out, compressed),
                _LoadPlan(array, encoding.spec, lf.dtype, shape, whole, lead, tail, (pn, sn), _NO_READS, bases))

    def _check_array(self, info: EntryInfo, array: ArrayLayout, layout: ModelLayout, lf: Field) -> None:
        """The entry's array agrees with the reader's layout (layers holding the field, logical
        shape, dtype, the axis tp splits), so no byte of one layer or slice lands in another."""
        ok_key = (info.id, array.field, self._fingerprint(layout), lf.shard_axis)
        if self._checked.get(ok_key) is info:
            return
        names = tuple(layer.name for layer in layout.layers if any(f.name == array.field for f in layer.page.fields))
        full = lf.logical_shape
        assert full is not None  # Field.__post_init__ resolves it (default: the field's shape)
        logical = tuple(full[1:]) if array.kind == "paged" else tuple(full)
        axis = None if lf.shard_axis is None else lf.shard_axis + 1
        stored = array.shape[2:] if array.kind == "paged" else array.shape[1:]
        problems = []
        if array.layers != names:
            problems.append(f"its layers {list(array.layers)} are not the reader's {list(names)}")
        if tuple(stored) != logical:
            problems.append(f"its logical shape {list(stored)} is not the reader's {list(logical)}")
        if array.codec.source_dtype != dtype_name(lf.dtype):
            problems.append(f"its dtype {array.codec.source_dtype} is not the reader's {dtype_name(lf.dtype)}")
        if array.shard_axis != axis:
            problems.append(f"it is split along axis {array.shard_axis}, the reader along {axis}")
        if problems:
            raise CorruptEntry(info.id, f"field {array.field!r}: " + "; ".join(problems) + "; recompute")
        self._checked[ok_key] = info

    def load_async(self, *args: Any, **kwargs: Any) -> Future:
        """`load` on the I/O pool: a future of the `Packed`."""
        return self.submit(self.load, *args, **kwargs)

    def _array(self, info: EntryInfo, field: str) -> ArrayLayout:
        cached = self._arrays.get(info.id)
        if cached is not None and cached[0] is info:
            arrays = cached[1]
        else:
            arrays = info.arrays()
            self._arrays[info.id] = (info, arrays)
        try:
            return arrays[field]
        except KeyError:
            raise KeyError(f"entry {info.id} has no field {field!r}; it has {sorted(arrays)}") from None

    def _touch(self, entry_id: str) -> None:
        """Record a use for LRU eviction, at most once a minute per entry and process."""
        t = time.monotonic()
        last = self._touched.get(entry_id)
        if last is None or t - last > 60.0:
            self._touched[entry_id] = t
            self.backend.touch_entry(entry_path(entry_id))

    @contextlib.contextmanager
    def pin(self, entry: EntryInfo | str) -> Iterator[EntryInfo]:
        """Hold a lease on an entry (eviction and gc skip it, across processes) while restoring."""
        info = self.get(entry)
        with self.pins.pinned(info.id), eviction.lease(self, info.id):
            self._touch(info.id)
            yield info

    # ------------------------------------------------------------------ admin
    def delete(self, entry: EntryInfo | str) -> None:
        """Delete an entry, damaged or not (it vanishes atomically: readers see all of it or
        nothing); the key's directory goes too once it holds no entry."""
        entry_id = entry.id if isinstance(entry, EntryInfo) else entry
        key, _, name = entry_id.partition("/")
        if not HEX64.match(key) or parse_entry_name(name) is None:
            raise EntryNotFound(f"{entry_id!r} is not an entry id ('<64 hex key>/t<tokens>-<hash>')")
        path = entry_path(entry_id)
        if not self.backend.exists(zarr_json(path)) and not self.backend.exists(path) \
                and not self.backend.list_dir(path):  # (a local file with an entry's name exists too)
            raise EntryNotFound(f"entry {entry_id} does not exist in {self.url} (deleted, evicted or never committed)")
        self.backend.delete_tree(path)
        self._infos.pop(entry_id, None)
        self._arrays.pop(entry_id, None)
        with self._usage_lock:
            gone = self._sizes.pop(entry_id, None)
            if gone is not None and self._usage is not None:
                self._usage -= gone[0]  # (a damaged one's bytes stay counted until the next scan)
        self._touched.pop(entry_id, None)
        self.backend.remove_empty_dir(key_path(key))

    def verify(self, entry: EntryInfo | str, progress: Callable[[int], None] | None = None) -> builtins.list[str]:
        """Read every shard of an entry and check it; returns the problems found (empty: ok).
        `progress(1)` is called per shard."""
        try:
            info = self.get(entry)
        except (CorruptEntry, EntryNotFound) as e:
            return [str(e)]
        problems = []
        for array in info.arrays().values():
            expected = array_json(array, info.manifest.get("compressor"))
            for part in array.parts:
                try:
                    doc = json.loads(self.backend.read(zarr_json(f"{info.path}/{part.name}")))
                    want = json.loads(expected[part.name])
                    wrong = [k for k in _ARRAY_KEYS if doc.get(k) != want.get(k)]
                    if wrong:
                        problems.append(f"entry {info.id}: array {part.name!r}: its zarr.json disagrees with the "
                                        f"manifest in {wrong} (other Zarr readers would misread it)")
                except FileNotFoundError:
                    problems.append(f"entry {info.id}: array {part.name!r} has no zarr.json")
                except ValueError as e:
                    problems.append(f"entry {info.id}: array {part.name!r}: its zarr.json is not JSON ({e})")
                for shard in array.all_shards():
                    problems += verify_shard(self.backend, info, array, part, shard)
                    if progress:
                        progress(1)
        return problems

    def usage(self) -> int:
        """Bytes of all entries, damaged and other-format ones included."""
        return sum(e.stored_bytes for e in self.scan(sizes_only=True))

    def evict(self, capacity_bytes: int | None = None) -> builtins.list[str]:  # `list` is a method here
        """Delete least-recently-used entries until the store holds <= capacity bytes."""
        cap = self.capacity_bytes if capacity_bytes is None else capacity_bytes
        if cap is None:
            raise ValueError("no capacity: pass capacity_bytes here or to Store.open")
        return eviction.evict(self, cap)

    def gc(self, *, stale_after: float = 3600.0, progress: Callable[[str, int], None] | None = None,
           dry_run: bool = False, verify: bool = False) -> dict:
        """Remove garbage: abandoned writes older than `stale_after` seconds (what a killed save
        left), stale leases, duplicate object-store entries, orphaned object prefixes, leftover
        trash, damaged and old-format entries (never loadable), empty key directories; then
        evict down to the capacity, if one is set. Returns counts per kind, ``freed_bytes`` and
        ``removed`` (kind, what, bytes of each). `dry_run`: remove nothing, report what would go.
        `verify`: also read every shard of each entry whose manifest is fine (`verify`; as long
        as reading the whole store) and remove those that fail as ``damaged``: without it gc
        finds only entries whose manifest is damaged.

        `stale_after` must exceed the longest save in progress: a younger staged write is
        presumed alive and kept (0 removes every unfinished write, alive or not). Errors (e.g.
        a read-only store) propagate.
        """
        return eviction.gc(self, stale_after, progress, dry_run=dry_run, verify=verify)

    # ------------------------------------------------------------------ threads
    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run `fn(*args, **kwargs)` on the store's I/O threads."""
        return self._executor("io", self._io_threads).submit(fn, *args, **kwargs)

    def _executor(self, name: str, threads: int) -> ThreadPoolExecutor:
        """The pool `name` (threads `anchorkv-<name>`), made with `threads` threads at its first use."""
        with self._lock:
            return self._executor_locked(name, threads)

    def _executor_locked(self, name: str, threads: int) -> ThreadPoolExecutor:
        pool = self._pools.get(name)
        if pool is None:
            pool = self._pools[name] = ThreadPoolExecutor(threads, thread_name_prefix=f"anchorkv-{name}")
        return pool

    def _chunk_submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """`fn(*args)` on a chunk thread (not the I/O pool, whose tasks call this); the caller
        must wait for the future. With CHUNK_THREADS < 2 it runs here, at once."""
        if CHUNK_THREADS < 2:
            f: Future = Future()
            try:
                f.set_result(fn(*args))
            except BaseException as e:
                f.set_exception(e)
            return f
        return self._executor("chunk", CHUNK_THREADS).submit(fn, *args)

    def _put_threads(self) -> int:
        """Shard writes of one save in flight at once: the backend's `write_concurrency` (an
        object store's round trips; 1 for any backend that asks for its writes in turn), or for
        anchorkv's own local directory `LOCAL_PUT_THREADS` (copies into the page cache)."""
        if type(self.backend) is LocalBackend:
            return LOCAL_PUT_THREADS
        return self.backend.write_concurrency

    def _put_submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """`fn(*args)` on one of the `_put_threads()` put threads (their tasks submit nothing)."""
        return self._executor("put", self._put_threads()).submit(fn, *args)

    def _help_submit(self, fn: Callable[..., Any], *args: Any) -> Future | None:
        """`fn(*args)` on the help thread if it is idle (no write of any save of this store in
        flight there), else None: the caller writes the shard itself, never waits behind another."""
        with self._lock:
            if self._helping is not None and not self._helping.done():
                return None
            self._helping = future = self._executor_locked("help", 1).submit(fn, *args)
        return future

    def close(self) -> None:
        for name in ("io", "put", "help", "chunk", "manifest"):  # (in order: a task of one may queue work on the next)
            with self._lock:
                pool = self._pools.pop(name, None)
            if pool is not None:
                pool.shutdown(wait=True)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Manifests a `match` with `shared` reads beyond those read before (each is cached).
SHARED_READS = 8
#: Entries whose manifest (and arrays) a `Store` keeps in memory, the most recently used.
CACHED_MANIFESTS = 512
#: Load plans (with their read plans) a `Store` keeps (one per field, layer, slice and reader
#: layout loaded: 47 a Kimi-Linear request at tp=1, ~1 KiB each), the most recently used.
READ_PLANS = 4096

K = TypeVar("K")
V = TypeVar("V")


_UNKNOWN = object()  # no stamp recorded: never equal to one


class _Recent(Generic[K, V]):
    """A map that keeps its `size` most recently used items (thread-safe: the store's pools
    read manifests concurrently)."""

    def __init__(self, size: int) -> None:
        self._items: OrderedDict[K, V] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: K, default: V | None = None) -> V | None:
        with self._lock:
            if key not in self._items:
                return default
            self._items.move_to_end(key)
            return self._items[key]

    def __setitem__(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

    def pop(self, key: K, default: V | None = None) -> V | None:
        with self._lock:
            return self._items.pop(key, default)

    def pop_if(self, key: K, value: V) -> None:
        """Drop `key` if it still maps to `value` (not a newer value another thread put)."""
        with self._lock:
            if self._items.get(key) is value:
                del self._items[key]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


class Match(NamedTuple):
    """A lookup's entry and how many of its first tokens the request can use (all of them but
    for a shared match)."""

    info: EntryInfo
    tokens: int


class _Candidate(NamedTuple):
    """An entry under a lookup's key, by what its name says."""

    num_tokens: int
    hash16: str  # the first 16 hex digits of its prefix hash
    name: str


#: What a Zarr reader takes from an array's zarr.json (`verify` compares them with the manifest's).
_ARRAY_KEYS = ("zarr_format", "node_type", "shape", "data_type", "chunk_grid", "chunk_key_encoding",
               "fill_value", "codecs")


class _LoadPlan(NamedTuple):
    """What a load of one slice of a field derives from the entry's manifest and the reader's
    layout alone, checked once (`Store._load_plan`)."""

    array: ArrayLayout
    spec: CodecSpec
    dtype: torch.dtype
    shape: tuple[int, ...]  # what the reader gets: [1, *rank shape] or [num_blocks, block_size, *row]
    whole: tuple[int, ...]  # the block read into, a sliding window's lead rows included
    lead: int  # those rows (zeros)
    tail: tuple[slice, ...] | None  # rows of the block past the entry's last chunk (zeros), if any
    nbytes: tuple[int, int]  # payload, scales
    read: ReadPlan
    bases: tuple[int, int]  # where the output's first byte lies in the payload, the scales (bytes)


#: `Store._shape_load`'s: (what the load reads, the text of its layer's coordinate, the plan
#: with the reads of the first entry planned by it, `rebind_reads` for the next)
_Shaped = tuple[Any, str, _LoadPlan]
_NO_READS = ReadPlan((), ())
#: `Store._make_load_plan`'s geometries, module wide as `reader`'s (every Store and entry of a
#: model and length share them)
_SHAPED: _Recent[tuple, _Shaped] = _Recent(4096)


def _output(encoding: QuantChunkEncoding | PluginChunkEncoding, payload: np.ndarray, scales: np.ndarray,
            whole: tuple[int, ...], lead: int, zero: bool = True) -> Encoded:
    """The block a load reads into: views of `payload` and `scales` as `whole`, less its first
    `lead` rows (a sliding window's rows before its first token), which hold the encoding of
    zeros (`zero`): no query after the entry's last token attends to them (the window starts
    there)."""
    out = encoding.views(payload, scales, whole)
    if not lead:
        return out
    if zero:
        copy_into(out.region((slice(0, 1), slice(0, lead), *[slice(0, n) for n in whole[2:]])),
                  zero_chunk(encoding, (1, 1, *whole[2:])))
    return Encoded(out.encoding, out.payload[:, lead:], out.scales[:, lead:])


def _host_bytes(host: Callable[[int], torch.Tensor] | None, nbytes: int) -> torch.Tensor:
    """`nbytes` of host memory for a load: from `host`, checked, else a new tensor."""
    if host is None or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    t = host(nbytes)
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.device.type == "cpu"
            and t.dim() == 1 and t.numel() == nbytes and t.is_contiguous() and t.data_ptr() % 16 == 0):
        found = (f"{t.dtype} {list(t.shape)} on {t.device}, address {t.data_ptr()} mod 16 = {t.data_ptr() % 16}"
                 if isinstance(t, torch.Tensor) else type(t).__name__)
        raise ValueError(f"load: host({nbytes}) must give a contiguous 1-D uint8 CPU tensor of {nbytes} bytes at "
                         f"a 16-byte aligned address, it gave {found}; use codec.HostArena or leave host unset")
    return t
