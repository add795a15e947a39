"""Model configs the vLLM harnesses build engines from (no weights: `config.json` only).

`KIMI_LINEAR_48B_VLLM_CONFIG` is the library's `KIMI_LINEAR_48B_CONFIG` (what layouts read:
layer kinds, latent and rope widths, KDA heads) completed with the fields vLLM 0.33 reads to
build the model's layers and cache specs, from the public `config.json` of
moonshotai/Kimi-Linear-48B-A3B-Instruct. The layer facts are the library's, not a copy.
"""

from __future__ import annotations

import copy
from typing import Any

from anchorkv.codec import KIMI_LINEAR_48B_CONFIG

#: The rest of Kimi-Linear-48B-A3B-Instruct's public config.json that vLLM reads.
_KIMI_LINEAR_48B_FOR_VLLM: dict[str, Any] = {
    "vocab_size": 163840,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 72,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "mla_use_nope": True,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "use_grouped_topk": True,
    "num_expert_group": 1,
    "topk_group": 1,
    "max_position_embeddings": 1048576,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
}

#: The public config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct (the fields vLLM reads).
KIMI_LINEAR_48B_VLLM_CONFIG: dict[str, Any] = {**copy.deepcopy(KIMI_LINEAR_48B_CONFIG), **_KIMI_LINEAR_48B_FOR_VLLM}

_LINEAR = KIMI_LINEAR_48B_VLLM_CONFIG["linear_attn_config"]
KIMI_NUM_LAYERS: int = KIMI_LINEAR_48B_VLLM_CONFIG["num_hidden_layers"]
#: 0-based layer indices (the config lists them 1-based).
KIMI_KDA_LAYERS: list[int] = [i - 1 for i in _LINEAR["kda_layers"]]
KIMI_MLA_LAYERS: list[int] = [i - 1 for i in _LINEAR["full_attn_layers"]]
#: The MLA cache row: kv_lora_rank latent + qk_rope_head_dim rope.
KIMI_MLA_HEAD_SIZE: int = KIMI_LINEAR_48B_VLLM_CONFIG["kv_lora_rank"] + KIMI_LINEAR_48B_VLLM_CONFIG["qk_rope_head_dim"]
