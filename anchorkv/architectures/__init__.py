"""Per-architecture cache descriptions: one small module each, data read by generic code.

Each module has `describe(config) -> Description`; `MODULES` maps each module to the
Hugging Face `architectures` names it covers, and `describe` here picks the module by the
config's architecture, importing only that one. A model without a description still saves and
restores at the same tensor-parallel size (see `anchorkv.architectures.base`).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module

from anchorkv.architectures.base import (
    Attention,
    ConvSegment,
    ConvState,
    Description,
    DescriptionMismatch,
    HeadState,
    Latent,
)

#: module name -> the architectures it describes (kept here so lookups import one module)
MODULES: dict[str, tuple[str, ...]] = {
    "kimi_linear": ("KimiLinearForCausalLM",),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                   "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
    "nemotron_h": ("NemotronHForCausalLM",),
    "dense_attention": ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                        "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                        "Gemma3ForConditionalGeneration", "GptOssForCausalLM"),
    "deepseek_mla": ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
}


def architecture_of(config: Mapping) -> str | None:
    archs = config.get("architectures") or []
    return str(archs[0]) if archs else None


def describe(config: Mapping) -> Description | None:
    """The description of the model `config` (a config.json dict), or None if none covers it."""
    archs = set(config.get("architectures") or [])
    for module, names in MODULES.items():
        if archs & set(names):
            return import_module(f"{__name__}.{module}").describe(dict(config))
    return None


def described_architectures() -> list[str]:
    return sorted(a for names in MODULES.values() for a in names)


__all__ = ["Attention", "ConvSegment", "ConvState", "Description", "DescriptionMismatch", "HeadState",
           "Latent", "MODULES", "architecture_of", "describe", "described_architectures"]
