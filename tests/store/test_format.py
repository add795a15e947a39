"""The entry format: standard Zarr v3 arrays; fast path, zarr-python and golden bytes agree exactly."""

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from anchorkv.codec import CodecSpec
from anchorkv.kernels import reference
from anchorkv.store import format as F
from anchorkv.store.errors import FormatError
from anchorkv.store.format import MAX_TP, TOKEN_CHUNK, QuantChunkEncoding
from anchorkv.store.store import Store
from tests.store import golden
from tests.store.helpers import CODECS, RAW_CODECS, all_packed, logical_values, rank_packed, tiny_layout, tokens

CODEC_SETS = {
    "quant": CODECS,
    "raw": RAW_CODECS,
    "int4": {"conv": "int4:8", "recurrent": "int4:16", "latent": "int4:24"},
}


def _fixture(name: str) -> dict:
    path = golden.FIXTURES / f"{name}.json"
    assert path.exists(), f"missing fixture {path}; run `python tests/store/golden.py` (format change only)"
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", [c[0] for c in golden.CASES])
def test_golden_chunk_bytes(name):
    fixture = _fixture(name)
    case = next(c for c in golden.CASES if c[0] == name)
    assert golden.encode_case(*case[1:]) == fixture
    codec = QuantChunkEncoding.from_config(fixture["codec"])
    data = b"".join(base64.b64decode(a["chunk_b64"]) for a in fixture["arrays"].values())
    values = codec.decode(data, tuple(fixture["chunk_shape"]))
    assert codec.encode(values) == data or codec.format.value != "raw"
    assert list(fixture["arrays"]) == (["latent"] if codec.format.value == "raw" else ["latent", "latent_scales"])


@pytest.mark.parametrize("name", [c[0] for c in golden.SHARD_CASES])
def test_golden_shard_bytes(name):
    """Whole shard files (one per stored array) are pinned, and zarr-python writes the same
    bytes from the codes and scales as plain arrays (no codec of anchorkv's)."""
    from zarr.storage import MemoryStore

    fixture = _fixture(name)
    case = next(c for c in golden.SHARD_CASES if c[0] == name)
    assert golden.encode_shard_case(*case[1:]) == fixture
    fmt, group, dtype, tokens_, shard_tokens = case[1:]
    codec = QuantChunkEncoding.from_config(fixture["codec"])
    values = torch.from_numpy(golden.shard_values(tokens_)).to(getattr(torch, dtype))
    payload, scales = reference.quantize(values, CodecSpec(fmt, group))
    array = golden._layout(fmt, group, dtype, tuple(fixture["array_shape"]), tuple(fixture["chunk_shape"]),
                           tuple(fixture["shard_shape"]))
    for part, data in zip(array.parts, (payload.numpy(), scales.numpy()), strict=False):  # raw: no scales part
        mem = MemoryStore()
        arr = zarr.create_array(
            store=mem, shape=part.shape, chunks=part.chunks, shards=part.shards, dtype=part.dtype, fill_value=0,
            compressors=None,
            config={"write_empty_chunks": tokens_ % shard_tokens == 0},  # skip the empty slot past the end
        )
        arr[:] = np.frombuffer(data.tobytes(), part.dtype).reshape(part.shape)
        key = "c/" + "/".join("0" * len(part.shape))
        assert fixture["arrays"][part.name]["data_type"] == part.dtype
        assert mem._store_dict[key.replace("0/0", "0/0")].to_bytes() == base64.b64decode(
            fixture["arrays"][part.name]["shard_b64"]), part.name
    assert codec.to_config() == fixture["codec"]


@pytest.mark.parametrize("fmt,group,dtype", [("raw", None, "bfloat16"), ("fp8", 24, "bfloat16"),
                                             ("int8", 8, "float32"), ("int4", 6, "float16")])
def test_chunk_bytes_are_the_reference_quantize(fmt, group, dtype):
    codec = QuantChunkEncoding(fmt, group, dtype)
    x = logical_values(1, "latent", 7).to(getattr(torch, dtype))
    payload, scales = reference.quantize(x, CodecSpec(fmt, group))
    data = codec.encode(x.float().numpy())
    assert data == payload.numpy().tobytes() + scales.contiguous().numpy().tobytes()
    assert sum(codec.nbytes((7, 72))) == len(data)


