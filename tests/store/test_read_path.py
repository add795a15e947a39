"""The load's read path (`anchorkv.store.reader`): read plans, chunks read straight into their
place in runs, each chunk checked as soon as it is read, plans reused only with their manifest."""

from __future__ import annotations

import pytest
import torch

from anchorkv.codec import HostArena
from anchorkv.store import CorruptEntry
from anchorkv.store import reader as reader_module
from anchorkv.store.backends import _local
from anchorkv.store.format import crc32c
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, RAW_CODECS, all_packed, rank_packed, tiny_layout, tokens

#: per-layer shards (format versions 3-6): see `one_layer_shards`
pytestmark = pytest.mark.usefixtures("one_layer_shards")

N = 700


def _save(store: Store, codecs=CODECS, seed: int = 0):
    layout = tiny_layout()
    return store.save(layout, codecs, tokens(N), all_packed(layout, codecs, N, seed), anchor="read-path")


def _equal(got, ref, paged: bool) -> bool:
    if not paged:
        return torch.equal(got.payload, ref.payload) and torch.equal(got.scales, ref.scales)
    k = N * got.payload.numel() // got.shape[0] // got.shape[1]  # the stored tokens' bytes
    return torch.equal(got.payload[:k], ref.payload[:k]) and torch.equal(got.scales[:N], ref.scales[:N])


def _flip(store: Store, info, key: str, shard: str, at: int, bit: int) -> int:
    """Flip `bit` of byte `at` of chunk `key` (-1: its last) in shard file `shard`; the chunk's
    size."""
    crc, size, offset = info.manifest["checksums"][key]
    path = f"{info.path}/{shard}"
    data = bytearray(store.backend.read(path))
    data[offset + at % size] ^= bit
    store.backend.write(path, [bytes(data)])
    return size


@pytest.mark.parametrize("codecs", [CODECS, RAW_CODECS], ids=["quant", "raw"])
def test_chunks_split_along_the_last_axis_are_read_straight_into_their_rows(tmp_path, codecs):
    """The conv state is chunked along its last axis (channels): at tp=1 each chunk lies in the
    load's output as one run per row, the chunks' rows at regular steps. A shard's chunks are
    read together into one buffer, each checked there by one crc32c, and copied into their
    rows by one strided copy (`_Group.strided`); none goes through a buffer of its own, and
    every byte is what was saved."""
    store = Store.open(tmp_path / "s")
    info = _save(store, codecs)
    layout = tiny_layout()
    arena = HostArena(pin=False)
    for (layer, field), ref in all_packed(layout, codecs, N).items():
        got = store.load(info.id, layout, layer, field, host=arena)
        assert _equal(got, ref, layout.layer(layer).kind.value == "paged"), (layer, field)
    plans = [plan.read for key, (_, _, plan) in store._plans._items.items() if key[3] == "conv"]
    assert plans and all(not plan.scratch for plan in plans)
    runs = [len(c.runs) for plan in plans for shard in plan.shards for c in shard.chunks]
    assert min(runs) == 3 * 3, runs  # [1, 3 taps, 3, 8 channels]: 9 rows of each chunk
    groups = [g for plan in plans for shard in plan.shards for g in shard.groups]
    assert all(g.strided is not None for g in groups), groups


def test_a_flipped_byte_of_a_chunk_read_in_runs_is_detected(tmp_path):
    store = Store.open(tmp_path / "s")
    info = _save(store)
    key, shard = "conv/c.2.0.0.5", "conv/c.2.0.0.0"  # channels 40-47 of the third state layer, codes
    assert info.arrays()["conv"].layers[2] == "model.layers.3.attn"
    _flip(store, info, key, shard, -1, 0x10)  # its last row
    with pytest.raises(CorruptEntry, match=f"{info.id}.*chunk {key} fails its check.*{shard}"):
        Store.open(tmp_path / "s").load(info.id, tiny_layout(), "model.layers.3.attn", "conv")
    # tp=2 rank 0 reads channels 0-31 only: intact
    assert Store.open(tmp_path / "s").load(info.id, tiny_layout(2, 0), "model.layers.3.attn", "conv") is not None


