"""A restore whose parts all use built-in codecs is read into one batch in the worker's arena
(each part at its span, the rows past the entry's end in a partial last block zero) and written
by one `codec.Unpacker` call (`WorkerSide._restore_batch`; on a GPU the batch crosses in one
copy). Every byte of the cache then equals what the part-by-part path (`_restore`) writes,
raw buffers compared; a store that ignores `host`, an entry saved with other codecs than the
worker's, and a state group restored into two blocks are restored correctly too."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from anchorkv.connector.plan import LoadSpec, Metadata, SaveSpec
from tests.connector.kimi_worker import kimi_worker

SAVED = ((1,), (2,), (3,), (4, 5))  # three KDA groups, then the MLA group's two blocks
RESTORED = ((6,), (7,), (8,), (9, 10))
QUANT = {"codec": {"conv": "int8:128", "recurrent": "int4:64", "latent": "fp8:64"}}


def _buffers(w) -> list[torch.Tensor]:
    """The cache's raw buffers (HMA regions alias: compare bytes, never float views)."""
    return list({v.region.buffer.data_ptr(): v.region.buffer for v in w.views.values()}.values())


@contextmanager
def _worker(tmp_path, extra=None):
    """A Kimi-Linear worker on the store in `tmp_path` (shut down after)."""
    w, *_, store = kimi_worker(tmp_path, 11, SAVED, extra)
    try:
        yield w, store
    finally:
        w.shutdown()
        store.close()


@contextmanager
def _saved(tmp_path, tokens_past_blocks: int, extra=None):
    """A worker that saved one request of a block plus `tokens_past_blocks` tokens, its cache
    then overwritten with stale bytes; (worker, store, the load of that entry into other
    blocks, tokens)."""
    with _worker(tmp_path, extra) as (w, store):
        yield (w, store, *_save(w, store, tokens_past_blocks))


def _save(w, store, tokens_past_blocks: int):
    layout = w.layout
    tokens = layout.block_size + tokens_past_blocks
    w.save(Metadata(saves=[SaveSpec("r", None, tuple(range(tokens)), tokens, SAVED)]))
    w.flush()
    [entry] = store.store.list()
    w.saved = [b.clone() for b in _buffers(w)]  # (the test's record of the saved bytes)
    stale = torch.Generator().manual_seed(5)
    for b in _buffers(w):  # stale bytes everywhere, restored blocks included
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=stale))
    return LoadSpec("q", entry.id, 0, tokens, RESTORED, sync=True), tokens


def _restore(w, load, *, batch: bool) -> tuple[list[torch.Tensor], list[str]]:
    """The cache bytes after restoring `load` from the current bytes (which are put back
    after), through the batch path or part by part; and which path ran. The arena holds
    garbage before (as it does after earlier restores: nothing may rely on fresh zeros)."""
    before = [b.clone() for b in _buffers(w)]
    for slab in w._arena.slabs:
        slab.fill_(0xAB)
    ran: list[str] = []
    for name in ("_restore", "_restore_batch"):  # spies on the instance, removed below
        real = getattr(type(w), name)
        setattr(w, name, lambda *a, _n=name, _r=real: (ran.append(_n), _r(w, *a))[1])
    if not batch:
        w._batch_for = lambda spec: None
    try:
        w.start_load(Metadata(loads=[load]))
    finally:
        for name in ("_restore", "_restore_batch", "_batch_for"):
            w.__dict__.pop(name, None)
    after = [b.clone() for b in _buffers(w)]
    for b, old in zip(_buffers(w), before, strict=True):
        b.copy_(old)
    return after, ran


