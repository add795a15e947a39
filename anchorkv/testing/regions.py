"""Synthetic cache regions and realistic fills (the demo, the benchmarks and the tests).

`hma_regions` lays one `CacheView` per layer over shared regions the way vLLM 0.33's hybrid
allocator does for Kimi-Linear-48B-A3B; `fill_realistic` writes values shaped like real state
into one request's blocks.
"""

from __future__ import annotations

import torch

from anchorkv.codec import CacheView, LayerKind, ModelLayout, Region


def hma_regions(layout: ModelLayout, num_blocks: int, device: str = "cpu") -> dict[str, CacheView]:
    """One `CacheView` per layer, laid over shared regions the way vLLM's HMA groups them.

    Layers are dealt into groups (three KDA groups, one MLA group); layer j of every group
    shares region j, each through its own page layout.
    """
    state = [layer for layer in layout.layers if layer.kind is LayerKind.STATE]
    paged = [layer for layer in layout.layers if layer.kind is LayerKind.PAGED]
    groups = [state[g::3] for g in range(3)] + [paged]
    n_regions = max(len(g) for g in groups)
    page = layout.layers[0].page.page_bytes
    buffers = [torch.zeros(num_blocks * page, dtype=torch.int8, device=device) for _ in range(n_regions)]
    views = {}
    for group in groups:
        for j, layer in enumerate(group):
            views[layer.name] = CacheView(Region(buffers[j], num_blocks, page), layer.page, layer.name)
    return views


def fill_realistic(view: CacheView, block_ids: list[int], g: torch.Generator) -> None:
    """Values shaped like real state: per-head scales, outlier channels, larger rope dims."""
    for f in view.page.fields:
        t = view.tensor(f.name)
        x = torch.randn((len(block_ids), *f.shape), generator=g)
        if f.name == "recurrent":  # per-head magnitude, heavy-ish tails
            x = x * torch.rand((1, f.shape[0], 1, 1), generator=g) * 0.05
        elif f.name == "conv":  # a few outlier channels
            x[..., :: max(1, f.shape[-1] // 8)] *= 20.0
        elif f.name == "latent":  # 512 latent + 64 rope, rope larger, outlier channels
            x[..., 512:] *= 4.0
            x[..., 7] *= 30.0
        t[block_ids] = x.to(device=t.device, dtype=f.dtype)
