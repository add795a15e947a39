"""Entries whose fields are encoded by a codec plug-in (the example ``lowrank`` codec, loaded
through its entry point): pack -> store -> load against the plug-in's own decode, at other tp
sizes and token windows; what the manifest records; a load without the plug-in (one line
naming it); ls / inspect / verify; what the store refuses; older readers."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from anchorkv.codec import CodecSpec, get_codec
from anchorkv.codec.packed import Packed
from anchorkv.store import format as F
from anchorkv.store import plugin_format as PF
from anchorkv.store.errors import FormatError, OtherFormat, StoreError
from anchorkv.store.format import (
    FORMAT_VERSION,
    PLUGIN_FORMAT_VERSION,
    SIZED_CHUNK_FORMAT_VERSION,
    TOKEN_CHUNK,
    array_layouts,
)
from anchorkv.store.manifest import manifest_checksum
from anchorkv.store.plugin_format import MissingCodec
from anchorkv.store.store import Store
from anchorkv.testing.metrics import sqnr_db
from tests.codec.test_plugin_codec import install_example, uninstall_plugins
from tests.store import helpers as H

#: per-layer shards (format versions 3-6): see `one_layer_shards`
pytestmark = pytest.mark.usefixtures("one_layer_shards")

N = 1500  # tokens: eight latent chunks of 192 (format version 5), the last partial


@pytest.fixture
def lowrank(monkeypatch, tmp_path):
    install_example(monkeypatch, tmp_path)
    import lowrank_codec

    return lowrank_codec


def _specs(lowrank) -> dict[str, dict]:
    """lowrank on the latent (rows of 72) and the recurrent state (rows of 16, split by heads);
    projections fitted on other seeds' values than the ones stored."""
    lat = torch.cat([H.logical_values(i, "latent", 400, seed=9) for i in (2, 4)]).double()
    rec = torch.cat([H.logical_values(i, "recurrent", seed=9) for i in (0, 1, 3)]).double().reshape(-1, H.DIM)
    return {"conv": "raw", "latent": lowrank.codec_config(lowrank.fit_projection(lat, 12)),
            "recurrent": lowrank.codec_config(lowrank.fit_projection(rec, 8), code_dtype="float32")}


def _resolved(layout, specs) -> dict[str, CodecSpec]:
    return {k: a.codec.spec for k, a in array_layouts(layout, specs, N).items()}


def _packed(layout, codecs: dict[str, CodecSpec], n: int = N) -> dict:
    """Every (layer, field) of this rank as the plug-in (or raw) packs it; paged rows past the
    tokens hold junk, as a real cache block does."""
    out = {}
    for layer in layout.layers:
        for f in layer.page.fields:
            spec = codecs[f.name]
            if spec.builtin:
                out[(layer.name, f.name)] = H.rank_packed(layout, layer.name, f.name, str(spec), n)
                continue
            x = _rank_values(layout, layer, f, n)
            payload, scales = get_codec(spec.id).encode(x, spec)
            out[(layer.name, f.name)] = Packed(spec, tuple(x.shape), x.dtype, payload, scales)
    return out


