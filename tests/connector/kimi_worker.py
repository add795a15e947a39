"""A `WorkerSide` over a Kimi-Linear tp=1 cache on the CPU and a local store (three KDA KV-cache
groups and the MLA group, as vLLM's hybrid allocator gives them), and `gated`, which holds a
store call until the test lets it go (not a test module)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import contextmanager

import torch

from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, LayerKind, kimi_linear_layout
from anchorkv.connector.config import ConnectorConfig
from anchorkv.connector.plan import GroupInfo, GroupKind
from anchorkv.connector.storage_zarr import ZarrEntryStore
from anchorkv.connector.worker import WorkerSide
from anchorkv.testing.regions import fill_realistic, hma_regions


def kimi_worker(tmp_path, num_blocks: int, filled: Sequence[Sequence[int]], extra: dict | None = None):
    """(worker, views, state layer names, paged layer names, layout, store): `num_blocks` blocks
    per region, group g's blocks `filled[g]` filled with realistic state (seed 0), the store in
    `tmp_path / "store"` with `kv_connector_extra_config` `extra` (default codecs: raw)."""
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=1)
    views = hma_regions(layout, num_blocks)
    state = [layer.name for layer in layout.of_kind(LayerKind.STATE)]
    paged = [layer.name for layer in layout.of_kind(LayerKind.PAGED)]
    groups = [GroupInfo(g, GroupKind.STATE, layout.block_size, tuple(state[g::3])) for g in range(3)]
    groups.append(GroupInfo(3, GroupKind.PAGED, layout.block_size, tuple(paged)))
    g = torch.Generator().manual_seed(0)
    for grp in groups:
        for name in grp.layers:
            fill_realistic(views[name], list(filled[grp.index]), g)
    store = ZarrEntryStore(ConnectorConfig.from_extra_config({"store": str(tmp_path / "store"), **(extra or {})}),
                           layout)
    w = WorkerSide(store.config, groups, "none", store, 1, 0)
    w.register(layout, views)
    return w, views, state, paged, layout, store


def assert_failed_restore_writes_nothing(w: WorkerSide, load) -> None:
    """A restore of `load` (a `LoadSpec`) through `start_load`, as vLLM drives it, fails: the
    request is reported finished and failed, and no byte of any cache region changed."""
    from anchorkv.connector.plan import LoadSpec, Metadata

    buffers = {v.region.buffer.data_ptr(): v.region.buffer for v in w.views.values()}
    before = {k: b.clone() for k, b in buffers.items()}  # every byte (the raw int8 buffers)
    w.start_load(Metadata(loads=[LoadSpec(load.req_id, load.entry_id, 0, load.num_tokens, load.blocks)]))
    w.flush()
    _, recving, failed = w.transfer_results(set())
    assert recving == failed == {load.req_id}
    assert all(torch.equal(b, before[k]) for k, b in buffers.items())


@contextmanager
def gated(monkeypatch, obj, name: str):
    """(gate, entered): `obj.name` made to wait for `gate` before it runs, `entered` set once a
    call waits there; the gate opens on leaving (a failed assertion leaves no thread held)."""
    gate, entered, real = threading.Event(), threading.Event(), getattr(obj, name)

    def held(*args, **kwargs):
        entered.set()
        assert gate.wait(30), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, held)
    try:
        yield gate, entered
    finally:
        gate.set()
