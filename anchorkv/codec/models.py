"""Model layouts: which layers hold which fields, built from a model config or by hand.

Nothing below `kimi_linear_layout` is specific to Kimi-Linear: a `ModelLayout` is a list of
layers, each a `PageLayout` of fields, of one of two kinds:

* ``state`` layers (KDA, GDN, Mamba): a request's whole state lives in one block (the snapshot
  after some number of tokens); fields like ``conv`` and ``recurrent``;
* ``paged`` layers (attention, MLA): a request's tokens are spread over many blocks of
  `block_size` tokens; fields like ``latent`` (or ``k`` and ``v``). A sliding-window attention
  layer is a paged layer with a `window`: a query sees only the last `window` tokens (itself
  included), so an entry keeps only the rows its last token's window needs (`window_start`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from anchorkv.codec.layout import Field, PageLayout, dense_strides
from anchorkv.codec.packed import dtype_name


class LayerKind(str, Enum):
    STATE = "state"
    PAGED = "paged"

    def __str__(self) -> str:
        return self.value


class Role(str, Enum):
    """What a field holds, whatever a model calls it: the codec config is keyed by role (a
    field name works too), so one setting covers every model that has such a field."""

    CONV_STATE = "conv_state"  # causal-conv window of a linear-attention / Mamba layer
    SSM_STATE = "ssm_state"  # recurrent state (KDA, Gated DeltaNet, Mamba2 SSM)
    K = "k"  # attention keys
    V = "v"  # attention values
    LATENT = "latent"  # MLA compressed latent (+ rope) rows
    STATE = "state"  # a state tensor of a model without a description

    def __str__(self) -> str:
        return self.value


#: Names users wrote before roles existed: they keep selecting the same fields.
ROLE_ALIASES = {"conv": Role.CONV_STATE, "recurrent": Role.SSM_STATE}


class ConvLayout(str, Enum):
    """vLLM's `VLLM_SSM_CONV_STATE_LAYOUT`: SD = `[state_len, dim]` (default), DS = `[dim, state_len]`."""

    SD = "SD"
    DS = "DS"


@dataclass(frozen=True)
class LayerLayout:
    name: str
    index: int
    kind: LayerKind
    page: PageLayout
    #: sliding-window attention (paged layers only): the tokens a query attends to, itself
    #: included (vLLM's `sliding_window`); None: every earlier token
    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and (self.kind is not LayerKind.PAGED or self.window < 1):
            raise ValueError(f"layer {self.name!r}: a window ({self.window}) needs a paged layer and at least "
                             "one token")


def window_start(num_tokens: int, window: int, block_size: int) -> int:
    """The first token whose rows a sliding-window layer's entry of `num_tokens` tokens keeps:
    the start of the block holding the first token the next query attends to
    (`num_tokens - window + 1`), so the kept rows are whole blocks of a `block_size` engine
    (what vLLM still holds then; it frees the blocks wholly before that token)."""
    first = max(0, num_tokens - window + 1)
    return first // block_size * block_size


