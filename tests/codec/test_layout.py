"""The layout model and the Kimi-Linear builder against vLLM 0.33's sizes and byte layout."""

from __future__ import annotations

import copy

import pytest
import torch

from anchorkv.codec import (
    KIMI_LINEAR_48B_CONFIG,
    CacheView,
    Field,
    LayerKind,
    PageLayout,
    Region,
    kimi_linear_layout,
)

# (tp, block_size, page bytes, KDA state bytes) from VLLM_NOTES.md (tp=1 read off the real allocator)
VLLM_SIZES = [(1, 1920, 2_211_840, 2_170_880), (2, 1024, 1_179_648, 1_085_440),
              (4, 512, 589_824, 542_720), (8, 256, 294_912, 271_360)]

KDA_LAYERS = [0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, 16, 17, 18, 20, 21, 22, 24, 25]
MLA_LAYERS = [3, 7, 11, 15, 19, 23, 26]


@pytest.mark.parametrize("tp,block_size,page,state", VLLM_SIZES)
def test_kimi_sizes_match_vllm(tp, block_size, page, state):
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=tp)
    assert layout.block_size == block_size
    kda, mla = layout.layer("model.layers.0.self_attn"), layout.layer("model.layers.3.self_attn")
    assert kda.page.page_bytes == mla.page.page_bytes == page
    conv, rec = kda.page.field("conv"), kda.page.field("recurrent")
    assert conv.nbytes == 73_728 // tp and rec.offset == 73_728 // tp
    assert rec.shape == (32 // tp, 128, 128) and rec.extent == state
    assert mla.page.field("latent").shape == (block_size, 576)


def test_kimi_layer_kinds_follow_config():
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG)
    assert [layer.index for layer in layout.of_kind(LayerKind.STATE)] == KDA_LAYERS
    assert [layer.index for layer in layout.of_kind("paged")] == MLA_LAYERS
    assert layout.layers[26].name == "model.layers.26.self_attn"


def _region(page: int, num_blocks: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (num_blocks * page,), dtype=torch.int8, generator=g)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_conv_sd_matches_vllm_slicing(tp):
    """vLLM slices conv as bf16 [blocks, 3, 12288/tp] at byte 0 (SD): channels q | k | v."""
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=tp)
    page = layout.layers[0].page
    buf = _region(page.page_bytes, 3)
    ours = CacheView(Region(buf, 3, page.page_bytes), page).tensor("conv")
    c = 4096 // tp
    vllm = buf.view(torch.bfloat16).reshape(3, -1)[:, : 3 * 3 * c].reshape(3, 3, 3 * c)
    assert torch.equal(ours.view(torch.int16), vllm.reshape(3, 3, 3, c).view(torch.int16))


def test_conv_ds_transposes_taps():
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=4, conv_layout="DS")
    page = layout.layers[0].page
    buf = _region(page.page_bytes, 2)
    ours = CacheView(Region(buf, 2, page.page_bytes), page).tensor("conv")  # [b, tap, j, c]
    c = 1024
    vllm = buf.view(torch.bfloat16).reshape(2, -1)[:, : 3 * 3 * c].reshape(2, 3 * c, 3)  # [b, ch, tap]
    for t in range(3):
        for j in range(3):
            assert torch.equal(ours[:, t, j].view(torch.int16), vllm[:, j * c : (j + 1) * c, t].view(torch.int16))


def test_recurrent_matches_vllm_slicing():
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=8)
    page = layout.layers[0].page
    buf = _region(page.page_bytes, 3)
    ours = CacheView(Region(buf, 3, page.page_bytes), page).tensor("recurrent")
    rows = buf.reshape(3, page.page_bytes)[:, 73_728 // 8 : 73_728 // 8 + 4 * 128 * 128 * 4]
    vllm = rows.contiguous().view(torch.float32).reshape(3, 4, 128, 128)
    assert torch.equal(ours.view(torch.int32), vllm.view(torch.int32))


def test_views_alias_one_region_with_their_own_strides():
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=8)
    page = layout.layers[0].page.page_bytes
    buf = torch.zeros(4 * page, dtype=torch.int8)
    kda = CacheView(Region(buf, 4, page), layout.layers[0].page)
    mla = CacheView(Region(buf, 4, page), layout.layers[3].page)
    mla.tensor("latent")[2] = 1.0
    assert kda.tensor("recurrent")[[0, 1, 3]].abs().sum() == 0
    assert (buf.reshape(4, page)[2] != 0).all()  # the latent fills the whole page
    assert not buf.reshape(4, page)[[0, 1, 3]].any()


