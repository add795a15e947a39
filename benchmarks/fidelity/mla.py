"""A reference MLA attention with absorbed queries, reading a `[T, 512 + 64]` latent cache.

Per head h and query position i: logits_j = q_lat[h] . c_kv[j] + q_pe[h] . k_pe[j]; weights
= softmax over the causally visible tokens j; out[h] = (weights @ c_kv) @ W_uv[h]. The
queries live in latent space (W_uk absorbed), as MLA decoding does.

Two query models. `isotropic` (the default, used by the rule): the query and W_uv are random in
the cache's own coordinates, so the outlier channels weigh in as much as their size says.
`equalized` (a stress test): they are drawn so that every latent channel contributes alike once
the norm weight (`gamma`) is undone, the pessimistic case for group scales shared between an
outlier channel and ordinary ones (absolute-step codecs, int8/int4, suffer most). The logit
scale is calibrated so the logits of a query spread with a standard deviation of `logit_std`
(about 3: peaked but not one-hot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUERY_MODELS = ("isotropic", "equalized")


@dataclass
class MLAQueries:
    q: torch.Tensor  # [Tq, H, 576] absorbed query (latent | rope), calibrated
    w_uv: torch.Tensor  # [H, 512, Dv]


def make_queries(cache: torch.Tensor, gamma: torch.Tensor, positions: int, heads: int,
                 g: torch.Generator, *, latent: int = 512, v_dim: int = 128,
                 logit_std: float = 3.0, equalize: bool = False) -> MLAQueries:
    """Queries for `positions` steps and the value up-projection, calibrated on `cache`."""
    width = cache.shape[-1]
    q = torch.randn(positions, heads, width, generator=g)
    w_uv = torch.randn(heads, latent, v_dim, generator=g) / latent**0.5
    if equalize:  # equal contribution per latent channel
        q[..., :latent] /= gamma
        q[..., latent:] /= cache[:, latent:].float().pow(2).mean().sqrt()
        w_uv = w_uv / gamma[None, :, None]
    probe = q @ cache.float().T[None]  # [Tq, H, T]
    q = q * (logit_std / probe.std(dim=-1, keepdim=True).mean(0, keepdim=True))
    return MLAQueries(q, w_uv)


def attend(cache: torch.Tensor, queries: MLAQueries, prefix: int, latent: int = 512) -> torch.Tensor:
    """Outputs `[Tq, H, Dv]` of queries at positions prefix .. prefix + Tq - 1 over `cache`.

    `cache` `[prefix + Tq, 576]` (any float dtype; computed in fp32): query i sees tokens
    0 .. prefix + i (causal), as the continuation after a restore does.
    """
    tq, h, _ = queries.q.shape
    kv = cache.float()
    logits = torch.einsum("thc,jc->thj", queries.q, kv)  # [Tq, H, T]
    j = torch.arange(kv.shape[0])
    visible = j[None, :] <= (prefix + torch.arange(tq))[:, None]  # [Tq, T]
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    out_lat = torch.einsum("thj,jc->thc", weights, kv[:, :latent])  # [Tq, H, 512]
    return torch.einsum("thc,hcv->thv", out_lat, queries.w_uv)