@dataclass(frozen=True)
class ModelLayout:
    """Every cached layer of one model on one tensor-parallel rank."""

    architecture: str
    layers: tuple[LayerLayout, ...]
    block_size: int
    tp_size: int = 1
    tp_rank: int = 0
    #: the weights' name (the connector's `model_id`): two checkpoints of one architecture
    #: (a fine-tune, another revision) have the same layers and must not restore each other's
    #: state. None: not part of the fingerprint (layouts made outside an engine, or where the
    #: weights' content names them: `weights`).
    model: str | None = None
    #: the weights' content (`connector.weights.weights_digest`): equal files, equal digest,
    #: wherever they are loaded from. None: not part of the fingerprint.
    weights: str | None = None
    #: what besides the weights decides the computed state (`connector.weights.config_digest`:
    #: the model's config, overrides included, the dtype and the quantization). None: not part
    #: of the fingerprint.
    model_config: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"layer names must be distinct, found duplicates in {names}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, found {self.block_size}")

    def layer(self, name: str) -> LayerLayout:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"unknown layer {name!r}; this model has {len(self.layers)} cached layers")

    def of_kind(self, kind: LayerKind | str) -> tuple[LayerLayout, ...]:
        kind = LayerKind(kind)
        return tuple(layer for layer in self.layers if layer.kind is kind)

    def field_kinds(self) -> dict[str, Field]:
        """Each field name once (its first layer's field): what the store keeps one array of."""
        out: dict[str, Field] = {}
        for layer in self.layers:
            for f in layer.page.fields:
                out.setdefault(f.name, f)
        return out

    def fingerprint(self) -> dict[str, Any]:
        """What a stored entry must agree with to be restored: TP-independent by design.

        The model's name, weights and config (`model`, `weights`, `model_config`, when set),
        layer names, kinds (and sliding windows) and each field's logical shape and dtype; not
        the rank, the block size or the strides (those change with tp and with vLLM's
        allocator, and the logical arrays do not).
        """
        return {
            "architecture": self.architecture,
            **({"model": self.model} if self.model is not None else {}),
            **({"weights": self.weights} if self.weights is not None else {}),
            **({"model_config": self.model_config} if self.model_config is not None else {}),
            "layers": [
                {
                    "name": layer.name,
                    "kind": layer.kind.value,
                    **({"window": layer.window} if layer.window is not None else {}),
                    "fields": {f.name: _field_fingerprint(layer.kind, f) for f in layer.page.fields},
                }
                for layer in self.layers
            ],
        }

    def fingerprint_hash(self) -> str:
        """The digest of `fingerprint()`, made once per layout (its fields never change)."""
        digest = self.__dict__.get("_fingerprint_hash")
        if digest is None:
            digest = self.__dict__["_fingerprint_hash"] = _digest(self.fingerprint())
        return digest

    def layout_fingerprint(self) -> dict[str, Any]:
        """The rank-specific physical layout (for diagnostics; not needed to restore)."""
        return {
            "block_size": self.block_size,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "pages": {
                layer.name: {
                    "page_bytes": layer.page.page_bytes,
                    "fields": [
                        [f.name, dtype_name(f.dtype), list(f.shape), list(f.strides), f.offset]
                        for f in layer.page.fields
                    ],
                }
                for layer in self.layers
            },
        }


def _field_fingerprint(kind: LayerKind, f: Field) -> dict[str, Any]:
    """dtype and logical shape; for paged layers the per-token row only (block size varies)."""
    shape = list(f.logical_shape) if kind is LayerKind.STATE else list(f.logical_shape[1:])
    return {"dtype": dtype_name(f.dtype), "shape": shape}


def _digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------- Kimi-Linear

#: vLLM 0.33 raises the attention block size to a multiple of this many tokens when it unifies
#: the page sizes of the hybrid groups (see `kimi_linear_layout`).
VLLM_BLOCK_ALIGN = 128

KIMI_ARCHITECTURE = "KimiLinearForCausalLM"


def _require(config: dict, *keys: str) -> Any:
    node: Any = config
    for i, key in enumerate(keys):
        if not isinstance(node, dict) or key not in node:
            raise ValueError(
                f"model config lacks {'.'.join(keys[: i + 1])!r}; is this a Kimi-Linear config.json?"
            )
        node = node[key]
    return node


def kimi_linear_dims(config: dict) -> dict[str, int]:
    """The dimensions of Kimi-Linear's cache state from its `config.json`."""
    lin = "linear_attn_config"
    heads = int(_require(config, lin, "num_heads"))
    head_dim = int(_require(config, lin, "head_dim"))
    return {
        "num_layers": int(_require(config, "num_hidden_layers")),
        "heads": heads,
        "head_dim": head_dim,
        "conv_taps": int(_require(config, lin, "short_conv_kernel_size")) - 1,
        "conv_channels": heads * head_dim,  # per q, k and v
        "latent": int(_require(config, "kv_lora_rank")) + int(_require(config, "qk_rope_head_dim")),
    }


