"""The golden cases of the codec fixtures: inputs built from arithmetic, never from an RNG.

`python tests/codec/golden.py` rewrites `tests/fixtures/codec/*.json`; the tests never do
(a missing or stale fixture fails). Rewrite only for an intended format change, and say so.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import torch

from anchorkv.codec import CodecSpec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "codec"

CASES = [
    # (name, codec, group, dtype)
    ("raw_bf16", "raw", None, torch.bfloat16),
    ("raw_fp32", "raw", None, torch.float32),
    ("fp8_g32_bf16", "fp8", 32, torch.bfloat16),
    ("fp8_g64_fp32", "fp8", 64, torch.float32),
    ("fp8_whole_bf16", "fp8", None, torch.bfloat16),
    ("int8_g32_fp32", "int8", 32, torch.float32),
    ("int8_g128_bf16", "int8", 128, torch.bfloat16),
    ("int8_whole_fp16", "int8", None, torch.float16),
    ("int4_g32_bf16", "int4", 32, torch.bfloat16),
    ("int4_g64_fp32", "int4", 64, torch.float32),
    ("int4_whole_fp16", "int4", None, torch.float16),
    ("bf16_fp32", "bf16", None, torch.float32),
    ("bf16_fp16", "bf16", None, torch.float16),
]


def golden_input(dtype: torch.dtype) -> torch.Tensor:
    """`[3, 2, 128]`: smooth values, an outlier channel, exact ties, a zero row, a NaN row."""
    i = torch.arange(3 * 2 * 128, dtype=torch.float64)
    x = torch.sin(i * 0.37) * 3.0 + torch.cos(i * 0.011) * 0.5
    x = x.reshape(3, 2, 128)
    x[:, :, 7] *= 40.0  # outlier channel
    x[1, 0, :] = torch.arange(128, dtype=torch.float64) * 0.5 - 32.0  # ties at .5
    x[1, 1, :] = 0.0  # all-zero row
    x[2, 1, 5] = float("nan")  # a poisoned group
    x[2, 1, 9] = float("-inf")
    return x.to(dtype)


def bf16_edges() -> torch.Tensor:
    """128 fp32 values at the edges of bf16 rounding, from their bit patterns: exact ties (low
    half 0x8000) with odd and even kept bits, one below and above a tie, the largest finite
    values (rounding to Inf), subnormals, +-0, +-Inf and NaNs of several payloads."""
    bits = []
    for base in (0x3F800000, 0x3F810000, 0x40490000, 0x00010000, 0x7F7F0000, 0x00800000, 0x4B7F0000, 0x3A120000):
        for low in (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000):
            bits += [base | low, base | low | 0x80000000]
    bits[-8:] = [0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7F7FFFFF]
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def case_input(codec: str, dtype: torch.dtype) -> torch.Tensor:
    """`golden_input`; for bf16 of fp32 its first smooth row is `bf16_edges` instead."""
    x = golden_input(dtype)
    if codec == "bf16" and dtype == torch.float32:
        x[0, 1] = bf16_edges()
    return x


def encode_case(codec: str, group: int | None, dtype: torch.dtype) -> dict:
    from anchorkv.kernels.reference import quantize

    payload, scales = quantize(case_input(codec, dtype), CodecSpec(codec, group))
    return {
        "codec": codec,
        "group": group,
        "dtype": str(dtype).removeprefix("torch."),
        "payload_b64": base64.b64encode(payload.numpy().tobytes()).decode(),
        "scales_b64": base64.b64encode(scales.contiguous().numpy().tobytes()).decode(),
        "scales_shape": list(scales.shape),
    }


if __name__ == "__main__":
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, codec, group, dtype in CASES:
        (FIXTURES / f"{name}.json").write_text(json.dumps(encode_case(codec, group, dtype), indent=1) + "\n")
        print("wrote", name)
