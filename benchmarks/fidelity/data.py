"""Generators of data shaped like real cache state (not only Gaussian).

* `heavy_tailed`: Student-t values (tails far heavier than a Gaussian's);
* `with_outlier_channels`: a few channels 10-100x larger than the rest, as in real K/V and
  projection outputs (the "massive activation" channels of LLMs);
* `layer_inputs`: what a KDA / Gated DeltaNet layer is fed, by input model (`LAYER_INPUTS`:
  Gaussian q/k/v; Gaussian projections through the short conv; heavy-tailed projections with
  outlier channels) plus its gate and beta inputs;
* `mla_latent`: an MLA cache row `[T, 512 + 64]` by input model (`LATENT_INPUTS`: Gaussian or
  heavy-tailed latents without outlier channels, or heavy-tailed with them), then the rope key
  at its own scale, rotated by position.

The conv and recurrent states are not drawn here: `layers.run` produces them by running the
layer over `layer_inputs`.
"""

from __future__ import annotations

import math

import torch


def heavy_tailed(shape, g: torch.Generator, dof: float = 4.0) -> torch.Tensor:
    """Student-t with `dof` degrees of freedom, scaled to unit variance (dof > 2)."""
    z = torch.randn(shape, generator=g, dtype=torch.float64)
    w = _gamma(shape, dof / 2.0, g) * 2.0  # chi-squared(dof); torch's Chi2 takes no generator
    t = z / torch.sqrt(w / dof)
    return (t * math.sqrt((dof - 2.0) / dof)).float()


def _gamma(shape, alpha: float, g: torch.Generator) -> torch.Tensor:
    """Gamma(alpha, 1) samples with an explicit generator (Marsaglia-Tsang, alpha >= 1)."""
    d = alpha - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    n = math.prod(shape)
    out = torch.empty(0, dtype=torch.float64)
    while out.numel() < n:
        m = 2 * (n - out.numel()) + 16
        x = torch.randn(m, generator=g, dtype=torch.float64)
        u = torch.rand(m, generator=g, dtype=torch.float64)
        v = (1.0 + c * x) ** 3
        ok = (v > 0) & (torch.log(u.clamp_min(1e-300)) < 0.5 * x**2 + d - d * v + d * torch.log(v.clamp_min(1e-300)))
        out = torch.cat([out, (d * v)[ok]])
    return out[:n].reshape(shape)


def outlier_scales(channels: int, g: torch.Generator, fraction: float = 0.01,
                   low: float = 10.0, high: float = 100.0, spread: float = 0.3) -> torch.Tensor:
    """Per-channel scales: log-normal around 1, and `fraction` of channels `low`-`high` x larger."""
    s = torch.exp(spread * torch.randn(channels, generator=g))
    if fraction == 0:
        return s
    n_out = max(1, round(fraction * channels))
    idx = torch.randperm(channels, generator=g)[:n_out]
    s[idx] *= low + (high - low) * torch.rand(n_out, generator=g)
    return s


def with_outlier_channels(x: torch.Tensor, g: torch.Generator, **kw) -> torch.Tensor:
    """`x` `[..., C]` with per-channel scales from `outlier_scales` applied to its last axis."""
    return x * outlier_scales(x.shape[-1], g, **kw)


def gaussian(shape, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g)


#: Synthetic distributions of the SQNR table, by name.
SYNTHETIC = {
    "gaussian": lambda shape, g: gaussian(shape, g),
    "student_t3": lambda shape, g: heavy_tailed(shape, g, dof=3.0),
    "outlier_channels": lambda shape, g: with_outlier_channels(heavy_tailed(shape, g, dof=4.0), g),
}


#: Input models of the linear-attention layers (what their recurrence is fed).
LAYER_INPUTS = ("gaussian", "conv", "outliers")
#: Input models of the MLA latent.
LATENT_INPUTS = ("gaussian", "heavy", "outliers")