def _rank_values(layout, layer, f, n: int) -> torch.Tensor:
    full = H.logical_values(layer.index, f.name, n)
    if layer.kind.value == "state":
        return full[f.rank_slice()].unsqueeze(0).contiguous()
    bs = layout.block_size
    blocks = -(-n // bs)
    pad = torch.full((blocks * bs - n, H.ROW), 7.0, dtype=full.dtype)
    return torch.cat([full, pad]).reshape(blocks, bs, H.ROW)


def _save(store, lowrank, tp: int = 1, anchor: str = "plug-in-entry", n: int = N):
    layout1 = H.tiny_layout()
    codecs = _resolved(layout1, _specs(lowrank))
    info = None
    writers = []
    for r in range(tp):
        layout = H.tiny_layout(tp, r)
        w = store.begin_entry(layout, codecs, H.tokens(n), anchor=anchor, write_id=f"plugin{tp}")
        for (layer, field), p in _packed(layout, codecs, n).items():
            w.write_layer(layer, field, p)
        w.finish_rank()
        writers.append(w)
    info = writers[0].commit()
    return info, codecs


def _expected(layout, layer_name: str, field: str, spec: CodecSpec, n: int = N) -> torch.Tensor:
    """decode(encode(x)) of this rank's values, computed directly with the plug-in."""
    layer = layout.layer(layer_name)
    x = _rank_values(layout, layer, layer.page.field(field), n)
    codec = get_codec(spec.id)
    return codec.decode(*codec.encode(x, spec), spec, tuple(x.shape), x.dtype)


@pytest.mark.parametrize("write_tp,read_tp", [(1, 1), (2, 1), (1, 4), (2, 2)])
def test_round_trip_against_the_plugins_own_decode(tmp_path, lowrank, write_tp, read_tp):
    with Store.open(tmp_path / "store") as store:
        info, codecs = _save(store, lowrank, tp=write_tp)
        assert info.manifest["format_version"] == SIZED_CHUNK_FORMAT_VERSION
        for r in range(read_tp):
            layout = H.tiny_layout(read_tp, r)
            for name, field in [("model.layers.2.attn", "latent"), ("model.layers.3.attn", "recurrent"),
                                ("model.layers.0.attn", "conv")]:
                p = store.load(info.id, layout, name, field)
                spec = codecs[field]
                assert p.codec == spec
                if spec.builtin:
                    want = H.rank_packed(layout, name, field, "raw", N)
                    assert torch.equal(p.payload, want.payload)
                    continue
                got = get_codec(spec.id).decode(p.payload, p.scales, p.codec, p.shape, p.dtype)
                want = _expected(layout, name, field, spec)
                if field == "latent":  # rows past the entry's end: zero bytes, never restored
                    got, want = got.reshape(-1, H.ROW)[:N], want.reshape(-1, H.ROW)[:N]
                assert torch.equal(got, want)
                assert sqnr_db(H.logical_values(3, "recurrent")[layout.layer(name).page.field(field)
                                       .rank_slice()] if field == "recurrent" else
                                       H.logical_values(2, "latent", N), got.reshape(want.shape)) > 20.0


def test_token_window_load(tmp_path, lowrank):
    """A load of tokens [1000, 1100) (crossing the chunk boundary at 1024) returns exactly those
    rows' bytes (rows are encoded independently)."""
    with Store.open(tmp_path / "store") as store:
        info, codecs = _save(store, lowrank)
        layout = H.tiny_layout(block_size=1)
        p = store.load(info.id, layout, "model.layers.4.attn", "latent", start_token=1000, num_blocks=100)
        full = _packed(H.tiny_layout(), codecs)[("model.layers.4.attn", "latent")]
        row = full.payload.numel() // (full.shape[0] * full.shape[1])
        assert torch.equal(p.payload, full.payload[1000 * row:1100 * row])


def test_manifest_records_the_plugin(tmp_path, lowrank):
    with Store.open(tmp_path / "store") as store:
        info, codecs = _save(store, lowrank)
        c = info.manifest["codecs"]["latent"]
        assert c["plugin"] == "lowrank" and c["source_dtype"] == "bfloat16"
        assert c["config"] == codecs["latent"].options and len(c["config"]["projection"]) > 0
        assert c["row"] == {"width": H.ROW, "payload_bytes": 24, "payload_dtype": "float16",
                            "scale_groups": 0, "scale_columns": 0}
        assert info.manifest["codecs"]["recurrent"]["row"]["payload_dtype"] == "float32"
        assert info.manifest["codecs"]["conv"] == {"format": "raw", "group": None, "source_dtype": "bfloat16"}
        arrays = info.arrays()
        assert [p.dtype for p in arrays["latent"].parts] == ["float16"]
        assert arrays["latent"].parts[0].shape == (2, N, 12)


@pytest.mark.parametrize("plugin", [False, True], ids=["builtin", "plugin"])
@pytest.mark.parametrize("n,chunk", [(N, 192), (7680, 960), (7681, 1024), (8300, 1024)])
def test_version_is_the_lowest_that_holds_the_entry(tmp_path, lowrank, plugin, n, chunk):
    """Latent chunks sized to the entry (up to 7680 tokens) make version 5; entries chunked by
    1024 tokens stay version 3 (built-in codecs) or 4 (a plug-in array), which older readers
    read; every one verifies."""
    with Store.open(tmp_path / "store") as store:
        if plugin:
            info, _ = _save(store, lowrank, n=n)
        else:
            layout = H.tiny_layout()
            info = store.save(layout, H.CODECS, H.tokens(n), H.all_packed(layout, H.CODECS, n), anchor="x")
        assert info.arrays()["latent"].chunks[1] == chunk
        if chunk < TOKEN_CHUNK:
            assert info.manifest["format_version"] == SIZED_CHUNK_FORMAT_VERSION == 5
        else:
            assert info.manifest["format_version"] == (PLUGIN_FORMAT_VERSION if plugin else FORMAT_VERSION)
        assert store.verify(info) == []


def test_plugin_arrays_are_standard_zarr(tmp_path, lowrank):
    import zarr

    with Store.open(tmp_path / "store") as store:
        info, codecs = _save(store, lowrank)
        a = zarr.open_array(str(tmp_path / "store" / info.path / "latent"), mode="r")
        assert a.dtype == np.float16 and a.shape == (2, N, 12)
        attrs = a.attrs["anchorkv"]
        assert attrs["plugin"] == "lowrank" and "@ P^T" in attrs["decode"]
        full = _packed(H.tiny_layout(), codecs)[("model.layers.2.attn", "latent")]
        codes = full.payload.view(torch.float16).reshape(-1, 12)[:N].numpy()
        assert np.array_equal(a[0].view(np.uint16), codes.view(np.uint16))


def test_load_without_the_plugin_fails_in_one_line(tmp_path, lowrank, monkeypatch):
    with Store.open(tmp_path / "store") as store:
        info, _ = _save(store, lowrank)
    uninstall_plugins(monkeypatch)
    with Store.open(tmp_path / "store") as store:
        assert [e.state for e in store.scan()] == ["ok"]  # listed, intact: only decoding needs it
        assert store.verify(info.id) == []  # every byte checked without the plug-in
        layout = H.tiny_layout()
        reads = []
        real = store.backend.read_ranges_into
        monkeypatch.setattr(store.backend, "read_ranges_into", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
        with pytest.raises(MissingCodec) as e:
            store.load(info.id, layout, "model.layers.2.attn", "latent")
        msg = str(e.value)
        assert "\n" not in msg and "'lowrank'" in msg and "field 'latent'" in msg and "install" in msg
        assert reads == []  # refused before reading a byte
        raw = store.load(info.id, layout, "model.layers.0.attn", "conv")  # built-in fields still load
        assert raw.codec.id == "raw"


#: `anchorkv` in a fresh process that finds no codec plug-in, even where one is installed
_NO_PLUGINS = ("import sys; from anchorkv.codec import registry; registry.entry_points = lambda group: []; "
               "from anchorkv.cli import main; sys.exit(main(sys.argv[1:]))")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_PLUGINS, *args], capture_output=True, text=True, timeout=300)


