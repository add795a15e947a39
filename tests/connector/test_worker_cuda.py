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
