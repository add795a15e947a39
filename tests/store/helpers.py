"""A small hybrid model for store tests, and Packed fields cut from TP-independent data.

The model has the shape of Kimi-Linear at 1/64 of its size: state layers with ``conv``
bf16 `[3 taps, 3, 64 channels]` (sharded along channels, the last axis) and ``recurrent`` fp32
`[8 heads, 16, 16]` (sharded along heads), paged layers with a replicated ``latent`` bf16 row of
72 (not a power of two). Values come from arithmetic, so every rank of every tp cuts its slice
from the same logical arrays.
"""

from __future__ import annotations

import numpy as np
import torch

from anchorkv.codec.layout import Field, PageLayout, dense_strides
from anchorkv.codec.models import custom_layout
from anchorkv.codec.packed import Packed
from anchorkv.codec.spec import CodecSpec
from anchorkv.kernels import reference

CHANNELS, HEADS, DIM, ROW, TAPS = 64, 8, 16, 72, 3
KINDS = ["state", "state", "paged", "state", "paged"]
CODECS = {"conv": "int8:8", "recurrent": "int8:16", "latent": "fp8:whole"}
RAW_CODECS = {"conv": "raw", "recurrent": "raw", "latent": "raw"}


def tiny_layout(tp_size: int = 1, tp_rank: int = 0, block_size: int = 64, architecture: str = "TinyHybrid"):
    tp = {"tp_size": tp_size, "tp_rank": tp_rank}
    ch = CHANNELS // tp_size
    conv = Field("conv", torch.bfloat16, (TAPS, 3, ch), dense_strides((TAPS, 3, ch)), 0,
                 logical_shape=(TAPS, 3, CHANNELS), shard_axis=2, **tp)
    rshape = (HEADS // tp_size, DIM, DIM)
    rec = Field("recurrent", torch.float32, rshape, dense_strides(rshape), conv.extent,
                logical_shape=(HEADS, DIM, DIM), shard_axis=0, **tp)
    latent = Field("latent", torch.bfloat16, (block_size, ROW), dense_strides((block_size, ROW)), 0, **tp)
    page_bytes = max(rec.extent, latent.extent)
    pages = {"state": PageLayout((conv, rec), page_bytes), "paged": PageLayout((latent,), page_bytes)}
    layers = [(f"model.layers.{i}.attn", kind, pages[kind]) for i, kind in enumerate(KINDS)]
    return custom_layout(architecture, layers, block_size=block_size, **tp)


def logical_values(layer: int, field: str, num_tokens: int = 0, seed: int = 0) -> torch.Tensor:
    """The TP-independent values of a field of a layer (float64 arithmetic, then the dtype)."""
    shape = {"conv": (TAPS, 3, CHANNELS), "recurrent": (HEADS, DIM, DIM), "latent": (num_tokens, ROW)}[field]
    n = int(np.prod(shape))
    i = torch.arange(n, dtype=torch.float64)
    x = torch.sin(i * (0.37 + 0.01 * layer) + seed) * 3.0 + torch.cos(i * 0.011) * (1 + layer)
    dtype = torch.float32 if field == "recurrent" else torch.bfloat16
    return x.reshape(shape).to(dtype)


def rank_packed(layout, layer_name: str, field: str, codec: str, num_tokens: int, seed: int = 0) -> Packed:
    """What the pack kernel gives rank `layout.tp_rank` for this field (via the reference)."""
    layer = layout.layer(layer_name)
    f = layer.page.field(field)
    full = logical_values(layer.index, field, num_tokens, seed)
    if layer.kind.value == "state":
        x = full[f.rank_slice()].unsqueeze(0)
    else:
        bs = layout.block_size
        blocks = -(-num_tokens // bs)
        pad = torch.full((blocks * bs - num_tokens, ROW), 7.0, dtype=full.dtype)  # junk past the tokens
        x = torch.cat([full, pad]).reshape(blocks, bs, ROW)
    spec = CodecSpec.parse(codec)
    payload, scales = reference.quantize(x.contiguous(), spec)
    return Packed(spec, tuple(x.shape), x.dtype, payload, scales)


def all_packed(layout, codecs: dict[str, str], num_tokens: int, seed: int = 0) -> dict:
    return {
        (layer.name, f.name): rank_packed(layout, layer.name, f.name, codecs[f.name], num_tokens, seed)
        for layer in layout.layers
        for f in layer.page.fields
    }


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 7919 + seed * 104729) % 151_000


def record_reads(monkeypatch, store, before=None) -> list[str]:
    """The paths `store.backend.read` is asked for from now on (a list that grows as it reads);
    `before(path)`, if given, runs before each read (to hold it, or make it fail)."""
    paths: list[str] = []
    real = store.backend.read

    def read(path, *args, **kwargs):
        paths.append(path)
        if before is not None:
            before(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(store.backend, "read", read)
    return paths
