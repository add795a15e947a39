"""Connector settings and import behaviour; no vLLM needed."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from anchorkv.codec import CodecSpec
from anchorkv.connector.config import PRESETS, ConnectorConfig, codec_banner, lossy_codecs, parse_size


def test_defaults():
    c = ConnectorConfig.from_extra_config({})
    assert c.lookup == "exact" and c.save_points == ("prefill", "finish") and c.async_load
    assert set(c.codec) == {"conv_state", "ssm_state", "k", "v", "latent"}  # roles


def test_default_codecs_are_exact():
    """Restores are bit-exact unless the user opts in: every field, and any unlisted one, is raw."""
    c = ConnectorConfig.from_extra_config({})
    assert {v.id for v in c.codec.values()} == {"raw"}
    assert c.codec_for("some_other_field").id == "raw"
    partial = ConnectorConfig.from_extra_config({"codec": {"recurrent": "bf16"}})
    assert {k: v.id for k, v in partial.codec.items() if v.id != "raw"} == {"recurrent": "bf16"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_by_name(name):
    c = ConnectorConfig.from_extra_config({"codec": name})
    assert {k: str(v) for k, v in c.codec.items()} == {k: str(CodecSpec.parse(v)) for k, v in PRESETS[name].items()}
    assert (name == "exact") == (not lossy_codecs(c.codec))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_resolve_for_the_store(tmp_path, name):
    """Every preset is a setting the store can keep (bf16 included), for Kimi-Linear at tp=2."""
    from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, kimi_linear_layout
    from anchorkv.connector.storage_zarr import ZarrEntryStore

    config = ConnectorConfig.from_extra_config({"store": str(tmp_path / "store"), "codec": name})
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=2)
    es = ZarrEntryStore(config, layout)
    # presets are keyed by role: Kimi-Linear's conv, recurrent and latent fields take theirs
    expected = {f.name: CodecSpec.parse(PRESETS[name][f.role]).id for f in layout.field_kinds().values()}
    assert {k: v.id for k, v in es.codecs.items()} == expected


def test_compact_preset_save_restore_cycle(tmp_path):
    """`compact` end to end through the worker path and the store: save, restore in a new
    process; conv and latent come back bit-exact, the recurrent state as its bf16 rounding
    (SQNR of bf16 rounding: 8 significant bits, about 55 dB), and nothing else is written."""
    from anchorkv.demo.cycle import cycle

    r = cycle(str(tmp_path / "store"), dict(PRESETS["compact"]))
    assert r["ok"], r.get("error")
    assert r["codecs"]["recurrent"].startswith("bf16") and r["codecs"]["conv"].startswith("raw")
    assert r["sqnr_db"]["conv"] == float("inf") and r["sqnr_db"]["latent"] == float("inf")
    assert 50.0 < r["sqnr_db"]["recurrent"] < 60.0
    assert r["stored_bytes"] < 0.75 * r["logical_bytes"]


def test_codec_banner_warns_when_lossy():
    exact = ConnectorConfig.from_extra_config({}).codec
    level, msg = codec_banner(exact)
    assert level == logging.INFO and "bit-exact" in msg
    level, msg = codec_banner(ConnectorConfig.from_extra_config({"codec": {"latent": "fp8:64"}}).codec)
    assert level == logging.WARNING and "LOSSY" in msg and "latent" in msg and "fp8:64" in msg


def test_full_config():
    c = ConnectorConfig.from_extra_config({
        "store": "/tmp/x", "codec": {"latent": "fp8:64", "recurrent": "int8"},
        "lookup": "semantic", "save_points": ["finish"], "capacity": "1.5GiB",
        "load_timeout_s": 5, "async_load": False, "model_id": " kimi-linear@v2 ",
    })
    assert c.model_id == "kimi-linear@v2"
    assert c.codec_for("latent") == CodecSpec("fp8", 64) and c.codec_for("recurrent") == CodecSpec("int8", 128)
    assert c.capacity == int(1.5 * 2**30) and c.save_points == ("finish",) and not c.async_load


@pytest.mark.parametrize("extra,msg", [
    ({"stor": "/x"}, r"unknown kv_connector_extra_config key\(s\) \['stor'\]; known keys are"),
    ({"lookup": "fuzzy"}, "'lookup' must be one of"),
    ({"codec": {"latent": "fp9:64"}}, None),
    ({"codec": {"latent": "fp8:abc"}}, "codec for field 'latent': .*group must be a number"),
    ({"codec": "fp8"}, "'codec' must be a preset name .* or map field kinds to codecs"),
    ({"save_points": ["prefil"]}, "'save_points' must be a list drawn from"),
    ({"capacity": "12 parsecs"}, "capacity"),
    ({"capacity": True}, "capacity"),
    ({"load_timeout_s": -1}, "'load_timeout_s' must be a positive number"),
    ({"async_load": "yes"}, "'async_load' must be true or false"),
    ({"store": ""}, "'store' must be a path or s3:// URL"),
    ({"model_id": ""}, "'model_id' must be a non-empty string naming the model's weights"),
    ({"model_id": 3}, "'model_id' must be a non-empty string"),
    # a second review's: values taken silently, or refused by a TypeError naming no key
    ({"capacity": 0.5}, "'capacity' must be a size like 200GB or a number of bytes >= 1"),  # was 0: evict all
    ({"save_backlog": 0.5}, "'save_backlog' must be"),
    ({"capacity": float("inf")}, "'capacity' must be"),  # OverflowError
    ({"load_timeout_s": float("nan")}, "'load_timeout_s' must be a positive number"),  # never timed out
    ({"save_points": 5}, "'save_points' must be a list"),  # TypeError
    ({"save_points": None}, "'save_points' must be a list"),
    ({"codec": {"recurrent": "int8:grup=64"}}, "codec 'int8' is built in and takes no options .* found \\['grup'\\]"),
    ({"codec": {"recurrent": {"id": "int8", "grup": 64}}}, "takes no options but its group size"),
    ({"codec": {"recurrent": "int8:rank=3"}}, "takes no options"),
    ({"storage_options": "x"}, "'storage_options' must be an object .* found 'x'"),
])
def test_bad_config_is_refused(extra, msg):
    if msg is None:  # an unknown codec id is only known at use; spelling is valid
        ConnectorConfig.from_extra_config(extra)
        return
    with pytest.raises(ValueError, match=msg):
        ConnectorConfig.from_extra_config(extra)


@pytest.mark.parametrize("extra", ["store=/x", [], [("store", "/x")]])
def test_a_config_that_is_not_an_object_is_refused(extra):
    with pytest.raises(ValueError, match="kv_connector_extra_config must be an object of keys"):
        ConnectorConfig.from_extra_config(extra)


@pytest.mark.parametrize("text,n", [("200GB", 200 * 10**9), ("1 TiB", 2**40), (4096, 4096), ("10mb", 10**7)])
def test_parse_size(text, n):
    assert parse_size(text) == n


def test_import_without_vllm_names_the_install():
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import anchorkv.connector as c\n"
        "try:\n    c.AnchorKVConnector\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "ERR" in out and "vllm==0.33.0" in out


def test_worker_path_and_store_import_without_vllm():
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import anchorkv.connector as c\n"
        "import anchorkv.connector.storage_zarr, anchorkv.connector.worker, anchorkv.demo.cycle\n"
        "try:\n    c.NoSuchThing\nexcept AttributeError as e:\n    print('ATTR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "ATTR module 'anchorkv.connector' has no attribute 'NoSuchThing'" in out


def test_the_default_model_id_is_what_every_process_is_given():
    """vLLM's model as given, with its revision when one is set: nothing a process finds on its
    own disk (every process of an engine must name the model alike)."""
    from types import SimpleNamespace

    from anchorkv.connector.connector import model_id_of

    def engine(model, revision=None):
        return SimpleNamespace(model_config=SimpleNamespace(model=model, revision=revision))

    assert model_id_of(engine("acme/Linear-7B")) == "acme/Linear-7B"
    assert model_id_of(engine("acme/Linear-7B", "0123abc")) == "acme/Linear-7B@0123abc"
    assert model_id_of(engine("/models/linear")) == "/models/linear"


def test_a_role_key_reaches_every_field_of_the_role_even_where_a_field_has_its_name():
    """Gemma 3: full layers' `k`, sliding layers' `k_window` (role k). `"k"` sets both (as on a
    model whose layers all slide, where no field is named `k`); `"k_window"` the sliding alone."""
    from anchorkv.connector.config import field_codecs

    roles = {"k": "k", "v": "v", "k_window": "k", "v_window": "v"}
    assert field_codecs({"k": "fp8:whole"}, roles) == {"k": "fp8:whole", "v": "raw", "k_window": "fp8:whole",
                                                        "v_window": "raw"}
    assert field_codecs({"k": "fp8:whole", "k_window": "bf16"}, roles)["k_window"] == "bf16"
    assert field_codecs({"k": "fp8:whole"}, {"k_window": "k"}) == {"k_window": "fp8:whole"}
