"""`ZarrEntryStore` on its own (no vLLM): lookup limits, the multi-rank commit, TP-independent
fingerprints, codec resolution at start-up."""

from __future__ import annotations

import threading

import pytest
import torch

from anchorkv.codec import (
    KIMI_LINEAR_48B_CONFIG,
    CodecSpec,
    Field,
    PageLayout,
    custom_layout,
    kimi_linear_layout,
    pack,
)
from anchorkv.codec.layout import CacheView, Region, dense_strides
from anchorkv.connector.config import ConnectorConfig
from anchorkv.connector.plan import SaveSpec
from anchorkv.connector.storage_zarr import ZarrEntryStore, store_layout, write_id_of
from anchorkv.store.errors import CorruptEntry, EntryNotFound, FingerprintMismatch

TOKENS = list(range(500, 900))


def tiny(tp_size: int = 1, tp_rank: int = 0, heads: int = 8):
    """Two state layers (conv [3, 3, 64/tp], recurrent [heads/tp, 16, 16]) and a paged one."""
    ch = 64 // tp_size
    conv = Field("conv", torch.bfloat16, (3, 3, ch), dense_strides((3, 3, ch)), 0, logical_shape=(3, 3, 64),
                 shard_axis=2, tp_size=tp_size, tp_rank=tp_rank)
    rs = (heads // tp_size, 16, 16)
    rec = Field("recurrent", torch.float32, rs, dense_strides(rs), conv.extent, logical_shape=(heads, 16, 16),
                shard_axis=0, tp_size=tp_size, tp_rank=tp_rank)
    lat = Field("latent", torch.bfloat16, (4, 32), (32, 1), 0, tp_size=tp_size, tp_rank=tp_rank)
    page = max(rec.extent, lat.extent)
    kda, mla = PageLayout((conv, rec), page), PageLayout((lat,), page)
    return custom_layout("Tiny", [("s0", "state", kda), ("p1", "paged", mla), ("s2", "state", kda)],
                         block_size=4, tp_size=tp_size, tp_rank=tp_rank)


def raw_config(tmp_path, **kw) -> ConnectorConfig:
    kw.setdefault("codec", {"conv": "raw", "recurrent": "raw", "latent": "raw"})
    return ConnectorConfig.from_extra_config({"store": str(tmp_path / "store"), **kw})


def parts_of(layout, tokens: list[int], n: int, seed: int = 0) -> dict:
    """A rank's parts: state fields [1, *rank shape], latent rows [n, 32], from logical values."""
    g = torch.Generator().manual_seed(seed + len(tokens[:n]))
    out = {}
    for layer in layout.layers:
        for f in layer.page.fields:
            if layer.kind.value == "state":
                full = torch.randn(f.logical_shape, generator=g).to(f.dtype)
                value = full[f.rank_slice()].unsqueeze(0)
            else:
                value = torch.randn((n, 32), generator=g).to(f.dtype)
            out[(layer.name, f.name)] = value
    return out


def packed(values: dict, codec: str = "raw") -> dict:
    """Pack values through the public API (a one-block view per value)."""
    out = {}
    for key, v in values.items():
        shape = tuple(v.shape[1:]) if v.shape[0] == 1 and v.dim() > 2 else tuple(v.shape)
        f = Field("x", v.dtype, shape, dense_strides(shape), 0)
        region = Region(v.reshape(-1).contiguous().view(torch.int8), 1, f.nbytes)
        p = pack(CacheView(region, PageLayout((f,), f.nbytes)), "x", [0], codec)
        out[key] = p.reshape(*v.shape) if p.shape != tuple(v.shape) else p
    return out


def save(es: ZarrEntryStore, n: int, anchor="a", tokens=TOKENS, tp_size=1, ranks=None, req="r"):
    spec = SaveSpec(req, anchor, tuple(tokens[:n]), n, ())
    values = {}
    for r in (range(tp_size) if ranks is None else ranks):
        vals = parts_of(tiny(tp_size, r), tokens, n)
        values[r] = vals
        es.save_part(spec, packed(vals), tp_size=tp_size, tp_rank=r)
    return values


def test_fingerprint_is_tp_independent():
    kimi = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=1)
    fp = kimi.fingerprint_hash()
    for tp in (2, 4, 8):
        assert kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=tp, tp_rank=tp - 1).fingerprint_hash() == fp
        assert store_layout(kimi, tp, tp - 1).fingerprint_hash() == fp
    assert store_layout(tiny(), 2, 1).fingerprint_hash() == tiny(2, 1).fingerprint_hash()