def _events(monkeypatch) -> list[str]:
    """"read" for each `preadv` of a local load, "check" for each crc32c call of the reader."""
    events: list[str] = []
    real_preadv, real_crc = _local._preadv_all, reader_module.crc32c
    monkeypatch.setattr(_local, "_preadv_all", lambda *a: (events.append("read"), real_preadv(*a))[1])
    monkeypatch.setattr(reader_module, "crc32c", lambda *a, **k: (events.append("check"), real_crc(*a, **k))[1])
    return events


def test_each_group_of_chunks_is_checked_before_the_next_is_read(tmp_path, monkeypatch):
    """A local load of part of a shard (tp=2 rank 0: 4 of its 8 head chunks) reads it in groups
    of neighbouring chunks (here 1 a group: at most `GROUP_BYTES`) and checks each chunk of a
    group right after the group's read (its bytes still in the CPU's cache); the first that
    fails stops the read, so the groups after it are never read into the caller's memory."""
    store = Store.open(tmp_path / "s")
    info = _save(store, RAW_CODECS)
    layer, layout = "model.layers.1.attn", tiny_layout(2, 0)
    crc, size, offset = info.manifest["checksums"]["recurrent/c.1.0.0.0"]
    monkeypatch.setattr(reader_module, "GROUP_BYTES", size)
    events = _events(monkeypatch)
    ref = rank_packed(layout, layer, "recurrent", "raw", N)
    assert torch.equal(Store.open(tmp_path / "s").load(info.id, layout, layer, "recurrent").payload, ref.payload)
    assert events == ["read", "check"] * 4, events  # heads 0-7 of 16: 4 chunks of one shard
    # damage the second chunk: the last two are not read
    key, shard = "recurrent/c.1.1.0.0", "recurrent/c.1.0.0.0"
    _flip(store, info, key, shard, 0, 0x01)
    events.clear()
    out = torch.full((ref.payload.numel(),), 0xAB, dtype=torch.uint8)
    with pytest.raises(CorruptEntry, match=f"chunk {key} fails its check"):
        Store.open(tmp_path / "s").load(info.id, layout, layer, "recurrent", host=lambda n: out[:n])
    assert events == ["read", "check", "read", "check"], events
    assert bool((out[2 * size :] == 0xAB).all()), "a group after the damaged chunk's was read"


def test_small_neighbouring_chunks_are_read_together(tmp_path, monkeypatch):
    """Chunks that follow each other in a shard and fit `GROUP_BYTES` together are read by one
    `preadv` (one system call, not one a chunk), each still checked by its own crc32c (a load
    of part of the shard: tp=2 rank 1, the last 4 of its 8 head chunks)."""
    store = Store.open(tmp_path / "s")
    info = _save(store, RAW_CODECS)
    layer, layout = "model.layers.1.attn", tiny_layout(2, 1)
    assert 4 * info.manifest["checksums"]["recurrent/c.1.0.0.0"][1] <= reader_module.GROUP_BYTES
    events = _events(monkeypatch)
    ref = rank_packed(layout, layer, "recurrent", "raw", N)
    assert torch.equal(Store.open(tmp_path / "s").load(info.id, layout, layer, "recurrent").payload, ref.payload)
    assert events == ["read"] + ["check"] * 4, events


