"""Checks on the cache bytes of a mini engine's ranks (not a test module).

`snapshot` copies every byte of a rank's cache regions; `touched` marks the bytes a load may
write (the fields of the request's blocks: every state block it names, the paged blocks of
the restored token rows, the last one whole since its rows past the entry's end are zeroed);
`assert_only_touched` checks that nothing else changed; `assert_restored` compares the
restored fields with what the fake model writes for the same tokens.
"""

from __future__ import annotations

import torch

from anchorkv.connector.plan import GroupKind
from anchorkv.testing.metrics import sqnr_db
from tests.connector import engine as E


def _storages(caches: dict) -> dict[int, torch.Tensor]:
    """Each distinct storage behind a rank's views, as a flat uint8 tensor (a view, no copy)."""
    out = {}
    for t in caches.values():
        st = t.untyped_storage()
        if st.data_ptr() not in out:
            out[st.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(st)
    return out


def snapshot(rank: E.Rank) -> dict[int, torch.Tensor]:
    return {k: v.clone() for k, v in _storages(rank.caches).items()}


def touched(eng: E.Engine, rank: E.Rank, spec) -> dict[int, torch.Tensor]:
    """Bytes a load of `spec` (a LoadSpec) may write, as a boolean mask per storage."""
    masks = {k: torch.zeros(v.numel(), dtype=torch.bool) for k, v in _storages(rank.caches).items()}
    groups = rank.connector.groups
    for g in groups:
        ids = spec.blocks[g.index]
        for name in g.layers:
            if name not in rank.views:
                continue
            view = rank.views[name]
            t = view.region.buffer  # scheduler blocks, whatever kernel blocks vLLM registered
            base = t.storage_offset() * t.element_size()
            stride = view.region.block_stride
            mask = masks[t.untyped_storage().data_ptr()]
            for f in view.page.fields:
                for b in ids:
                    start = base + b * stride + f.offset
                    if g.kind is GroupKind.STATE:
                        mask[start:f.extent - f.offset + start] = True
                    else:
                        mask[start:start + f.nbytes] = True
    return masks


def zeroed_by_vllm(rank: E.Rank, block_ids) -> dict[int, torch.Tensor]:
    """Bytes of the attention (paged) pages of `block_ids`: what vLLM zeroes for new blocks."""
    masks = {k: torch.zeros(v.numel(), dtype=torch.bool) for k, v in _storages(rank.caches).items()}
    for g in rank.connector.groups:
        if g.kind is not GroupKind.PAGED:
            continue
        for name in g.layers:
            view = rank.views[name]
            t = view.region.buffer
            base = t.storage_offset() * t.element_size()
            mask = masks[t.untyped_storage().data_ptr()]
            for b in block_ids:
                start = base + b * view.region.block_stride
                mask[start:start + view.page.page_bytes] = True
    return masks


def assert_zero(rank: E.Rank, masks: dict[int, torch.Tensor]) -> None:
    for k, now in _storages(rank.caches).items():
        assert int(now[masks[k]].ne(0).sum()) == 0, "bytes vLLM zeroes are not zero"


def assert_only_touched(rank: E.Rank, before: dict[int, torch.Tensor], masks: dict[int, torch.Tensor] | None) -> None:
    """Every byte outside `masks` (all bytes when None) equals the snapshot."""
    for k, now in _storages(rank.caches).items():
        keep = torch.ones(now.numel(), dtype=torch.bool) if masks is None else ~masks[k]
        changed = int((now[keep] != before[k][keep]).sum())
        assert changed == 0, f"{changed} cache bytes changed outside the restored blocks"


def assert_restored(eng: E.Engine, rank: E.Rank, spec, tokens: list[int], *, min_sqnr: dict | None = None) -> None:
    """The restored fields equal what the fake model writes for `tokens` (raw: bit for bit;
    `min_sqnr` {field: dB}: at least that SQNR and not bit-identical)."""
    n = spec.num_tokens
    for g in rank.connector.groups:
        ids = spec.blocks[g.index]
        for name in g.layers:
            if name not in rank.views:
                continue
            view = rank.views[name]
            layer = int(name.split(".")[2])
            if g.kind is GroupKind.STATE:
                state = E.logical_state(layer, tuple(tokens[:n]))
                pairs = [(fname, full[view.page.field(fname).rank_slice()], view.tensor(fname)[ids[0]])
                         for fname, full in state.items()]
            else:
                pos = torch.arange(spec.start, n)
                want = E.latent_rows(layer, pos, torch.tensor(tokens[spec.start:n]))
                lat = view.tensor("latent")
                bs = lat.shape[1]
                got = torch.cat([lat[b] for b in ids])[: n - spec.start]
                assert bs * len(ids) >= n - spec.start
                pairs = [("latent", want, got)]
            for fname, want, got in pairs:
                if min_sqnr is None or fname not in min_sqnr:
                    assert torch.equal(want, got), f"{name}.{fname}: restored bytes differ"
                else:
                    db = sqnr_db(want, got)
                    assert db >= min_sqnr[fname], f"{name}.{fname}: SQNR {db:.1f} dB < {min_sqnr[fname]} dB"
                    assert not torch.equal(want, got), f"{name}.{fname}: a lossy codec restored exact bytes"
