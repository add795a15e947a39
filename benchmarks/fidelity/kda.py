"""A reference KDA (Kimi Delta Attention) layer in plain torch, written from the gated delta rule.

Per head, with state S `[K, V]` (keys by values, fla's `[B, H, K, V]` convention, which is the
`recurrent` field `[heads, head_dim, head_dim]`):

    S_t = (I - b_t k_t k_t^T) diag(a_t) S_{t-1} + b_t k_t v_t^T,     o_t = S_t^T (q_t / sqrt(K))

a_t = exp(g_t) `[K]` is KDA's per-channel forget gate (diagonal over the key dimension), b_t a
scalar per head (beta). Equivalently, as flash-linear-attention's `naive_recurrent_kda` writes
it: S <- diag(a_t) S; S <- S + b_t k_t (v_t - S^T k_t)^T.

Around the recurrence, as in Kimi-Linear: a depthwise causal short convolution (kernel 4) with
SiLU over the q | k | v projections, whose state is the last 3 inputs (the `conv` field
`[taps=3, 3, H*D]`); q and k are L2-normalized per head; the gate is
g = -exp(A_log) * softplus(gate_in + dt_bias) (fla's `naive_kda_gate`), beta = sigmoid(beta_in).
Shapes: T tokens, H heads, D = K = V head dim, C = H*D channels.
"""

from __future__ import annotations

from dataclasses import dataclass
import math

import torch
import torch.nn.functional as F

CONV_KERNEL = 4  # Kimi-Linear's short_conv_kernel_size; the state keeps CONV_KERNEL - 1 inputs


@dataclass
class KDAParams:
    """The weights of one layer that the recurrence needs (random, with realistic ranges)."""

    conv_w: torch.Tensor  # [3, C, CONV_KERNEL] depthwise taps per q|k|v channel, oldest first
    A_log: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H, D]

    @classmethod
    def random(cls, heads: int, head_dim: int, g: torch.Generator) -> "KDAParams":
        """A_log = log U(1, 16) and dt in [1e-3, 1e-1] (Mamba's init, as fla's KDA uses):
        per-channel decays a = exp(g) from ~0.999 (memory of ~1000 tokens) down to ~0.2."""
        c = heads * head_dim
        conv_w = torch.randn(3, c, CONV_KERNEL, generator=g) / math.sqrt(CONV_KERNEL)
        A_log = torch.log(1.0 + 15.0 * torch.rand(heads, generator=g))
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = torch.exp(lo + (hi - lo) * torch.rand(heads, head_dim, generator=g))
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        return cls(conv_w, A_log, dt_bias)


def kda_gate(gate_in: torch.Tensor, p: KDAParams) -> torch.Tensor:
    """log-decay g `[T, H, D]` (<= 0): -exp(A_log) * softplus(gate_in + dt_bias)."""
    return -p.A_log.exp()[:, None] * F.softplus(gate_in + p.dt_bias)


def short_conv(x: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU over `x` `[T, 3, C]` continuing from `conv_state` `[3, 3, C]`.

    Returns (outputs `[T, 3, C]`, the new state: the last 3 inputs `[3, 3, C]`, oldest first).
    """
    full = torch.cat([conv_state.float(), x], dim=0)  # [3 + T, 3, C]
    t = x.shape[0]
    y = sum(full[j : j + t] * w[:, :, j] for j in range(CONV_KERNEL))
    return F.silu(y), full[-(CONV_KERNEL - 1):].clone()


def delta_rule_step(S: torch.Tensor, q, k, v, a, b) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for all heads: S `[H, K, V]`, q/k `[H, K]`, v `[H, V]`, a `[H, K]`, b `[H]`.

    Returns (o `[H, V]`, S_t). Written as fla's naive form, in place on a copy-free `S`:
    decay, then write b k (v - S^T k)^T.
    """
    S.mul_(a.unsqueeze(-1))
    u = v - torch.bmm(k.unsqueeze(1), S).squeeze(1)  # v - S^T k
    S.baddbmm_((b.unsqueeze(-1) * k).unsqueeze(2), u.unsqueeze(1))
    o = torch.bmm(q.unsqueeze(1), S).squeeze(1)  # S^T q
    return o, S


def delta_rule(S0: torch.Tensor, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the recurrence over T steps: q/k `[T, H, K]`, v `[T, H, V]`, g `[T, H, K]` (log
    decay), beta `[T, H]`, S0 `[H, K, V]`. Returns (o `[T, H, V]`, S_T); q is scaled by K^-1/2."""
    S = S0.clone().float()
    scale = q.shape[-1] ** -0.5
    a = g.exp()
    out = torch.empty(v.shape, dtype=torch.float32)
    for t in range(q.shape[0]):
        out[t], S = delta_rule_step(S, q[t] * scale, k[t], v[t], a[t], beta[t])
    return out, S


def delta_rule_matrix_form(S0, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """The published formula taken literally, head by head, in float64 (slow; for tests):
    S_t = (I - b k k^T) diag(a) S_{t-1} + b k v^T; o_t = S_t^T q_t / sqrt(K)."""
    T, H, K = q.shape
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


@dataclass
class KDAState:
    conv: torch.Tensor  # [3, 3, C] bf16, the `conv` field in logical order
    recurrent: torch.Tensor  # [H, K, V] fp32, the `recurrent` field


def kda_layer(x, gate_in, beta_in, p: KDAParams, state: KDAState) -> tuple[torch.Tensor, KDAState]:
    """One KDA layer over `x` `[T, 3, C]` from `state`: outputs `[T, H, V]` and the new state.

    The conv state is held in bf16 (as vLLM does); the recurrent state in fp32.
    """
    H, D = p.dt_bias.shape
    y, conv = short_conv(x, state.conv, p.conv_w)
    T = x.shape[0]
    q = F.normalize(y[:, 0].reshape(T, H, D), dim=-1)
    k = F.normalize(y[:, 1].reshape(T, H, D), dim=-1)
    v = y[:, 2].reshape(T, H, D)
    g = kda_gate(gate_in, p)
    beta = torch.sigmoid(beta_in)
    o, S = delta_rule(state.recurrent, q, k, v, g, beta)
    return o, KDAState(conv.to(torch.bfloat16), S)


def head_rms_norm(o: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Per-head RMS normalization of outputs `[T, H, V]`: what Kimi-Linear's o_proj reads.

    Why: the layer feeds `RMSNorm(o_h) * sigmoid(gate)` per head into its output projection, so
    every head counts alike downstream whatever its raw magnitude; the norm's weight and the
    gate are elementwise and leave relative errors roughly as they are, so they are omitted.
    """
    return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)


def empty_state(heads: int, head_dim: int) -> KDAState:
    c = heads * head_dim
    return KDAState(
        torch.zeros(CONV_KERNEL - 1, 3, c, dtype=torch.bfloat16),
        torch.zeros(heads, head_dim, head_dim, dtype=torch.float32),
    )