def test_ls_and_inspect_show_the_plugin_and_mark_it_missing(tmp_path, lowrank):
    """The CLI runs in a fresh process without the plug-in: the entry is listed
    with its codec ids and marked; `inspect` says what a load will do."""
    store_dir = tmp_path / "store"
    with Store.open(store_dir) as store:
        info, _ = _save(store, lowrank)
    ls = _cli("ls", "--store", str(store_dir))
    assert ls.returncode == 0, ls.stderr
    assert "latent=lowrank(plug-in MISSING)" in ls.stdout and "recurrent=lowrank(plug-in MISSING)" in ls.stdout
    assert "ok (plug-in missing)" in ls.stdout and "need codec plug-ins not installed here: lowrank" in ls.stdout
    js = json.loads(_cli("ls", "--store", str(store_dir), "--json").stdout)
    (entry,) = js["entries"]
    assert entry["missing_plugins"] == ["lowrank"] and entry["codecs"]["conv"] == "raw"
    ins = _cli("inspect", "--store", str(store_dir), "plug-in-entry")
    assert ins.returncode == 0, ins.stderr
    assert "latent: lowrank:code_dtype=float16,digest=" in ins.stdout and "NOT INSTALLED here" in ins.stdout
    assert "version 5" in ins.stdout
    js = json.loads(_cli("inspect", "--store", str(store_dir), "plug-in-entry", "--json").stdout)
    assert js["missing_plugins"] == ["lowrank"]
    assert _cli("verify", "--store", str(store_dir)).returncode == 0


def test_ls_shows_an_installed_plugin(tmp_path, lowrank):
    from anchorkv.store.cli import codecs_text, missing_plugins

    with Store.open(tmp_path / "store") as store:
        info, _ = _save(store, lowrank)
        assert codecs_text(info) == "conv=raw latent=lowrank(plug-in) recurrent=lowrank(plug-in)"
        assert missing_plugins(info) == []


