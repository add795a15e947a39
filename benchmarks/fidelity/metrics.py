"""Error metrics of a lossy round trip beside SQNR (`anchorkv.testing.metrics.sqnr_db`, the one of
the tests and the demo): max relative error, per-step output error."""

from __future__ import annotations

import math

import torch


def max_rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    """max_i |x_i - y_i| / max(|x_i|, rms(x)).

    Why the floor: elementwise relative error is unbounded near zero, where an integer code's
    absolute step dominates; flooring the denominator at the tensor's RMS keeps true relative
    error for the values that matter and error-relative-to-typical-magnitude for tiny ones.
    """
    x, y = x.double(), y.double()
    rms = x.pow(2).mean().sqrt()
    denom = torch.maximum(x.abs(), rms)
    if rms == 0:
        return 0.0 if torch.equal(x, y) else math.inf
    return ((x - y).abs() / denom).max().item()


def rel_err_per_step(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """||out_t - ref_t|| / ||ref_t|| for each step t of `[T, ...]` outputs (float64 `[T]`)."""
    ref = ref.double().reshape(ref.shape[0], -1)
    out = out.double().reshape(out.shape[0], -1)
    return (out - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-300)
