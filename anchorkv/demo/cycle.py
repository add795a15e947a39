"""The demo's store cycle: save through the connector's worker path, restore in a NEW process.

Parent: builds the regions vLLM 0.33 gives Kimi-Linear-48B-A3B on one rank (tp=1), fills one
request's blocks, and saves them with `WorkerSide.save` into a `ZarrEntryStore` (pack, copy,
staged write, commit). Child (a fresh interpreter, `python -m anchorkv.demo.cycle`):
a fresh allocation, `lookup`, `WorkerSide.start_load` into other block ids, then checks the
restored fields against the same source values (raw: identical bytes; lossy: SQNR floor) and
that every other byte of the cache is still zero. No vLLM needed: the worker side is plain torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import torch

from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, LayerKind, kimi_linear_layout
from anchorkv.connector.config import ConnectorConfig
from anchorkv.connector.plan import GroupInfo, GroupKind, LoadSpec, Metadata, SaveSpec
from anchorkv.connector.storage_zarr import ZarrEntryStore
from anchorkv.connector.worker import WorkerSide
from anchorkv.testing.metrics import sqnr_db
from anchorkv.testing.regions import fill_realistic, hma_regions

ANCHOR = "alice-software-tokyo"
NUM_TOKENS = 3000  # two MLA blocks of 1920 tokens, the second partial
NUM_BLOCKS = 9
SRC = {"state": (1, 2, 3), "paged": (4, 5)}  # the saving request's blocks
DST = {"state": (6, 7, 8), "paged": (3, 1)}  # the restoring request's, in a fresh allocation
#: Lowest acceptable SQNR (dB) of a lossy restore per format (fp8 e4m3: ~31 dB on gaussians).
SQNR_FLOOR = {"fp8": 28.0, "int8": 38.0, "int4": 14.0}


def _setup(store: str, codec: dict[str, str], device: str = "cpu"):
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=1)
    views = hma_regions(layout, NUM_BLOCKS, device)
    state = [layer.name for layer in layout.of_kind(LayerKind.STATE)]
    paged = [layer.name for layer in layout.of_kind(LayerKind.PAGED)]
    groups = [GroupInfo(g, GroupKind.STATE, layout.block_size, tuple(state[g::3])) for g in range(3)]
    groups.append(GroupInfo(3, GroupKind.PAGED, layout.block_size, tuple(paged)))
    config = ConnectorConfig.from_extra_config({"store": store, "codec": codec})
    es = ZarrEntryStore(config, layout)
    worker = WorkerSide(es.config, groups, "none", es, 1, 0)
    worker.register(layout, views)
    return layout, views, groups, es, worker


def _blocks(which: dict) -> tuple[tuple[int, ...], ...]:
    return tuple((b,) for b in which["state"]) + (tuple(which["paged"]),)


def _source(views, groups, seed: int) -> None:
    """The saving request's blocks, filled with realistic values (deterministic in `seed`)."""
    g = torch.Generator().manual_seed(seed)
    blocks = _blocks(SRC)
    for grp in groups:
        for name in grp.layers:
            fill_realistic(views[name], list(blocks[grp.index]), g)


def _tokens(seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed + 1)
    return tuple(torch.randint(0, 163840, (NUM_TOKENS + 17,), generator=g).tolist())


def save(store: str, codec: dict[str, str], seed: int, device: str = "cpu") -> dict:
    layout, views, groups, es, worker = _setup(store, codec, device)
    _source(views, groups, seed)
    spec = SaveSpec("demo-1", ANCHOR, _tokens(seed)[:NUM_TOKENS], NUM_TOKENS, _blocks(SRC))
    t0 = time.perf_counter()
    worker.save(Metadata(saves=[spec]))
    worker.flush()
    dt = time.perf_counter() - t0
    worker.shutdown()
    info = max(es.store.list(), key=lambda e: e.created)
    return {"entry": info.id, "stored_bytes": info.stored_bytes, "logical_bytes": info.logical_bytes,
            "save_s": dt, "codecs": info.codecs}