def test_what_the_store_refuses(tmp_path, lowrank, monkeypatch):
    layout = H.tiny_layout()
    specs = _specs(lowrank)
    conv = lowrank.codec_config(lowrank.fit_projection(torch.randn(50, H.CHANNELS).double(), 4))
    with pytest.raises(FormatError, match="split along its last axis.*use a built-in codec"):
        array_layouts(layout, {**specs, "conv": conv}, N)
    with pytest.raises(FormatError, match="field 'latent': no codec 'nope'"):
        array_layouts(layout, {**specs, "latent": "nope"}, N)
    with pytest.raises(FormatError, match="refused.*needs a fitted projection"):
        array_layouts(layout, {**specs, "latent": "lowrank"}, N)

    class NoRow:
        id = "norow"

        def encode(self, values, spec):
            raise AssertionError

        def decode(self, *a):
            raise AssertionError

    from anchorkv.codec import register_codec

    register_codec(NoRow)
    with pytest.raises(FormatError, match="no encoded_row.*cannot size its chunks"):
        array_layouts(layout, {**specs, "latent": "norow"}, N)


def test_writer_refuses_a_packed_of_other_options(tmp_path, lowrank):
    with Store.open(tmp_path / "store") as store:
        layout = H.tiny_layout()
        codecs = _resolved(layout, _specs(lowrank))
        packed = _packed(layout, codecs)
        w = store.begin_entry(layout, codecs, H.tokens(N), anchor="x")
        other = Packed(CodecSpec("lowrank", None, {**codecs["latent"].options, "digest": "0" * 16}),
                       *[getattr(packed[("model.layers.2.attn", "latent")], k)
                         for k in ("shape", "dtype", "payload", "scales")])
        with pytest.raises(FormatError, match="options it recorded at begin_entry"):
            w.write_layer("model.layers.2.attn", "latent", other)
        short = packed[("model.layers.2.attn", "latent")]
        bad = Packed(short.codec, short.shape, short.dtype, short.payload[:-2], short.scales)
        with pytest.raises(FormatError, match="payload bytes"):
            w.write_layer("model.layers.2.attn", "latent", bad)
        w.abort()


def test_version_must_match_the_arrays(tmp_path, lowrank):
    """A plug-in entry stamped version 3 (what an older reader would misread) is damaged."""
    from anchorkv.store.manifest import check_manifest

    with Store.open(tmp_path / "store") as store:
        info, _ = _save(store, lowrank)
    for stamped in (3, 4):
        m = dict(info.manifest, format_version=stamped)
        m["checksum"] = manifest_checksum(m)
        problems = check_manifest(info.id, m)
        assert any(f"format_version is {stamped}, its arrays make 5 (version 5: token chunks sized to the entry)" in p
                   for p in problems), problems


def test_an_older_reader_leaves_plugin_entries_alone(tmp_path, lowrank, monkeypatch):
    """An anchorkv that reads only version 3 lists the entry as newer-format (gc keeps it),
    never as damaged."""
    with Store.open(tmp_path / "store") as store:
        info, _ = _save(store, lowrank)
    import anchorkv.store.manifest as M

    monkeypatch.setattr(M, "READABLE_VERSIONS", (3,))
    with Store.open(tmp_path / "store") as store:
        with pytest.raises(OtherFormat, match="newer than"):
            store.get(info.id)
        assert [e.state for e in store.scan()] == ["newer-format"]
        report = store.gc(stale_after=0)
        assert report["removed"] == []


def test_chunk_encoding_encode_decode_match_the_plugin(lowrank):
    """`PluginChunkEncoding` (what conformance tools use per chunk) agrees with the plug-in."""
    layout = H.tiny_layout()
    encoding = array_layouts(layout, _specs(lowrank), N)["latent"].codec
    assert isinstance(encoding, PF.PluginChunkEncoding) and F.encoding_from_config(encoding.to_config()) == encoding
    x = H.logical_values(2, "latent", 64).float().numpy().reshape(1, 64, H.ROW)
    data = encoding.encode(x)
    plug = get_codec("lowrank")
    payload, _ = plug.encode(torch.from_numpy(x).to(torch.bfloat16), encoding.spec)
    assert data == payload.numpy().tobytes()
    want = plug.decode(payload, torch.empty(0, 0), encoding.spec, x.shape, torch.bfloat16).float().numpy()
    assert np.array_equal(encoding.decode(data, x.shape), want)
    with pytest.raises(StoreError, match="'absent'"):  # MissingCodec without the plug-in
        PF.PluginChunkEncoding.from_config({**encoding.to_config(), "plugin": "absent"}).decode(data, x.shape)


