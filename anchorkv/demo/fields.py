"""Every field of one Kimi-Linear request through every codec, in memory, verified.

Builds the regions vLLM 0.33 would allocate for Kimi-Linear-48B-A3B on one rank (27 layers:
three KDA groups and one MLA group sharing 7 regions, real dims), fills one request's blocks
with realistic data, packs every field with each codec, unpacks into other block ids of the
same regions (as after a restart), and checks the result (raw: identical bytes; lossy: SQNR)
and that no other byte changed.
"""

from __future__ import annotations

import math
import time

import torch

from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, CacheView, LayerKind, Region, kimi_linear_layout, pack, unpack
from anchorkv.kernels.reference import dequantize
from anchorkv.testing.metrics import sqnr_db
from anchorkv.testing.regions import fill_realistic, hma_regions

CODECS = ("raw", "fp8", "int8", "int4")
GROUPS = {"conv": 128, "recurrent": 128, "latent": 64}  # 576 = 9 x 64


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def run(tp_size: int = 1, tp_rank: int = 0, seed: int = 0) -> list[dict]:
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=tp_size, tp_rank=tp_rank)
    # the request's blocks (src) and a fresh allocation's (dst), like after a restart: one
    # state block per KDA group, the paged blocks of the MLA group
    src_state, src_paged = [[1], [2], [3]], [4, 5]
    dst_state, dst_paged = [[6], [7], [8]], [10, 9]
    views = hma_regions(layout, num_blocks=11)
    state_layers = layout.of_kind(LayerKind.STATE)
    ids_of = {layer.name: src_state[i % 3] for i, layer in enumerate(state_layers)}
    dst_of = {layer.name: dst_state[i % 3] for i, layer in enumerate(state_layers)}
    for layer in layout.of_kind(LayerKind.PAGED):
        ids_of[layer.name], dst_of[layer.name] = src_paged, dst_paged
    g = torch.Generator().manual_seed(seed)
    for name, view in views.items():
        fill_realistic(view, ids_of[name], g)
    snapshot = {name: view.region.buffer.clone() for name, view in views.items()}

    rows = []
    for codec in CODECS:
        for field in GROUPS:
            layers = [layer for layer in layout.layers if field in layer.page.names]
            spec = codec if codec == "raw" else f"{codec}:{GROUPS[field]}"
            t0 = time.perf_counter()
            packed = [pack(views[layer.name], field, ids_of[layer.name], spec) for layer in layers]
            t1 = time.perf_counter()
            for layer, p in zip(layers, packed, strict=True):
                unpack(p, views[layer.name], field, dst_of[layer.name])
            t2 = time.perf_counter()
            worst, identical, untouched = math.inf, True, True
            for layer, p in zip(layers, packed, strict=True):
                view = views[layer.name]
                x = view.tensor(field)[ids_of[layer.name]]
                y = view.tensor(field)[dst_of[layer.name]]
                # the restored bytes are exactly the decoded packed values (raw: the source)
                expected = dequantize(p.payload, p.scales, p.codec, p.shape, p.dtype)
                identical &= torch.equal(_bytes(expected), _bytes(y))
                worst = min(worst, sqnr_db(x, y))
                untouched &= torch.equal(  # the source blocks are unchanged
                    _bytes(x),
                    _bytes(CacheView(Region(snapshot[layer.name], view.region.num_blocks,
                                            view.region.block_stride), view.page).tensor(field)[ids_of[layer.name]]),
                )
            before = sum(p.source_nbytes for p in packed)
            after = sum(p.nbytes for p in packed)
            rows.append({
                "field": field, "codec": spec, "layers": len(layers), "bytes_before": before,
                "bytes_after": after, "ratio": after / before, "sqnr_db": worst,
                "ok": identical and untouched and (codec != "raw" or math.isinf(worst)),
                "pack_gbs": (before + after) / (t1 - t0) / 1e9,
                "unpack_gbs": (before + after) / (t2 - t1) / 1e9,
            })
    return rows
