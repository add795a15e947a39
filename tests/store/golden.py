"""Golden bytes of the store format: `python tests/store/golden.py` rewrites
`tests/fixtures/store/*.json`; tests never do (a missing or stale fixture fails). Rewrite
only for an intended format change, bump `FORMAT_VERSION`, and say so.

Two kinds: inner chunk bytes (`CASES`: one chunk's payload and scales, the bytes unchanged since
format version 1; since version 3 they are the chunks of two standard arrays, codes and scales)
and whole shard files (`SHARD_CASES`: inner chunks in zarr's order, then the index with its
crc32c, one file per stored array; the tests also check them against zarr-python).
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


def _layout(fmt: str, group: int | None, dtype: str, shape: tuple, chunks: tuple, shards: tuple):
    from anchorkv.store.format import ArrayLayout, QuantChunkEncoding

    encoding = QuantChunkEncoding(fmt, group, dtype)
    return ArrayLayout("latent", "paged", ("l0",), shape, chunks, None, encoding, shards)


def encode_case(fmt: str, group: int | None, dtype: str) -> dict:
    """One chunk's bytes, split into the chunks of its stored arrays (values / codes, scales)."""
    array = _layout(fmt, group, dtype, CHUNK, CHUNK, CHUNK)
    data = array.codec.encode(golden_values())
    pn, _ = array.codec.nbytes(CHUNK)
    pieces = [data[:pn], data[pn:]][: len(array.parts)]
    return {
        "codec": array.codec.to_config(),
        "chunk_shape": list(CHUNK),
        "arrays": {p.name: {"data_type": p.dtype, "chunk_shape": list(p.chunks),
                            "chunk_b64": base64.b64encode(b).decode(), "sha256": hashlib.sha256(b).hexdigest()}
                   for p, b in zip(array.parts, pieces, strict=True)},
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
    """The shard files as the store's format defines them (chunks padded with zero bytes, in
    `shard_order`, absent past the end, then `shard_index`), one per stored array."""
    from anchorkv.store.format import FORMAT_VERSION, shard_index, shard_order

    chunk = CHUNK[1]
    array = _layout(fmt, group, dtype, (1, tokens, 3, 16), (1, chunk, 3, 16), (1, shard_tokens, 3, 16))
    codec = array.codec
    per = (1, shard_tokens // chunk, 1, 1)
    values = np.zeros((1, shard_tokens, 3, 16), np.float32)
    values[:, :tokens] = shard_values(tokens)
    files = {}
    for i, part in enumerate(array.parts):
        data, slots = b"", {}
        for local in shard_order(per):
            t = local[1] * chunk
            if t >= tokens:
                continue
            block = values[:, t : t + chunk].copy()
            rows = min(chunk, tokens - t)
            enc = codec.encode(block)
            pn, _ = codec.nbytes(block.shape)
            piece = bytearray([enc[:pn], enc[pn:]][i])
            if rows < chunk:  # padding rows hold zero bytes (zarr's fill value), not an encoding
                row = len(piece) // chunk
                piece[rows * row :] = bytes(len(piece) - rows * row)
            slots[part.local(local)] = (len(data), len(piece))
            data += bytes(piece)
        data += shard_index(part.chunks_per_shard(per), slots)
        files[part.name] = {"data_type": part.dtype, "shard_b64": base64.b64encode(data).decode(),
                            "sha256": hashlib.sha256(data).hexdigest()}
    return {
        "format_version": FORMAT_VERSION,
        "codec": codec.to_config(),
        "array_shape": [1, tokens, 3, 16],
        "chunk_shape": [1, chunk, 3, 16],
        "shard_shape": [1, shard_tokens, 3, 16],
        "arrays": files,
    }


if __name__ == "__main__":
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name, fmt, group, dtype in CASES:
        (FIXTURES / f"{name}.json").write_text(json.dumps(encode_case(fmt, group, dtype), indent=1) + "\n")
        print("wrote", name)
    for name, *args in SHARD_CASES:
        (FIXTURES / f"{name}.json").write_text(json.dumps(encode_shard_case(*args), indent=1) + "\n")
        print("wrote", name)