def restore(store: str, codec: dict[str, str], seed: int, device: str = "cpu") -> dict:
    """In a fresh process (or a fresh worker): look up, load into other blocks, verify."""
    layout, views, groups, es, worker = _setup(store, codec, device)
    tokens = list(_tokens(seed))
    t0 = time.perf_counter()
    ref = es.lookup(anchor=ANCHOR, token_ids=tokens, max_tokens=len(tokens) - 1, multiple_of=1, mode="exact")
    if ref is None or ref.num_tokens != NUM_TOKENS:
        return {"ok": False, "error": f"lookup found {ref}, expected an entry of {NUM_TOKENS} tokens"}
    spec = LoadSpec("demo-2", ref.entry_id, 0, ref.num_tokens, _blocks(DST))
    worker.start_load(Metadata(loads=[spec]))
    worker.flush()
    dt = time.perf_counter() - t0
    _, recving, failed = worker.transfer_results(set())
    if failed or recving != {"demo-2"}:
        return {"ok": False, "error": f"load reported finished {recving}, failed {failed}"}
    # the expected values: the same source, regenerated in a scratch allocation
    _, expect, *_ = _setup(store, codec, device)
    _source(expect, groups, seed)
    src, dst = _blocks(SRC), _blocks(DST)
    worst: dict[str, float] = {}
    ok = True
    for grp in groups:
        for name in grp.layers:
            for f in views[name].page.fields:
                x = expect[name].tensor(f.name)[list(src[grp.index])]
                y = views[name].tensor(f.name)[list(dst[grp.index])]
                if grp.kind is GroupKind.PAGED:  # only the stored tokens' rows
                    x = x.reshape(-1, *x.shape[2:])[:NUM_TOKENS]
                    y = y.reshape(-1, *y.shape[2:])[:NUM_TOKENS]
                db = sqnr_db(x, y)
                worst[f.name] = min(worst.get(f.name, math.inf), db)
                fmt = es.codecs[f.name].id
                ok &= torch.equal(x, y) if fmt == "raw" else db >= SQNR_FLOOR.get(fmt, 0.0)
    # nothing else changed: clear the restored fields; the fresh (zero) allocation must remain
    restored = 0
    for grp in groups:
        for name in grp.layers:
            for f in views[name].page.fields:
                t = views[name].tensor(f.name)
                for i, b in enumerate(dst[grp.index]):
                    if grp.kind is GroupKind.PAGED:
                        rows = min(t.shape[1], NUM_TOKENS - i * t.shape[1])
                        restored += t[b, :rows].numel() * t.element_size()
                        t[b, :rows] = 0
                    else:
                        restored += t[b].numel() * t.element_size()
                        t[b] = 0
    buffers = {id(v.region.buffer): v.region.buffer for v in views.values()}.values()
    stray = sum(int((b.reshape(-1).view(torch.uint8) != 0).sum()) for b in buffers)
    worker.shutdown()
    return {"ok": bool(ok) and stray == 0, "restore_s": dt, "sqnr_db": worst,
            "restored_bytes": restored, "stray_bytes": stray}


def cycle(store: str, codec: dict[str, str], seed: int = 0) -> dict:
    """Save here, restore in a new Python process; the combined report."""
    saved = save(store, codec, seed)
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "anchorkv.demo.cycle", "--store", store,
         "--codec", json.dumps(codec), "--seed", str(seed)],
        capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if out.returncode != 0:
        return {**saved, "ok": False, "error": out.stderr.strip()[-2000:]}
    restored = json.loads(out.stdout.strip().splitlines()[-1])
    return {**saved, **restored, "child_s": time.perf_counter() - t0}


#: The store cycle's codec settings: lossless, and the connector's defaults.
CYCLE_CODECS = {
    "raw": {"conv": "raw", "recurrent": "raw", "latent": "raw"},
    "default": None,  # filled from anchorkv.connector.config.DEFAULT_CODECS
}


def store_cycle(store: str | None, seed: int) -> list[dict]:
    """Save -> NEW PROCESS -> restore through the store and the connector's worker path."""
    import tempfile

    from anchorkv.connector.config import DEFAULT_CODECS

    rows = []
    with tempfile.TemporaryDirectory(prefix="anchorkv-demo-") as tmp:
        root = store or tmp
        for name, codec in CYCLE_CODECS.items():
            codec = dict(codec or DEFAULT_CODECS)
            path = os.path.join(root, f"demo-{name}")
            rows.append({"name": name, "store": path if store else None, **cycle(path, codec, seed)})
    return rows


def _main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--store", required=True)
    p.add_argument("--codec", required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(json.dumps(restore(a.store, json.loads(a.codec), a.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
