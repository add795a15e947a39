"""NemotronH (Mamba2 + attention): vLLM's Mamba2 state is the conv window over x | B | C
(x of `mamba_num_heads * mamba_head_dim`, B and C of `n_groups * ssm_state_size` channels)
then the SSM state `[H, P, N]`. When tp does not divide `n_groups`, vLLM replicates groups
across ranks and the layout no longer splits evenly: those states are kept per rank."""

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
    heads = need(c, "mamba_num_heads")
    intermediate = heads * need(c, "mamba_head_dim")
    groups = need(c, "n_groups") * need(c, "ssm_state_size")
    conv = ConvState((ConvSegment("conv_x", intermediate), ConvSegment("conv_b", groups),
                      ConvSegment("conv_c", groups)))
    kv_heads = need(c, "num_key_value_heads", "num_attention_heads")
    return Description("NemotronHForCausalLM", (conv, HeadState("ssm", heads)), Attention(kv_heads))
