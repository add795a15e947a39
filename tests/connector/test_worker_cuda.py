"""The worker's CUDA path: save (Triton pack on a side stream, pinned host copies) into a
store, then a fresh worker restores into other blocks of CUDA regions; every byte checked
(`anchorkv.demo.cycle`); a restore's host parts reach the GPU without a host synchronization.
CUDA only: the CPU path of the same cycle runs in the demo and in tests/connector."""

from __future__ import annotations

import pytest
import torch

from anchorkv.demo import cycle as demo_cycle

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the worker's CUDA stream/event path needs a GPU")


@pytest.mark.parametrize("codec", [{}, {"conv": "fp8:128", "recurrent": "bf16",
                                        "latent": "fp8:64"}], ids=["exact", "lossy"])
def test_cuda_save_then_restore_into_other_blocks(tmp_path, codec):
    store = str(tmp_path / "store")
    saved = demo_cycle.save(store, codec, seed=3, device="cuda")
    assert saved["stored_bytes"] > 0
    restored = demo_cycle.restore(store, codec, seed=3, device="cuda")
    assert restored["ok"], restored
    assert restored["stray_bytes"] == 0


@pytest.mark.parametrize("host", ["own tensors", "pinned arena"])
def test_restore_parts_from_the_host_unpack_without_a_host_synchronization(monkeypatch, host):
    """A restore's parts (host `Packed`s, as the store returns them) unpack into CUDA views
    with no host synchronization, byte-identical to the same unpack on the CPU: parts in their
    own tensors through one staging copy; parts in a page-locked `HostArena` (as the worker's
    restore reads them) in one copy of the slab's used span, no staging copy."""
    import warnings

    from anchorkv.codec import CacheView, HostArena, Packed, Region, pack_many, unpack_many
    from tests.codec.test_api import make_kimi_views

    buf, kda, mla = make_kimi_views()
    page = kda.region.block_stride
    requests = [(kda, "recurrent", [1], "int8:128"), (kda, "conv", [2], "fp8:64"), (mla, "latent", [3, 4], "raw")]
    packed = pack_many(requests)
    arena = HostArena(pin=True, hint=HostArena.size_for(t.nbytes for p in packed for t in (p.payload, p.scales)))
    if host == "pinned arena":  # as `Store.load(host=arena)` lays them
        packed = [Packed(p.codec, p.shape, p.dtype, arena(p.payload.nbytes).copy_(p.payload),
                         arena(p.scales.nbytes).view(torch.float32).view(p.scales.shape).copy_(p.scales))
                  for p in packed]
        assert len(arena.slabs) == 1 and arena.slabs[0].is_pinned()
    targets = [[4], [0], [1, 5]]
    gpu = buf.cuda()
    views = {id(v): CacheView(Region(gpu, 6, page), v.page, v.name) for v in (kda, mla)}
    work = [(p, views[id(v)], f, t) for p, (v, f, _, _), t in zip(packed, requests, targets, strict=True)]
    unpack_many(work)  # compile outside the check
    torch.cuda.synchronize()
    moves = []
    real_to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: moves.append(
        (self.untyped_storage().data_ptr(), self.data_ptr(), self.nbytes)) or real_to(self, *a, **kw))
    with warnings.catch_warnings():  # torch warns that the mode is a prototype
        warnings.filterwarnings("ignore", "Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode("error")
    try:
        unpack_many(work)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if host == "pinned arena":
        slab = arena.slabs[0].untyped_storage().data_ptr()
        # one copy from the slab: its used span (the kernels' item tables cross from their own buffer)
        assert [m for m in moves if m[0] == slab] == [(slab, arena.slabs[0].data_ptr(), arena.used)], moves
    unpack_many([(p, v, f, t) for p, (v, f, _, _), t in zip(packed, requests, targets, strict=True)])
    assert torch.equal(gpu.cpu(), buf)


class _Keep:
    """An `EntryStore` whose `save_part` keeps a copy of every part's bytes, by request id."""

    def __init__(self) -> None:
        self.saved: dict[str, dict] = {}

    def save_part(self, spec, parts, *, tp_size: int, tp_rank: int) -> int:
        self.saved[spec.req_id] = {k: (p.payload.clone(), p.scales.clone()) for k, p in parts.items()}
        return sum(p.nbytes for p in parts.values())


@pytest.mark.parametrize("copy_stream", [False, True], ids=["side-stream-copies", "copy-stream"])
@pytest.mark.parametrize("codecs", ["raw", "quant"])
def test_saves_back_to_back_each_store_their_own_bytes(tmp_path, monkeypatch, codecs, copy_stream):
    """Three saves of a full-size Kimi-Linear request (105 MB of state, different blocks each)
    issued without waiting, then one flush: each stores exactly the bytes a synchronous
    `pack_many` of its blocks gives. With the copies on their own stream
    (`worker.SAVE_COPY_STREAM`) the next save's pack runs while the last copy (~2 ms) reads
    the batch: without `record_stream` the allocator would hand it the batch's memory and the
    first save would store the second's bytes."""
    from anchorkv.connector import worker as worker_module

    monkeypatch.setattr(worker_module, "SAVE_COPY_STREAM", copy_stream)
    worker = back_to_back_saves(tmp_path, codecs, "cuda", tokens=7680)
    assert (worker._copy_stream is not None) == copy_stream


@pytest.mark.parametrize("lean", [True, False], ids=["lean-switch", "torch-context"])
def test_a_save_packs_on_its_side_stream_and_leaves_the_steps_stream_current(tmp_path, monkeypatch, lean):
    """Each save packs with the worker's side stream current (`launch.on_stream`, or torch's own
    context with `LEAN_STREAMS` off) and returns with the step's stream current again; the
    bytes stored are `pack_many`'s (`back_to_back_saves`), the saves on a stream made current
    by the caller (as vLLM's step may run on one of its own)."""
    from anchorkv.codec import api
    from anchorkv.kernels import launch

    monkeypatch.setattr(launch, "LEAN_STREAMS", lean)
    seen: list = []
    real = api.Packer.pack
    monkeypatch.setattr(api.Packer, "pack", lambda self, ids: (seen.append(torch.cuda.current_stream()),
                                                              real(self, ids))[1])
    step = torch.cuda.Stream()
    with torch.cuda.stream(step):
        worker = back_to_back_saves(tmp_path, "quant", "cuda", tokens=1920, saves=2)
        assert torch.cuda.current_stream() == step
    assert seen == [worker._stream] * 2
    assert worker._streams is not None and (step.device_index, step.cuda_stream) in worker._streams.known


def back_to_back_saves(tmp_path, codecs: str, device: str, tokens: int, saves: int = 3):
    """`saves` saves of a Kimi-Linear request (tp=1, `tokens` tokens) on `device`, each of
    other blocks, issued back to back and flushed; every stored part checked against
    `pack_many` of its blocks afterwards. Returns the (shut down) worker."""
    import numpy as np

    from anchorkv.codec import KIMI_LINEAR_48B_CONFIG, LayerKind, kimi_linear_layout, pack_many
    from anchorkv.connector.config import ConnectorConfig
    from anchorkv.connector.plan import GroupInfo, GroupKind, Metadata, SaveSpec
    from anchorkv.connector.storage_zarr import ZarrEntryStore
    from anchorkv.connector.worker import WorkerSide
    from anchorkv.testing.regions import hma_regions

    codec = {"raw": {}, "quant": {"conv": "int8:128", "recurrent": "int8:128", "latent": "fp8:64"}}[codecs]
    layout = kimi_linear_layout(KIMI_LINEAR_48B_CONFIG, tp_size=1)
    bs = layout.block_size
    state = [layer.name for layer in layout.of_kind(LayerKind.STATE)]
    paged = [layer.name for layer in layout.of_kind(LayerKind.PAGED)]
    groups = [GroupInfo(g, GroupKind.STATE, bs, tuple(state[g::3])) for g in range(3)]
    groups.append(GroupInfo(3, GroupKind.PAGED, bs, tuple(paged)))
    per = tokens // bs
    first = 1 + 3 * saves  # block 0 unused (vLLM's null block); then each save's 3 state blocks
    blocks = [((1 + 3 * s,), (2 + 3 * s,), (3 + 3 * s,), tuple(range(first + s * per, first + (s + 1) * per)))
              for s in range(saves)]
    views = hma_regions(layout, first + saves * per, device=device)
    g = torch.Generator().manual_seed(5)
    for ids in blocks:  # each group's layers in its own blocks only (layers of groups share regions)
        for grp in groups:
            for name in grp.layers:
                for f in views[name].page.fields:
                    t = views[name].tensor(f.name)
                    rows = list(ids[grp.index])
                    t[rows] = (torch.randn((len(rows), *f.shape), generator=g) * 0.1).to(f.dtype).to(device)
    config = ConnectorConfig.from_extra_config({"store": str(tmp_path / "store"), "codec": codec})
    config = ZarrEntryStore(config, layout).config  # (the codecs resolved for the layout)
    keep = _Keep()
    worker = WorkerSide(config, groups, "none", keep, 1, 0)
    worker.register(layout, views)
    specs = [SaveSpec(f"r{s}", None, tuple((np.arange(tokens) + 1_000_003 * (s + 1)).tolist()), tokens, blocks[s])
             for s in range(saves)]
    try:
        for spec in specs:
            worker.save(Metadata(saves=[spec]))
        worker.flush()
        assert (worker.stats.take() or {}).get("save_failed") is None
    finally:
        worker.shutdown()
    firsts = [next(iter(keep.saved[spec.req_id].values()))[0] for spec in specs]
    assert not any(torch.equal(firsts[0], f) for f in firsts[1:]), "the saves hold the same bytes: nothing checked"
    for s, spec in enumerate(specs):
        items = [(views[name], f.name, list(spec.blocks[grp.index]), config.codec_for(f.name))
                 for grp in groups for name in grp.layers for f in views[name].page.fields]
        got = keep.saved[spec.req_id]
        assert len(got) == len(items)
        for (view, fname, _, _), p in zip(items, pack_many(items), strict=True):
            payload, scales = got[(view.name, fname)]
            p = p.to("cpu")
            assert torch.equal(payload.reshape(-1), p.payload.reshape(-1)), f"save {s}: {view.name}.{fname} payload"
            assert torch.equal(scales.reshape(-1).view(torch.int32), p.scales.reshape(-1).view(torch.int32)), \
                f"save {s}: {view.name}.{fname} scales"
    return worker