@pytest.fixture
def entry(tmp_path, request):
    codecs, compressor = request.param
    layout = tiny_layout()
    n = TOKEN_CHUNK + 100  # an edge chunk along the token axis
    store = Store.open(tmp_path / "s")
    packed = all_packed(layout, codecs, n)
    info = store.save(layout, codecs, tokens(n), packed, anchor="a", compressor=compressor)
    return store, layout, info, packed, codecs


ENTRIES = [(CODECS, None), (RAW_CODECS, None), (CODEC_SETS["int4"], None), (CODECS, {"id": "zstd", "level": 3}),
           ({"conv": "raw", "recurrent": "bf16", "latent": "fp8:24"}, None)]


def expected_values(layout, info, packed) -> dict[str, np.ndarray]:
    """Per field, the float32 values a restore gives, stacked over the array's layers."""
    out = {}
    for name, array in info.arrays().items():
        rows = []
        for layer_name in array.layers:
            p = packed[(layer_name, name)]
            x = reference.dequantize(p.payload, p.scales, p.codec, p.shape, p.dtype).float()
            f = layout.layer(layer_name).page.field(name)
            rows.append(x.reshape(-1, f.shape[-1])[: info.num_tokens] if array.kind == "paged" else x[0])
        out[name] = torch.stack(rows).numpy()
    return out


