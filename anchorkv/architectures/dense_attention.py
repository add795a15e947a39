"""Dense attention models (Llama, Mistral, Qwen2/Qwen3; with sliding-window layers Gemma 2/3
and gpt-oss): K and V pages of `num_key_value_heads` heads, split along heads by tensor
parallelism (sliding-window layers alike; which layers slide, vLLM's specs say)."""

from anchorkv.architectures.base import Attention, Description, need, text_config


def describe(config: dict) -> Description:
    c = text_config(config)
    archs = c.get("architectures") or ["LlamaForCausalLM"]
    return Description(str(archs[0]), (), Attention(need(c, "num_key_value_heads", "num_attention_heads")))
