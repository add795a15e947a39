"""What a per-architecture description says, and the generic code that turns it, with the
shapes vLLM hands the connector, into pages of fields.

A description is data (one small module per architecture, see `anchorkv.architectures`):

* the state tensors of its linear-attention / Mamba layers, in the order vLLM's `MambaSpec`
  lists them: a `ConvState` (the causal-conv window, whose channel axis concatenates
  `segments` that tensor parallelism splits one by one) or a `HeadState` (a recurrent / SSM
  state split along its leading heads axis);
* its attention pages: `Attention` (K and V rows of `kv_heads` heads) or `Latent` (MLA).

From these the builders derive each field's name, role, logical (TP-independent) shape and
sharded axis, so the store keeps one logical array per field whatever the tensor-parallel
size. A state tensor or attention page no description covers is still saved and restored,
per rank: its logical shape gets a leading axis of `tp_size` ranks (sharded along it), so
its entries restore only at the same tensor-parallel size (the fingerprint says so).

Axis letters: T taps of the conv window, C channels, H heads, N tokens of a block.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from anchorkv.codec.layout import Field, PageLayout, dense_strides
from anchorkv.codec.models import ConvLayout, Role


class DescriptionMismatch(ValueError):
    """vLLM's shapes do not match what the description derives from the model config."""


@dataclass(frozen=True)
class ConvSegment:
    """A run of `channels` logical channels of a conv state, split evenly across ranks."""

    name: str
    channels: int


@dataclass(frozen=True)
class ConvState:
    """A conv window `[T, C]` (vLLM: `(T, C/tp)` for SD, `(C/tp, T)` for DS) whose channels
    are `segments` back to back; rank r holds the r-th slice of every segment, in order.

    Each segment becomes a field `[T, channels]` (role conv_state). `stacked`: segments of
    equal width kept as one field `[T, len(segments), channels]` of that name instead
    (Kimi-Linear's `conv`, q | k | v)."""

    segments: tuple[ConvSegment, ...]
    stacked: str | None = None

    @property
    def channels(self) -> int:
        return sum(s.channels for s in self.segments)


@dataclass(frozen=True)
class HeadState:
    """A recurrent state `[H, ...]` (vLLM: `(H/tp, ...)`), split along its heads."""

    name: str
    heads: int
    role: Role = Role.SSM_STATE


@dataclass(frozen=True)
class Attention:
    """K and V rows of `kv_heads` heads per token (fields `k`, `v`: `[N, H, head_size]`)."""

    kv_heads: int


@dataclass(frozen=True)
class Latent:
    """One MLA latent row per token (field `latent`: `[N, width]`), the same on every rank."""


@dataclass(frozen=True)
class Description:
    """One architecture's cache, as data. `architecture` is recorded in fingerprints."""

    architecture: str
    state: tuple[ConvState | HeadState, ...] = ()
    paged: Attention | Latent | None = None


# ----------------------------------------------------------------------------- config helpers


def text_config(config: Mapping) -> dict:
    """The language model's config: multimodal wrappers (Qwen3.5) nest it in `text_config`."""
    inner = config.get("text_config")
    if isinstance(inner, Mapping):
        return {**config, **inner}
    return dict(config)


def need(config: Mapping, *keys: str, default=None) -> int:
    """The first of `keys` the config has, as an int; a clear error naming them otherwise."""
    for key in keys:
        if config.get(key) is not None:
            return int(config[key])
    if default is not None:
        return default
    raise DescriptionMismatch(f"model config lacks {' / '.join(repr(k) for k in keys)}")


def layer_number(name: str) -> int:
    """The layer index in a vLLM layer name (``model.layers.12.linear_attn`` -> 12)."""
    m = re.search(r"\.(\d+)\.", f".{name}.")
    return int(m.group(1)) if m else -1


# ----------------------------------------------------------------------------- state pages


