"""Codec plug-ins: specs that carry a plug-in's options, the entry-point registry (through a
real ``importlib.metadata`` distribution on `sys.path`), and the example plug-in
``examples/lowrank_codec`` through `pack` / `unpack`.

`install_example` is shared with the store and connector plug-in tests.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from anchorkv.codec import CacheView, CodecSpec, Region, custom_layout, get_codec, pack, registry, unpack
from anchorkv.codec.layout import Field, PageLayout, dense_strides
from anchorkv.codec.spec import BUILTIN_IDS
from anchorkv.kernels.quant import Quant
from anchorkv.testing.metrics import sqnr_db

EXAMPLE_SRC = Path(__file__).resolve().parents[2] / "examples" / "lowrank_codec" / "src"


def _dist(site: Path, name: str, entry_points: str) -> None:
    """A minimal installed distribution (what pip leaves in site-packages) under `site`."""
    info = site / f"{name}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(entry_points)


def sandbox_registry(monkeypatch, site: Path | None = None) -> None:
    """A registry of the built-ins only, whose entry points are read afresh, by
    ``importlib.metadata``, from the distributions in `site` alone (none without one), so a
    plug-in installed in the environment plays no part."""
    from importlib.metadata import distributions

    def entry_points(group: str):
        dists = distributions(path=[str(site)]) if site is not None else []
        return [ep for d in dists for ep in d.entry_points if ep.group == group]

    monkeypatch.setattr(registry, "_codecs", {k: v for k, v in registry._codecs.items() if k in BUILTIN_IDS})
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.setattr(registry, "_broken", {})
    monkeypatch.setattr(registry, "entry_points", entry_points)


def install_example(monkeypatch, tmp_path: Path) -> None:
    """Make the example plug-in installed the way pip does (its package and a dist-info holding
    its ``anchorkv.codecs`` entry point in a site directory on `sys.path`), in a fresh registry.
    The package is copied, so build leftovers in the source tree (an ``.egg-info`` from ``pip
    install -e``) play no part."""
    site = _site_with_example(tmp_path)
    entry = (EXAMPLE_SRC.parent / "pyproject.toml").read_text().split('[project.entry-points."anchorkv.codecs"]')[1]
    name, _, target = entry.strip().splitlines()[0].partition("=")  # lowrank = "module:attr"
    _dist(site, "anchorkv_lowrank_codec", f"[anchorkv.codecs]\n{name.strip()} = {target.strip().strip(chr(34))}\n")
    monkeypatch.syspath_prepend(str(site))
    sandbox_registry(monkeypatch, site)


def _site_with_example(tmp_path: Path) -> Path:
    site = tmp_path / "site-packages"
    shutil.copytree(EXAMPLE_SRC / "lowrank_codec", site / "lowrank_codec",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return site


def uninstall_plugins(monkeypatch) -> None:
    """As if no plug-in were installed: built-ins only, no entry point found."""
    sandbox_registry(monkeypatch)


@pytest.fixture
def lowrank(monkeypatch, tmp_path):
    install_example(monkeypatch, tmp_path)
    import lowrank_codec

    return lowrank_codec


def low_rank_rows(n: int, width: int, rank: int, seed: int, noise: float = 0.0) -> torch.Tensor:
    """`[n, width]` rows lying in a fixed rank-`rank` subspace (plus isotropic `noise`)."""
    g = torch.Generator().manual_seed(1234)  # the subspace: the same for every seed
    basis = torch.linalg.qr(torch.randn(width, rank, generator=g, dtype=torch.float64))[0]
    g = torch.Generator().manual_seed(seed)
    coeffs = torch.randn(n, rank, generator=g, dtype=torch.float64) * torch.linspace(3, 1, rank, dtype=torch.float64)
    return coeffs @ basis.T + noise * torch.randn(n, width, generator=g, dtype=torch.float64)


# ------------------------------------------------------------------ specs


def test_builtin_ids_agree_with_the_formats():
    assert BUILTIN_IDS == {q.value for q in Quant}


@pytest.mark.parametrize("text,spec", [
    ("lowrank", CodecSpec("lowrank", None)),
    ("lowrank:rank=16,code_dtype=float16", CodecSpec("lowrank", None, {"rank": 16, "code_dtype": "float16"})),
    ("lowrank:rank=16,group=64,x=1.5,y=true,z=null",
     CodecSpec("lowrank", 64, {"rank": 16, "x": 1.5, "y": True, "z": None})),
    ("int8:64", CodecSpec("int8", 64)),
    ("fp8", CodecSpec("fp8", 128)),
])
def test_plugin_spec_string_form(text, spec):
    assert CodecSpec.parse(text) == spec
    assert CodecSpec.parse(str(spec)) == spec
    assert CodecSpec.from_dict(spec.to_dict()) == spec


def test_plugin_spec_dict_forms_agree():
    inline = CodecSpec.parse({"id": "lowrank", "rank": 16, "basis": [[1, 0], [0, 1]]})
    nested = CodecSpec.parse({"id": "lowrank", "params": {"basis": [[1, 0], [0, 1]], "rank": 16}})
    assert inline == nested and hash(inline) == hash(nested)  # hashable with list values
    assert inline.options == {"rank": 16, "basis": [[1, 0], [0, 1]]}
    assert CodecSpec.from_dict(inline.to_dict()) == inline
    assert inline.group is None and CodecSpec.parse({"id": "int8"}).group == 128


def test_plugin_spec_str_abbreviates_long_values():
    spec = CodecSpec("lowrank", None, {"projection": "A" * 5000, "rank": 8})
    assert str(spec) == "lowrank:projection=<5000 chars>,rank=8"


@pytest.mark.parametrize("value,msg", [
    ("lowrank:rank", r"group must be a number or 'whole' \(or key=value options"),
    ("lowrank:rank=1,width", "expected key=value options"),
    ("lowrank:rank=1,rank=2", "given twice"),
    ({"rank": 4}, "needs an 'id'"),
    ({"id": "lowrank", "rank": 4, "params": {"width": 2}}, "either inline or under 'params'"),
    ({"id": "lowrank", "x": float("nan")}, "JSON values"),
    ({"id": "lowrank", "params": {"id": 1}}, "other than 'id'"),
])
def test_plugin_spec_errors(value, msg):
    with pytest.raises(ValueError, match=msg):
        CodecSpec.parse(value)


# ------------------------------------------------------------------ registry


def test_example_registers_through_its_entry_point(lowrank):
    codec = get_codec("lowrank")
    assert type(codec) is lowrank.LowRankCodec  # loaded from the dist-info's entry point
    assert "lowrank" in registry.available_codecs() and registry.has_codec("lowrank")


def test_a_broken_plugin_is_named_and_spares_the_others(monkeypatch, tmp_path):
    site = _site_with_example(tmp_path)
    _dist(site, "broken_codec", "[anchorkv.codecs]\nbroken = no_such_module_xyz:Codec\n"
                                "misnamed = lowrank_codec:LowRankCodec\n")
    monkeypatch.syspath_prepend(str(site))
    sandbox_registry(monkeypatch, site)
    assert get_codec("int8").id == "int8"
    with pytest.raises(KeyError) as e:
        get_codec("broken")
    msg = e.value.args[0]
    assert "'broken' is installed but" in msg and "ModuleNotFoundError" in msg and "\n" not in msg
    with pytest.raises(KeyError, match="codec's id is 'lowrank', the entry point is named 'misnamed'"):
        get_codec("misnamed")
    assert not registry.has_codec("lowrank")  # never registered under another name


def test_missing_plugin_message_says_what_to_do(monkeypatch):
    uninstall_plugins(monkeypatch)
    with pytest.raises(KeyError, match=r"no codec 'lowrank'.*install the package that provides it"):
        get_codec("lowrank")


# ------------------------------------------------------------------ the example codec


def test_fit_projection_is_orthonormal_and_deterministic(lowrank):
    rows = low_rank_rows(300, 64, 6, seed=0, noise=0.01)
    p = lowrank.fit_projection(rows, 6)
    assert p.shape == (64, 6) and p.dtype == torch.float32
    assert torch.allclose(p.double().T @ p.double(), torch.eye(6, dtype=torch.float64), atol=1e-5)
    assert torch.equal(p, lowrank.fit_projection(rows, 6))


def _configured(lowrank, p, width, dtype=torch.bfloat16, **kw):
    return lowrank.LowRankCodec().configure(CodecSpec.parse(lowrank.codec_config(p, **kw)), width, dtype)


@pytest.mark.parametrize("rows", [(0, 1), (7, 50), (130, 131)], ids=lambda r: f"rows{r[0]}-{r[1]}")
@pytest.mark.parametrize("code_dtype", ["float16", "bfloat16", "float32"])
def test_rows_encode_independently(lowrank, code_dtype, rows):
    """The store's contract: any subset of rows encodes to exactly those rows' bytes, and
    decodes to those rows of the whole decode."""
    x = low_rank_rows(131, 72, 5, seed=1, noise=0.05).to(torch.bfloat16).reshape(131, 72)
    codec = lowrank.LowRankCodec()
    spec = _configured(lowrank, lowrank.fit_projection(x.double(), 5), 72, code_dtype=code_dtype)
    row = codec.encoded_row(72, torch.bfloat16, spec)
    payload, scales = codec.encode(x, spec)
    assert payload.dtype == torch.uint8 and payload.numel() == 131 * row.payload_bytes and scales.numel() == 0
    per_row = payload.reshape(131, row.payload_bytes)
    lo, hi = rows
    assert torch.equal(codec.encode(x[lo:hi], spec)[0].reshape(-1, row.payload_bytes), per_row[lo:hi])
    out = codec.decode(payload, scales, spec, (131, 72), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (131, 72)
    part = codec.decode(per_row[lo:hi].reshape(-1), scales, spec, (hi - lo, 72), torch.bfloat16)
    assert torch.equal(part, out[lo:hi])


def test_fidelity_floors(lowrank):
    """Rows in a rank-8 subspace come back to the code dtype's precision; isotropic rows lose
    exactly the energy outside the kept rank (the codec cannot do better, and does not)."""
    codec = lowrank.LowRankCodec()
    calib = low_rank_rows(2000, 576, 8, seed=0, noise=0.0)
    spec = _configured(lowrank, lowrank.fit_projection(calib, 8), 576, dtype=torch.float32)
    test = low_rank_rows(500, 576, 8, seed=1).to(torch.float32)
    got = codec.decode(*codec.encode(test, spec), spec, tuple(test.shape), torch.float32)
    assert sqnr_db(test, got) >= 60.0  # fp16 codes: ~70 dB
    iso = torch.randn(500, 576, generator=torch.Generator().manual_seed(3))
    got = codec.decode(*codec.encode(iso, spec), spec, tuple(iso.shape), torch.float32)
    assert abs(sqnr_db(iso, got) - 10 * math.log10(576 / (576 - 8))) < 0.05


def test_pack_unpack_through_a_cache_view(lowrank):
    """The public API with the plug-in: pack blocks of a K field `[block, heads, head_dim]`,
    unpack into other blocks; the cache gets exactly decode(encode(values)), nothing else."""
    bs, heads, dim = 16, 4, 32
    k = Field("k", torch.bfloat16, (bs, heads, dim), dense_strides((bs, heads, dim)), 0)
    page = PageLayout((k,), k.extent + 64)
    layout = custom_layout("TinyLlama", [("model.layers.0.attn", "paged", page)], block_size=bs)
    region = Region(torch.zeros(6 * page.page_bytes, dtype=torch.int8), 6, page.page_bytes)
    view = CacheView(region, layout.layers[0].page)
    values = low_rank_rows(2 * bs * heads, dim, 4, seed=2, noise=0.02).to(torch.bfloat16).reshape(2, bs, heads, dim)
    view.tensor("k")[[1, 4]] = values
    spec = _configured(lowrank, lowrank.fit_projection(values.double().reshape(-1, dim), 4), dim)
    before = region.buffer.clone()
    packed = pack(view, "k", [1, 4], spec)
    assert packed.payload.numel() == 2 * bs * heads * 4 * 2  # rank 4, fp16 codes
    unpack(packed, view, "k", [0, 2])
    codec = get_codec("lowrank")
    want = codec.decode(*codec.encode(values, spec), spec, tuple(values.shape), torch.bfloat16)
    assert torch.equal(view.tensor("k")[[0, 2]], want)
    assert sqnr_db(values, want) > 30.0
    page_bytes = page.page_bytes
    changed = (region.buffer != before).nonzero().flatten()
    blocks = set((changed // page_bytes).tolist())
    assert blocks <= {0, 2} and all(int(i) % page_bytes < k.extent for i in changed)


@pytest.mark.parametrize("opts,msg", [
    ({}, "needs a fitted projection"),
    ({"rank": 2, "colour": "red"}, "unknown lowrank options"),
    ({"code_dtype": "int8"}, "code_dtype must be one of"),
])
def test_configure_refuses_bad_options(lowrank, opts, msg):
    with pytest.raises(ValueError, match=msg):
        lowrank.LowRankCodec().configure(CodecSpec("lowrank", None, opts), 16, torch.bfloat16)


def test_configure_checks_the_projection(lowrank, tmp_path):
    codec = lowrank.LowRankCodec()
    p = lowrank.fit_projection(low_rank_rows(100, 16, 3, seed=0), 3)
    with pytest.raises(ValueError, match="rows of 16 values, this field's rows have 24"):
        codec.configure(CodecSpec.parse(lowrank.codec_config(p)), 24, torch.bfloat16)
    with pytest.raises(ValueError, match="not orthonormal"):
        codec.configure(CodecSpec.parse(lowrank.codec_config(p * 2)), 16, torch.bfloat16)
    path = tmp_path / "p.npy"
    lowrank.save_projection(path, p)
    from_file = codec.configure(CodecSpec("lowrank", None, {"projection_file": str(path)}), 16, torch.bfloat16)
    assert from_file == codec.configure(CodecSpec.parse(lowrank.codec_config(p)), 16, torch.bfloat16)
    assert "projection_file" not in from_file.options  # entries carry P itself, not a path
    assert set(from_file.options) == {"projection", "rank", "width", "code_dtype", "digest"}
