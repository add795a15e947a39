"""Golden chunk bytes of the store format: `python tests/store/golden.py` rewrites
`tests/fixtures/store/*.json`; tests never do (a missing or stale fixture fails). Rewrite
only for an intended format change, bump `FORMAT_VERSION`, and say so.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "store"
#: A chunk of `[1, 4, 3, 16]` (layer, tokens, ..., last axis); the last token row is padding.
CHUNK = (1, 4, 3, 16)
CASES = [
    # (name, format, group, source dtype)
    ("raw_bf16", "raw", None, "bfloat16"),
    ("raw_fp32", "raw", None, "float32"),
    ("fp8_g8_bf16", "fp8", 8, "bfloat16"),
    ("int8_g16_fp32", "int8", 16, "float32"),
    ("int4_g8_bf16", "int4", 8, "bfloat16"),
]


def golden_values() -> np.ndarray:
    """float32 `CHUNK` values exact in bf16: smooth, an outlier, a zero row, padding zeros."""
    import torch

    i = torch.arange(int(np.prod(CHUNK)), dtype=torch.float64)
    x = (torch.sin(i * 0.37) * 3.0).reshape(CHUNK)
    x[0, 0, 1, 5] = 90.0
    x[0, 1, 2, :] = 0.0
    x[0, 3] = 0.0  # the padded row of an edge chunk
    return x.to(torch.bfloat16).to(torch.float32).numpy()


def encode_case(fmt: str, group: int | None, dtype: str) -> dict:
    from anchorkv.store.format import ChunkCodec
    from anchorkv.store.zarr_codec import AnchorQuantCodec

    codec = ChunkCodec(fmt, group, dtype)
    data = codec.encode(golden_values())
    return {
        "zarr_codec": AnchorQuantCodec.from_chunk_codec(codec).to_dict(),
        "chunk_shape": list(CHUNK),
        "chunk_b64": base64.b64encode(data).decode(),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


if __name__ == "__main__":
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, fmt, group, dtype in CASES:
        (FIXTURES / f"{name}.json").write_text(json.dumps(encode_case(fmt, group, dtype), indent=1) + "\n")
        print("wrote", name)
