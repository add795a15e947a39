"""Golden bytes of the store format: `python tests/store/golden.py` rewrites
`tests/fixtures/store/*.json`; tests never do (a missing or stale fixture fails). Rewrite
only for an intended format change, bump `FORMAT_VERSION`, and say so.

Two kinds: inner chunk bytes (`CASES`: one chunk's ``payload || scales``, unchanged since
format version 1) and whole shard files (`SHARD_CASES`, format version 2: inner chunks in
zarr's order, then the index with its crc32c; the tests also check them against zarr-python).
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


#: Whole shard files: an array `[1, tokens, 3, 16]` in chunks of 4 tokens and shards of
#: `shard_tokens`; the second case has a partial chunk and an empty slot past the end.
SHARD_CASES = [
    # (name, format, group, source dtype, tokens, shard tokens)
    ("shard_fp8_g8_bf16", "fp8", 8, "bfloat16", 8, 8),
    ("shard_int8_g16_fp32_edge", "int8", 16, "float32", 9, 16),
]


def shard_values(tokens: int) -> np.ndarray:
    import torch

    i = torch.arange(tokens * 48, dtype=torch.float64)
    x = (torch.cos(i * 0.23) * 2.0 + 0.5).reshape(1, tokens, 3, 16)
    x[0, 1, 0, 3] = -40.0
    return x.to(torch.bfloat16).to(torch.float32).numpy()


def encode_shard_case(fmt: str, group: int | None, dtype: str, tokens: int, shard_tokens: int) -> dict:
    """The shard file as the store's format defines it (chunks padded with zeros, in
    `shard_order`, absent past the end, then `shard_index`)."""
    from anchorkv.store.format import FORMAT_VERSION, ChunkCodec, shard_index, shard_order
    from anchorkv.store.zarr_codec import AnchorQuantCodec

    codec = ChunkCodec(fmt, group, dtype)
    chunk = CHUNK[1]
    per = (1, shard_tokens // chunk, 1, 1)
    values = np.zeros((1, shard_tokens, 3, 16), np.float32)
    values[:, :tokens] = shard_values(tokens)
    data, slots = b"", {}
    for local in shard_order(per):
        t = local[1] * chunk
        if t >= tokens:
            continue
        enc = codec.encode(values[:, t : t + chunk])
        slots[local] = (len(data), len(enc))
        data += enc
    data += shard_index(per, slots)
    return {
        "format_version": FORMAT_VERSION,
        "zarr_codec": AnchorQuantCodec.from_chunk_codec(codec).to_dict(),
        "array_shape": [1, tokens, 3, 16],
        "chunk_shape": [1, chunk, 3, 16],
        "shard_shape": [1, shard_tokens, 3, 16],
        "shard_b64": base64.b64encode(data).decode(),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


if __name__ == "__main__":
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, fmt, group, dtype in CASES:
        (FIXTURES / f"{name}.json").write_text(json.dumps(encode_case(fmt, group, dtype), indent=1) + "\n")
        print("wrote", name)
    for name, *args in SHARD_CASES:
        (FIXTURES / f"{name}.json").write_text(json.dumps(encode_shard_case(*args), indent=1) + "\n")
        print("wrote", name)
