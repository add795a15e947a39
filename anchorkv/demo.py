"""`anchorkv demo`: one Kimi-Linear request's cache state through every codec, verified; then a
save -> new process -> restore cycle through the store (`anchorkv.connector.demo_cycle`).

Builds the regions vLLM 0.33 would allocate for Kimi-Linear-48B-A3B on one rank (27 layers:
three KDA groups and one MLA group sharing 7 regions, real dims), fills one request's blocks
with realistic data, packs every field with each codec, unpacks into other block ids of the
same regions (as after a restart), checks the result (raw: identical bytes; lossy: SQNR) and
that no other byte changed, and prints a table.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch

from anchorkv.codec import (
    KIMI_LINEAR_48B_CONFIG,
    CacheView,
    LayerKind,
    ModelLayout,
    Region,
    kimi_linear_layout,
    pack,
    unpack,
)
from anchorkv.kernels.reference import dequantize

CODECS = ("raw", "fp8", "int8", "int4")
GROUPS = {"conv": 128, "recurrent": 128, "latent": 64}  # 576 = 9 x 64


def hma_regions(layout: ModelLayout, num_blocks: int, device: str = "cpu") -> dict[str, CacheView]:
    """One `CacheView` per layer, laid over shared regions the way vLLM's HMA groups them.

    Layers are dealt into groups (three KDA groups, one MLA group); layer j of every group
    shares region j, each through its own page layout.
    """
    state = [l for l in layout.layers if l.kind is LayerKind.STATE]
    paged = [l for l in layout.layers if l.kind is LayerKind.PAGED]
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


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    noise = ((x - y) ** 2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10((x**2).sum().item() / noise)


def run(tp_size: int = 1, tp_rank: int = 0, seed: int = 0) -> list[dict]:
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=tp_size, tp_rank=tp_rank)
    # the request's blocks (src) and a fresh allocation's (dst), like after a restart
    src = {"state": [[1], [2], [3]], "paged": [4, 5]}
    dst = {"state": [[6], [7], [8]], "paged": [10, 9]}
    views = hma_regions(layout, num_blocks=11)
    state_layers = layout.of_kind(LayerKind.STATE)
    ids_of = {l.name: src["state"][i % 3] for i, l in enumerate(state_layers)}
    dst_of = {l.name: dst["state"][i % 3] for i, l in enumerate(state_layers)}
    for l in layout.of_kind(LayerKind.PAGED):
        ids_of[l.name], dst_of[l.name] = src["paged"], dst["paged"]
    g = torch.Generator().manual_seed(seed)
    for name, view in views.items():
        fill_realistic(view, ids_of[name], g)
    snapshot = {name: view.region.buffer.clone() for name, view in views.items()}

    rows = []
    for codec in CODECS:
        for field in GROUPS:
            layers = [l for l in layout.layers if field in l.page.names]
            spec = codec if codec == "raw" else f"{codec}:{GROUPS[field]}"
            t0 = time.perf_counter()
            packed = [pack(views[l.name], field, ids_of[l.name], spec) for l in layers]
            t1 = time.perf_counter()
            for l, p in zip(layers, packed):
                unpack(p, views[l.name], field, dst_of[l.name])
            t2 = time.perf_counter()
            worst, identical, untouched = math.inf, True, True
            for l, p in zip(layers, packed):
                view = views[l.name]
                x = view.tensor(field)[ids_of[l.name]]
                y = view.tensor(field)[dst_of[l.name]]
                # the restored bytes are exactly the decoded packed values (raw: the source)
                expected = dequantize(p.payload, p.scales, p.codec.id, p.codec.group, p.shape, p.dtype)
                identical &= torch.equal(_bytes(expected), _bytes(y))
                worst = min(worst, sqnr_db(x, y))
                untouched &= torch.equal(  # the source blocks are unchanged
                    _bytes(x),
                    _bytes(CacheView(Region(snapshot[l.name], view.region.num_blocks,
                                            view.region.block_stride), view.page).tensor(field)[ids_of[l.name]]),
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


def _print(rows: list[dict], tp_size: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Kimi-Linear-48B-A3B, one request, tp={tp_size} (rank 0), CPU reference path")
    for col in ("field", "codec", "layers", "before", "after", "ratio", "worst SQNR dB",
                "pack GB/s", "unpack GB/s", "verified"):
        table.add_column(col, justify="left" if col in ("field", "codec") else "right")
    for r in rows:
        table.add_row(
            r["field"], r["codec"], str(r["layers"]), _size(r["bytes_before"]), _size(r["bytes_after"]),
            f"{r['ratio']:.3f}", "exact" if math.isinf(r["sqnr_db"]) else f"{r['sqnr_db']:.1f}",
            f"{r['pack_gbs']:.2f}", f"{r['unpack_gbs']:.2f}", "yes" if r["ok"] else "NO",
        )
    Console(width=max(Console().width, 120)).print(table)


def _size(n: float) -> str:
    """Binary units, as `anchorkv ls` shows sizes."""
    from anchorkv.store.cli import human_bytes

    return human_bytes(n)


#: The store cycle's codec settings: lossless, and the connector's defaults.
CYCLE_CODECS = {
    "raw": {"conv": "raw", "recurrent": "raw", "latent": "raw"},
    "default": None,  # filled from anchorkv.connector.config.DEFAULT_CODECS
}


def store_cycle(store: str | None, seed: int) -> list[dict]:
    """Save -> NEW PROCESS -> restore through the store and the connector's worker path."""
    import tempfile

    from anchorkv.connector.config import DEFAULT_CODECS
    from anchorkv.connector.demo_cycle import cycle

    rows = []
    with tempfile.TemporaryDirectory(prefix="anchorkv-demo-") as tmp:
        root = store or tmp
        for name, codec in CYCLE_CODECS.items():
            codec = dict(codec or DEFAULT_CODECS)
            path = os.path.join(root, f"demo-{name}")
            rows.append({"name": name, "store": path if store else None, **cycle(path, codec, seed)})
    return rows


