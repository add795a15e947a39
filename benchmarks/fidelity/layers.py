"""Reference KDA and Gated DeltaNet layers around fla's own recurrences, batched over variants.

Per head, with state S `[K, V]` (fla's `[B, H, K, V]` convention; the cache's `recurrent`
field `[heads, head_dim, head_dim]`), both layers run the gated delta rule

    S_t = (I - b_t k_t k_t^T) diag(a_t) S_{t-1} + b_t k_t v_t^T,     o_t = S_t^T (q_t / sqrt(K))

KDA's forget gate a_t = exp(g_t) is per key channel `[K]`; Gated DeltaNet's is one scalar per
head. The recurrence itself is fla-core's `naive_recurrent_kda` / `naive_recurrent_gated_delta_rule`
(`fla_ref`); `delta_rule_matrix_form` is the formula taken literally, for the tests.

Around it, as in Kimi-Linear and Qwen3-Next: a depthwise causal short convolution (kernel 4)
with SiLU over the q | k | v projections, whose state is the last 3 inputs (the `conv` field
`[taps=3, 3, H*D]`, held in bf16 as vLLM does); q and k L2-normalized per head; the gate
g = -exp(A_log) * softplus(gate_in + dt_bias) (fla's `naive_kda_gate` / `naive_gdn_gate`, run
as they are), beta = sigmoid(beta_in).

Variants: the continuation after a restore runs every codec's restored state at once, as the
batch axis B of fla's functions (B = 1 + number of variants; index 0 is the exact state).
Shapes: T tokens, H heads, D = K = V head dim, C = H*D channels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import fla_ref

CONV_KERNEL = 4  # short_conv_kernel_size of both models; the state keeps CONV_KERNEL - 1 inputs
KINDS = ("kda", "gdn")


@dataclass
class LayerParams:
    """The weights of one layer that the recurrence needs (random, with realistic ranges)."""

    kind: str  # "kda" or "gdn"
    conv_w: torch.Tensor  # [3, C, CONV_KERNEL] depthwise taps per q|k|v channel, oldest first
    A_log: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H, D] (kda) or [H] (gdn)

    @classmethod
    def random(cls, kind: str, heads: int, head_dim: int, g: torch.Generator) -> LayerParams:
        """A_log = log U(1, 16) and dt in [1e-3, 1e-1] (Mamba's init, which fla's KDA and GDN
        layers use); `calibrate` then sets the decay regime."""
        if kind not in KINDS:
            raise ValueError(f"layer kind must be one of {KINDS}, found {kind!r}")
        c = heads * head_dim
        conv_w = torch.randn(3, c, CONV_KERNEL, generator=g) / math.sqrt(CONV_KERNEL)
        A_log = torch.log(1.0 + 15.0 * torch.rand(heads, generator=g))
        lo, hi = math.log(1e-3), math.log(1e-1)
        shape = (heads, head_dim) if kind == "kda" else (heads,)
        dt = torch.exp(lo + (hi - lo) * torch.rand(shape, generator=g))
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        return cls(kind, conv_w, A_log, dt_bias)

    def calibrate(self, gate_in: torch.Tensor, median_decay: float) -> LayerParams:
        """The same layer with exp(A_log) scaled so that the median decay a = exp(g) over
        `gate_in` is `median_decay` (exact: a^c has median m^c, so c = log(target) / log(m))."""
        m = gate(gate_in, self).exp().median().item()
        c = math.log(median_decay) / math.log(m)
        return LayerParams(self.kind, self.conv_w, self.A_log + math.log(c), self.dt_bias)


def gate(gate_in: torch.Tensor, p: LayerParams) -> torch.Tensor:
    """log-decay g (<= 0): -exp(A_log) * softplus(gate_in + dt_bias), by fla's own
    `naive_kda_gate` (kda: `[T, H, D]`) or `naive_gdn_gate` (gdn: `[T, H]`)."""
    return fla_ref.naive_gate(p.kind)(gate_in, p.A_log, p.dt_bias.reshape(-1))


def short_conv(x: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU over `x` `[T, 3, C]` from `conv_state` `[B, 3, 3, C]`.

    Returns (outputs `[B, T, 3, C]`, the new states: the last 3 inputs `[B, 3, 3, C]`).
    """
    b, t = conv_state.shape[0], x.shape[0]
    full = torch.cat([conv_state.float(), x.float().expand(b, *x.shape)], dim=1)  # [B, 3 + T, 3, C]
    y = sum(full[:, j : j + t] * w[:, :, j] for j in range(CONV_KERNEL))
    return F.silu(y), full[:, -(CONV_KERNEL - 1):].clone()