@pytest.mark.parametrize("entry", ENTRIES, indirect=True, ids=["quant", "raw", "int4", "quant-zstd", "bf16"])
def test_standard_readers_without_anchorkv(entry, tmp_path):
    """In a process where `import anchorkv` fails, zarr-python and tensorstore open every array
    of the entry (raw values, codes, scales; real dtypes, bf16 as its bits) and numpy, following
    only the array attributes, gets exactly the values a restore gives."""
    import subprocess
    import sys

    store, layout, info, packed, codecs = entry
    out = tmp_path / "plain.npz"
    script = Path(__file__).with_name("plain_read.py")
    res = subprocess.run([sys.executable, str(script), str(store.backend.root / info.path), str(out)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, f"a plain reader failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    opened = [line.split()[:2] for line in res.stdout.splitlines()]
    assert sorted(opened) == sorted([r, f] for r in ("zarr", "tensorstore") for f in info.manifest["arrays"])
    got = np.load(out)
    for name, want in expected_values(layout, info, packed).items():
        for reader in ("zarr", "tensorstore"):
            np.testing.assert_array_equal(got[f"{reader}/{name}"], want, err_msg=f"{reader} {name}")
    # every array of the entry directory was opened: fields and their scales, nothing else
    dirs = sorted(p.name for p in (store.backend.root / info.path).iterdir() if p.is_dir())
    assert dirs == sorted(p.name for a in info.arrays().values() for p in a.parts)


@pytest.mark.parametrize("entry", ENTRIES[:3], indirect=True, ids=["quant", "raw", "int4"])
def test_open_entry_dequantizes(entry):
    """With anchorkv installed, `open_entry(path)[field][i]` gives the restored values."""
    from anchorkv.store import open_entry

    store, layout, info, packed, codecs = entry
    e = open_entry(store.backend.root / info.path)
    for name, want in expected_values(layout, info, packed).items():
        assert e[name].shape == want.shape
        for i in range(want.shape[0]):
            np.testing.assert_array_equal(e[name][i], want[i])


def _save_at_tp(root, codecs, n, tp, compressor=None):
    """An entry of the tiny model written by `tp` ranks (each writes its own shards)."""
    store = Store.open(root)
    writers = [store.begin_entry(tiny_layout(tp, r), codecs, tokens(n), anchor="a", write_id=f"tp{tp}",
                                 compressor=compressor) for r in range(tp)]
    for w in writers:
        for (layer, field), p in all_packed(w.layout, codecs, n).items():
            w.write_layer(layer, field, p)
        w.finish_rank()
    return store, writers[0].commit()


ZARR_CASES = [  # (codecs, compressor, writer tp, tokens, zarr's write_empty_chunks)
    (CODECS, None, 1, TOKEN_CHUNK + 100, True),
    (RAW_CODECS, None, 1, TOKEN_CHUNK + 100, True),
    (CODEC_SETS["int4"], None, 1, TOKEN_CHUNK + 100, True),
    (CODECS, {"id": "zstd", "level": 3}, 1, TOKEN_CHUNK + 100, True),
    (CODECS, None, 2, 3 * TOKEN_CHUNK, True),
    (CODECS, {"id": "zstd", "level": 3}, 8, 700, True),
    # 9 token chunks: shards of 8; the second shard holds 1 chunk and 7 empty slots past the
    # end, which zarr leaves empty (2**64-1) when it skips fill-valued chunks
    (CODECS, None, 4, 8 * TOKEN_CHUNK + 808, False),
]


@pytest.mark.parametrize("codecs,compressor,tp,n,write_empty", ZARR_CASES,
                         ids=["quant", "raw", "int4", "quant-zstd", "quant-tp2", "zstd-tp8", "long-tp4"])
@pytest.mark.usefixtures("one_layer_shards")  # (versions 3-6; test_layer_span.py: version 7)
def test_zarr_write_gives_fast_path_bytes(tmp_path, codecs, compressor, tp, n, write_empty):
    """zarr-python (its ShardingCodec, standard codecs only) writing the codes and scales of the
    logical values with the entry's metadata writes exactly the shard files of the fast path,
    byte for byte (inner chunk order, edge padding, index and its crc32c included); so the fast
    path then loads what zarr wrote."""
    store, info = _save_at_tp(tmp_path / "s", codecs, n, tp, compressor)
    layout = tiny_layout()
    src = store.backend.root / info.path
    dst = tmp_path / "zarr-written"
    for meta in src.rglob("zarr.json"):
        (dst / meta.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(meta, dst / meta.relative_to(src))
    group = zarr.open_group(dst, mode="r+")
    for name, array in info.arrays().items():
        for k, part in enumerate(array.parts):
            arr = zarr.open_array(dst / part.name, mode="r+", config={"write_empty_chunks": write_empty})
            assert arr.shards == part.shards and str(arr.dtype) == part.dtype
            for i, layer_name in enumerate(group[part.name].attrs["anchorkv"]["layers"]):
                x = logical_values(layout.layer(layer_name).index, name, info.num_tokens)
                encoded = reference.quantize(x, array.codec.spec)[k].numpy()
                arr[i] = np.frombuffer(encoded.tobytes(), part.dtype).reshape(part.shape[1:])
    shards = sorted(p.relative_to(src) for p in src.rglob("c.*"))
    assert shards == sorted(p.relative_to(dst) for p in dst.rglob("c.*"))
    assert sorted(map(str, shards)) == sorted(info.manifest["shards"])
    assert len(info.manifest["checksums"]) == sum(len(a.all_chunks()) * len(a.parts) for a in info.arrays().values())
    for rel in shards:
        assert (src / rel).read_bytes() == (dst / rel).read_bytes(), rel
    shutil.rmtree(src)
    shutil.copytree(dst, src)
    fresh = Store.open(tmp_path / "s")
    assert fresh.verify(info.id) == []
    for rtp in (1, 8):
        rl = tiny_layout(rtp, rtp - 1)
        ref = rank_packed(rl, "model.layers.1.attn", "recurrent", codecs["recurrent"], n)
        got = fresh.load(info.id, rl, "model.layers.1.attn", "recurrent")
        assert torch.equal(got.payload, ref.payload) and torch.equal(got.scales, ref.scales)
    p = fresh.load(info.id, layout, "model.layers.2.attn", "latent")
    ref = packed_latent = rank_packed(layout, "model.layers.2.attn", "latent", codecs["latent"], n)
    rows = n * ref.payload.numel() // (ref.shape[0] * ref.shape[1])
    assert torch.equal(p.payload[:rows], packed_latent.payload[:rows])


@pytest.mark.usefixtures("one_layer_shards")  # (versions 3-6; test_layer_span.py: version 7)
def test_shard_layout(tmp_path):
    """Shards: state = one layer x the writer's rank slice; paged = one layer x up to 8 token
    chunks; the index is zarr's (offset, nbytes) uint64 pairs + crc32c, empty = 2**64-1."""
    from anchorkv.store.format import EMPTY, parse_shard_index

    store, info = _save_at_tp(tmp_path / "s", CODECS, 8 * TOKEN_CHUNK + 808, 2)
    arrays = info.arrays()
    assert arrays["recurrent"].shards == (1, 4, 16, 16) and arrays["recurrent"].chunks == (1, 1, 16, 16)
    assert arrays["conv"].shards == (1, 3, 3, 32) and arrays["conv"].chunks == (1, 3, 3, 8)
    assert arrays["latent"].shards == (1, 8 * TOKEN_CHUNK, 72) and arrays["latent"].shard_grid == (2, 2, 1)
    entry_dir = store.backend.root / info.path
    files = sorted(str(p.relative_to(entry_dir)) for p in entry_dir.rglob("c.*"))
    assert len(files) == 2 * (3 * 2 + 3 * 2 + 2 * 2) == len(info.manifest["shards"])  # codes + scales
    assert {f.split("/")[0] for f in files} == {"conv", "conv_scales", "recurrent", "recurrent_scales",
                                                 "latent", "latent_scales"}
    scales = store.backend.read(f"{info.path}/latent_scales/c.0.1.0.0")
    sindex = parse_shard_index(scales[-(16 * 8 + 4):], (1, 8, 1, 1))
    assert tuple(sindex[0, 0, 0, 0]) == (0, info.manifest["checksums"]["latent_scales/c.0.8.0.0"][1])
    data = store.backend.read(f"{info.path}/latent/c.0.1.0")
    index = parse_shard_index(data[-(16 * 8 + 4):], (1, 8, 1))
    crc, size, offset = info.manifest["checksums"]["latent/c.0.8.0"]
    assert tuple(index[0, 0, 0]) == (0, size) and offset == 0
    assert (index[0, 1:, 0, :] == EMPTY).all()  # both offset and nbytes
    assert len(data) == size + 16 * 8 + 4 == info.manifest["shards"]["latent/c.0.1.0"][1]
    for key, (_crc, size, offset) in info.manifest["checksums"].items():
        if key.startswith(("recurrent/c.2.", "recurrent_scales/c.2.")):  # layer 2, heads h: shard h // 4, slot h % 4
            h = int(key.split(".")[2])
            assert offset == (h % 4) * size


def test_token_chunk_pads_a_short_entry_little():
    """Format 5 cuts a paged field of up to 7680 tokens into at most 8 chunks, each a multiple of
    64 tokens: the padded edge chunk adds fewer than min(512, n / 8 + 64) rows (up to 1023 before,
    e.g. a 280-token entry stored 1024 rows); past 7680 tokens the chunks are format 3's 1024;
    every entry up to 8192 tokens stays one shard per layer."""
    for n in [*range(1, 2100), *range(2100, 20000, 37), 7679, 7680, 7681, 8191, 8192, 8193, 122_880]:
        c = F.token_chunk(n)
        rows = -(-n // c) * c
        assert c % 64 == 0 and 64 <= c <= TOKEN_CHUNK, (n, c)
        assert rows - n < (min(512, n / 8 + 64) if n <= 7680 else TOKEN_CHUNK), (n, c)
        assert (c == TOKEN_CHUNK) == (n > 7680), (n, c)
        assert F.token_chunk(n, version=3) == F.token_chunk(n, version=4) == TOKEN_CHUNK
        _, chunks, shards = F.geometry("latent", "paged", 2, (72,), None, n, 1)
        assert chunks == (1, c, 72) and shards == (1, c * min(8, -(-n // c)), 72), n
        if n <= 8192:
            assert shards[1] >= n, n  # one shard per layer
    assert [F.token_chunk(n) for n in (280, 600, 1100, 3000, 5000)] == [64, 128, 192, 384, 640]


@pytest.mark.usefixtures("one_layer_shards")  # (versions 3-6; test_layer_span.py: version 7)
def test_entries_chunked_by_1024_tokens_still_load(tmp_path, monkeypatch):
    """An entry written before format 5 (version 3: a 700-token latent in one 1024-token chunk)
    is listed ok, verifies and loads the same bytes as the new, smaller version 5 entry."""
    layout = tiny_layout()
    n = 700
    with monkeypatch.context() as m:
        m.setattr(F, "token_chunk", lambda num_tokens, version=5: TOKEN_CHUNK)  # the writer before format 5
        old = Store.open(tmp_path / "old").save(layout, CODECS, tokens(n), all_packed(layout, CODECS, n), anchor="a")
    new = Store.open(tmp_path / "new").save(layout, CODECS, tokens(n), all_packed(layout, CODECS, n), anchor="a")
    assert (old.manifest["format_version"], old.arrays()["latent"].chunks[1]) == (3, 1024)
    assert (new.manifest["format_version"], new.arrays()["latent"].chunks[1]) == (5, 128)
    assert new.stored_bytes < old.stored_bytes
    stores = {"old": Store.open(tmp_path / "old", create=False), "new": Store.open(tmp_path / "new", create=False)}
    assert [e.state for e in stores["old"].scan()] == ["ok"] and stores["old"].verify(old.id) == []
    for layer, field in [("model.layers.2.attn", "latent"), ("model.layers.1.attn", "recurrent")]:
        a = stores["old"].load(old.id, layout, layer, field)
        b = stores["new"].load(new.id, layout, layer, field)
        assert torch.equal(a.payload, b.payload) and torch.equal(a.scales, b.scales), (layer, field)
    window = [s.load(e.id, layout, "model.layers.4.attn", "latent", start_token=192, num_blocks=3)
              for s, e in ((stores["old"], old), (stores["new"], new))]
    assert torch.equal(window[0].payload, window[1].payload)


@pytest.mark.usefixtures("one_layer_shards")  # (versions 3-6; test_layer_span.py: version 7)
def test_an_older_reader_leaves_sized_chunk_entries_alone(tmp_path, monkeypatch):
    """An anchorkv that reads versions 3 and 4 lists a version 5 entry as newer-format, which its
    gc keeps, never as damaged."""
    import anchorkv.store.manifest as M

    layout = tiny_layout()
    info = Store.open(tmp_path / "s").save(layout, CODECS, tokens(300), all_packed(layout, CODECS, 300), anchor="a")
    assert info.manifest["format_version"] == 5
    monkeypatch.setattr(M, "READABLE_VERSIONS", (3, 4))
    store = Store.open(tmp_path / "s", create=False)
    assert [e.state for e in store.scan()] == ["newer-format"]
    assert store.gc(stale_after=0)["removed"] == []


@pytest.mark.usefixtures("one_layer_shards")  # (versions 3-6; test_layer_span.py: version 7)
def test_group_for_last_axis_shard_is_fixed(tmp_path):
    store = Store.open(tmp_path)
    layout = tiny_layout()
    with pytest.raises(FormatError, match="must divide the chunk's last axis"):
        store.begin_entry(layout, {**CODECS, "conv": "int8:16"}, tokens(300))
    # "whole" means the chunk's last axis (64 / MAX_TP channels), whatever tp writes it
    writer = store.begin_entry(layout, {**CODECS, "conv": "int8:whole"}, tokens(300))
    assert writer.arrays["conv"].codec.group == 64 // MAX_TP
    bad = rank_packed(layout, "model.layers.0.attn", "conv", "int8:whole", 300)  # group 64 at tp=1
    with pytest.raises(FormatError, match="int8:8"):
        writer.write_layer("model.layers.0.attn", "conv", bad)
    ok = rank_packed(layout, "model.layers.0.attn", "conv", "int8:8", 300)
    assert writer.write_layer("model.layers.0.attn", "conv", ok) > 0
    writer.abort()


def test_unknown_codec_is_refused(tmp_path):
    """An id that is neither built in nor an installed plug-in (tests/store/test_plugin_store.py
    covers plug-ins)."""
    store = Store.open(tmp_path)
    with pytest.raises(FormatError, match=r"field 'latent': no codec 'learned-proj'.*install the package"):
        store.begin_entry(tiny_layout(), {**CODECS, "latent": "learned-proj"}, tokens(300))


#: The README's "read an entry" snippets, run verbatim (paths substituted): with anchorkv's
#: `open_entry`, and with plain zarr-python + numpy (no anchorkv).
README_SNIPPET = '''
from anchorkv.store import open_entry

entry = open_entry("STORE/entries/ENTRY_ID")  # ENTRY_ID: from `anchorkv ls`
print(entry.manifest["num_tokens"], entry["recurrent"].shape)
layer3 = entry["recurrent"][3]  # float32: the state of the 4th KDA layer, as a restore gives it
'''

README_PLAIN_SNIPPET = '''
import numpy as np
import zarr

entry = zarr.open_group("STORE/entries/ENTRY_ID", mode="r")
codes, scales = entry["recurrent"][3], entry["recurrent_scales"][3]  # int8 codes, fp32 scales
group = entry["recurrent"].attrs["anchorkv"]["group"]  # the dequantization is in the attributes
layer3 = codes.astype(np.float32) * np.repeat(scales[..., 0], group, axis=-1)
'''


def _reference_recurrent(layout, info, i):
    name = info.arrays()["recurrent"].layers[i]
    p = rank_packed(layout, name, "recurrent", CODECS["recurrent"], info.num_tokens)
    return reference.dequantize(p.payload, p.scales, p.codec, p.shape, torch.float32)[0].numpy()


@pytest.mark.parametrize("snippet", ["anchorkv", "plain"])
def test_readme_snippets_read_an_entry(tmp_path, snippet):
    """A separate Python process runs the README's snippet and reads `recurrent` layer 3 equal
    to the dequantized values the fast path wrote (the plain one with anchorkv unimportable)."""
    import subprocess
    import sys

    # 4 state layers so that index 3 exists: the tiny model with one more state layer
    from anchorkv.codec.models import custom_layout

    base = tiny_layout()
    pages = {layer.kind.value: layer.page for layer in base.layers}
    kinds = ["state", "state", "paged", "state", "state"]
    layout = custom_layout("TinyHybrid4", [(f"model.layers.{i}.attn", k, pages[k]) for i, k in enumerate(kinds)],
                           block_size=base.block_size, tp_size=1, tp_rank=0)
    store = Store.open(tmp_path / "store")
    info = store.save(layout, CODECS, tokens(700), all_packed(layout, CODECS, 700), anchor="readme")
    text = README_SNIPPET if snippet == "anchorkv" else README_PLAIN_SNIPPET
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert text.strip() in readme, "the README no longer holds this snippet: update both"
    script = text.replace("STORE", str(tmp_path / "store")).replace("ENTRY_ID", info.id)
    if snippet == "plain":
        script = "import sys\nsys.modules['anchorkv'] = None\n" + script
    script += f"\nimport numpy as np\nnp.save({str(tmp_path / 'layer3.npy')!r}, layer3)\n"
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert res.returncode == 0, f"the README snippet failed:\n{res.stderr[-3000:]}"
    if snippet == "anchorkv":
        assert res.stdout.split() == ["700", "(4,", "8,", "16,", "16)"], res.stdout
    got = np.load(tmp_path / "layer3.npy")
    expected = _reference_recurrent(layout, info, 3)
    assert got.dtype == np.float32 and got.shape == (8, 16, 16)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("codecs,compressor,tp", [(RAW_CODECS, None, 1), (CODECS, None, 2),
                                                  (CODECS, {"id": "zstd", "level": 3}, 2)],
                         ids=["raw", "quant-tp2", "quant-zstd-tp2"])
def test_checksums_on_a_chunk_thread_or_the_writing_thread_agree(tmp_path, monkeypatch, codecs, compressor, tp):
    """`CHUNK_THREADS` (which the machine's cores and crc32c library choose: CI runs one, users
    another) and `LOCAL_PUT_THREADS` (1; the benchmarks try more) move where a shard's crc32c
    is computed and which thread writes it, nothing else: every way writes the same shard files and records the same
    checksums, and each entry verifies. So does `writer.INLINE_CRC_BYTES` (shards below it, here
    all of them, checksummed by the writing thread after their write)."""
    from anchorkv.store import store as store_module
    from anchorkv.store import writer as writer_module

    entries = {}
    for chunk, put, inline in ((1, 1, 0), (2, 1, 0), (1, 2, 0), (2, 3, 0), (2, 1, 1 << 30)):
        monkeypatch.setattr(store_module, "CHUNK_THREADS", chunk)
        monkeypatch.setattr(store_module, "LOCAL_PUT_THREADS", put)
        monkeypatch.setattr(writer_module, "INLINE_CRC_BYTES", inline)
        store, info = _save_at_tp(tmp_path / f"t{chunk}{put}{inline}", codecs, 3 * TOKEN_CHUNK + 100, tp, compressor)
        assert ("put" in store._pools) == (put > 1)  # the put threads did write the shards,
        # which compute their own checksums
        assert ("chunk" in store._pools) == (chunk == 2 and put == 1 and not inline)
        assert store.verify(info.id) == []
        root = store.backend.root / info.path
        entries[chunk, put, inline] = ({str(p.relative_to(root)): p.read_bytes() for p in root.rglob("c.*")},
                                       info.manifest["checksums"], info.manifest["shards"])
    first = entries[1, 1, 0]
    assert first[0] and all(e == first for e in entries.values())