@pytest.mark.parametrize("extra", [None, QUANT], ids=["raw", "quant"])
@pytest.mark.parametrize("past", [5, 1920], ids=["partial-last-block", "whole-blocks"])
def test_the_batch_path_writes_the_bytes_of_the_part_by_part_path(tmp_path, extra, past):
    with _saved(tmp_path, past, extra) as (w, store, load, tokens):
        assert (tokens % w.layout.block_size == 0) == (past == 1920)
        _restore(w, load, batch=True)  # sizes the arena
        batches, loads, real_for, real_load = [], [], w._batch_for, store.load
        w._batch_for = lambda spec: batches.append(real_for(spec)) or batches[-1]
        store.load = lambda *a, **k: loads.append((a[1:3], real_load(*a, **k))) or loads[-1][1]
        got, ran = _restore(w, load, batch=True)
        store.load = real_load
        assert ran == ["_restore_batch"]
        [batch] = batches  # every part was read in place, at its span of the batch
        read = dict(loads)
        for i, (layer, fname, _, _) in enumerate(w._parts(load.blocks)):
            p, (payload, scales) = read[(layer, fname)], batch.spans(i)
            assert p.payload.data_ptr() == payload.data_ptr(), (layer, fname)
            assert not p.scales.numel() or p.scales.data_ptr() == scales.data_ptr(), (layer, fname)
        want, ran = _restore(w, load, batch=False)
        assert ran == ["_restore"]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), "the two paths differ"
        untouched = [b.clone() for b in _buffers(w)]
        assert not all(torch.equal(a, b) for a, b in zip(got, untouched, strict=True)), "nothing was restored"
        if extra is None:  # exact: the restored blocks hold the saved bytes, zeros past the end
            for name, v in w.views.items():
                for f in v.page.fields:
                    src, dst = _view_of(w.saved, w, name, f.name), _view_of(got, w, name, f.name)
                    paged = f.shape[0] == w.layout.block_size and len(f.shape) == 2
                    if paged:
                        full, tail = divmod(tokens, w.layout.block_size)
                        for a, b in list(zip(SAVED[3], RESTORED[3], strict=True))[:full]:
                            assert torch.equal(dst[b].view(torch.uint8), src[a].view(torch.uint8)), (name, f.name)
                        if tail:
                            a, b = SAVED[3][full], RESTORED[3][full]
                            assert torch.equal(dst[b, :tail].view(torch.uint8), src[a, :tail].view(torch.uint8))
                            assert not dst[b, tail:].view(torch.uint8).any(), "a stale row past the end"
                    else:
                        g = next(g for g in w.groups if name in g.layers).index
                        assert torch.equal(dst[RESTORED[g][0]].view(torch.uint8), src[SAVED[g][0]].view(torch.uint8))


def _view_of(buffers: list[torch.Tensor], w, layer: str, fname: str) -> torch.Tensor:
    """`layer`'s field `fname` over the buffer in `buffers` that stands for its region."""
    from anchorkv.codec import CacheView, Region

    v = w.views[layer]
    index = [b.data_ptr() for b in _buffers(w)].index(v.region.buffer.data_ptr())
    region = Region(buffers[index], v.region.num_blocks, v.region.block_stride)
    return CacheView(region, v.page, v.name).tensor(fname)


def test_a_store_that_ignores_host_still_restores_through_the_batch(tmp_path):
    with _saved(tmp_path, 5, QUANT) as (w, store, load, _):
        want, _ = _restore(w, load, batch=False)
        real = store.load
        store.load = lambda *a, host=None, **k: real(*a, **k)  # every part in its own tensors
        got, ran = _restore(w, load, batch=True)
        assert ran == ["_restore_batch"]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("reader", [None, {"codec": {**QUANT["codec"], "latent": "int8:64"}}],
                         ids=["raw", "same-sizes"])
def test_an_entry_saved_with_other_codecs_is_restored_part_by_part(tmp_path, reader):
    """The worker's batch is laid out for its configured codecs; an entry saved with others (a
    config changed since) is restored part by part, with the entry's codecs, also where the
    sizes agree (int8 and fp8 latents, both a byte a value and a scale per group)."""
    with _saved(tmp_path, 5, QUANT) as (w, store, load, _):
        want, ran = _restore(w, load, batch=True)
        assert ran == ["_restore_batch"]
        with _worker(tmp_path, reader) as (other, _):  # the same store
            for b, src in zip(_buffers(other), _buffers(w), strict=True):
                b.copy_(src)
            got, ran = _restore(other, load, batch=True)
            assert ran == ["_restore"]
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_state_group_restored_into_two_blocks_goes_part_by_part(tmp_path):
    with _saved(tmp_path, 0) as (w, store, load, _):
        two = LoadSpec(load.req_id, load.entry_id, 0, load.num_tokens, ((6, 2),) + RESTORED[1:], sync=True)
        assert w._batch_for(two) is None
        got, ran = _restore(w, two, batch=True)
        assert ran == ["_restore"]
        layer = w.groups[0].layers[0]
        for fname in w.views[layer].page.names:
            dst = _view_of(got, w, layer, fname)
            assert torch.equal(dst[6].view(torch.uint8), dst[2].view(torch.uint8))
