"""Tiny random-weight models for the engine tests, made at test time (no hub, nothing committed).

    .venv-engine/bin/python -m anchorkv.testing.engine.models qwen3_next DIR ['{"num_hidden_layers": 6}']
    .venv-engine/bin/python -m anchorkv.testing.engine.models llama DIR
    .venv-engine/bin/python -m anchorkv.testing.engine.models deepseek_v2 DIR
    .venv-engine/bin/python -m anchorkv.testing.engine.models gemma3 DIR

Runs in the engine environment (its transformers writes the config vLLM reads). Weights come
from a seeded initialization and are saved with `save_pretrained`, so every engine process of a
test reads the same bytes. `initializer_range` is raised from 0.02 so that greedy tokens depend
strongly on the context (a near-uniform random model would repeat one token whatever the state
holds, and a broken restore could not change its output).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

QWEN3_NEXT = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, head_dim=64, full_attention_interval=2,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=128, shared_expert_intermediate_size=128, decoder_sparse_step=1,
    max_position_embeddings=16384, initializer_range=0.1, tie_word_embeddings=False,
)
LLAMA = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=16384,
    initializer_range=0.1, tie_word_embeddings=False,
)
#: DeepSeek-V2-style MLA (Kimi-Linear's attention): vLLM's CPU MLA kernels take only a 576-wide
#: latent row (kv_lora_rank 512 + rope 64), so those two are the real ones; one dense layer, then MoE
DEEPSEEK_V2 = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1, first_k_dense_replace=1,
    topk_method="greedy", n_group=1, topk_group=1, max_position_embeddings=16384,
    initializer_range=0.1, tie_word_embeddings=False,
)
#: Gemma 3 text: three sliding-window layers (window 200, longer than vLLM's 128-token CPU block,
#: so a prompt's early blocks are freed) and one full-attention layer
GEMMA3 = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=200,
    layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=16384,
    initializer_range=0.1, tie_word_embeddings=False,  # (tied, its greedy tokens repeat one token whatever the prompt)
)
GPT_OSS = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=4, num_experts_per_tok=2,
    max_position_embeddings=16384, initializer_range=0.1, tie_word_embeddings=False,
)
KINDS = ("qwen3_next", "llama", "deepseek_v2", "gemma3", "gpt_oss")


def make(kind: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny `kind` model (bf16 safetensors + config.json) to `path`; return it."""
    import torch
    import transformers

    config: transformers.PretrainedConfig
    cls: type[transformers.PreTrainedModel]
    if kind == "qwen3_next":
        config = transformers.Qwen3NextConfig(**{**QWEN3_NEXT, **overrides})
        cls = transformers.Qwen3NextForCausalLM
    elif kind == "llama":
        config = transformers.LlamaConfig(**{**LLAMA, **overrides})
        cls = transformers.LlamaForCausalLM
    elif kind == "deepseek_v2":
        config = transformers.DeepseekV2Config(**{**DEEPSEEK_V2, **overrides})
        cls = transformers.DeepseekV2ForCausalLM
    elif kind == "gemma3":
        config = transformers.Gemma3TextConfig(**{**GEMMA3, **overrides})
        cls = transformers.Gemma3ForCausalLM
    elif kind == "gpt_oss":
        config = transformers.GptOssConfig(**{**GPT_OSS, **overrides})
        cls = transformers.GptOssForCausalLM
    else:
        raise ValueError(f"model kind must be one of {KINDS}, found {kind!r}")
    torch.manual_seed(seed)
    # transformers wraps `to` with functools.wraps(torch.nn.Module.to), which types it as the
    # unbound function: mypy would take the dtype for `self`
    model = cls(config).to(torch.bfloat16)  # type: ignore[arg-type]
    path = Path(path)
    model.save_pretrained(path)
    return path


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] not in KINDS:
        sys.exit(f"usage: {sys.argv[0]} {{{'|'.join(KINDS)}}} DIR [JSON_OVERRIDES]")
    make(sys.argv[1], sys.argv[2], **(json.loads(sys.argv[3]) if len(sys.argv) == 4 else {}))
