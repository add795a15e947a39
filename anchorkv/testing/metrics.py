"""Error metrics of lossy round trips, shared by the tests, the benchmarks and the demo."""

from __future__ import annotations

import math

import torch


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `y` against the reference `x`, in dB.

    10 log10(sum x^2 / sum (x - y)^2) in float64; +inf when `y` equals `x` exactly, -inf when
    `x` is all zeros and `y` is not.
    """
    x, y = x.double(), y.double()
    noise = ((x - y) ** 2).sum().item()
    signal = (x**2).sum().item()
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
