"""Qwen3-Next / Qwen3.5 (Gated DeltaNet + gated full attention): vLLM's GDN state is the conv
window over q | k | v (q and k of `linear_num_key_heads`, v of `linear_num_value_heads`:
unequal widths, so three fields) then the recurrent state `[Hv, Dv, Dk]`; attention pages
hold K and V of `num_key_value_heads` heads."""

from anchorkv.architectures.base import (
    Attention,
    ConvSegment,
    ConvState,
    Description,
    HeadState,
    need,
    text_config,
)


def describe(config: dict) -> Description:
    c = text_config(config)
    k_heads, v_heads = need(c, "linear_num_key_heads"), need(c, "linear_num_value_heads")
    key_dim = k_heads * need(c, "linear_key_head_dim")
    value_dim = v_heads * need(c, "linear_value_head_dim")
    conv = ConvState((ConvSegment("conv_q", key_dim), ConvSegment("conv_k", key_dim),
                      ConvSegment("conv_v", value_dim)))
    kv_heads = need(c, "num_key_value_heads", "num_attention_heads")
    name = str((c.get("architectures") or ["Qwen3NextForCausalLM"])[0])
    return Description(name, (conv, HeadState("ssm", v_heads)), Attention(kv_heads))
