"""Build the layout model from what vLLM registers, and refuse what it does not understand.

vLLM 0.33 hands `register_kv_caches` one tensor per layer: MLA layers as bf16
`[num_blocks, 1, block_size, 576]`, KDA layers as int8 `[num_blocks, 1, 1, state_bytes]`
whose block stride is the padded page. An attention backend with its own kernel block size
(FlashMLA 64, FlashInfer-MLA 32 or 64, CUTLASS-MLA 128) makes vLLM split each scheduler block
into dense kernel blocks (`prepare_kernel_block_sizes`): the MLA view is then
`[num_blocks * k, 1, block_size / k, 576]`. Block ids and the layout count scheduler blocks
(tokens per block id); `scheduler_block_view` regroups a split view into those. Layers of different KV-cache groups alias the same
bytes; each view keeps its own strides (`Region.from_view`), so one view's stride is never
used for another's data (the bug vLLM PR #44848 fixed for NIXL).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from anchorkv.codec import CacheView, ConvLayout, LayerKind, ModelLayout, Region, kimi_linear_layout
from anchorkv.codec.models import KIMI_ARCHITECTURE


class UnsupportedModelError(ValueError):
    """The registered caches do not match any layout anchorkv knows how to save."""


def config_dict(hf_config: Any) -> dict:
    """A plain dict of a Hugging Face config object (or a dict already)."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    return dict(vars(hf_config))


def conv_layout_from_env() -> ConvLayout:
    value = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "SD").upper()
    try:
        return ConvLayout(value)
    except ValueError:
        raise UnsupportedModelError(
            f"VLLM_SSM_CONV_STATE_LAYOUT must be SD or DS, found {value!r}"
        ) from None


def build_views(
    kv_caches: Mapping[str, torch.Tensor],
    hf_config: Any,
    *,
    tp_size: int,
    tp_rank: int,
    conv_layout: ConvLayout | str | None = None,
    block_size: int | None = None,
) -> tuple[ModelLayout, dict[str, CacheView]]:
    """The model layout for this rank and one `CacheView` per registered layer.

    `block_size` is the scheduler's block size of the attention group (tokens per block id);
    None takes the registered view's (no kernel split)."""
    config = config_dict(hf_config)
    archs = config.get("architectures") or []
    if KIMI_ARCHITECTURE not in archs:
        raise UnsupportedModelError(
            f"anchorkv's vLLM connector knows {KIMI_ARCHITECTURE}; this model is {archs or 'unnamed'}. "
            "Other hybrid models need a layout builder (anchorkv.codec.custom_layout)."
        )
    mla_views = [t for t in kv_caches.values() if t.dtype == torch.bfloat16 and t.dim() == 4]
    if not mla_views:
        raise UnsupportedModelError(
            "no MLA cache view (bf16 [num_blocks, 1, block_size, 576]) among the registered layers; "
            f"found {_describe(kv_caches)}"
        )
    if block_size is None:
        block_size = mla_views[0].shape[2]
    kv_caches = {name: scheduler_block_view(name, t, block_size) if t.dtype == torch.bfloat16 and t.dim() == 4
                 else t for name, t in kv_caches.items()}
    layout = kimi_linear_layout(
        config, tp_size=tp_size, tp_rank=tp_rank, block_size=block_size,
        conv_layout=conv_layout or conv_layout_from_env(),
    )
    missing = [l.name for l in layout.layers if l.name not in kv_caches]
    extra = [n for n in kv_caches if n not in {l.name for l in layout.layers}]
    if missing or extra:
        raise UnsupportedModelError(
            f"registered layers do not match Kimi-Linear's {len(layout.layers)} cached layers: "
            f"missing {missing[:4]}{'...' if len(missing) > 4 else ''}, unexpected {extra[:4]}"
        )
    views = {}
    for layer in layout.layers:
        t = kv_caches[layer.name]
        _check_view(layer.name, layer.kind, t, layout)
        views[layer.name] = CacheView(Region.from_view(t), layer.page, layer.name)
    return layout, views


def scheduler_block_view(name: str, t: torch.Tensor, block_size: int) -> torch.Tensor:
    """An attention view `[blocks * k, 1, kernel_block, row]` regrouped as
    `[blocks, 1, block_size, row]` (the same bytes), `k = block_size / kernel_block`."""
    kernel_block = t.shape[2]
    if kernel_block == block_size:
        return t
    k, rest = divmod(block_size, kernel_block)
    dense = t.stride(0) == kernel_block * t.stride(2) and t.stride(3) == 1
    if rest or t.shape[0] % k or not dense:
        raise UnsupportedModelError(
            f"layer {name!r}: expected kernel blocks that tile the scheduler block of {block_size} "
            f"tokens densely, found {t.dtype} {list(t.shape)} strides {list(t.stride())}; "
            "use a kernel block size that divides the block size and a layer-compact KV-cache layout (LBNHC)"
        )
    return t.as_strided((t.shape[0] // k, t.shape[1], block_size, t.shape[3]),
                        (t.stride(0) * k, t.stride(1), t.stride(2), t.stride(3)), t.storage_offset())


def _check_view(name: str, kind: LayerKind, t: torch.Tensor, layout: ModelLayout) -> None:
    page = layout.layer(name).page
    if kind is LayerKind.PAGED:
        row = page.field("latent").shape[-1]
        expected = ("bf16", (1, layout.block_size, row))
        ok = t.dtype == torch.bfloat16 and t.dim() == 4 and tuple(t.shape[1:]) == (1, layout.block_size, row)
        ok = ok and t.stride()[2:] == (row, 1)  # axis 1 has size 1: its stride is arbitrary
    else:
        state = page.field("recurrent").extent
        expected = ("int8", (1, 1, state))
        ok = t.dtype in (torch.int8, torch.uint8) and t.dim() == 4 and tuple(t.shape[1:]) == (1, 1, state)
        ok = ok and t.stride(-1) == 1
    if not ok:
        raise UnsupportedModelError(
            f"layer {name!r}: expected a {expected[0]} view [num_blocks, {', '.join(map(str, expected[1]))}] "
            f"(tp={layout.tp_size}, block_size={layout.block_size}), found {t.dtype} {list(t.shape)} "
            f"strides {list(t.stride())}"
        )
    block_stride = t.stride(0) * t.element_size()
    if block_stride < page.page_bytes and kind is LayerKind.STATE:
        raise UnsupportedModelError(
            f"layer {name!r}: block stride {block_stride} bytes is smaller than the KDA page "
            f"{page.page_bytes} bytes"
        )


def _describe(kv_caches: Mapping[str, torch.Tensor]) -> str:
    kinds = {(str(t.dtype), tuple(t.shape[1:])) for t in kv_caches.values()}
    return ", ".join(f"{d} [*, {', '.join(map(str, s))}]" for d, s in sorted(kinds)) or "nothing"
