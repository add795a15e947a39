"""One conformance suite, run on every backend (local directory and S3 via moto)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr

from anchorkv.codec import CodecSpec
from anchorkv.kernels import reference
from anchorkv.store import CorruptEntry, EntryNotFound, FingerprintMismatch, IncompleteEntry
from anchorkv.store.keys import TOKEN_BLOCK
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, all_packed, rank_packed, tiny_layout, tokens

N = 700  # tokens: several blocks of 64, one token chunk


def save(store, n=N, anchor="alice-software-tokyo", tp=1, seed=0, codecs=CODECS, toks=None, **kw):
    toks = tokens(max(n, N), seed) if toks is None else toks
    wid = f"w{seed}t{tp}n{n}{abs(hash(anchor)) % 10_000}"
    writers = [store.begin_entry(tiny_layout(tp, r), codecs, toks, num_tokens=n, anchor=anchor,
                                 write_id=wid, **kw) for r in range(tp)]
    for w in writers:
        for (layer, field), p in all_packed(w.layout, codecs, n, seed).items():
            w.write_layer(layer, field, p)
        w.finish_rank()
    return writers[0].commit()


def _spans(ranges) -> list[tuple[int, int]]:
    """Byte ranges `(offset, bytes)` with neighbours merged: the bytes a load reads, however it
    groups its chunks into reads (`reader.GROUP_BYTES`)."""
    spans: list[tuple[int, int]] = []
    for offset, n in ranges:
        if spans and spans[-1][0] + spans[-1][1] == offset:
            spans[-1] = (spans[-1][0], spans[-1][1] + n)
        else:
            spans.append((offset, n))
    return spans


def fp():
    return tiny_layout().fingerprint_hash()


class TestStoreConformance:
    def test_save_lookup_load_round_trip(self, store):
        info = save(store)
        found = store.lookup(fingerprint_hash=fp(), tokens=tokens(N), anchor="<Alice-Software-Tokyo/>")
        assert found is not None and found.id == info.id
        assert (found.num_tokens, found.anchor, found.tp_size) == (N, "alice-software-tokyo", 1)
        layout = tiny_layout()
        for (layer, field), ref in all_packed(layout, CODECS, N).items():
            got = store.load(found, layout, layer, field)
            assert got.shape == ref.shape and got.dtype == ref.dtype and got.codec.id == ref.codec.id
            assert got.codec.group == (ref.codec.group or ref.shape[-1])  # stored resolved
            if layout.layer(layer).kind.value == "state":
                assert torch.equal(got.payload, ref.payload) and torch.equal(got.scales, ref.scales)
            else:  # rows past the stored tokens: the encoding of zeros
                assert torch.equal(got.payload[: N * 72], ref.payload[: N * 72])
                assert torch.equal(got.scales[:N], ref.scales[:N])
                assert not got.payload[N * 72 :].any()

    @pytest.mark.parametrize("read_tp", [1, 2])
    def test_load_into_a_host_arena_gives_the_same_parts_in_its_slab(self, store, read_tp):
        """`load(host=arena)`: the bytes, shapes and codecs of a plain load, every payload and
        scale laid in the arena's one slab (sized by the hint), 16-byte aligned (a restore then
        crosses to the GPU in one copy, no staging on the CPU)."""
        from anchorkv.codec import HostArena

        info = save(store, tp=2)
        layout = tiny_layout(read_tp, read_tp - 1)
        fields = list(all_packed(layout, CODECS, N))
        plain = [store.load(info, layout, layer, field) for layer, field in fields]
        arena = HostArena(pin=False, hint=sum(p.nbytes + 32 for p in plain))
        got = [store.load(info, layout, layer, field, host=arena) for layer, field in fields]
        [slab] = arena.slabs
        lo, hi = slab.data_ptr(), slab.data_ptr() + slab.numel()
        for p, g, key in zip(plain, got, fields, strict=True):
            assert (g.shape, g.dtype, g.codec) == (p.shape, p.dtype, p.codec), key
            assert torch.equal(g.payload, p.payload) and torch.equal(g.scales, p.scales), key
            for t in (g.payload, g.scales):
                if t.numel():
                    assert lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi and t.data_ptr() % 16 == 0, key
        assert arena.used <= sum(p.nbytes + 30 for p in plain)

    def test_load_refuses_a_host_allocator_that_gives_the_wrong_memory(self, store):
        info = save(store)
        layout = tiny_layout()
        layer, field = next(iter(all_packed(layout, CODECS, N)))
        for bad in (lambda n: torch.empty(n + 1, dtype=torch.uint8), lambda n: torch.empty(n, dtype=torch.float32),
                    lambda n: torch.empty(n + 16, dtype=torch.uint8)[1 : n + 1],  # not 16-byte aligned
                    lambda n: bytearray(n)):
            with pytest.raises(ValueError, match=r"host\(\d+\) must give a contiguous 1-D uint8 CPU tensor"):
                store.load(info, layout, layer, field, host=bad)

    @pytest.mark.parametrize("write_tp,read_tp", [(1, 2), (2, 1), (4, 8), (8, 2), (2, 4)])
    def test_restore_at_another_tp(self, store, write_tp, read_tp):
        info = save(store, tp=write_tp)
        assert info.tp_size == write_tp
        for rank in range(read_tp):
            layout = tiny_layout(read_tp, rank, block_size=128)
            for (layer, field), ref in all_packed(layout, CODECS, N).items():
                got = store.load(info, layout, layer, field)
                assert got.shape == ref.shape
                k = N * 72 if field == "latent" else ref.payload.numel()
                assert torch.equal(got.payload[:k], ref.payload[:k]), (layer, field, rank)

    @pytest.mark.usefixtures("one_layer_shards")  # (a shard a layer: test_layer_span.py spans them)
    def test_readers_read_only_their_inner_chunks(self, store):
        """A tp=1 entry holds one shard per layer; a reader at tp 8 / 2 reads its inner chunks
        alone, by byte range (offsets from the manifest), and a token window of the latent reads
        only the token chunks it covers."""
        info = save(store)
        sums = info.manifest["checksums"]
        calls = []
        real = store.backend.read_ranges_into

        def spy(path, ranges, **kw):
            calls.append((path.rsplit("/", 2)[-2:], _spans((o, sum(v.nbytes for v in views)) for o, views in ranges)))
            return real(path, ranges, **kw)

        store.backend.read_ranges_into = spy
        try:
            for tp, rank in ((8, 5), (2, 1)):
                calls.clear()
                store.load(info, tiny_layout(tp, rank), "model.layers.3.attn", "recurrent")
                heads = range(rank * 8 // tp, (rank + 1) * 8 // tp)
                want = [(sums[f"recurrent/c.2.{h}.0.0"][2], sums[f"recurrent/c.2.{h}.0.0"][1]) for h in heads]
                swant = [(sums[f"recurrent_scales/c.2.{h}.0.0.0"][2], sums[f"recurrent_scales/c.2.{h}.0.0.0"][1])
                         for h in heads]
                assert calls == [(["recurrent", "c.2.0.0.0"], _spans(want)),
                                 (["recurrent_scales", "c.2.0.0.0.0"], _spans(swant))], calls
            long = save(store, n=3 * 1024 + 5, anchor="long")
            rows = long.arrays()["latent"].chunks[1]
            assert rows == 448  # format 5: 8 chunks of 448 tokens, not 4 of 1024
            calls.clear()
            store.load(long, tiny_layout(), "model.layers.4.attn", "latent", start_token=1024, num_blocks=16)
            sums = long.manifest["checksums"]
            covered = range(1024 // rows, -(-2048 // rows))  # the chunks of tokens [1024, 2048)
            assert calls == [(["latent", "c.1.0.0"], _spans(tuple(sums[f"latent/c.1.{i}.0"][2:0:-1]) for i in covered)),
                             (["latent_scales", "c.1.0.0.0"],
                              _spans(tuple(sums[f"latent_scales/c.1.{i}.0.0"][2:0:-1]) for i in covered))], calls
        finally:
            store.backend.read_ranges_into = real

    def test_paged_token_window(self, store):
        info = save(store)
        layout = tiny_layout(block_size=64)
        got = store.load(info, layout, "model.layers.4.attn", "latent", start_token=128, num_blocks=2)
        ref = rank_packed(layout, "model.layers.4.attn", "latent", CODECS["latent"], N)
        assert got.shape == (2, 64, 72)
        assert torch.equal(got.payload, ref.payload[128 * 72 : 256 * 72])

    def test_exact_lookup_takes_longest_matching_prefix(self, store):
        toks = tokens(N)
        short = save(store, n=300, toks=toks)
        long = save(store, n=600, toks=toks)
        hit = store.lookup(fingerprint_hash=fp(), tokens=toks, anchor="alice-software-tokyo")
        assert hit.id == long.id
        other = toks.copy()
        other[400] += 1  # diverges inside the long prefix, after the short one
        assert store.lookup(fingerprint_hash=fp(), tokens=other, anchor="alice-software-tokyo").id == short.id
        other[10] += 1
        assert store.lookup(fingerprint_hash=fp(), tokens=other, anchor="alice-software-tokyo") is None
        assert store.lookup(fingerprint_hash=fp(), tokens=toks[:500], anchor="alice-software-tokyo").id == short.id
        # semantic: the longest of the anchor whatever the tokens (lossy, opt-in)
        semantic = store.lookup(fingerprint_hash=fp(), tokens=other, anchor="alice-software-tokyo", mode="semantic")
        assert semantic.id == long.id
        assert store.lookup(fingerprint_hash=fp(), tokens=toks, anchor="bob") is None
        # bounds: at most max_tokens, a multiple of multiple_of (exact and semantic alike)
        look = dict(fingerprint_hash=fp(), tokens=toks, anchor="alice-software-tokyo")
        assert store.lookup(**look, max_tokens=599).id == short.id
        assert store.lookup(**look, max_tokens=299) is None
        assert store.lookup(**look, multiple_of=200).id == long.id
        assert store.lookup(**look, multiple_of=300).id == long.id
        assert store.lookup(**look, multiple_of=150).id == long.id
        assert store.lookup(**look, multiple_of=100, max_tokens=500).id == short.id
        assert store.lookup(**look, multiple_of=7) is None
        assert store.lookup(**{**look, "tokens": other}, mode="semantic", max_tokens=599).id == short.id
        with pytest.raises(ValueError, match="multiple_of"):
            store.lookup(**look, multiple_of=0)

    def test_anchorless_prefix_cache(self, store):
        toks = tokens(N, seed=3)
        info = save(store, anchor=None, toks=toks, seed=3)
        assert info.anchor is None
        assert store.lookup(fingerprint_hash=fp(), tokens=np.concatenate([toks, [1, 2, 3]])).id == info.id
        assert store.lookup(fingerprint_hash=fp(), tokens=toks[: TOKEN_BLOCK - 1]) is None
        with pytest.raises(ValueError, match="at least|needs >="):
            save(store, n=TOKEN_BLOCK - 1, anchor=None)

    def test_fingerprint_mismatch_is_refused(self, store):
        info = save(store)
        other = tiny_layout(architecture="OtherModel")
        assert store.lookup(fingerprint_hash=other.fingerprint_hash(), tokens=tokens(N),
                            anchor="alice-software-tokyo") is None
        with pytest.raises(FingerprintMismatch, match=info.id):
            store.load(info, other, "model.layers.0.attn", "conv")

    @pytest.mark.usefixtures("one_layer_shards")  # (a shard a layer: test_layer_span.py spans them)
    def test_flipped_byte_is_detected(self, store):
        info = save(store)
        # inner chunk [1, 3, 0, 0] of `recurrent` (its second layer, heads 3) lies in the shard
        # [1, 0, 0, 0]: the whole layer, as tp=1 wrote it
        key, shard = "recurrent/c.1.3.0.0", "recurrent/c.1.0.0.0"
        layer = info.arrays()["recurrent"].layers[1]
        assert layer == "model.layers.1.attn"
        crc, size, offset = info.manifest["checksums"][key]
        path = f"{info.path}/{shard}"
        data = bytearray(store.backend.read(path))
        data[offset + size // 2] ^= 0x01
        store.backend.write(path, [bytes(data)])
        fresh = Store(store.backend)
        with pytest.raises(CorruptEntry, match=f"{info.id}.*{key}.*crc32c.*{shard}"):
            fresh.load(info.id, tiny_layout(), layer, "recurrent")
        # rank 0 of tp 8 reads only heads 0 of that layer (a byte range of the shard): intact
        assert fresh.load(info.id, tiny_layout(8, 0), layer, "recurrent") is not None
        with pytest.raises(CorruptEntry, match=f"{info.id}.*{key}"):
            fresh.load(info.id, tiny_layout(8, 3), layer, "recurrent")
        problems = fresh.verify(info.id)
        assert len(problems) == 2 and f"shard {shard} fails its check" in problems[0], problems
        assert f"shard {shard}: damaged chunks: {key} " in problems[1], problems

    def test_truncated_and_missing_shards_are_detected(self, store):
        info = save(store)
        store.backend.write(f"{info.path}/latent/c.0.0.0", [store.backend.read(f"{info.path}/latent/c.0.0.0")[:-3]])
        store.backend.delete(f"{info.path}/conv/c.0.0.0.0")
        with pytest.raises(CorruptEntry, match=f"entry {info.id}: shard latent/c.0.0.0 .*expected .* bytes"):
            store.load(info, tiny_layout(), "model.layers.2.attn", "latent")
        with pytest.raises(CorruptEntry, match=f"entry {info.id}: shard conv/c.0.0.0.0 is missing"):
            store.load(info, tiny_layout(), "model.layers.0.attn", "conv")
        problems = store.verify(info)
        assert len(problems) == 3, problems  # latent: size/crc, its index; conv: missing
        text = "\n".join(problems)
        assert "shard latent/c.0.0.0 fails its check" in text and "shard latent/c.0.0.0: its index is damaged" in text
        assert f"entry {info.id}: shard conv/c.0.0.0.0 is missing" in problems, problems
        # cut into the chunk bytes (not only the index): a range read comes back short
        store.backend.write(f"{info.path}/latent/c.1.0.0", [store.backend.read(f"{info.path}/latent/c.1.0.0")[:100]])
        with pytest.raises(CorruptEntry, match=f"entry {info.id}: shard latent/c.1.0.0 .*expected .* bytes"):
            store.load(info, tiny_layout(), "model.layers.4.attn", "latent")

    def test_commit_refuses_missing_ranks_and_chunks(self, store):
        toks = tokens(N)
        w0, w1 = (store.begin_entry(tiny_layout(2, r), CODECS, toks, anchor="x", write_id="wpartial") for r in range(2))
        for (layer, field), p in all_packed(w0.layout, CODECS, N).items():
            w0.write_layer(layer, field, p)
        with pytest.raises(IncompleteEntry, match=r"ranks \[1\] of 2"):
            w0.commit()
        w1.write_layer("model.layers.0.attn", "conv",
                       rank_packed(w1.layout, "model.layers.0.attn", "conv", "int8:8", N))
        w1.finish_rank()
        with pytest.raises(IncompleteEntry, match="never written"):
            store.commit_staged("wpartial")
        assert store.list() == []
        assert store.lookup(fingerprint_hash=fp(), tokens=toks, anchor="x") is None
        for (layer, field), p in all_packed(w1.layout, CODECS, N).items():
            w1.write_layer(layer, field, p)
        w1.finish_rank()
        info = store.commit_staged("wpartial")
        assert store.lookup(fingerprint_hash=fp(), tokens=toks, anchor="x").id == info.id
        assert store.verify(info) == []

    def test_list_delete_and_plain_zarr(self, store):
        a = save(store)
        b = save(store, anchor="bob", seed=1)
        assert {e.id for e in store.list()} == {a.id, b.id}
        group = zarr.open_group(store.backend.zarr_store(), path=a.path, mode="r")
        assert group["recurrent"].shape == (3, 8, 16, 16)
        assert group.attrs["anchorkv"]["num_tokens"] == N
        ref = rank_packed(tiny_layout(), "model.layers.1.attn", "recurrent", CODECS["recurrent"], N)
        expected = reference.dequantize(ref.payload, ref.scales, CodecSpec("int8", 16), ref.shape, torch.float32)[0]
        codes, scales = group["recurrent"][1], group["recurrent_scales"][1]  # plain int8 and float32
        assert codes.dtype == np.int8 and scales.shape == (8, 16, 1, 1)
        np.testing.assert_array_equal(codes.astype(np.float32) * scales[..., 0], expected.numpy())
        store.delete(a.id)
        assert [e.id for e in store.list()] == [b.id]
        with pytest.raises(EntryNotFound, match=a.id):
            Store(store.backend).load(a.id, tiny_layout(), "model.layers.0.attn", "conv")
        assert store.lookup(fingerprint_hash=fp(), tokens=tokens(N), anchor="alice-software-tokyo") is None

    def test_same_entry_saved_twice_ends_as_one(self, store):
        a = save(store)
        b = save(store, seed=0)
        store.gc()
        entries = store.list()
        assert len(entries) == 1 and entries[0].id in (a.id, b.id)
        assert store.verify(entries[0]) == []

    def test_async_load(self, store):
        info = save(store)
        futs = [store.load_async(info, tiny_layout(), f"model.layers.{i}.attn", "recurrent") for i in (0, 1, 3)]
        assert [f.result(timeout=30).shape for f in futs] == [(1, 8, 16, 16)] * 3

    def test_eviction_is_lru_and_spares_pinned(self, store):
        a = save(store, anchor="a")
        b = save(store, anchor="b")
        c = save(store, anchor="c")
        size = a.stored_bytes
        with store.pin(a.id):
            evicted = store.evict(capacity_bytes=size * 2)
        assert a.id not in evicted and len(evicted) == 1
        remaining = {e.id for e in store.list()}
        assert a.id in remaining and len(remaining) == 2
        assert store.evict(capacity_bytes=0) and store.list() == []
        assert b.id and c.id
