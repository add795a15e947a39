"""DeepSeek-V2/V3-style MLA: one latent row (kv_lora_rank + qk_rope_head_dim) per token,
the same on every tensor-parallel rank."""

from anchorkv.architectures.base import Description, Latent


def describe(config: dict) -> Description:
    archs = config.get("architectures") or ["DeepseekV3ForCausalLM"]
    return Description(str(archs[0]), (), Latent())
