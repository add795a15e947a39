"""The worker never stores NaN/Inf state, and refuses nothing else: the writer thread checks a
save's whole batch of scales in one reduction and counts poisoned groups part by part only when
that finds a NaN (`PackedParts.may_hold_nan`), so rows it does not save may hold anything."""

from __future__ import annotations

import pytest

from anchorkv.connector.plan import Metadata, SaveSpec
from tests.connector.kimi_worker import kimi_worker

CODECS = {"conv": "int8:128", "recurrent": "int4:32", "latent": "fp8:64"}
BLOCKS = ((1,), (2,), (3,), (4, 5))  # three KDA groups, then the MLA group's two blocks


@pytest.fixture
def worker(tmp_path):
    w, views, state, paged, layout, store = kimi_worker(tmp_path, 7, BLOCKS, {"codec": CODECS})
    yield w, views, state, paged, layout.block_size, store
    w.shutdown()
    store.close()


def _save(w, tokens: int, salt: int) -> dict:
    spec = SaveSpec(f"r{salt}", None, tuple(range(salt, salt + tokens)), tokens, BLOCKS)
    w.save(Metadata(saves=[spec]))
    w.flush()
    return w.stats.take() or {}


@pytest.mark.parametrize("field", ["recurrent", "conv", "latent"])
def test_a_nan_in_saved_state_refuses_the_save(worker, field):
    w, views, state, paged, bs, store = worker
    layer = paged[1] if field == "latent" else state[4]
    block = 4 if field == "latent" else BLOCKS[4 % 3][0]
    views[layer].tensor(field)[block].view(-1)[17] = float("nan")
    counts = _save(w, 2 * bs, salt=1)
    assert counts.get("save_failed") == 1 and not counts.get("saves")
    assert list(store.store.list()) == []


def test_nan_outside_the_saved_rows_is_not_refused(worker):
    """The last MLA block is partial: its rows past the saved tokens (stale, NaN here) are packed
    with the block, so the batch check raises an alarm; the exact count over the trimmed parts
    finds nothing, and the save goes through."""
    w, views, state, paged, bs, store = worker
    tokens = bs + bs // 2
    for name in paged:
        views[name].tensor("latent")[5, bs // 2:] = float("nan")
    counts = _save(w, tokens, salt=2)
    assert counts.get("saves") == 1 and not counts.get("save_failed"), counts
    assert len(list(store.store.list())) == 1
    views[paged[0]].tensor("latent")[5, bs // 2 - 1, 3] = float("inf")  # now a saved row
    counts = _save(w, tokens, salt=3)
    assert counts.get("save_failed") == 1 and not counts.get("saves"), counts
