"""Format version 7: a state field's shard spans layers (`format.layer_span`).

A quantized Kimi-Linear request's int8 conv state was 20 files of 37 KB and 20 of their scales
(1.2 KB each); each file a save writes costs it far more than its bytes. From version 7 a state
field's shard holds the most layers, a divisor of its layer count, whose rank slices fit in
`LAYER_SHARD_BYTES`, laid out layer after layer (`format.shard_order`), so a load of one layer
is one range of the file, checked by one running crc32c. What per-layer shards do (zarr-python
writing the same bytes, reads of part of a shard group by group) is tested with
`one_layer_shards` in the other store tests.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, kimi_linear_layout
from anchorkv.store import format as F
from anchorkv.store import manifest as M
from anchorkv.store import reader as reader_module
from anchorkv.store import store as store_module
from anchorkv.store.errors import CorruptEntry, IncompleteEntry
from anchorkv.store.format import LAYER_SPAN_FORMAT_VERSION, array_layouts, layer_span
from anchorkv.store.store import Store
from tests.store.helpers import CODECS, RAW_CODECS, all_packed, rank_packed, tiny_layout, tokens
from tests.store.test_format import _save_at_tp, expected_values
from tests.store.test_read_path import _flip

N = 700
KIMI_QUANT = {"conv": "int8:128", "recurrent": "int8:128", "latent": "fp8:64"}
KIMI_RAW = {"conv": "raw", "recurrent": "raw", "latent": "raw"}


def _save(root: Path, codecs: dict, tp: int, compressor=None):
    """An entry of the tiny model (3 state layers: one shard a state field and rank slice) of
    `N` tokens written by `tp` ranks."""
    return _save_at_tp(root, codecs, N, tp, compressor)


def test_layer_span_is_the_most_layers_that_divide_and_fit():
    for layers in range(1, 65):
        for layer_bytes in (1, 1000, 37_000, 540_000, 2 << 20, 3 << 20, 5 << 20):
            s = layer_span(layers, layer_bytes)
            assert layers % s == 0 and (s == 1 or s * layer_bytes <= F.LAYER_SHARD_BYTES), (layers, layer_bytes, s)
            assert not any(layers % d == 0 and d * layer_bytes <= F.LAYER_SHARD_BYTES
                           for d in range(s + 1, layers + 1)), (layers, layer_bytes, s)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kimi_linear_state_shards(tp):
    """Kimi-Linear (20 KDA layers, 7 MLA layers, 7680 tokens): the state fields' shards span
    layers, the latent's stay one a layer; at tp=1 a quantized entry has 24 shard files (was
    94), a raw one 18 (was 47)."""
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=tp, tp_rank=0)
    spans, files = {}, {}
    for name, codecs in (("quant", KIMI_QUANT), ("raw", KIMI_RAW)):
        arrays = array_layouts(layout, codecs, 7680)
        assert F.entry_format_version(arrays) == LAYER_SPAN_FORMAT_VERSION
        assert arrays["latent"].shards[0] == 1
        for a in arrays.values():
            if a.kind == "state":
                per_layer = sum(a.codec.nbytes(a.shards[1:]))  # the rank slice of a layer
                assert 20 % a.shards[0] == 0 and a.shards[0] * per_layer <= F.LAYER_SHARD_BYTES
        spans[name] = {f: a.shards[0] for f, a in arrays.items()}
        files[name] = sum(len(a.all_shards()) * len(a.parts) for a in arrays.values())
    if tp == 1:
        assert spans == {"quant": {"conv": 20, "recurrent": 5, "latent": 1},
                         "raw": {"conv": 20, "recurrent": 2, "latent": 1}}
        assert files == {"quant": 2 + 8 + 14, "raw": 1 + 10 + 7}


@pytest.mark.parametrize("codecs,compressor,tp", [(CODECS, None, 1), (RAW_CODECS, None, 1), (CODECS, None, 2),
                                                  (CODECS, {"id": "zstd", "level": 3}, 4)],
                         ids=["quant", "raw", "quant-tp2", "quant-zstd-tp4"])
def test_a_spanning_entry_restores_exactly_at_every_tp(tmp_path, codecs, compressor, tp):
    """Written by `tp` ranks (each its own shards of its slice), read at tp 1, 2 and 8: every
    layer's slice is the reference's bytes, and the entry verifies."""
    store, info = _save(tmp_path / "s", codecs, tp, compressor)
    assert info.manifest["format_version"] == LAYER_SPAN_FORMAT_VERSION
    arrays = info.arrays()
    assert arrays["conv"].shards[0] == arrays["recurrent"].shards[0] == 3 and arrays["latent"].shards[0] == 1
    fresh = Store.open(tmp_path / "s", create=False)
    assert fresh.verify(info.id) == []
    for rtp in (1, 2, 8):
        for rank in {0, rtp - 1}:
            layout = tiny_layout(rtp, rank)
            for (layer, field), ref in all_packed(layout, codecs, N).items():
                got = fresh.load(info.id, layout, layer, field)
                if layout.layer(layer).kind.value == "paged":  # the stored rows: the saved tokens
                    ref, got = (t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).narrow(0, N) for t in (ref, got))
                assert torch.equal(got.payload, ref.payload) and torch.equal(got.scales, ref.scales), \
                    (rtp, rank, layer, field)


def test_standard_readers_read_a_spanning_entry(tmp_path):
    """zarr-python and tensorstore, in a process without anchorkv, read every array of a
    version 7 entry written at tp=2 (its shards' chunks in anchorkv's order, found by their
    index) as exactly the values a restore gives."""
    store, info = _save(tmp_path / "s", CODECS, 2)
    assert info.arrays()["recurrent"].shards == (3, 4, 16, 16)  # 3 layers x a rank's 4 heads
    out = tmp_path / "plain.npz"
    script = Path(__file__).with_name("plain_read.py")
    res = subprocess.run([sys.executable, str(script), str(store.backend.root / info.path), str(out)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, f"a plain reader failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    got = np.load(out)
    for name, want in expected_values(tiny_layout(), info, all_packed(tiny_layout(), CODECS, N)).items():
        for reader in ("zarr", "tensorstore"):
            np.testing.assert_array_equal(got[f"{reader}/{name}"], want, err_msg=f"{reader} {name}")


def _spy(monkeypatch, store) -> list:
    calls = []
    real = store.backend.read_ranges_into

    def spy(path, ranges, **kw):
        calls.append((path.rsplit("/", 2)[-2:], [(o, sum(v.nbytes for v in views)) for o, views in ranges]))
        return real(path, ranges, **kw)

    monkeypatch.setattr(store.backend, "read_ranges_into", spy)
    return calls


def _one_chunk_groups(monkeypatch, info) -> None:
    """Loads group one recurrent chunk a range (`reader.GROUP_BYTES`), in plans of their own:
    the module-wide plans (`store._SHAPED`) other tests made with the default groups are set
    aside for this test."""
    monkeypatch.setattr(reader_module, "GROUP_BYTES", info.manifest["checksums"]["recurrent/c.1.0.0.0"][1])
    monkeypatch.setattr(store_module, "_SHAPED", store_module._Recent(4096))


@pytest.mark.parametrize("group", ["default", "chunk"])
def test_a_layer_of_a_spanning_shard_is_one_range(tmp_path, monkeypatch, group):
    """The shard holds layer after layer: a load of the middle layer reads its chunks alone,
    as one range of each file (codes, scales), where the manifest puts them, checked by one
    running crc32c, whether they are one group of `reader.GROUP_BYTES` or more (a one-group
    layer was checked chunk by chunk: 8 crc32c calls a file, ~16 us more a quantized
    Kimi-Linear conv load than its shard of one layer read whole)."""
    store, info = _save(tmp_path / "s", CODECS, 1)
    if group == "chunk":  # (a Kimi-Linear layer's 8 chunks of 256 KiB: 8 groups)
        _one_chunk_groups(monkeypatch, info)
    sums = info.manifest["checksums"]
    calls = _spy(monkeypatch, store)
    crcs: list[int] = []
    real_crc = reader_module.crc32c
    monkeypatch.setattr(reader_module, "crc32c", lambda data, value=0: (crcs.append(1), real_crc(data, value=value))[1])
    layer = info.arrays()["recurrent"].layers[1]
    store.load(info.id, tiny_layout(), layer, "recurrent")
    assert len(crcs) == 2, crcs  # one a file
    want = []
    for part in ("recurrent", "recurrent_scales"):
        tail = ".0" if part.endswith("scales") else ""
        chunks = [sums[f"{part}/c.1.{h}.0.0{tail}"] for h in range(8)]  # layer 1, heads 0-7
        assert [c[2] for c in chunks] == [chunks[0][2] + h * chunks[0][1] for h in range(8)]  # together
        assert chunks[0][2] == 8 * chunks[0][1]  # after layer 0's 8 chunks
        want.append(([part, f"c.0.0.0.0{tail}"], [(chunks[0][2], 8 * chunks[0][1])]))
    assert calls == want, calls


@pytest.mark.parametrize("group", ["default", "chunk"])
def test_a_damaged_layer_of_a_spanning_shard_is_named(tmp_path, monkeypatch, group):
    """A flipped byte in one chunk of layer 1: its load names the chunk (read as one group, or
    as a run of groups checked together); layers 0 and 2 of the same file, which a load does
    not read, still load; verify names the shard and the chunk."""
    store, info = _save(tmp_path / "s", CODECS, 1)
    if group == "chunk":  # (a Kimi-Linear layer's 8 chunks of 256 KiB: 8 groups)
        _one_chunk_groups(monkeypatch, info)
    key, shard = "recurrent/c.1.3.0.0", "recurrent/c.0.0.0.0"
    size = info.manifest["checksums"][key][1]
    _flip(store, info, key, shard, size // 2, 0x01)
    fresh = Store(store.backend)
    layers = info.arrays()["recurrent"].layers
    with pytest.raises(CorruptEntry, match=f"{info.id}.*{key}.*crc32c.*{shard}"):
        fresh.load(info.id, tiny_layout(), layers[1], "recurrent")
    for i in (0, 2):
        ref = rank_packed(tiny_layout(), layers[i], "recurrent", CODECS["recurrent"], N)
        assert torch.equal(fresh.load(info.id, tiny_layout(), layers[i], "recurrent").payload, ref.payload)
    problems = fresh.verify(info.id)
    assert any(f"shard {shard}" in p and key in p for p in problems), problems


def test_a_state_layer_never_written_leaves_its_shard_unwritten(tmp_path):
    """A rank that skips a state layer: the shard it would share with the others is never
    written and the commit names it; written later (the others again too: a retry), the entry
    commits and restores exactly."""
    store = Store.open(tmp_path / "s")
    layout = tiny_layout()
    packed = all_packed(layout, CODECS, N)
    skipped = ("model.layers.1.attn", "conv")
    w = store.begin_entry(layout, CODECS, tokens(N), anchor="a", write_id="w1")
    for key, p in packed.items():
        if key != skipped:
            w.write_layer(*key, p)
    with pytest.raises(IncompleteEntry, match=r"field 'conv' were never written \(e\.g\. conv/c\.0\.0\.0\.0\)"):
        w.commit()
    assert store.list() == []
    w.write_layer(*skipped, packed[skipped])  # its shard is complete now: written
    info = w.commit()
    got = Store.open(tmp_path / "s", create=False).load(info.id, layout, *skipped)
    assert torch.equal(got.payload, packed[skipped].payload) and torch.equal(got.scales, packed[skipped].scales)


def test_an_older_reader_lists_a_spanning_entry_as_newer_format(tmp_path, monkeypatch):
    store, info = _save(tmp_path / "s", CODECS, 1)
    monkeypatch.setattr(M, "READABLE_VERSIONS", (3, 4, 5, 6))
    old = Store.open(tmp_path / "s", create=False)
    assert [e.state for e in old.scan()] == ["newer-format"]
    assert old.gc(stale_after=0)["removed"] == []


def test_the_manifest_check_recomputes_the_span(tmp_path):
    """A version 7 manifest whose state shards claim another span, or a version 6 manifest of
    spanning shards, is refused by the checks a load relies on."""
    store, info = _save(tmp_path / "s", CODECS, 1)
    assert M.check_manifest(info.id, info.manifest) == []
    six = {**info.manifest, "format_version": 6}
    assert any("format_version is 6, its arrays make 7" in p for p in M.check_manifest(info.id, six))
    for span in (1, 2):  # not a divisor of 3 layers, or one layer a shard: not what the format makes
        arrays = {**info.manifest["arrays"], "conv": {**info.manifest["arrays"]["conv"], "shards": [span, 3, 3, 64]}}
        problems = M.check_manifest(info.id, {**info.manifest, "arrays": arrays})
        assert any("array 'conv': shape/chunks/shards" in p for p in problems), (span, problems)


def test_a_layer_written_again_rewrites_its_shard(tmp_path):
    """A layer written again once its shard is written (a retry) rewrites the shard at once
    with the others' blocks, as a shard of one layer is rewritten: the entry holds the new
    values (found by review: the block waited for the others' next writes, which never came,
    and the commit published the old bytes)."""
    store = Store.open(tmp_path / "s")
    layout = tiny_layout()
    w = store.begin_entry(layout, CODECS, tokens(N), anchor="a", write_id="w1")
    for key, p in all_packed(layout, CODECS, N).items():
        w.write_layer(*key, p)
    again = ("model.layers.1.attn", "recurrent")
    new = all_packed(layout, CODECS, N, seed=5)[again]
    assert w.write_layer(*again, new) > 0
    info = w.commit()
    got = Store.open(tmp_path / "s", create=False).load(info.id, layout, *again)
    assert torch.equal(got.payload, new.payload) and torch.equal(got.scales, new.scales)
    assert w._held == {}  # the caller's buffers are let go once committed


def test_a_failed_write_drops_held_layers(tmp_path):
    """An aborted write lets go of the blocks it held for their shards (views of the caller's,
    perhaps page-locked, buffers)."""
    store = Store.open(tmp_path / "s")
    layout = tiny_layout()
    w = store.begin_entry(layout, CODECS, tokens(N), anchor="a", write_id="w1")
    key = ("model.layers.0.attn", "recurrent")
    w.write_layer(*key, all_packed(layout, CODECS, N)[key])
    assert w._held
    w.abort()
    assert w._held == {} and store.list() == []


@pytest.mark.parametrize("mode", ["put-threads", "help-thread"])
def test_a_layer_written_again_waits_for_its_shards_earlier_write(tmp_path, monkeypatch, mode):
    """A layer written again while its shard's earlier write is still in flight (on a put
    thread, or the help thread) rewrites the shard after that write has ended: the retry's
    bytes land last and its checksums are recorded (found by review: the stale write landed
    last, leaving a corrupt entry with put threads and, with the help thread, an entry that
    verified but held the first write's codes with the retry's scales)."""
    import threading

    from anchorkv.store import writer as writer_module

    target = "recurrent/c.0.0.0.0"
    if mode == "put-threads":
        monkeypatch.setattr(store_module, "LOCAL_PUT_THREADS", 4)
    else:
        monkeypatch.setattr(store_module, "HELP_WRITES", True)
        monkeypatch.setattr(writer_module, "HELP_BYTES", 1)
    store = Store.open(tmp_path / "s")
    if mode == "help-thread":  # only the target goes there (others would keep it busy at random)
        real_help = store._help_submit
        monkeypatch.setattr(store, "_help_submit",
                            lambda fn, path, *a: real_help(fn, path, *a) if path.endswith(target) else None)
    real_write = store.backend.write
    second_done, calls = threading.Event(), []

    def write(path, buffers, **kw):
        if not path.endswith(target):
            return real_write(path, buffers, **kw)
        calls.append(1)
        if len(calls) == 1:  # the first write: held until the retry's has landed, or 1 s
            second_done.wait(1)
            return real_write(path, buffers, **kw)
        real_write(path, buffers, **kw)
        second_done.set()

    monkeypatch.setattr(store.backend, "write", write)
    layout = tiny_layout()
    w = store.begin_entry(layout, CODECS, tokens(N), anchor="a", write_id="w1")
    first, second = all_packed(layout, CODECS, N), all_packed(layout, CODECS, N, seed=3)
    for key, p in first.items():
        w.write_layer(*key, p)
    again = ("model.layers.1.attn", "recurrent")
    w.write_layer(*again, second[again])
    info = w.commit()
    assert len(calls) == 2
    fresh = Store.open(tmp_path / "s", create=False)
    assert fresh.verify(info.id) == []
    got = fresh.load(info.id, layout, *again)
    assert torch.equal(got.payload, second[again].payload) and torch.equal(got.scales, second[again].scales)