@pytest.mark.parametrize("codecs", [CODECS, RAW_CODECS], ids=["quant", "raw"])
def test_a_shard_read_whole_is_one_read_and_one_running_check(tmp_path, monkeypatch, codecs):
    """A load of every byte of a shard (all of an entry's tokens at its tp) reads it by one
    `preadv` (its chunks straight into place, its index after them) and checks it by one
    running crc32c, a call per run of neighbouring places (one here; a chunk through a buffer
    of its own, one more) and one for the index, against the checksum the chunks' own make
    together and the shard's: every stored array (codes, scales) of the three fields, every
    byte as saved."""
    store = Store.open(tmp_path / "s")
    info = _save(store, codecs)
    events = _events(monkeypatch)
    fresh, layout = Store.open(tmp_path / "s"), tiny_layout()
    for (layer, field), ref in all_packed(layout, codecs, N).items():
        events.clear()
        got = fresh.load(info.id, layout, layer, field)
        assert _equal(got, ref, layout.layer(layer).kind.value == "paged"), (layer, field)
        (plan,) = [p.read for key, (_, _, p) in fresh._plans._items.items() if key[2:4] == (layer, field)]
        files = 2 if codecs["recurrent"] != "raw" else 1  # (codes and scales: a shard file each)
        assert len(plan.shards) == files and all(s.crc is not None for s in plan.shards), plan.shards
        # a chunk the load covers in part (the latent's last, past the entry's 700 tokens) is
        # read into a buffer of its own: a call more
        want = [e for sh in plan.shards for e in ["read"] + ["check"] * (2 + sum(c.runs is None for c in sh.chunks))]
        assert events == want, (layer, field, events)


def test_a_damaged_chunk_of_a_shard_read_whole_is_named(tmp_path):
    """The running check of a shard read whole fails with the first damaged chunk named, as a
    load by chunks would; a damaged index (its chunks intact: other Zarr readers would misread
    them) fails the shard's own crc32c."""
    store = Store.open(tmp_path / "s")
    info = _save(store, RAW_CODECS)
    layer, shard = "model.layers.1.attn", "recurrent/c.1.0.0.0"
    key = "recurrent/c.1.5.0.0"
    _flip(store, info, key, shard, 100, 0x04)
    with pytest.raises(CorruptEntry, match=f"chunk {key} fails its check.*{shard}"):
        Store.open(tmp_path / "s").load(info.id, tiny_layout(), layer, "recurrent")
    _flip(store, info, key, shard, 100, 0x04)  # back
    assert Store.open(tmp_path / "s").load(info.id, tiny_layout(), layer, "recurrent") is not None
    path = f"{info.path}/{shard}"
    data = bytearray(store.backend.read(path))
    data[-3] ^= 0x01  # the index's crc32c (its last 4 bytes)
    store.backend.write(path, [bytes(data)])
    with pytest.raises(CorruptEntry, match=f"shard {shard} fails its check: its chunks pass theirs.*zarr index"):
        Store.open(tmp_path / "s").load(info.id, tiny_layout(), layer, "recurrent")


def test_a_read_plan_is_reused_only_with_its_manifest(tmp_path, monkeypatch):
    """A load of the same slice again reuses its plan; an entry deleted and saved again under
    the same id (other bytes, other checksums) is read by a plan of its own manifest, whose
    geometry (what the load reads, and where it goes) it shares with the first: made once."""
    from anchorkv.store import store as store_module

    store_module._SHAPED.clear()
    store = Store.open(tmp_path / "s")
    info = _save(store, seed=0)
    layout, layer = tiny_layout(), "model.layers.4.attn"
    made, shaped = [], []  # the manifests read plans were made of (new, or re-bound); the geometries' entries
    real, rebind, real_shape = reader_module.bind_reads, reader_module.rebind_reads, Store._shape_load
    monkeypatch.setattr("anchorkv.store.store.bind_reads", lambda *a: made.append(a[0]) or real(*a))
    monkeypatch.setattr("anchorkv.store.store.rebind_reads", lambda *a: made.append(a[1]) or rebind(*a))
    monkeypatch.setattr(Store, "_shape_load", lambda *a: shaped.append(a[1]) or real_shape(*a))
    first = store.load(info.id, layout, layer, "latent")
    again = store.load(info.id, layout, layer, "latent")
    assert len(made) == 1 and torch.equal(first.payload, again.payload)
    store.delete(info.id)
    other = _save(store, seed=5)
    assert other.id == info.id and other.manifest["checksums"] != info.manifest["checksums"]
    got = store.load(other.id, layout, layer, "latent")
    assert made == [info, other], made
    assert shaped == [info], shaped  # the second entry's plan: its checksums into the same geometry
    ref = all_packed(layout, CODECS, N, seed=5)[(layer, "latent")]
    assert _equal(got, ref, paged=True) and not torch.equal(got.payload, first.payload)