def _kv_layout(tp: int, r: int, block_size: int = 16):
    """A dense-attention model (Llama-like): paged ``k`` and ``v`` `[block, heads, head_dim]`,
    heads split by tp (the engine tests' shape, at 1/16 size)."""
    from anchorkv.codec import custom_layout
    from anchorkv.codec.layout import Field, PageLayout, dense_strides

    heads, dim = 4, 32
    shape = (block_size, heads // tp, dim)
    k = Field("k", torch.bfloat16, shape, dense_strides(shape), 0, logical_shape=(block_size, heads, dim),
              shard_axis=1, tp_size=tp, tp_rank=r)
    v = Field("v", torch.bfloat16, shape, dense_strides(shape), k.extent, logical_shape=(block_size, heads, dim),
              shard_axis=1, tp_size=tp, tp_rank=r)
    page = PageLayout((k, v), v.extent)
    return custom_layout("TinyLlama", [(f"model.layers.{i}.self_attn", "paged", page) for i in range(2)],
                         block_size=block_size, tp_size=tp, tp_rank=r)


def _kv_values(layer: int, field: str, n: int) -> torch.Tensor:
    """Logical `[n, heads, head_dim]` rows of rank 3 along head_dim."""
    i = torch.arange(n * 4, dtype=torch.float64)[:, None]
    c = torch.arange(32, dtype=torch.float64)[None]
    x = torch.sin(i * 0.31 + c * 0.2 + layer) + (field == "v") * torch.cos(i * 0.07 - c * 0.05)
    return x.reshape(n, 4, 32).to(torch.bfloat16)


def test_kv_rows_split_by_heads_restore_at_another_tp(tmp_path, lowrank):
    """K/V with the plug-in on head_dim rows: written by 2 ranks (each its heads), read at tp 1."""
    n = 40
    calib = torch.cat([_kv_values(9, f, 200) for f in ("k", "v")]).double().reshape(-1, 32)
    spec = lowrank.codec_config(lowrank.fit_projection(calib, 6))
    codecs = {k: a.codec.spec for k, a in array_layouts(_kv_layout(1, 0), {"k": spec, "v": spec}, n).items()}
    plug = get_codec("lowrank")
    with Store.open(tmp_path / "store") as store:
        writers = []
        for r in range(2):
            layout = _kv_layout(2, r)
            w = store.begin_entry(layout, codecs, H.tokens(n), anchor="kv", write_id="kvtp2")
            for layer in layout.layers:
                for f in layer.page.fields:
                    x = _kv_values(layer.index, f.name, 48)[:, f.rank_slice()[1]].reshape(3, 16, 2, 32)
                    payload, scales = plug.encode(x, codecs[f.name])
                    w.write_layer(layer.name, f.name, Packed(codecs[f.name], tuple(x.shape), x.dtype, payload, scales))
            w.finish_rank()
            writers.append(w)
        info = writers[0].commit()
        layout = _kv_layout(1, 0)
        for name, field in [("model.layers.0.self_attn", "k"), ("model.layers.1.self_attn", "v")]:
            p = store.load(info.id, layout, name, field)
            got = plug.decode(p.payload, p.scales, p.codec, p.shape, p.dtype).reshape(-1, 4, 32)[:n]
            x = _kv_values(layout.layer(name).index, field, n)
            want = plug.decode(*plug.encode(x, codecs[field]), codecs[field], tuple(x.shape), x.dtype)
            assert torch.equal(got, want)
            assert sqnr_db(x, got) > 40.0


def test_open_entry_decodes_plugin_fields(tmp_path, lowrank, monkeypatch):
    """`open_entry(path)[field]` reads a plug-in field as the plug-in decodes it (what a
    restore writes, as float32), and fails in one line naming the plug-in without it."""
    from anchorkv.store.reading import open_entry

    with Store.open(tmp_path / "store") as store:
        info, codecs = _save(store, lowrank)
    entry = open_entry(tmp_path / "store" / "entries" / info.id)
    layout = H.tiny_layout()
    got = entry["recurrent"][1]  # the state of the 2nd state layer holding it
    name = [layer.name for layer in layout.layers if "recurrent" in layer.page.names][1]
    want = _expected(layout, name, "recurrent", codecs["recurrent"])[0].to(torch.float32).numpy()
    assert got.shape == want.shape and np.array_equal(got, want)
    assert entry["latent"].shape[-1] == H.ROW
    uninstall_plugins(monkeypatch)
    with pytest.raises(MissingCodec, match="lowrank") as e:
        open_entry(tmp_path / "store" / "entries" / info.id)["recurrent"][0]
    assert "\n" not in str(e.value)
