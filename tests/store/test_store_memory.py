"""A serving process's `Store` keeps what it learned of entries (manifests, arrays, checks, last
uses) for its most recently used entries only: it saves, looks up and loads entries for as long
as it runs, and a Kimi-Linear manifest costs ~240 KiB of memory."""

from __future__ import annotations

import torch

from anchorkv.store import store as store_module
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, all_packed, tiny_layout, tokens


def test_a_store_keeps_its_most_recently_used_manifests(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "CACHED_MANIFESTS", 4)
    layout = tiny_layout()
    store = Store.open(tmp_path / "s")
    infos = [store.save(layout, CODECS, tokens(300, seed=i), all_packed(layout, CODECS, 300, seed=i), anchor=f"a{i}")
             for i in range(10)]
    assert len(store._infos) == 4  # the last four saved
    reference = Store.open(tmp_path / "s", create=False)
    for info in infos:  # each load of an entry that dropped out reads its manifest again
        for name, field in [("model.layers.1.attn", "recurrent"), ("model.layers.2.attn", "latent")]:
            got = store.load(info.id, layout, name, field)
            want = reference.load(info.id, layout, name, field)
            assert torch.equal(got.payload, want.payload) and torch.equal(got.scales, want.scales)
        fp = info.fingerprint_hash
        assert store.lookup(fingerprint_hash=fp, tokens=tokens(300, seed=infos.index(info)), anchor=info.anchor).id \
            == info.id
    assert len(store._infos) == len(store._arrays) == 4
    assert len(store._checked) <= 8 * 4 and len(store._touched) <= 8 * 4
    assert list(store._infos._items) == [infos[i].id for i in range(6, 10)]  # the most recently used
