"""Measure the `lowrank` codec's fidelity: SQNR (dB) of decode(encode(x)) against x on test rows
the projection was not fitted on, and the stored size against bf16, per data set and rank.

    pip install -e examples/lowrank_codec --no-deps       # once, see README.md
    python examples/lowrank_codec/measure_fidelity.py   # writes fidelity.json beside this file

It runs in a checkout: two data sets come from its connector tests and benchmarks, which are
not installed (the codec and anchorkv are).

Data sets (576-wide rows, as an MLA latent; bf16 in, float16 codes):

* ``harness``: the rows the connector tests' fake model writes (`tests/connector/engine.py`:
  smooth in the channel index, so rank 2 per layer): the best case, not a real model;
* ``decaying``: synthetic rows with singular values falling as 1/k (a low-rank-dominated
  spectrum, as learned K/V projections tend to have; synthetic, not measured on a model);
* ``mla_outliers`` / ``mla_gaussian``: the fidelity study's MLA latents (`benchmarks.fidelity.data`:
  RMS-normalized heavy-tailed or Gaussian channels, 1% outlier channels, rotated rope part):
  near full rank, the codec's bad case;
* ``isotropic``: Gaussian rows; any rank-r projection keeps r / 576 of their energy, so the
  SQNR is 10 log10(576 / (576 - r)) at best: the worst case.

No real model's cache was available here: the numbers say how the codec behaves on these
spectra, not how a given model's outputs change (that needs a continuation study).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lowrank_codec as L
import torch

from anchorkv.codec import CodecSpec
from anchorkv.testing.metrics import sqnr_db

HERE = Path(__file__).resolve().parent
#: The checkout, for the data sets of its tests and benchmarks (`tests.connector.engine`,
#: `benchmarks.fidelity.data`), imported where they are used.
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

WIDTH, CALIB, TEST = 576, 4096, 2048
RANKS = (8, 16, 64, 128)


def harness(n: int, g: torch.Generator, offset: int) -> torch.Tensor:
    from tests.connector import engine as E  # the connector tests' fake model (no vLLM needed)

    pos = torch.arange(offset, offset + n)
    layers = [E.latent_rows(layer, pos, torch.randint(0, 150000, (n,), generator=g)) for layer in (3, 7, 11)]
    return torch.cat(layers)[torch.randperm(3 * n, generator=g)[:n]].float()


def decaying(n: int, g: torch.Generator, offset: int) -> torch.Tensor:
    basis = torch.linalg.qr(torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7)))[0]
    s = 1.0 / torch.arange(1, WIDTH + 1, dtype=torch.float32)
    return (torch.randn(n, WIDTH, generator=g) * s) @ basis.T


def mla(model: str):
    def make(n: int, g: torch.Generator, offset: int) -> torch.Tensor:
        from benchmarks.fidelity.data import mla_latent

        # one draw for calibration and test, so both share the norm weight and rope scales
        x, _ = mla_latent(CALIB + TEST, torch.Generator().manual_seed(11), model=model)
        return (x[:CALIB] if offset == 0 else x[CALIB:CALIB + n]).float()
    return make


def isotropic(n: int, g: torch.Generator, offset: int) -> torch.Tensor:
    return torch.randn(n, WIDTH, generator=g)


DATA = {"harness": harness, "decaying": decaying, "mla_outliers": mla("outliers"),
        "mla_gaussian": mla("gaussian"), "isotropic": isotropic}


def main() -> None:
    codec = L.LowRankCodec()
    results = []
    for name, make in DATA.items():
        calib = make(CALIB, torch.Generator().manual_seed(1), 0).to(torch.bfloat16)
        test = make(TEST, torch.Generator().manual_seed(2), 10_000).to(torch.bfloat16)
        for r in RANKS:
            spec = codec.configure(CodecSpec.parse(L.codec_config(L.fit_projection(calib.double(), r))),
                                   WIDTH, torch.bfloat16)
            got = codec.decode(*codec.encode(test, spec), spec, tuple(test.shape), torch.bfloat16)
            row = {"data": name, "rank": r, "sqnr_db": round(sqnr_db(test, got), 2),
                   "bytes_per_row": 2 * r, "size_vs_bf16": round(2 * r / (2 * WIDTH), 4)}
            results.append(row)
            print(f"{name:>13} rank {r:>3}: SQNR {row['sqnr_db']:7.2f} dB, {row['bytes_per_row']:>4} B/row "
                  f"({row['size_vs_bf16']:.3f}x of bf16)")
    (HERE / "fidelity.json").write_text(json.dumps({"width": WIDTH, "calibration_rows": CALIB,
                                                    "test_rows": TEST, "code_dtype": "float16",
                                                    "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
