"""Read an entry with no anchorkv at all: zarr-python or tensorstore, and numpy dequantization
following only what the array attributes state.

As a script (the tests run it in a process where ``import anchorkv`` fails):

    python tests/store/plain_read.py ENTRY_DIR OUT.npz

writes ``<reader>/<field>`` float32 arrays for both readers and prints one line per array opened.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def to_source(x: np.ndarray, source_dtype: str) -> np.ndarray:
    """float32 values rounded to the source dtype (RNE), returned as float32."""
    import ml_dtypes

    if source_dtype == "bfloat16":
        return x.astype(ml_dtypes.bfloat16).astype(np.float32)
    if source_dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    return x.astype(np.float32)


def dequantize(codes: np.ndarray, scales: np.ndarray | None, attrs: dict) -> np.ndarray:
    """The float32 values of a field from its stored arrays, by the rules in its attributes."""
    import ml_dtypes

    if attrs["role"] == "values":
        if attrs["source_dtype"] == "bfloat16":  # uint16 bits
            return (codes.astype(np.uint32) << 16).view(np.float32)
        return codes.astype(np.float32)
    fmt, g = attrs["codec"], attrs.get("group")
    if fmt == "bf16":  # elementwise: uint16 bfloat16 bits, no scales
        return to_source((codes.astype(np.uint32) << 16).view(np.float32), attrs["source_dtype"])
    if fmt == "fp8":
        q = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    elif fmt == "int8":
        q = codes.astype(np.float32)
    else:
        q = np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1).astype(np.float32)
    x = q * np.repeat(scales[..., 0], g, axis=-1)
    if fmt == "int4":
        x = x + np.repeat(scales[..., 1], g, axis=-1)
    return to_source(x, attrs["source_dtype"])


def read_array(path: str, reader: str) -> tuple[np.ndarray, dict]:
    if reader == "tensorstore":
        import tensorstore as ts

        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}, open=True, read=True).result()
        data = np.asarray(t.read().result())
    else:
        import zarr

        data = zarr.open_array(path, mode="r")[...]
    with open(os.path.join(path, "zarr.json")) as f:
        meta = json.load(f)
    assert str(data.dtype) == meta["data_type"], (path, data.dtype, meta["data_type"])
    return data, meta["attributes"]["anchorkv"]


def read_entry(entry_dir: str, reader: str) -> dict[str, np.ndarray]:
    with open(os.path.join(entry_dir, "zarr.json")) as f:
        manifest = json.load(f)["attributes"]["anchorkv"]
    out = {}
    for field in sorted(manifest["arrays"]):
        codes, attrs = read_array(os.path.join(entry_dir, field), reader)
        scales = None
        if "scales" in attrs:
            scales, _ = read_array(os.path.join(entry_dir, attrs["scales"]), reader)
        print(reader, field, codes.dtype, list(codes.shape), None if scales is None else list(scales.shape))
        out[field] = dequantize(codes, scales, attrs)
    return out


if __name__ == "__main__":
    sys.modules["anchorkv"] = None  # no plug-in can be found: any import of anchorkv fails
    entry, out = sys.argv[1], sys.argv[2]
    arrays = {f"{r}/{k}": v for r in ("zarr", "tensorstore") for k, v in read_entry(entry, r).items()}
    np.savez(out, **arrays)
