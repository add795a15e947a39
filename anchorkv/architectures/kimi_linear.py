"""Kimi-Linear (KDA + MLA): vLLM's KDA state is the conv window over q | k | v (equal widths,
kept as one field `conv` `[T, 3, C]`) then the recurrent state `[H, K, V]`; MLA pages hold
one latent row (kv_lora_rank + rope) per token."""

from anchorkv.architectures.base import ConvSegment, ConvState, Description, HeadState, Latent, need


def describe(config: dict) -> Description:
    lin = config.get("linear_attn_config") or {}
    heads, head_dim = need(lin, "num_heads"), need(lin, "head_dim")
    channels = heads * head_dim
    conv = ConvState(tuple(ConvSegment(n, channels) for n in ("q", "k", "v")), stacked="conv")
    return Description("KimiLinearForCausalLM", (conv, HeadState("recurrent", heads)), Latent())
