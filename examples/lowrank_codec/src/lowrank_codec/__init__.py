"""`lowrank`: an example anchorkv codec plug-in, a learned low-rank projection of cache rows.

A row `x` (the last axis of a field: a K or V head `[head_dim]`, an MLA latent `[576]`) is
stored as `r` numbers, its coordinates in a fitted orthonormal basis `P` `[W, r]`:

    encode:  codes = x @ P            (stored as float16 by default: 2r bytes a row)
    decode:  x' = codes @ P^T          (the orthogonal projection of x onto P's columns)

`P` holds the top-r right singular vectors of calibration rows (`fit_projection`): the rank-r
subspace that keeps the most of their energy. The codec is as good as the rows are low-rank:
rows whose energy lies in few directions come back almost exactly, isotropic rows lose
(W - r) / W of their energy (see README.md beside this package for measured SQNRs).

Options (the codec spec, e.g. in the connector config
``"codec": {"latent": {"id": "lowrank", "projection_file": "/path/P.npy"}}``):

* ``projection``: P as base64 of float32 little-endian `[W, r]` bytes (`codec_config(P)`), or
* ``projection_file``: a ``.npy`` file of P (`save_projection`); read once at start-up and
  recorded inline, so every entry carries the P it was encoded with;
* ``code_dtype``: ``float16`` (default), ``bfloat16`` or ``float32``.

`configure` adds ``rank``, ``width`` and ``digest`` (16 hex of the sha256 of P's bytes). One
P serves every layer of a field (the codec is not told the layer). Arithmetic is float64, so
a row's bytes never depend on how many rows are encoded with it (the store re-cuts rows).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import math
import os

import numpy as np
import torch

from anchorkv.codec import CodecSpec
from anchorkv.codec.registry import EncodedRow

__all__ = ["LowRankCodec", "LowRankProjection", "codec_config", "fit_projection", "load_projection",
           "save_projection"]

#: code dtype -> (torch dtype, Zarr v3 data type the codes are stored as)
CODE_DTYPES = {"float16": (torch.float16, "float16"), "bfloat16": (torch.bfloat16, "uint16"),
               "float32": (torch.float32, "float32")}
_OPTIONS = {"projection", "projection_file", "code_dtype", "rank", "width", "digest"}
#: columns of P must be orthonormal to this tolerance (|P^T P - I|_max)
ORTHONORMAL_TOL = 1e-4


class LowRankProjection(torch.nn.Module):
    """The fitted projection `P` `[W, r]` as a module: `encode` rows to r coordinates, `decode` back."""

    def __init__(self, projection: torch.Tensor) -> None:
        super().__init__()
        if projection.ndim != 2 or not 0 < projection.shape[1] <= projection.shape[0]:
            raise ValueError(f"a projection is [W, r] with 0 < r <= W, found {list(projection.shape)}")
        self.register_buffer("P", projection.to(torch.float64).contiguous())

    @classmethod
    def fit(cls, rows: torch.Tensor, rank: int) -> LowRankProjection:
        return cls(fit_projection(rows, rank))

    @property
    def width(self) -> int:
        return self.P.shape[0]

    @property
    def rank(self) -> int:
        return self.P.shape[1]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., W]` -> `[..., r]` float64."""
        return x.to(torch.float64) @ self.P.to(x.device)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """`[..., r]` -> `[..., W]` float64."""
        return codes.to(torch.float64) @ self.P.to(codes.device).T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))