def test_layers_share_one_geometry_and_keep_their_own_checksums(tmp_path):
    """Every layer of a field is read by one geometry (its chunks and places), each with the
    chunk keys and checksums of its own layer: a damaged chunk of one layer fails that layer
    alone."""
    reader_module._GEOMETRIES.clear()
    store = Store.open(tmp_path / "s")
    info = _save(store, RAW_CODECS)
    layout = tiny_layout()
    state = [layer.name for layer in layout.layers if layer.kind.value == "state"]
    for name in state:
        store.load(info.id, layout, name, "recurrent")
    assert sum(1 for key in reader_module._GEOMETRIES if key[0].field == "recurrent") == 1
    key, shard = "recurrent/c.2.2.0.0", "recurrent/c.2.0.0.0"  # heads 2 of the array's third layer
    _flip(store, info, key, shard, 5, 0x04)
    fresh = Store.open(tmp_path / "s")
    bad = info.arrays()["recurrent"].layers[2]
    for name in state:
        if name == bad:
            with pytest.raises(CorruptEntry, match=f"chunk {key} fails its check"):
                fresh.load(info.id, layout, name, "recurrent")
        else:
            ref = all_packed(layout, RAW_CODECS, N)[(name, "recurrent")]
            assert torch.equal(fresh.load(info.id, layout, name, "recurrent").payload, ref.payload)


def test_a_backend_that_skips_the_checks_still_gets_every_chunk_checked(tmp_path, monkeypatch):
    """`check` is the backend's to call; one that reads the ranges without calling it (an older
    or third-party backend) still has every chunk checked by the reader before `load` returns."""
    store = Store.open(tmp_path / "s")
    info = _save(store, RAW_CODECS)
    layer = "model.layers.1.attn"
    key, shard = "recurrent/c.1.5.0.0", "recurrent/c.1.0.0.0"
    _flip(store, info, key, shard, 7, 0x80)
    fresh = Store.open(tmp_path / "s")
    real = fresh.backend.read_ranges_into
    monkeypatch.setattr(fresh.backend, "read_ranges_into", lambda path, ranges, check=None: real(path, ranges))
    with pytest.raises(CorruptEntry, match=f"chunk {key} fails its check"):
        fresh.load(info.id, tiny_layout(), layer, "recurrent")
    ref = all_packed(tiny_layout(), RAW_CODECS, N)[("model.layers.0.attn", "recurrent")]
    assert torch.equal(fresh.load(info.id, tiny_layout(), "model.layers.0.attn", "recurrent").payload, ref.payload)


def test_a_strided_group_is_only_chunks_in_rows_at_regular_steps():
    """`_steps` describes chunks' places by one byte view only where that view holds exactly
    each chunk's runs, in order; anything else is read straight into its runs."""
    rows = [tuple((i * 8 + j * 64, 8) for j in range(3)) for i in range(4)]  # 4 chunks x 3 rows of 8 bytes
    assert reader_module._steps(rows) == (0, 3, 8, 8, 64)
    assert reader_module._steps(rows[:1]) == (0, 3, 8, 0, 64)
    assert reader_module._steps([*rows[:3], ((24, 8), (88, 8), (160, 8))]) is None  # its last row a step too far
    assert reader_module._steps([*rows[:3], ((32, 8), (96, 8), (160, 8))]) is None  # chunks 8 bytes apart, then 16
    assert reader_module._steps([((0, 24),)]) is None  # one run: read straight in
    assert reader_module._steps([rows[0], None]) is None  # one through a buffer of its own
    # a group of the 2nd and 3rd chunks: the view of those two only
    chunk = reader_module._Chunk(0, "k", 24, rows[0], -1)
    assert reader_module._group(1, 3, 48, reader_module._steps(rows)) == (1, 3, 48, (8, (2, 3, 8), (8, 64, 1)))
    groups = reader_module._groups([chunk._replace(offset=24 * i) for i in range(4)], reader_module._steps(rows))
    assert [g.strided for g in groups] == [(0, (4, 3, 8), (8, 64, 1))]


