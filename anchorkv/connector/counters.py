"""What the connector counts, without vLLM: lookups, hits, misses by reason, saves, restores.

The scheduler side and every worker rank own one `Counters`. vLLM takes a snapshot every step
(`take`, which starts a new interval); `anchorkv.connector.metrics` wraps the snapshots for
vLLM's stats path (aggregation across ranks and steps, the periodic log line, Prometheus).
This module needs no vLLM because `WorkerSide` also runs without it (`anchorkv demo`).

A snapshot is a flat dict with string keys (it crosses process boundaries as msgpack and
pickle): counters are ints, latencies are lists of seconds (one per save or restore).

Who counts what (each event once per request, whatever the tensor-parallel size):

* scheduler side, when vLLM admits a request (`update_state_after_alloc`, once per
  admission, as vLLM counts its own external-cache queries): ``lookups``, ``hits`` and
  ``hit_tokens`` (a load is planned), or one ``miss:<reason>`` of `LOOKUP_MISSES`;
  ``scoped_lookups`` / ``scoped_hits`` for requests with a ``cache_salt`` or LoRA adapter;
  ``junction_saves``, when it plans a save at a shared-prefix junction (see
  `SchedulerSide._maybe_save_boundary`).
* rank 0 (every rank does the same work): ``saves``, ``saved_tokens``, ``save_failed``,
  ``save_skipped``, ``save_dropped`` (the store was behind: see ``save_backlog``), ``restores``,
  ``restored_tokens`` and the load failures (``miss:<reason>`` of `LOAD_MISSES`: a planned load
  that vLLM recomputes instead).
* every rank: ``saved_bytes``, ``restored_bytes`` (summed: the entry's bytes) and the
  latencies ``save_seconds``, ``restore_seconds`` (one observation per rank's part).

So over any interval that has settled: lookups = hits + lookup misses, and
hits = restores + load misses.
"""

from __future__ import annotations

import threading
from enum import Enum
from typing import Any


class Miss(str, Enum):
    """Why a request was computed instead of restored (the ``reason`` label)."""

    # decided when vLLM admits the request (scheduler side)
    NO_ENTRY = "no_entry"  # nothing under the request's key: never saved, evicted, or saved under
    #   another cache_salt / LoRA scope or for another model (those live under other keys, which
    #   a lookup never reads: isolation, not a counter, keeps them apart)
    PREFIX_MISMATCH = "prefix_mismatch"  # the key's entries hold other tokens (an anchor whose
    #   conversation was edited): exact mode restores none of them
    TOO_LONG = "too_long"  # the key's entries all reach the prompt's last token (vLLM must compute one)
    PLUGIN_MISSING = "plugin_missing"  # the matching entries need a codec plug-in this host lacks
    TOO_SHORT = "too_short"  # an anchorless prompt shorter than the store's token block
    COVERED_LOCALLY = "covered_locally"  # vLLM's prefix cache already holds as many tokens
    BAD_ENTRY = "bad_entry"  # the matching entries failed to load recently and are skipped
    STORE_ERROR = "store_error"  # the lookup itself failed (store unreachable)
    UNCACHEABLE = "uncacheable"  # multimodal inputs or prompt embeddings
    UNALIGNED = "unaligned"  # vLLM's local hit does not end on a block boundary
    DECLINED = "declined"  # vLLM admitted the request without the offered tokens
    NEEDS_PREFILL = "needs_prefill"  # the entry leaves more than the last token to compute and this
    #   engine cannot prefill after restored tokens (vLLM's reference CPU MLA backend)
    # decided when a planned load fails (worker side, rank 0): vLLM recomputes the request
    TIMEOUT = "timeout"  # not read within load_timeout_s
    ENTRY_GONE = "entry_gone"  # deleted or evicted between the lookup and the load
    CORRUPT = "corrupt"  # checksum, manifest or shape check failed
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"  # written for another model layout
    PREEMPTED = "preempted"  # vLLM preempted the request before its load started writing
    FAILED_LOAD = "failed_load"  # any other read error


LOOKUP_MISSES = (Miss.NO_ENTRY, Miss.PREFIX_MISMATCH, Miss.TOO_LONG, Miss.PLUGIN_MISSING, Miss.TOO_SHORT,
                 Miss.COVERED_LOCALLY, Miss.BAD_ENTRY, Miss.STORE_ERROR, Miss.UNCACHEABLE, Miss.UNALIGNED,
                 Miss.DECLINED, Miss.NEEDS_PREFILL)
LOAD_MISSES = (Miss.TIMEOUT, Miss.ENTRY_GONE, Miss.CORRUPT, Miss.FINGERPRINT_MISMATCH, Miss.PREEMPTED,
               Miss.FAILED_LOAD)
MISS_PREFIX = "miss:"
#: Plain counters of a snapshot (the ``miss:<reason>`` counters come on top).
COUNTERS = ("lookups", "hits", "hit_tokens", "scoped_lookups", "scoped_hits", "saves", "saved_tokens",
            "saved_bytes", "save_failed", "save_skipped", "save_dropped", "junction_saves", "restores",
            "restored_tokens", "restored_bytes")