def kimi_linear_layout(
    config: dict,
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    block_size: int | None = None,
    conv_layout: ConvLayout | str = ConvLayout.SD,
    dtype: torch.dtype = torch.bfloat16,
    state_dtype: torch.dtype = torch.float32,
) -> ModelLayout:
    """The cache layout vLLM 0.33 gives Kimi-Linear on rank `tp_rank` of `tp_size`.

    KDA page: `conv` `[taps, 3, channels/tp]` (logical order; physically `[taps, 3*channels/tp]`
    for SD or `[3*channels/tp, taps]` for DS, channels ordered q | k | v) at byte 0, then
    `recurrent` fp32 `[heads/tp, head_dim, head_dim]`, the page padded to the MLA page. MLA
    page: `latent` `[block_size, kv_lora_rank + rope]`, replicated on every rank. Without an
    explicit `block_size`, vLLM's rule applies: the smallest multiple of `VLLM_BLOCK_ALIGN`
    tokens whose MLA page holds one KDA state.
    """
    conv_layout = ConvLayout(conv_layout)
    d = kimi_linear_dims(config)
    if d["heads"] % tp_size or d["conv_channels"] % tp_size:
        raise ValueError(
            f"tp_size {tp_size} must divide the {d['heads']} KDA heads and "
            f"{d['conv_channels']} conv channels"
        )
    taps, ch = d["conv_taps"], d["conv_channels"] // tp_size
    conv_strides = (3 * ch, ch, 1) if conv_layout is ConvLayout.SD else (1, ch * taps, taps)
    tp = {"tp_size": tp_size, "tp_rank": tp_rank}
    conv = Field(
        "conv", dtype, (taps, 3, ch), conv_strides, 0,
        logical_shape=(taps, 3, d["conv_channels"]), shard_axis=2, role=Role.CONV_STATE.value, **tp,
    )
    rec_shape = (d["heads"] // tp_size, d["head_dim"], d["head_dim"])
    recurrent = Field(
        "recurrent", state_dtype, rec_shape, dense_strides(rec_shape), conv.extent,
        logical_shape=(d["heads"], d["head_dim"], d["head_dim"]), shard_axis=0,
        role=Role.SSM_STATE.value, **tp,
    )
    state_bytes = recurrent.extent
    token_bytes = d["latent"] * torch.empty((), dtype=dtype).element_size()
    if block_size is None:
        per_align = token_bytes * VLLM_BLOCK_ALIGN
        block_size = VLLM_BLOCK_ALIGN * -(-state_bytes // per_align)
    page_bytes = block_size * token_bytes
    if page_bytes < state_bytes:
        raise ValueError(
            f"block_size {block_size} gives an MLA page of {page_bytes} bytes, smaller than one "
            f"KDA state ({state_bytes} bytes); vLLM would pick at least "
            f"{-(-state_bytes // token_bytes)} tokens"
        )
    latent_shape = (block_size, d["latent"])
    latent = Field("latent", dtype, latent_shape, dense_strides(latent_shape), 0, role=Role.LATENT.value,
                   tp_size=tp_size, tp_rank=tp_rank)
    kda_page = PageLayout((conv, recurrent), page_bytes)
    mla_page = PageLayout((latent,), page_bytes)

    kda = {int(i) - 1 for i in _require(config, "linear_attn_config", "kda_layers")}
    full = {int(i) - 1 for i in _require(config, "linear_attn_config", "full_attn_layers")}
    if kda & full or (kda | full) != set(range(d["num_layers"])):
        raise ValueError(
            f"kda_layers and full_attn_layers must split the {d['num_layers']} layers; found "
            f"{len(kda)} KDA and {len(full)} full-attention layers ({len(kda & full)} in both)"
        )
    layers = [
        LayerLayout(
            f"model.layers.{i}.self_attn",
            i,
            LayerKind.STATE if i in kda else LayerKind.PAGED,
            kda_page if i in kda else mla_page,
        )
        for i in range(d["num_layers"])
    ]
    return ModelLayout(KIMI_ARCHITECTURE, tuple(layers), block_size, tp_size, tp_rank)


def custom_layout(
    architecture: str,
    layers: Iterable[tuple[str, LayerKind | str, PageLayout]],
    *,
    block_size: int,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> ModelLayout:
    """A layout from explicit pages, for any model with state layers and paged layers."""
    return ModelLayout(
        architecture,
        tuple(LayerLayout(name, i, LayerKind(kind), page) for i, (name, kind, page) in enumerate(layers)),
        block_size,
        tp_size,
        tp_rank,
    )


#: The public `config.json` of moonshotai/Kimi-Linear-48B-A3B, reduced to what layouts read.
KIMI_LINEAR_48B_CONFIG: dict[str, Any] = {
    "architectures": [KIMI_ARCHITECTURE],
    "model_type": "kimi_linear",
    "num_hidden_layers": 27,
    "hidden_size": 2304,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "q_lora_rank": None,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}