def conv_fields(desc: ConvState, shape: Sequence[int], dtype: torch.dtype, offset: int, *,
                conv_layout: ConvLayout, tp_size: int, tp_rank: int) -> list[Field]:
    """The fields of one conv state tensor of vLLM shape `shape` at byte `offset` of the page."""
    if conv_layout is ConvLayout.SD:
        taps, local = shape
    else:
        local, taps = shape
    if local * tp_size != desc.channels or any(s.channels % tp_size for s in desc.segments):
        raise DescriptionMismatch(
            f"conv state {tuple(shape)} ({conv_layout.value}) at tp={tp_size}: the description's "
            f"{len(desc.segments)} segments of {[s.channels for s in desc.segments]} channels "
            f"need {desc.channels // tp_size} channels per rank, vLLM allocates {local}")
    isz = dtype.itemsize
    # element (t, c) of the rank's window: SD at t * local + c, DS at c * taps + t
    t_stride, c_stride = (local, 1) if conv_layout is ConvLayout.SD else (1, taps)
    role = Role.CONV_STATE.value
    widths = {s.channels for s in desc.segments}
    if desc.stacked is not None:
        if len(widths) != 1:
            raise DescriptionMismatch(f"stacked conv segments must be of equal width, found {sorted(widths)}")
        ch = widths.pop()
        n = len(desc.segments)
        return [Field(desc.stacked, dtype, (taps, n, ch // tp_size),
                      (t_stride, ch // tp_size * c_stride, c_stride), offset,
                      logical_shape=(taps, n, ch), shard_axis=2, tp_size=tp_size, tp_rank=tp_rank, role=role)]
    out, start = [], 0
    for seg in desc.segments:
        width = seg.channels // tp_size
        out.append(Field(seg.name, dtype, (taps, width), (t_stride, c_stride), offset + start * c_stride * isz,
                         logical_shape=(taps, seg.channels), shard_axis=1, tp_size=tp_size, tp_rank=tp_rank,
                         role=role))
        start += width
    return out


def head_field(desc: HeadState, shape: Sequence[int], dtype: torch.dtype, offset: int, *,
               tp_size: int, tp_rank: int) -> Field:
    shape = tuple(shape)
    if shape[0] * tp_size != desc.heads:
        raise DescriptionMismatch(
            f"state {desc.name!r}: the description has {desc.heads} heads, {desc.heads / tp_size:g} per "
            f"rank at tp={tp_size}; vLLM allocates {shape}")
    return Field(desc.name, dtype, shape, dense_strides(shape), offset,
                 logical_shape=(desc.heads, *shape[1:]), shard_axis=0,
                 tp_size=tp_size, tp_rank=tp_rank, role=desc.role.value)


def per_rank_field(name: str, role: Role, dtype: torch.dtype, shape: Sequence[int], strides: Sequence[int],
                   offset: int, *, tp_size: int, tp_rank: int, token_axis: bool = False) -> Field:
    """A field kept per rank: a ranks axis of `tp_size` in front of its shape (behind the token
    axis of a paged field), split one rank each. Restores only at the same tp."""
    shape, strides = tuple(shape), tuple(strides)
    n = math.prod(shape)
    at = 1 if token_axis else 0
    local = (*shape[:at], 1, *shape[at:])
    logical = (*shape[:at], tp_size, *shape[at:])
    # the size-1 ranks axis needs a stride that keeps the field free of self-overlap
    rank_stride = max((s * k for s, k in zip(strides, shape, strict=True)), default=n)
    return Field(name, dtype, local, (*strides[:at], rank_stride, *strides[at:]), offset,
                 logical_shape=logical, shard_axis=at, tp_size=tp_size, tp_rank=tp_rank, role=role.value)


def state_page(desc: Sequence[ConvState | HeadState] | None, shapes: Sequence[Sequence[int]],
               dtypes: Sequence[torch.dtype], page_bytes: int, *, conv_layout: ConvLayout,
               tp_size: int, tp_rank: int) -> tuple[PageLayout, bool]:
    """The page of a state layer from vLLM's `MambaSpec` shapes and dtypes (the tensors lie
    back to back from byte 0, as vLLM's Mamba layers slice them). Returns (page, described):
    without a matching description every tensor is a per-rank field ``state<i>``."""
    offsets, off = [], 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        offsets.append(off)
        off += math.prod(shape) * dtype.itemsize
    if desc is not None and len(desc) == len(shapes):
        fields: list[Field] = []
        for d, shape, dtype, o in zip(desc, shapes, dtypes, offsets, strict=True):
            if isinstance(d, ConvState):
                fields += conv_fields(d, shape, dtype, o, conv_layout=conv_layout, tp_size=tp_size, tp_rank=tp_rank)
            else:
                fields.append(head_field(d, shape, dtype, o, tp_size=tp_size, tp_rank=tp_rank))
        return PageLayout(tuple(fields), page_bytes), True
    if desc is not None:
        raise DescriptionMismatch(f"the description lists {len(desc)} state tensors, vLLM allocates "
                                  f"{len(shapes)} ({[tuple(s) for s in shapes]})")
    fields = [per_rank_field(f"state{i}", Role.STATE, dtype, shape, dense_strides(tuple(shape)), o,
                             tp_size=tp_size, tp_rank=tp_rank)
              for i, (shape, dtype, o) in enumerate(zip(shapes, dtypes, offsets, strict=True))]
    return PageLayout(tuple(fields), page_bytes), False


# ----------------------------------------------------------------------------- paged pages


def attention_page(desc: Attention | None, *, heads: int, head_size: int, head_size_v: int, dtype: torch.dtype,
                   block_size: int, head_stride: int, token_stride: int, page_bytes: int,
                   tp_size: int, tp_rank: int, planar: bool = False) -> tuple[PageLayout, bool]:
    """K and V of an attention page, as fields `k` `[N, H, head_size]` and `v`
    `[N, H, head_size_v]`, from vLLM's `[H, N, head_size + head_size_v]` cells (strides in
    elements of `dtype`).

    How a backend arranges K and V in a head's `[N, 2 * head_size]` bytes differs: most split
    each cell (`[..., :head_size]` is K: `planar=False`); vLLM's CPU backend views them as
    `[2N, head_size]` rows, K in rows 0..N-1 and V in rows N..2N-1 (`planar=True`)."""
    isz = dtype.itemsize
    # the description's K/V heads, when this rank holds its share of them (None: per rank)
    kv_heads = desc.kv_heads if desc is not None and heads * tp_size == desc.kv_heads else None
    if planar:
        if head_size != head_size_v or token_stride != head_size + head_size_v:
            raise DescriptionMismatch(
                f"a planar K/V page needs equal K and V head sizes and dense [N, C] rows per head, found "
                f"head sizes {head_size}/{head_size_v}, token stride {token_stride}")
        parts = (("k", Role.K, head_size, 0), ("v", Role.V, head_size_v, block_size * head_size))
        token_stride = head_size
    else:
        parts = (("k", Role.K, head_size, 0), ("v", Role.V, head_size_v, head_size))
    out = []
    for name, role, size, at in parts:
        shape, strides = (block_size, heads, size), (token_stride, head_stride, 1)
        if kv_heads is not None:
            out.append(Field(name, dtype, shape, strides, at * isz, logical_shape=(block_size, kv_heads, size),
                             shard_axis=1, tp_size=tp_size, tp_rank=tp_rank, role=role.value))
        else:
            out.append(per_rank_field(name, role, dtype, shape, strides, at * isz, tp_size=tp_size,
                                      tp_rank=tp_rank, token_axis=True))
    return PageLayout(tuple(out), page_bytes), kv_heads is not None


def latent_page(*, width: int, dtype: torch.dtype, block_size: int, token_stride: int, page_bytes: int,
                tp_size: int, tp_rank: int) -> PageLayout:
    """An MLA page: one latent row `[width]` per token, replicated on every rank."""
    f = Field("latent", dtype, (block_size, width), (token_stride, 1), 0,
              tp_size=tp_size, tp_rank=tp_rank, role=Role.LATENT.value)
    return PageLayout((f,), page_bytes)