def test_chunks_the_manifest_orders_otherwise_are_read_into_their_runs(tmp_path):
    """A shard whose conv chunks lie in another order than the geometry's (two swapped, the
    manifest's offsets with them) is read by offset, each chunk straight into its rows, and
    every byte lands in its place; the plan of the entry as written first (its chunks in the
    geometry's order) is not re-bound to it (`rebind_reads`)."""
    store = Store.open(tmp_path / "s")
    info = _save(store, RAW_CODECS)
    layer, shard = "model.layers.3.attn", "conv/c.2.0.0.0"
    assert _equal(Store.open(tmp_path / "s").load(info, tiny_layout(), layer, "conv"),
                  all_packed(tiny_layout(), RAW_CODECS, N)[(layer, "conv")], paged=False)
    sums = {k: list(v) for k, v in info.manifest["checksums"].items()}
    a, b = "conv/c.2.0.0.1", "conv/c.2.0.0.4"
    (_, size, at_a), (_, _, at_b) = sums[a], sums[b]
    data = bytearray(store.backend.read(f"{info.path}/{shard}"))
    data[at_a : at_a + size], data[at_b : at_b + size] = data[at_b : at_b + size], data[at_a : at_a + size]
    store.backend.write(f"{info.path}/{shard}", [bytes(data)])
    sums[a][2], sums[b][2] = at_b, at_a
    shards = {**info.manifest["shards"], shard: [crc32c(bytes(data)), len(data)]}  # as such a writer records it
    swapped = type(info)(info.id, {**info.manifest, "checksums": sums, "shards": shards})
    got = Store.open(tmp_path / "s").load(swapped, tiny_layout(), layer, "conv")
    assert _equal(got, all_packed(tiny_layout(), RAW_CODECS, N)[(layer, "conv")], paged=False)
    fresh = Store.open(tmp_path / "s")
    fresh.load(swapped, tiny_layout(), layer, "conv")
    (plan,) = [p.read for _, _, p in fresh._plans._items.values()]
    assert [c.offset for c in plan.shards[0].chunks] == sorted(c.offset for c in plan.shards[0].chunks)
    assert all(g.strided is None for g in plan.shards[0].groups)


def test_a_load_plan_is_kept_with_its_layout(tmp_path):
    """Loads of the same slice of an entry into other reader layouts (another tp rank, made
    anew for each load) each get their own plan: every rank's bytes are its own."""
    store = Store.open(tmp_path / "s")
    info = _save(store)
    layer = "model.layers.3.attn"
    for _ in range(2):
        for rank in (0, 1, 0):
            layout = tiny_layout(2, rank)
            got = store.load(info.id, layout, layer, "conv")
            ref = rank_packed(layout, layer, "conv", CODECS["conv"], N)
            assert torch.equal(got.payload, ref.payload) and torch.equal(got.scales, ref.scales), rank


def test_a_manifest_read_that_fails_fails_its_waiters_at_once(tmp_path, monkeypatch):
    """Threads asking for an entry's manifest while one thread reads it wait for that read's
    outcome: one read, and its failure (an object store's timeout) theirs too, not a read
    again each in turn (found by review: k waiters, k timeouts one after another)."""
    import threading
    import time

    store = Store.open(tmp_path / "s")
    info = _save(store)
    fresh = Store.open(tmp_path / "s", create=False)
    reads = []

    def slow_failing(path):
        reads.append(path)
        time.sleep(0.3)  # the others ask meanwhile
        raise OSError(110, "Connection timed out (a test)")

    monkeypatch.setattr(fresh.backend, "read", slow_failing)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def get():
        start.wait()
        try:
            fresh.get(info.id)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=get) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(errors) == 4 and all(isinstance(e, OSError) for e in errors), errors
    assert len(reads) == 1, reads
    assert fresh._reading == {}
    monkeypatch.undo()
    assert fresh.get(info.id).id == info.id  # the next ask reads it again


