"""The worker's CUDA path: save (Triton pack on a side stream, pinned host copies) into a
store, then a fresh worker restores into other blocks of CUDA regions; every byte checked
(`anchorkv.demo.cycle`). CUDA only: the CPU path of the same cycle runs in the demo
and in tests/connector."""

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
