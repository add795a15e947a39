"""The save path's device-to-host step: the packed parts of one request cross in one copy per
device allocation they share (`worker._pinned_copies`), not two copies per part, and every
host tensor holds exactly the bytes of its device tensor."""

from __future__ import annotations

import pytest
import torch

from anchorkv.connector import worker


class CountingCopies:
    """Counts `Tensor.copy_` calls (the copies that would cross PCIe on a GPU)."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = torch.Tensor.copy_

        def copy_(dst, src, non_blocking=False):
            self.calls.append((src.numel() * src.element_size(), non_blocking))
            return original(dst, src, non_blocking=non_blocking)

        monkeypatch.setattr(torch.Tensor, "copy_", copy_)


def _slices(total: int, sizes: list[int], dtype: torch.dtype, cols: int = 0) -> list[torch.Tensor]:
    base = torch.arange(total, dtype=torch.int32).to(dtype)
    out, at = [], 0
    for n in sizes:
        t = base.narrow(0, at, n)
        out.append(t.view(-1, cols) if cols else t)
        at += n
    return out


def test_one_copy_per_shared_allocation_and_exact_bytes(monkeypatch):
    payloads = _slices(1000, [100, 300, 0, 600], torch.uint8)
    scales = _slices(64, [16, 24, 0, 24], torch.float32, cols=2)
    tensors = [t for pair in zip(payloads, scales, strict=True) for t in pair]
    copies = CountingCopies(monkeypatch)
    host = worker._pinned_copies(tensors, pin=False)
    assert [n for n, _ in copies.calls] == [1000, 64 * 4]  # one per storage
    assert all(nb for _, nb in copies.calls)
    for d, h in zip(tensors, host, strict=True):
        assert h.device.type == "cpu" and h.shape == d.shape and h.dtype == d.dtype
        assert torch.equal(h, d)
        assert h.untyped_storage().data_ptr() != d.untyped_storage().data_ptr() or d.numel() == 0


def test_sparse_spans_and_strided_tensors_are_copied_one_by_one(monkeypatch):
    base = torch.arange(4096, dtype=torch.float32)
    far_apart = [base[:8], base[4000:4008]]  # 16 wanted of 4008 spanned: not worth one copy
    strided = torch.arange(64, dtype=torch.float32).view(8, 8).t()  # not contiguous
    copies = CountingCopies(monkeypatch)
    host = worker._pinned_copies([*far_apart, strided], pin=False)
    assert sorted(n for n, _ in copies.calls) == [32, 32, 256]
    for d, h in zip([*far_apart, strided], host, strict=True):
        assert torch.equal(h, d)


@pytest.mark.parametrize("offset", [0, 2, 6])
def test_views_keep_their_dtype_alignment(offset):
    """A span starting mid-allocation is copied from a 16-byte aligned start, so each host
    tensor can alias the copy with its own dtype."""
    base = torch.arange(256, dtype=torch.float32)
    tensors = [base[offset : offset + 10], base[offset + 10 : offset + 40].view(15, 2)]
    host = worker._pinned_copies(tensors, pin=False)
    assert host[0].untyped_storage().data_ptr() == host[1].untyped_storage().data_ptr()
    for d, h in zip(tensors, host, strict=True):
        assert torch.equal(h, d)