def test_a_load_from_past_the_entry_says_so(tmp_path):
    store = Store.open(tmp_path / "s")
    info = _save(store)
    with pytest.raises(ValueError, match=f"holds tokens \\[0, {N}\\): a load of field 'latent' from token {N + 4}"):
        store.load(info.id, tiny_layout(), "model.layers.4.attn", "latent", start_token=N + 4)


def test_prepare_plans_every_load_and_reads_no_chunk(tmp_path, monkeypatch):
    """`Store.prepare` reads the manifest and makes the loads' plans on its thread; the loads
    then make none and read what loads without it read; it reads no chunk (no shard file)."""
    store = Store.open(tmp_path / "s")
    info = _save(store)
    layout = tiny_layout()
    loads = [(layer.name, f.name, 64 if layer.kind.value == "paged" else 0, 3 if layer.kind.value == "paged" else None)
             for layer in layout.layers for f in layer.page.fields]
    ref = {(layer, f): Store.open(tmp_path / "s").load(info.id, layout, layer, f, start_token=s, num_blocks=n)
           for layer, f, s, n in loads}
    fresh = Store.open(tmp_path / "s")
    plans, ranges = [], []
    real_plan, real_read = Store._make_load_plan, fresh.backend.read_ranges_into
    monkeypatch.setattr(Store, "_make_load_plan", lambda self, *a: plans.append(a[2:4]) or real_plan(self, *a))
    monkeypatch.setattr(fresh.backend, "read_ranges_into", lambda *a, **k: ranges.append(a[0]) or real_read(*a, **k))
    got = fresh.prepare(info.id, layout, loads)
    assert got.id == info.id and len(plans) == len(loads) and ranges == []
    for layer, f, s, n in loads:
        p = fresh.load(info.id, layout, layer, f, start_token=s, num_blocks=n)
        assert torch.equal(p.payload, ref[(layer, f)].payload) and torch.equal(p.scales, ref[(layer, f)].scales)
    assert len(plans) == len(loads) and ranges  # the loads planned nothing more; they read


def test_prepare_raises_what_the_loads_would(tmp_path):
    store = Store.open(tmp_path / "s")
    info = _save(store)
    layout, layer = tiny_layout(), "model.layers.4.attn"
    for kwargs, error in ((dict(start_token=-1), "start_token must be a whole number >= 0, found -1"),
                          (dict(start_token=N + 4), f"a load of field 'latent' from token {N + 4}")):
        with pytest.raises(ValueError, match=error):
            store.load(info.id, layout, layer, "latent", **kwargs)
        with pytest.raises(ValueError, match=error):
            store.prepare(info.id, layout, [(layer, "latent", kwargs["start_token"], None)])


def test_prepare_forgets_a_manifest_its_plans_find_wrong(tmp_path, monkeypatch):
    """As a load given the entry's id does: a plan that raises `CorruptEntry` drops the cached
    manifest (the next `get` reads it again); given the `EntryInfo`, the cache is the caller's."""
    store = Store.open(tmp_path / "s")
    info = _save(store)
    layout, layer = tiny_layout(), "model.layers.4.attn"

    def wrong(self, info, *args):
        raise CorruptEntry(info.id, "its plan is wrong")

    monkeypatch.setattr(Store, "_make_load_plan", wrong)
    for entry, forgotten in ((info, False), (info.id, True)):
        cached = store.get(info.id)
        with pytest.raises(CorruptEntry, match="its plan is wrong"):
            store.prepare(entry, layout, [(layer, "latent", 0, None)])
        assert (store._cached(info.id) is None) is forgotten
        assert store.get(info.id) is not cached if forgotten else store.get(info.id) is cached
