"""Kernel tests run the Triton kernels on a GPU when there is one, else in the interpreter.

`TRITON_INTERPRET` is read when a kernel is decorated, so it is set here, before any test
module imports `anchorkv.kernels.triton_pack`. Tests marked `interpreter` never skip: without CUDA
and with the interpreter switched off they fail, saying why.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _triton_can_run(request):
    if request.node.get_closest_marker("interpreter") is None:
        return
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail(
            "no CUDA device and TRITON_INTERPRET is not 1: the Triton kernel tests need one of "
            "them (unset TRITON_INTERPRET or set it to 1)"
        )