@dataclass
class LayerState:
    conv: torch.Tensor | None  # [B, 3, 3, C] bf16, the `conv` field in logical order (None: no conv)
    recurrent: torch.Tensor  # [B, H, K, V] fp32, the `recurrent` field


def run(p: LayerParams, inp: dict, state: LayerState) -> tuple[torch.Tensor, LayerState]:
    """The layer over `inp` for each of the B states: outputs `[B, T, H, V]` and the new states.
    `inp` holds either `x` `[T, 3, C]` (projections, through the short conv) or `q`, `k`, `v`
    `[T, H, D]` given directly (no conv), plus `gate_in` and `beta_in` `[T, H]`.
    """
    H = p.A_log.shape[0]
    B = state.recurrent.shape[0]
    if "x" in inp:
        y, conv = short_conv(inp["x"], state.conv, p.conv_w)
        T = y.shape[1]
        D = y.shape[-1] // H
        q = F.normalize(y[:, :, 0].reshape(B, T, H, D), dim=-1)
        k = F.normalize(y[:, :, 1].reshape(B, T, H, D), dim=-1)
        v = y[:, :, 2].reshape(B, T, H, D)
        conv = conv.to(torch.bfloat16)
    else:
        q, k, v = (inp[n].expand(B, *inp[n].shape) for n in ("q", "k", "v"))
        conv = state.conv
    g = gate(inp["gate_in"], p)
    g = g.expand(B, *g.shape)
    beta = torch.sigmoid(inp["beta_in"]).expand(B, *inp["beta_in"].shape)
    if p.kind == "kda":
        o, S = fla_ref.naive_recurrent_kda(q, k, v, g, beta, initial_state=state.recurrent,
                                           output_final_state=True)
    else:
        o, S = fla_ref.naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=state.recurrent,
                                                        output_final_state=True)
    return o, LayerState(conv, S)


def head_rms_norm(o: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-head RMS normalization of outputs `[..., H, V]`: what the layer's o_proj reads.

    Why: both models feed `RMSNorm(o_h) * gate` per head into their output projection, so every
    head counts alike downstream whatever its raw magnitude; the norm's weight and the gate are
    elementwise and leave relative errors roughly as they are, so they are omitted.
    """
    return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)


def empty_state(heads: int, head_dim: int, conv: bool = True) -> LayerState:
    c = heads * head_dim
    return LayerState(
        torch.zeros(1, CONV_KERNEL - 1, 3, c, dtype=torch.bfloat16) if conv else None,
        torch.zeros(1, heads, head_dim, head_dim, dtype=torch.float32),
    )


def delta_rule_matrix_form(S0, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """The published formula taken literally, head by head, in float64 (slow; for tests):
    S_t = (I - b k k^T) diag(a) S_{t-1} + b k v^T; o_t = S_t^T q_t / sqrt(K). q/k `[T, H, K]`,
    v `[T, H, V]`, beta `[T, H]`, S0 `[H, K, V]`; g `[T, H, K]` (KDA) or `[T, H]` (GDN: one
    decay for every key channel)."""
    T, H, K = q.shape
    if g.dim() == 2:
        g = g[..., None].expand(T, H, K)
    S = S0.double().clone()
    out = torch.empty(T, H, v.shape[-1], dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            kk, vv, qq = k[t, h].double(), v[t, h].double(), q[t, h].double() * K**-0.5
            b = beta[t, h].double()
            S[h] = (eye - b * torch.outer(kk, kk)) @ torch.diag(g[t, h].double().exp()) @ S[h] + b * torch.outer(kk, vv)
            out[t, h] = S[h].T @ qq
    return out, S
