"""Kimi Delta Attention core: the gated delta rule with per-key-channel decay, in fp32 (state included);
the output is rounded to v's dtype (bf16 or fp32), as vLLM's KDA kernels store it.

Per head, state S: [K, V]. For each token t:
    S <- S * exp(g_t)[:, None]                      (g_t: [K] log-decay, <= 0)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = scale * S^T q_t
(q, k already L2-normalised; beta = sigmoid(b).)

Invariant form: the recurrence itself, one token at a time, every contraction a `tree_sum`. Each
token's output and the state after it are pure functions of the state before it and that token's
inputs, so any split into prefill chunks and decode steps, any batch, and any resume point give the same
bits; a serving engine may snapshot S after any token (prefix caching from any position).
"""

from __future__ import annotations

import torch

from parity.kernels.primitives import sigmoid, softplus, tree_sum, wide


def kda_invariant(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, g: [B, T, H, K], v: [B, T, H, V], beta: [B, T, H], state: [B, H, K, V] fp32 (q, k, v, beta may
    be bf16: upcast); valid: [B, T] bool (False = padding: the state is left unchanged and the output is zero).
    Returns (o [B, T, H, V] in v's dtype, final state [B, H, K, V] fp32)."""
    out_dtype = v.dtype
    q, k, v, g, beta = wide(q), wide(k), wide(v), wide(g), wide(beta)
    outs = []
    s = state
    for t in range(q.shape[1]):
        s_new = s * torch.exp(g[:, t]).unsqueeze(-1)
        kt = k[:, t].unsqueeze(-1)  # [B, H, K, 1]
        ks = tree_sum(kt * s_new, dim=-2)  # [B, H, V]
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - ks)
        s_new = s_new + kt * u.unsqueeze(-2)
        o = tree_sum(q[:, t].unsqueeze(-1) * s_new, dim=-2) * scale
        if valid is not None:
            keep = valid[:, t].view(-1, 1, 1, 1)
            s_new = torch.where(keep, s_new, s)
            o = torch.where(keep.view(-1, 1, 1), o, torch.zeros_like(o))
        s = s_new
        outs.append(o)
    if not outs:
        return v.new_zeros(v.shape, dtype=out_dtype), s
    return torch.stack(outs, dim=1).to(out_dtype), s


def kda_fast(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same recurrence with `einsum` contractions (batched GEMV; bits depend on the batch)."""
    out_dtype = v.dtype
    q, k, v, g, beta = wide(q), wide(k), wide(v), wide(g), wide(beta)
    outs = []
    s = state
    for t in range(q.shape[1]):
        s_new = s * torch.exp(g[:, t]).unsqueeze(-1)
        ks = torch.einsum("bhk,bhkv->bhv", k[:, t], s_new)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - ks)
        s_new = s_new + torch.einsum("bhk,bhv->bhkv", k[:, t], u)
        o = torch.einsum("bhk,bhkv->bhv", q[:, t], s_new) * scale
        if valid is not None:
            keep = valid[:, t].view(-1, 1, 1, 1)
            s_new = torch.where(keep, s_new, s)
            o = torch.where(keep.view(-1, 1, 1), o, torch.zeros_like(o))
        s = s_new
        outs.append(o)
    if not outs:
        return v.new_zeros(v.shape, dtype=out_dtype), s
    return torch.stack(outs, dim=1).to(out_dtype), s


def kda_gate_invariant(
    f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """f: [..., H, K] = f_b(f_a(x)) (fp32 or bf16), a_log: [H], dt_bias: [H, K] fp32 -> log-decay g: [..., H, K],
    always fp32.

    g = -exp(A_log) * softplus(f + dt_bias), or with a lower bound lb:
    g = lb * sigmoid(exp(A_log) * (f + dt_bias)), so g lies in (lb, 0).
    """
    a = torch.exp(wide(a_log)).unsqueeze(-1)
    f = wide(f) + wide(dt_bias)
    if lower_bound is None:
        return -a * softplus(f)
    return lower_bound * sigmoid(a * f)


def kda_gate_fast(
    f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    a = torch.exp(wide(a_log)).unsqueeze(-1)
    f = wide(f) + wide(dt_bias)
    if lower_bound is None:
        return -a * torch.nn.functional.softplus(f)
    return lower_bound * torch.sigmoid(a * f)