def test_rank_slice_and_logical_shapes():
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=4, tp_rank=2)
    page = layout.layers[0].page
    assert page.field("recurrent").rank_slice()[0] == slice(16, 24)
    assert page.field("conv").rank_slice()[2] == slice(2048, 3072)
    assert page.field("conv").logical_shape == (3, 3, 4096)
    assert layout.layers[3].page.field("latent").rank_slice() == (slice(0, 512), slice(0, 576))


def test_fingerprint_is_tp_independent_and_sensitive_to_dims():
    fps = {kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=tp, tp_rank=tp - 1).fingerprint_hash()
           for tp in (1, 2, 4, 8)}
    assert len(fps) == 1
    other = copy.deepcopy(KIMI_LINEAR_48B_CONFIG)
    other["linear_attn_config"]["head_dim"] = 64
    assert kimi_linear_layout(other).fingerprint_hash() not in fps
    assert kimi_linear_layout(KIMI_LINEAR_48B_CONFIG).layout_fingerprint() != \
        kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=2).layout_fingerprint()


# ----------------------------------------------------------------------------- bad input


def test_tp_must_divide_heads():
    with pytest.raises(ValueError, match="tp_size 3 must divide the 32 KDA heads"):
        kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=3)


def test_block_size_too_small_for_state():
    with pytest.raises(ValueError, match="block_size 64 .* smaller than one KDA state"):
        kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, block_size=64)


def test_config_missing_key_is_named():
    config = copy.deepcopy(KIMI_LINEAR_48B_CONFIG)
    del config["linear_attn_config"]["num_heads"]
    with pytest.raises(ValueError, match="linear_attn_config.num_heads"):
        kimi_linear_layout(config)


def test_misaligned_offset_is_refused():
    with pytest.raises(ValueError, match="field 'x': byte offset 6 must be .* multiple of 4"):
        Field("x", torch.float32, (4,), (1,), 6)


def test_overlapping_strides_are_refused():
    with pytest.raises(ValueError, match="field 'x': strides \\[1, 2\\] make elements .* overlap"):
        Field("x", torch.float32, (4, 3), (1, 2), 0)


def test_shard_must_divide():
    with pytest.raises(ValueError, match="tp_size 3 does not divide axis 0 .* \\(32\\)"):
        Field("h", torch.float32, (10, 4), (4, 1), 0, logical_shape=(32, 4), shard_axis=0, tp_size=3)


def test_field_beyond_page():
    f = Field("x", torch.float32, (8, 8), (8, 1), 16)
    with pytest.raises(ValueError, match="field 'x' ends at byte 272 of the page, beyond the page size 256"):
        PageLayout((f,), 256)


def test_fields_overlapping_in_page():
    a = Field("a", torch.float32, (8,), (1,), 0)
    b = Field("b", torch.float32, (8,), (1,), 16)
    with pytest.raises(ValueError, match="fields 'a' and 'b' overlap"):
        PageLayout((a, b), 64)


def test_buffer_too_small():
    page = PageLayout((Field("x", torch.float32, (8,), (1,), 0),), 64)
    with pytest.raises(ValueError, match="4 blocks of 64 bytes need 224 bytes, but the buffer holds 200"):
        CacheView(Region(torch.zeros(200, dtype=torch.uint8), 4, 64), page, name="v")


def test_page_larger_than_block_stride():
    page = PageLayout((Field("x", torch.float32, (8,), (1,), 0),), 64)
    with pytest.raises(ValueError, match="page of 64 bytes does not fit the region's block stride of 48"):
        CacheView(Region(torch.zeros(400, dtype=torch.uint8), 4, 48), page)


def test_unknown_field_lists_known_ones():
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=8)
    with pytest.raises(KeyError, match="unknown field 'ssm'.*'conv', 'recurrent'"):
        layout.layers[0].page.field("ssm")


def test_region_from_view_reads_vllm_strides():
    page = 294_912
    storage = torch.zeros(5 * page, dtype=torch.int8)
    kda_view = storage.view(5, 1, 1, page)[:, :, :, :271_360]  # vLLM's int8 [blocks, 1, 1, state]
    region = Region.from_view(kda_view)
    assert (region.num_blocks, region.block_stride) == (5, page)
