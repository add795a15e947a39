"""Which implementation runs a kernel: Triton for CUDA tensors, the torch reference on CPU.

`ANCHORKV_BACKEND` forces one (`triton` or `reference`; default `auto`). It is read at every
call, never at import, so tests can switch it with `monkeypatch.setenv`. Forcing `triton` for
CPU tensors needs `TRITON_INTERPRET=1` (the Triton interpreter), which is how CI checks that the
kernels produce the reference's bytes without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

BACKENDS = ("auto", "triton", "reference")


def backend_for(device: torch.device) -> str:
    """`"triton"` or `"reference"` for tensors on `device`."""
    forced = os.environ.get("ANCHORKV_BACKEND", "auto").strip().lower() or "auto"
    if forced not in BACKENDS:
        raise ValueError(f"ANCHORKV_BACKEND must be one of {BACKENDS}, found {forced!r}")
    if forced == "reference":
        return "reference"
    if forced == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"ANCHORKV_BACKEND=triton with {device.type} tensors needs TRITON_INTERPRET=1 "
                "(the Triton interpreter) or CUDA tensors"
            )
        return _triton_available()
    return _triton_available() if device.type == "cuda" else "reference"


def _triton_available() -> str:
    """`"triton"`, or a one-line error naming the fix when the [gpu] extra is missing."""
    if "triton" not in sys.modules and importlib.util.find_spec("triton") is None:  # (find_spec
        # costs ~0.1 ms; once triton is imported it is there)
        raise ImportError(
            "CUDA tensors run anchorkv's Triton kernels, but triton is not installed; install "
            "it with pip install 'anchorkv[gpu]' (or set ANCHORKV_BACKEND=reference to use the "
            "slower torch path)"
        )
    return "triton"