def test_lookup_honours_max_tokens_multiple_and_prefix(tmp_path):
    es = ZarrEntryStore(raw_config(tmp_path), tiny())
    for n in (100, 150, 200):
        save(es, n)
    look = lambda tokens=TOKENS, **kw: es.lookup(**{"anchor": "a", "token_ids": tokens, "max_tokens": 399,  # noqa: E731
                                                   "multiple_of": 1, "mode": "exact", **kw})
    assert look().num_tokens == 200
    assert look(max_tokens=199).num_tokens == 150
    assert look(max_tokens=199, multiple_of=100).num_tokens == 100
    assert look(multiple_of=70) is None  # no stored length is a multiple of 70
    assert look(max_tokens=99) is None
    changed = TOKENS[:120] + [1] + TOKENS[121:]
    assert look(changed).num_tokens == 100  # exact: the prefix must match
    assert look(changed, mode="semantic").num_tokens == 200  # semantic: the anchor's longest
    assert look(changed, mode="semantic", max_tokens=160).num_tokens == 150
    assert look(anchor="b") is None


def test_anchorless_entries_need_a_token_block(tmp_path):
    es = ZarrEntryStore(raw_config(tmp_path), tiny())
    save(es, 100, anchor=None)
    save(es, 300, anchor=None)
    look = dict(anchor=None, token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact")
    assert es.lookup(**look).num_tokens == 300
    assert es.lookup(**{**look, "max_tokens": 299}) is None  # the 100-token prompt was not saved


def test_ranks_commit_when_all_finished_and_restore_at_any_tp(tmp_path):
    es = ZarrEntryStore(raw_config(tmp_path), tiny())
    spec = SaveSpec("req-1", "a", tuple(TOKENS[:120]), 120, ())
    wid = write_id_of(spec, es.fingerprint_hash)
    assert wid == write_id_of(SaveSpec("req-1", "a", tuple(TOKENS[:120]), 120, ((1,),)), es.fingerprint_hash)
    assert wid != write_id_of(SaveSpec("req-2", "a", tuple(TOKENS[:120]), 120, ()), es.fingerprint_hash)
    assert wid != write_id_of(SaveSpec("req-1", "a", tuple(TOKENS[:120]), 120, (), nonce="b3"), es.fingerprint_hash)
    look = dict(anchor="a", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact")
    vals = save(es, 120, tp_size=2, ranks=[1])
    assert es.lookup(**look) is None  # rank 0 has not written its part
    vals.update(save(es, 120, tp_size=2, ranks=[0]))
    ref = es.lookup(**look)
    assert ref.num_tokens == 120
    for tp in (1, 4):
        for r in range(tp):
            lay = tiny(tp, r)
            got = es.load(ref.entry_id, "s2", "recurrent", tp_size=tp, tp_rank=r, rows=None)
            full = torch.cat([vals[q][("s2", "recurrent")] for q in (0, 1)], dim=1)
            want = full[:, lay.layer("s2").page.field("recurrent").rank_slice()[0]]
            assert torch.equal(got.payload, want.contiguous().view(torch.uint8).reshape(-1))
    rows = es.load(ref.entry_id, "p1", "latent", tp_size=4, tp_rank=3, rows=(40, 120))
    assert rows.shape == (80, 32)
    assert torch.equal(rows.payload, vals[0][("p1", "latent")][40:120].contiguous().view(torch.uint8).reshape(-1))


def test_ranks_in_threads_of_one_process_commit_at_once(tmp_path):
    """Ranks simulated in one process (one `ZarrEntryStore` and one save thread each, as the
    test engine runs them) finish together and all try to commit: the store keeps exactly one
    entry per save, whole, with nothing left in staging. No lock in the connector serializes
    them, as none does between ranks in separate processes."""
    tp, n = 4, 120
    stores = [ZarrEntryStore(raw_config(tmp_path), tiny(tp, r)) for r in range(tp)]
    vals = {}
    for req in range(6):
        spec = SaveSpec(f"req-{req}", f"a{req}", tuple(TOKENS[:n]), n, ())
        parts = {r: parts_of(tiny(tp, r), TOKENS, n, seed=req) for r in range(tp)}
        vals[req] = parts
        start, errors = threading.Barrier(tp), []

        def rank(r, spec=spec, parts=parts, start=start, errors=errors):
            start.wait()
            try:
                stores[r].save_part(spec, packed(parts[r]), tp_size=tp, tp_rank=r)
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
    store = stores[0].store
    assert sorted(e.anchor for e in store.list()) == [f"a{req}" for req in range(6)]
    assert store.backend.list_dir(".staging") == []
    for req in range(6):
        ref = stores[0].lookup(anchor=f"a{req}", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact")
        assert store.verify(ref.entry_id) == []
        got = stores[0].load(ref.entry_id, "s2", "recurrent", tp_size=1, tp_rank=0, rows=None)
        full = torch.cat([vals[req][q][("s2", "recurrent")] for q in range(tp)], dim=1)
        assert torch.equal(got.payload, full.contiguous().view(torch.uint8).reshape(-1))


def test_load_errors_propagate(tmp_path):
    es = ZarrEntryStore(raw_config(tmp_path), tiny())
    save(es, 120)
    ref = es.lookup(anchor="a", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact")
    other = ZarrEntryStore(raw_config(tmp_path), tiny(heads=16))
    with pytest.raises(FingerprintMismatch):
        other.load(ref.entry_id, "s0", "conv", tp_size=1, tp_rank=0, rows=None)
    chunk = tmp_path / "store" / "entries" / ref.entry_id / "conv" / "c.0.0.0.0"
    data = bytearray(chunk.read_bytes())
    data[3] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptEntry):
        es.load(ref.entry_id, "s0", "conv", tp_size=1, tp_rank=0, rows=None)
    es.store.delete(ref.entry_id)
    with pytest.raises(EntryNotFound):
        es.load(ref.entry_id, "s2", "conv", tp_size=1, tp_rank=0, rows=None)


def test_codecs_are_resolved_and_checked_at_startup(tmp_path):
    kimi = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=2)
    codec = {"conv": "int8:whole", "recurrent": "int8", "latent": "fp8:64"}
    es = ZarrEntryStore(raw_config(tmp_path, codec=codec), kimi)
    # conv is sharded along its last axis: "whole" is the chunk's last axis (4096 / 8), at any tp
    assert es.codecs == {"conv": CodecSpec("int8", 512), "recurrent": CodecSpec("int8", 128),
                         "latent": CodecSpec("fp8", 64)}
    assert es.config.codec_for("conv") == CodecSpec("int8", 512)
    with pytest.raises(ValueError, match=r"group size 128 must divide .*576.*fp8:64"):
        ZarrEntryStore(raw_config(tmp_path, codec={"latent": "fp8"}), kimi)
    with pytest.raises(ValueError, match="no codec 'fp9'; known: .*install the package that provides it"):
        ZarrEntryStore(raw_config(tmp_path, codec={"latent": "fp9:64"}), kimi)
    with pytest.raises(ValueError, match=r"names \['rope'\], neither roles .* nor fields of this model"):
        ZarrEntryStore(raw_config(tmp_path, codec={"rope": "raw"}), kimi)


def test_an_entry_needing_a_missing_plugin_is_excluded_not_cut(tmp_path, monkeypatch):
    """The lookup passes over an entry this host cannot decode by excluding it, so a long one
    met as a shared match does not come back block by block until the rounds run out; the next
    best is returned."""
    from types import SimpleNamespace

    from anchorkv.store.store import Match

    es = ZarrEntryStore(raw_config(tmp_path), tiny())
    save(es, 100)
    usable = es.store.get(es.store.list()[0].id)
    plugin = SimpleNamespace(id="k/t00020000-0", num_tokens=20000, arrays=lambda: {
        "latent": SimpleNamespace(codec=SimpleNamespace(plugin=True, installed=False, id="lowrank"))})
    asked: list[set] = []

    def match(*, exclude=(), **_):
        asked.append(set(exclude))
        return Match(usable, 100) if plugin.id in exclude else Match(plugin, 19968)

    monkeypatch.setattr(es.store, "match", match)
    why: list[str] = []
    ref = es.lookup(anchor="a", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact", shared=True, why=why)
    assert (ref.entry_id, ref.num_tokens, ref.tokens) == (usable.id, 100, 100)
    assert asked == [set(), {plugin.id}] and why == ["plugin_missing"]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_failed_part_returns_after_its_writes_in_flight(tmp_path, monkeypatch, tp):
    """A rank whose save fails midway returns (and its worker reuses the host buffers it handed
    over) only once every shard write it had in flight has ended: with put threads (an object
    store; a local directory with `LOCAL_PUT_THREADS`) a write still reading them would stage
    the next save's bytes. At tp > 1 the staged part is left to `Store.gc`, as before."""
    import time

    from anchorkv.store import format as format_module
    from anchorkv.store import store as store_module
    from anchorkv.store.backends._local import LocalBackend

    monkeypatch.setattr(store_module, "LOCAL_PUT_THREADS", 2)
    # a shard a layer (format 6): s0's are written before p1 fails (format 7 holds a state
    # layer's block until its shard's last layer: `test_a_failed_write_drops_held_layers`)
    monkeypatch.setattr(format_module, "LAYER_SHARD_BYTES", 0)
    es = ZarrEntryStore(raw_config(tmp_path), tiny(tp, 0))
    n = 120
    spec = SaveSpec("r", "a", tuple(TOKENS[:n]), n, ())
    values = parts_of(tiny(tp, 0), TOKENS, n)
    values[("p1", "latent")] = values[("p1", "latent")][:-1]  # a row short: save_part raises there,
    parts = packed(values)  # after s0's shards were handed to the put threads
    write, live, ended = LocalBackend.write, [0], []

    def slow_write(self, path, buffers, *, atomic=False):
        if "/.staging/" not in f"/{path}" or atomic or "zarr.json" in path or "begun" in path:
            return write(self, path, buffers, atomic=atomic)
        live[0] += 1
        try:
            time.sleep(0.2)
            return write(self, path, buffers, atomic=atomic)
        finally:
            live[0] -= 1
            ended.append(path)

    monkeypatch.setattr(LocalBackend, "write", slow_write)
    with pytest.raises(ValueError, match="token rows"):
        es.save_part(spec, parts, tp_size=tp, tp_rank=0)
    assert ended and live[0] == 0


def _fields(layout):
    return [(layer.name, f.name) for layer in layout.layers for f in layer.page.fields]


def _load_all(es, ref, version, tp=1, r=0):
    return {(layer, fname): es.load(ref.entry_id, layer, fname, tp_size=tp, tp_rank=r,
                                    rows=(0, ref.num_tokens) if layer == "p1" else None, version=version)
            for layer, fname in _fields(tiny(tp, r))}


def test_a_restore_reads_one_write_of_an_entry_or_fails(tmp_path):
    """Another process deletes an entry and writes the same id again (other values) while a
    restore of it is under way: the loads after that fail (their manifest is the write the
    lookup found), never one of them returning the new write's bytes (review: with a per-field
    retry a restore finished on the new write, layers of two writes mixed). A lookup after it
    finds the new write, and a worker whose manifest is the old one reads the new one."""
    es = ZarrEntryStore(raw_config(tmp_path), tiny())
    look = dict(anchor="a", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact")
    old = save(es, 120)[0]
    ref = es.lookup(**look)
    assert ref.version is not None
    other = ZarrEntryStore(raw_config(tmp_path), tiny())
    fields = _fields(tiny())
    got, failed = {}, []
    for i, (layer, fname) in enumerate(fields):
        if i == 2:  # midway, another process evicts the entry and saves the same tokens again
            other.store.delete(ref.entry_id)
            spec = SaveSpec("r", "a", tuple(TOKENS[:120]), 120, ())
            new_vals = parts_of(tiny(), TOKENS, 120, seed=7)
            other.save_part(spec, packed(new_vals), tp_size=1, tp_rank=0)
            es.forget(ref.entry_id)  # and this process reads the new manifest (another restore's failed load)
        try:
            got[(layer, fname)] = es.load(ref.entry_id, layer, fname, tp_size=1, tp_rank=0,
                                          rows=(0, 120) if layer == "p1" else None, version=ref.version)
        except CorruptEntry as e:
            assert "written again since the lookup" in str(e)
            failed.append((layer, fname))
    assert list(got) == fields[:2] and failed == fields[2:]  # the old write's parts, then failures only
    for key, p in got.items():
        assert torch.equal(p.payload, old[key].contiguous().view(torch.uint8).reshape(-1))
    fresh = other.lookup(**look)
    assert fresh.entry_id == ref.entry_id and fresh.version != ref.version
    for key, p in _load_all(es, fresh, fresh.version).items():  # es's manifest is the old one: read again
        want = new_vals[key][: 120] if key[0] == "p1" else new_vals[key]
        assert torch.equal(p.payload, want.contiguous().view(torch.uint8).reshape(-1)), key
    with pytest.raises(CorruptEntry, match="written again since the lookup"):  # the old write, asked for now
        es.load(ref.entry_id, "s0", "conv", tp_size=1, tp_rank=0, rows=None, version=ref.version)


def test_a_lookup_finds_the_write_now_in_the_store(tmp_path):
    """The scheduler's lookup of an entry another process deleted and saved again (the same id,
    on a local store) finds the new write, though it cached the old one's manifest (its file
    is checked: `Backend.stamp`), so the load it plans reads that write; `forget` drops what
    is cached of an entry whose load failed."""
    es = ZarrEntryStore(raw_config(tmp_path), tiny())
    look = dict(anchor="a", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact")
    save(es, 120)
    ref = es.lookup(**look)
    other = ZarrEntryStore(raw_config(tmp_path), tiny())
    other.store.delete(ref.entry_id)
    save(other, 120, req="r2")
    assert es.store._infos.get(ref.entry_id).version == ref.version  # still cached here
    assert es.lookup(**look).version == other.lookup(**look).version != ref.version
    es.forget(ref.entry_id)
    assert es.store._infos.get(ref.entry_id) is None


def test_two_saves_of_one_request_id_and_tokens_stage_apart(tmp_path):
    """Two saves with the same request id and tokens (a retried request keeping its id, two
    instances serving one X-Request-Id) that overlap: each stages under its own write id (the
    scheduler's nonce), so the entry committed is one save's whole, never one save's manifest
    over the other's shards (review: the committed entry never loaded, and blocked re-saving)."""
    a, b = ZarrEntryStore(raw_config(tmp_path), tiny()), ZarrEntryStore(raw_config(tmp_path), tiny())
    vals = {s: parts_of(tiny(), TOKENS, 120, seed=s) for s in (1, 2)}
    specs = {s: SaveSpec("req-1", "a", tuple(TOKENS[:120]), 120, (), nonce=f"n{s}") for s in (1, 2)}
    wa = a.store.begin_entry(a.layout(1, 0), a.codecs, specs[1].token_ids, num_tokens=120, anchor="a",
                             write_id=write_id_of(specs[1], a.fingerprint_hash))
    for (layer, fname), p in packed(vals[1]).items():  # the first save is midway...
        wa.write_layer(layer, fname, p.reshape(120, 1, *p.shape[1:]) if layer == "p1" else p)
    assert b.save_part(specs[2], packed(vals[2]), tp_size=1, tp_rank=0) > 0  # ...when the second commits
    wa.finish_rank()
    ref = a.lookup(anchor="a", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact")
    assert a.store.verify(ref.entry_id) == []
    got = a.load(ref.entry_id, "s2", "recurrent", tp_size=1, tp_rank=0, rows=None, version=ref.version)
    assert torch.equal(got.payload, vals[2][("s2", "recurrent")].contiguous().view(torch.uint8).reshape(-1))


def test_one_rank_commits_from_memory_and_replaces_a_damaged_write(tmp_path, monkeypatch):
    """At tp_size 1 the save commits its part from memory: no part marker is written (nor
    listed and read back), the staging directory is gone after the commit, and the entry loads
    exactly. A save told to replace the committed write (`SaveSpec.replace`, what a load that
    found it damaged asks for) publishes over it; one not told so leaves it alone."""
    from anchorkv.store.backends._local import LocalBackend

    writes: list[str] = []
    write = LocalBackend.write

    def recorded(self, path, buffers, *, atomic=False):
        writes.append(path)
        return write(self, path, buffers, atomic=atomic)

    monkeypatch.setattr(LocalBackend, "write", recorded)
    es = ZarrEntryStore(raw_config(tmp_path), tiny())
    n = 120
    first = save(es, n)[0]
    assert writes and not [p for p in writes if "/parts/" in p], "a part marker was written at tp_size 1"
    assert es.store.backend.list_dir(".staging") == []
    ref = es.lookup(anchor="a", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact")
    assert torch.equal(_load_all(es, ref, ref.version)[("s2", "recurrent")].payload,
                       first[("s2", "recurrent")].contiguous().view(torch.uint8).reshape(-1))
    other = parts_of(tiny(), TOKENS, n, seed=7)
    assert es.save_part(SaveSpec("r2", "a", tuple(TOKENS[:n]), n, ()), packed(other), tp_size=1, tp_rank=0) == 0
    spec = SaveSpec("r3", "a", tuple(TOKENS[:n]), n, (), nonce="x", replace=ref.version)
    assert es.save_part(spec, packed(other), tp_size=1, tp_rank=0) > 0
    new = es.lookup(anchor="a", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact")
    assert new.entry_id == ref.entry_id and new.version != ref.version
    got = _load_all(es, new, new.version)
    for key, value in other.items():
        want = value.contiguous().view(torch.uint8).reshape(-1)
        assert torch.equal(got[key].payload.reshape(-1)[: want.numel()], want), key
    assert es.store.verify(new.entry_id) == [] and es.store.backend.list_dir(".staging") == []


def test_one_ranks_failed_shard_write_aborts_its_save(tmp_path, monkeypatch):
    """At tp_size 1 a shard write that fails on a put thread surfaces in `save_part` (before the
    commit, which would otherwise name it) and the save is aborted: the error is raised,
    nothing is committed and nothing stays staged."""
    from anchorkv.store import store as store_module
    from anchorkv.store.backends._local import LocalBackend

    monkeypatch.setattr(store_module, "LOCAL_PUT_THREADS", 2)
    write = LocalBackend.write

    def failing(self, path, buffers, *, atomic=False):
        if path.rsplit("/", 1)[-1].startswith("c.") and "/recurrent/" in path:
            raise OSError(28, "No space left on device")
        return write(self, path, buffers, atomic=atomic)

    monkeypatch.setattr(LocalBackend, "write", failing)
    es = ZarrEntryStore(raw_config(tmp_path), tiny())
    with pytest.raises(OSError, match="No space left"):
        save(es, 120)
    assert es.lookup(anchor="a", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact") is None
    assert es.store.backend.list_dir(".staging") == []


def test_a_failed_replace_raises_and_an_incomplete_single_rank_part_is_dropped(tmp_path, monkeypatch):
    """Found by review. (1) A save told to replace a damaged write whose commit fails (its
    manifest's write fails) raises: it is not reported saved because the entry of its tokens,
    the damaged write it was to replace, is still committed. (2) At tp_size 1 a part that lacks
    a layer cannot be completed by another rank: the save raises `IncompleteEntry` and its
    staged data is dropped (before, it returned its bytes, counted saved, and left the staging
    to gc)."""
    from anchorkv.store.backends._local import LocalBackend
    from anchorkv.store.errors import IncompleteEntry

    es = ZarrEntryStore(raw_config(tmp_path), tiny())
    n = 120
    save(es, n)
    ref = es.lookup(anchor="a", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact")
    write = LocalBackend.write

    def failing(self, path, buffers, *, atomic=False):
        if path.endswith("/data/zarr.json"):  # the entry's group: its manifest
            raise OSError(5, "Input/output error")
        return write(self, path, buffers, atomic=atomic)

    monkeypatch.setattr(LocalBackend, "write", failing)
    spec = SaveSpec("r2", "a", tuple(TOKENS[:n]), n, (), nonce="x", replace=ref.version)
    with pytest.raises(OSError, match="Input/output"):
        es.save_part(spec, packed(parts_of(tiny(), TOKENS, n, seed=7)), tp_size=1, tp_rank=0)
    monkeypatch.setattr(LocalBackend, "write", write)
    assert es.lookup(anchor="a", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact").version == ref.version
    m = 200
    parts = packed(parts_of(tiny(), TOKENS, m))
    del parts[("s2", "recurrent")]
    staged = es.store.backend.list_dir(".staging")
    with pytest.raises(IncompleteEntry, match="never written"):
        es.save_part(SaveSpec("r3", "b", tuple(TOKENS[:m]), m, ()), parts, tp_size=1, tp_rank=0)
    assert es.store.backend.list_dir(".staging") == staged  # (the failed replace's staging is gc's)
    assert es.lookup(anchor="b", token_ids=TOKENS, max_tokens=399, multiple_of=1, mode="exact") is None