#: Latency series of a snapshot, in seconds.
LATENCIES = ("save_seconds", "restore_seconds")


def load_miss_of(error: BaseException) -> Miss:
    """The reason a load failed, from what the store raised."""
    from anchorkv.store.errors import CorruptEntry, EntryNotFound, FingerprintMismatch

    if isinstance(error, EntryNotFound):
        return Miss.ENTRY_GONE
    if isinstance(error, FingerprintMismatch):
        return Miss.FINGERPRINT_MISMATCH
    if isinstance(error, CorruptEntry):
        return Miss.CORRUPT
    return Miss.FAILED_LOAD


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Add `other`'s counters to `into` and append its latencies (in place; returns `into`)."""
    for key, value in other.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
        else:
            into[key] = into.get(key, 0) + value
    return into


def is_empty(data: dict[str, Any]) -> bool:
    return not any(data.values())


def summary(data: dict[str, Any]) -> dict[str, int | float]:
    """What vLLM's periodic "KV Transfer metrics" line shows for one interval."""
    out: dict[str, int | float] = {}
    lookups, hits = data.get("lookups", 0), data.get("hits", 0)
    if lookups:
        out["lookups"] = lookups
        out["hits"] = hits
        out["hit_rate_pct"] = round(100.0 * hits / lookups, 1)
        out["hit_tokens"] = data.get("hit_tokens", 0)
    for key in sorted(k for k in data if k.startswith(MISS_PREFIX)):
        if data[key]:
            out[f"miss_{key[len(MISS_PREFIX):]}"] = data[key]
    for kind, past in (("save", "saved"), ("restore", "restored")):
        count, seconds = data.get(f"{kind}s", 0), data.get(f"{kind}_seconds", [])
        if count or seconds:
            out[f"{kind}s"] = count
            out[f"{past}_tokens"] = data.get(f"{past}_tokens", 0)
            out[f"{past}_MB"] = round(data.get(f"{past}_bytes", 0) / 1e6, 1)
            if seconds:
                out[f"{kind}_avg_s"] = round(sum(seconds) / len(seconds), 3)
                out[f"{kind}_max_s"] = round(max(seconds), 3)
    for key in ("save_failed", "save_skipped", "save_dropped", "junction_saves"):
        if data.get(key):
            out[key] = data[key]
    return out


class Counters:
    """The counts of one side (scheduler, or one worker rank) since the last `take`.

    Thread-safe: saves and loads finish on background threads. `primary` is False on worker
    ranks other than 0, which count only bytes and latencies (see the module docstring).
    """

    def __init__(self, *, primary: bool = True) -> None:
        self.primary = primary
        self._lock = threading.Lock()
        self._data: dict[str, Any] = {}

    def _add(self, **counts: int) -> None:
        with self._lock:
            for key, n in counts.items():
                self._data[key] = self._data.get(key, 0) + n

    def _observe(self, key: str, seconds: float) -> None:
        with self._lock:
            self._data.setdefault(key, []).append(float(seconds))

    def lookup(self, miss: Miss | None, *, tokens: int = 0, scoped: bool = False) -> None:
        """One admitted request: a hit restoring `tokens` tokens (`miss` None) or a miss."""
        counts = {"lookups": 1}
        if scoped:
            counts["scoped_lookups"] = 1
        if miss is None:
            counts.update(hits=1, hit_tokens=tokens)
            if scoped:
                counts["scoped_hits"] = 1
        else:
            counts[MISS_PREFIX + Miss(miss).value] = 1
        self._add(**counts)

    def load_failed(self, miss: Miss) -> None:
        if self.primary:
            self._add(**{MISS_PREFIX + Miss(miss).value: 1})

    def saved(self, *, tokens: int, nbytes: int, seconds: float) -> None:
        self._add(**({"saves": 1, "saved_tokens": tokens} if self.primary else {}), saved_bytes=nbytes)
        self._observe("save_seconds", seconds)

    def restored(self, *, tokens: int, nbytes: int, seconds: float) -> None:
        self._add(**({"restores": 1, "restored_tokens": tokens} if self.primary else {}), restored_bytes=nbytes)
        self._observe("restore_seconds", seconds)

    def save_failed(self) -> None:
        if self.primary:
            self._add(save_failed=1)

    def save_skipped(self) -> None:
        if self.primary:
            self._add(save_skipped=1)

    def save_dropped(self) -> None:
        if self.primary:
            self._add(save_dropped=1)

    def junction_saved(self) -> None:
        """(scheduler side) A save planned at a shared-prefix junction (the worker counts it
        again as ``saves`` once written, or ``save_skipped`` when the entry exists)."""
        self._add(junction_saves=1)

    def take(self) -> dict[str, Any] | None:
        """The counts since the last call (None if nothing happened); starts a new interval."""
        with self._lock:
            data, self._data = self._data, {}
        return data if not is_empty(data) else None
