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


def test_eviction_after_each_save_reads_no_manifest_again(tmp_path, monkeypatch):
    """With a capacity every commit scans the store to evict: entries whose manifests fell out
    of the bounded cache are counted from what the last scan learned, not read again; eviction
    still takes the least recently used."""
    monkeypatch.setattr(store_module, "CACHED_MANIFESTS", 2)
    layout = tiny_layout()
    packed = {i: all_packed(layout, CODECS, 300, seed=i) for i in range(8)}
    probe = Store.open(tmp_path / "probe").save(layout, CODECS, tokens(300), packed[0], anchor="p")
    store = Store.open(tmp_path / "s", capacity_bytes=6 * probe.stored_bytes + probe.stored_bytes // 2)
    reads: list[str] = []
    real = store.backend.read

    def spy(path, *a, **kw):
        reads.append(path)
        return real(path, *a, **kw)

    monkeypatch.setattr(store.backend, "read", spy)
    infos = []
    for i in range(8):
        reads.clear()
        infos.append(store.save(layout, CODECS, tokens(300, seed=i), packed[i], anchor=f"a{i}"))
        assert not [p for p in reads if p.endswith("zarr.json")], (i, reads)
    left = {e.id for e in store.list()}
    assert left == {e.id for e in infos[2:]}  # the two oldest evicted
    assert store.usage() == sum(e.stored_bytes for e in infos[2:])