def fit_projection(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """The top-`rank` right singular vectors of calibration `rows` `[n, W]`: float32 `[W, rank]`,
    orthonormal columns, each signed so its largest-magnitude entry is positive (deterministic).

    Uncentered on purpose: the codec stores `x @ P` without subtracting a mean, and the top
    singular vectors of the uncentered rows are then the best rank-r subspace for them."""
    x = rows.reshape(-1, rows.shape[-1]).to(torch.float64)
    if not 0 < rank <= min(x.shape):
        raise ValueError(f"rank must lie in [1, {min(x.shape)}] for {x.shape[0]} rows of {x.shape[1]}, found {rank}")
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    p = vh[:rank].T.contiguous()
    sign = torch.sign(p.gather(0, p.abs().argmax(0, keepdim=True)))
    p = p * torch.where(sign == 0, 1.0, sign)
    return p.to(torch.float32)


def _b64(projection: torch.Tensor) -> str:
    arr = np.ascontiguousarray(projection.detach().cpu().to(torch.float32).numpy(), dtype="<f4")
    return base64.b64encode(arr.tobytes()).decode("ascii")


def codec_config(projection: torch.Tensor, code_dtype: str = "float16") -> dict:
    """A codec spec dict carrying `projection` inline, ready for the connector's ``codec`` map or
    `anchorkv.codec.pack`: ``{"id": "lowrank", "rank": r, "width": W, "projection": ..., ...}``."""
    w, r = projection.shape
    return {"id": "lowrank", "rank": int(r), "width": int(w), "projection": _b64(projection),
            "code_dtype": code_dtype}


def save_projection(path: str | os.PathLike, projection: torch.Tensor) -> None:
    """Write P as a float32 ``.npy`` (what the ``projection_file`` option reads)."""
    np.save(path, np.ascontiguousarray(projection.detach().cpu().to(torch.float32).numpy()))


def load_projection(path: str | os.PathLike) -> torch.Tensor:
    arr = np.load(os.fspath(path), allow_pickle=False)
    if arr.ndim != 2 or arr.dtype.kind != "f":
        raise ValueError(f"{path}: expected a float [W, r] array, found {arr.dtype} {list(arr.shape)}")
    return torch.from_numpy(arr.astype(np.float32))


@functools.lru_cache(maxsize=16)
def _module(b64: str, width: int, rank: int) -> LowRankProjection:
    data = base64.b64decode(b64.encode("ascii"), validate=True)
    if len(data) != width * rank * 4:
        raise ValueError(f"projection holds {len(data)} bytes, [{width}, {rank}] float32 needs {width * rank * 4}")
    p = torch.from_numpy(np.frombuffer(data, dtype="<f4").reshape(width, rank).copy())
    return LowRankProjection(p)


class LowRankCodec:
    """The `lowrank` codec (see the module docstring). Lossy."""

    id = "lowrank"
    lossless = False

    # ------------------------------------------------------------------ resolution
    def configure(self, spec: CodecSpec, width: int, dtype: torch.dtype) -> CodecSpec:
        """The spec entries record: P inline (read from ``projection_file`` if given), checked
        against the row width and for orthonormal columns; rank, width and digest filled."""
        opts = spec.options
        unknown = sorted(set(opts) - _OPTIONS)
        if unknown:
            raise ValueError(f"unknown lowrank options {unknown}; expected some of {sorted(_OPTIONS)}")
        code_dtype = opts.get("code_dtype", "float16")
        if code_dtype not in CODE_DTYPES:
            raise ValueError(f"code_dtype must be one of {sorted(CODE_DTYPES)}, found {code_dtype!r}")
        if "projection_file" in opts:
            if "projection" in opts:
                raise ValueError("give either projection or projection_file, not both")
            p = load_projection(opts["projection_file"])
        elif "projection" in opts:
            b64 = opts["projection"]
            r = opts.get("rank")
            if not isinstance(b64, str) or not isinstance(r, int) or isinstance(r, bool):
                raise ValueError("an inline projection needs 'projection' (base64) and 'rank' (int); "
                                 "lowrank_codec.codec_config(P) writes both")
            nbytes = len(base64.b64decode(b64.encode("ascii"), validate=True))
            if r <= 0 or nbytes % (4 * r):
                raise ValueError(f"projection holds {nbytes} bytes: not a float32 [W, {r}] array")
            p = _module(b64, nbytes // (4 * r), r).P.to(torch.float32)
        else:
            raise ValueError("lowrank needs a fitted projection: 'projection' (base64, see "
                             "lowrank_codec.codec_config) or 'projection_file' (.npy, see save_projection)")
        if p.shape[0] != width:
            raise ValueError(f"the projection is for rows of {p.shape[0]} values, this field's rows have {width}")
        if "width" in opts and opts["width"] != width:
            raise ValueError(f"option width is {opts['width']}, this field's rows have {width}")
        gram = p.to(torch.float64).T @ p.to(torch.float64)
        off = float((gram - torch.eye(p.shape[1], dtype=torch.float64)).abs().max())
        if off > ORTHONORMAL_TOL:
            raise ValueError(f"the projection's columns are not orthonormal (|P^T P - I| = {off:.1e}); "
                             "fit it with lowrank_codec.fit_projection")
        b64 = _b64(p)
        digest = hashlib.sha256(base64.b64decode(b64)).hexdigest()[:16]
        return CodecSpec(self.id, None, {"projection": b64, "rank": int(p.shape[1]), "width": int(width),
                                         "code_dtype": code_dtype, "digest": digest})

    def encoded_row(self, width: int, dtype: torch.dtype, spec: CodecSpec) -> EncodedRow:
        opts = spec.options
        if opts.get("width") != width:
            raise ValueError(f"spec is for rows of {opts.get('width')} values, asked for {width}: configure it first")
        torch_dtype, zarr_dtype = CODE_DTYPES[opts.get("code_dtype", "float16")]
        itemsize = torch.empty((), dtype=torch_dtype).element_size()
        return EncodedRow(payload_bytes=opts["rank"] * itemsize, payload_dtype=zarr_dtype)

    def describe(self, spec: CodecSpec) -> str:
        o = spec.options
        bits = " bits" if o.get("code_dtype") == "bfloat16" else ""
        return (f"x[..., :] = codes[..., :] ({o.get('code_dtype', 'float16')}{bits}, "
                f"{o.get('rank')} per row) @ P^T, P = base64 float32 little-endian [{o.get('width')}, {o.get('rank')}] "
                "in config.projection; then rounded to source_dtype")

    # ------------------------------------------------------------------ values
    def _projection(self, spec: CodecSpec) -> LowRankProjection:
        o = spec.options
        if "projection" not in o or "width" not in o:
            raise ValueError("lowrank spec is not configured (no inline projection/width); pass it through "
                             "LowRankCodec().configure(spec, width, dtype) or a store's resolved codecs")
        return _module(o["projection"], o["width"], o["rank"])

    def encode(self, values: torch.Tensor, spec: CodecSpec) -> tuple[torch.Tensor, torch.Tensor]:
        m = self._projection(spec)
        if values.shape[-1] != m.width:
            raise ValueError(f"lowrank: rows of {values.shape[-1]} values, the projection is for {m.width}")
        torch_dtype, _ = CODE_DTYPES[spec.options.get("code_dtype", "float16")]
        codes = m.encode(values.reshape(-1, m.width)).to(torch_dtype).contiguous()
        return codes.view(torch.uint8).reshape(-1), torch.empty(0, 0, device=values.device)

    def decode(self, payload: torch.Tensor, scales: torch.Tensor, spec: CodecSpec, shape: tuple[int, ...],
               dtype: torch.dtype) -> torch.Tensor:
        m = self._projection(spec)
        torch_dtype, _ = CODE_DTYPES[spec.options.get("code_dtype", "float16")]
        itemsize = torch.empty((), dtype=torch_dtype).element_size()
        flat = payload.reshape(-1)
        if not flat.is_contiguous() or flat.storage_offset() % itemsize:
            flat = flat.clone()
        rows = math.prod(shape[:-1])
        if shape[-1] != m.width or flat.numel() != rows * m.rank * itemsize:
            raise ValueError(f"lowrank: {flat.numel()} payload bytes cannot decode to {list(shape)} "
                             f"(rank {m.rank}, {itemsize}-byte codes, rows of {m.width})")
        codes = flat.view(torch_dtype).reshape(rows, m.rank)
        return m.decode(codes).to(dtype).reshape(shape)