def _print_cycle(rows: list[dict], store: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    where = (f"stores {os.path.join(store, 'demo-<codecs>')}" if store else "temporary stores, removed after")
    table = Table(title="save -> new process -> restore (ZarrEntryStore + WorkerSide, tp=1, "
                        f"3000 tokens; {where})")
    for col in ("codecs", "logical", "stored", "ratio", "save s", "restore s", "worst SQNR dB", "verified"):
        table.add_column(col, justify="left" if col == "codecs" else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["name"], "", "", "", "", "", "", f"NO: {r['error'][:60]}")
            continue
        sq = min(r["sqnr_db"].values())
        table.add_row(", ".join(f"{k} {v}" for k, v in r["codecs"].items()), _size(r["logical_bytes"]),
                      _size(r["stored_bytes"]), f"{r['stored_bytes'] / r['logical_bytes']:.3f}",
                      f"{r['save_s']:.2f}", f"{r['restore_s']:.2f}",
                      "exact" if math.isinf(sq) else f"{sq:.1f}", "yes" if r["ok"] else "NO")
    Console(width=max(Console().width, 120)).print(table)
    for r in rows:
        if r.get("store"):
            print(f"wrote the {r['name']} entry to {r['store']} (see it: anchorkv ls --store {r['store']})")


def main(args: argparse.Namespace) -> int:
    from anchorkv.cli import with_json

    return with_json(_main, args)


def _main(args: argparse.Namespace, result: dict) -> int:
    rows = run(tp_size=args.tp, seed=args.seed)
    result["fields"] = rows
    _print(rows, args.tp)
    bad = [r for r in rows if not r["ok"]]
    if bad:
        print(f"FAILED: {len(bad)} field/codec pairs did not verify")
        return 1
    print("all fields restored into other blocks and verified; no other byte changed")
    cycle_rows = store_cycle(args.store, args.seed)
    result["store_cycle"] = cycle_rows
    _print_cycle(cycle_rows, args.store)
    bad = [r for r in cycle_rows if not r["ok"]]
    if bad:
        print(f"FAILED: {len(bad)} store cycles did not verify: {[r.get('error', r['name']) for r in bad]}")
        return 1
    print("saved, restored in a new process into other blocks, verified; no other byte changed")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="pack/unpack one Kimi-Linear request with every codec and verify")
    p.add_argument("--tp", type=int, default=1, choices=(1, 2, 4, 8), help="tensor-parallel size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store", default=None,
                   help="store directory for the save/restore cycle (default: a temporary one)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (every row, ok) on stdout; tables go to stderr")
    p.set_defaults(func=main)