def layer_inputs(model: str, tokens: int, heads: int, head_dim: int, kind: str,
                 g: torch.Generator) -> dict[str, torch.Tensor]:
    """Inputs of a KDA (`kind` "kda") or Gated DeltaNet ("gdn") layer for `tokens` steps.

    * ``gaussian``: q, k, v given to the recurrence directly, i.i.d. Gaussian (q, k
      L2-normalized per head), as fla's own tests draw them; no short conv, so no `conv` state;
    * ``conv``: Gaussian q | k | v projections `x` through the layer's short conv + SiLU + L2 norm;
    * ``outliers``: heavy-tailed projections (Student-t, 4 dof) with per-channel log-normal
      scales and 1% outlier channels 10-100x larger, through the conv as above.

    Projections are rounded through bf16 as the model holds them. Also returns the gate's
    pre-activation `gate_in` (`[T, H, D]` for kda, `[T, H]` for gdn) and `beta_in` `[T, H]`.
    """
    c = heads * head_dim
    out: dict[str, torch.Tensor] = {}
    if model == "gaussian":
        for name in ("q", "k", "v"):
            x = torch.randn(tokens, heads, head_dim, generator=g)
            out[name] = torch.nn.functional.normalize(x, dim=-1) if name != "v" else x
    elif model == "conv":
        out["x"] = torch.randn(tokens, 3, c, generator=g).to(torch.bfloat16).float()
    elif model == "outliers":
        x = torch.stack([with_outlier_channels(heavy_tailed((tokens, c), g, dof=4.0), g) for _ in range(3)], dim=1)
        out["x"] = x.to(torch.bfloat16).float()
    else:
        raise ValueError(f"input model must be one of {LAYER_INPUTS}, found {model!r}")
    gate_shape = (tokens, heads, head_dim) if kind == "kda" else (tokens, heads)
    out["gate_in"] = 0.5 * torch.randn(gate_shape, generator=g)
    out["beta_in"] = torch.randn(tokens, heads, generator=g)
    return out


def mla_latent(tokens: int, g: torch.Generator, *, model: str = "outliers", latent: int = 512,
               rope: int = 64, rope_scale: float = 4.0, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLA cache `[T, latent + rope]` (bf16) and the norm weight `[latent]` that shaped it.

    The latent is RMSNorm(z) times a norm weight `gamma` with log-normal spread, where by
    `model`: ``gaussian`` z Gaussian, no outlier channels; ``heavy`` z Student-t (4 dof), no
    outlier channels; ``outliers`` z Student-t and 1% of gamma's channels 10-100x larger. The
    rope part is Gaussian with per-pair scales around `rope_scale`, rotated by the token's
    position (`start` + t) as RoPE does; the two parts thus have different scales, as in
    DeepSeek-style MLA caches.
    """
    if model not in LATENT_INPUTS:
        raise ValueError(f"latent model must be one of {LATENT_INPUTS}, found {model!r}")
    c = torch.randn(tokens, latent, generator=g) if model == "gaussian" else heavy_tailed((tokens, latent), g, dof=4.0)
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
    gamma = outlier_scales(latent, g, fraction=0.01 if model == "outliers" else 0.0)
    c = c * gamma
    pairs = rope // 2
    pair_scale = rope_scale * torch.exp(0.5 * torch.randn(pairs, generator=g))
    r = torch.randn(tokens, pairs, 2, generator=g) * pair_scale[:, None]
    pos = torch.arange(start, start + tokens, dtype=torch.float64)[:, None]
    inv_freq = 10000.0 ** (-torch.arange(pairs, dtype=torch.float64) / pairs)
    ang = (pos * inv_freq).float()
    cos, sin = torch.cos(ang), torch.sin(ang)
    rot = torch.stack([r[..., 0] * cos - r[..., 1] * sin, r[..., 0] * sin + r[..., 1] * cos], -1)
    out = torch.cat([c, rot.reshape(tokens, rope)], dim=-1)
    return out.to(torch.bfloat16), gamma
