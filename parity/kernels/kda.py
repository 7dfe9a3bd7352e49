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

Autograd (`kda_invariant` when a gradient is needed): the forward runs that recurrence chunk by chunk (`CHUNK`
tokens) and saves only the state at each chunk boundary; the backward recomputes one chunk's per-token states from
its boundary state and back-propagates through the chunk with the closed-form gradient of each step (einsum
contractions: exact to fp32 rounding, deterministic, not batch-invariant). Memory for the backward: the inputs plus
T / CHUNK states instead of every token's state and intermediates.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import torch

from parity.kernels.primitives import needs_grad, sigmoid, softplus, tree_sum, wide


CHUNK = 64  # tokens between the states the autograd forward saves


def _step(s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          scale: float, keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the invariant recurrence: s [B, H, K, V], q, k, g [B, H, K], v [B, H, V], beta [B, H],
    keep [B] bool or None -> (o [B, H, V], state after the token)."""
    s_new = s * torch.exp(g).unsqueeze(-1)
    kt = k.unsqueeze(-1)  # [B, H, K, 1]
    ks = tree_sum(kt * s_new, dim=-2)  # [B, H, V]
    u = beta.unsqueeze(-1) * (v - ks)
    s_new = s_new + kt * u.unsqueeze(-2)
    o = tree_sum(q.unsqueeze(-1) * s_new, dim=-2) * scale
    if keep is not None:
        s_new = torch.where(keep.view(-1, 1, 1, 1), s_new, s)
        o = torch.where(keep.view(-1, 1, 1), o, 0.0)
    return o, s_new


def _recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
                state: torch.Tensor, valid: torch.Tensor | None,
                boundaries: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over all tokens (wide inputs) -> (o [B, T, H, V] wide, final state); appends the state before
    every CHUNK-th token to `boundaries` when given."""
    outs = []
    s = state
    for t in range(q.shape[1]):
        if boundaries is not None and t % CHUNK == 0:
            boundaries.append(s)
        o, s = _step(s, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], scale, None if valid is None else valid[:, t])
        outs.append(o)
    if not outs:
        return v.new_zeros(v.shape), s
    return torch.stack(outs, dim=1), s


def _step_backward(s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, scale: float, keep: torch.Tensor | None, do: torch.Tensor,
                   ds_next: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Gradients of one `_step` from the state before it: (ds, dq, dk, dv, dg, dbeta) given d(o) and d(state after)."""
    a = torch.exp(g)
    s1 = s * a.unsqueeze(-1)
    ks = torch.einsum("bhk,bhkv->bhv", k, s1)
    u = beta.unsqueeze(-1) * (v - ks)
    s2 = s1 + k.unsqueeze(-1) * u.unsqueeze(-2)
    d_s2 = ds_next + scale * q.unsqueeze(-1) * do.unsqueeze(-2)
    dq = scale * torch.einsum("bhkv,bhv->bhk", s2, do)
    du = torch.einsum("bhkv,bhk->bhv", d_s2, k)
    dk = torch.einsum("bhkv,bhv->bhk", d_s2, u)
    dbeta = (du * (v - ks)).sum(-1)
    dv = beta.unsqueeze(-1) * du
    d_s1 = d_s2 - k.unsqueeze(-1) * dv.unsqueeze(-2)  # ks enters u with weight -beta
    dk = dk - torch.einsum("bhkv,bhv->bhk", s1, dv)
    ds = d_s1 * a.unsqueeze(-1)
    dg = a * torch.einsum("bhkv,bhkv->bhk", d_s1, s)
    if keep is not None:  # a padding token: state passed through, no input gradient
        k4, k3, k2 = keep.view(-1, 1, 1, 1), keep.view(-1, 1, 1), keep.view(-1, 1)
        ds = torch.where(k4, ds, ds_next)
        dq, dk, dg = (torch.where(k3, t, 0.0) for t in (dq, dk, dg))
        dv, dbeta = torch.where(k3, dv, 0.0), torch.where(k2, dbeta, 0.0)
    return ds, dq, dk, dv, dg, dbeta


class _ChunkedKDA(torch.autograd.Function):
    """The invariant recurrence with chunk-boundary states saved and a recomputing closed-form backward."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, valid: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        boundaries: list[torch.Tensor] = []
        o, s = _recurrence(q, k, v, g, beta, scale, state, valid, boundaries)
        ctx.save_for_backward(q, k, v, g, beta, valid, *boundaries)
        ctx.scale = scale
        return o, s

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, ds_final: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, g, beta, valid, *boundaries = ctx.saved_tensors
        scale, t_len = ctx.scale, q.shape[1]
        grads = [torch.zeros_like(t) for t in (q, k, v, g, beta)]
        ds = ds_final
        for c in reversed(range(len(boundaries))):
            t0, t1 = c * CHUNK, min((c + 1) * CHUNK, t_len)
            states = [boundaries[c]]
            for t in range(t0, t1 - 1):  # the state before each token of the chunk
                keep = None if valid is None else valid[:, t]
                states.append(_step(states[-1], q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], scale, keep)[1])
            for t in reversed(range(t0, t1)):
                keep = None if valid is None else valid[:, t]
                ds, *step_grads = _step_backward(states[t - t0], q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t],
                                                 scale, keep, do[:, t], ds)
                for grad, d in zip(grads, step_grads):
                    grad[:, t] = d
        return (*grads, ds, None, None)


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
    if needs_grad(q, k, v, g, beta, state):
        o, s = _ChunkedKDA.apply(q, k, v, g, beta, state, valid, scale)
    else:
        o, s = _recurrence(q, k, v, g, beta, scale, state, valid)
    return o.to(out_dtype), s


def _padding_as_identity(g: torch.Tensor, beta: torch.Tensor,
                         valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """g and beta with every padding token's set to 0 (valid: [B, T] or None): g = 0 and beta = 0 leave the state as
    it is, so padding runs as identity steps."""
    if valid is None:
        return g, beta
    return (torch.where(valid[..., None, None], g, 0.0),
            torch.where(valid[..., None], beta, 0.0))


def _fla_runs(q: torch.Tensor) -> bool:
    return q.is_cuda and importlib.util.find_spec("fla") is not None


def _kda_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
             state: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's `chunk_kda` (several tokens) or `fused_recurrent_kda` (one): the kernels a GPU user runs. Padding runs as
    identity steps (g = 0 and beta = 0 leave the state as it is; the output there is zeroed)."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    g, beta = _padding_as_identity(g, beta, valid)
    run = fused_recurrent_kda if q.shape[1] == 1 else chunk_kda
    o, s = run(q, k, v.to(q.dtype), g, beta.to(q.dtype), scale=scale, initial_state=state.float(),
               output_final_state=True)
    if valid is not None:
        o = o * valid[..., None, None]
    return o.to(v.dtype), s


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
    """Same recurrence with `einsum` contractions (batched GEMV; bits depend on the batch); on CUDA with fla installed,
    fla's kernels (`_kda_fla`)."""
    if _fla_runs(q):
        return _kda_fla(q, k, v, g, beta, scale, state, valid)
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
            o = torch.where(keep.view(-1, 1, 1), o, 0.0)
        s = s_new
        outs.append(o)
    if not outs:
        return v.new_zeros(v.shape, dtype=out_dtype), s
    return torch.stack(outs, dim=1).to(out_dtype), s


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence in chunked (WY) form, in plain torch ops that autograd differentiates: CHUNK tokens at a time,
    within a chunk (G = inclusive cumsum of g, K~ = K * exp(G), Q~ = Q * exp(G), decays exp(G_t - G_s) <= 1 for s <= t
    taken pairwise, so nothing overflows):
        U = (I + diag(beta) L)^-1 diag(beta) (V - K~ S0),   L_ts = sum_c k_tc k_sc exp(G_tc - G_sc), s < t
        O = scale (Q~ S0 + M U),                            M_ts = sum_c q_tc k_sc exp(G_tc - G_sc), s <= t
        S = exp(G_last) * S0 + (K * exp(G_last - G))^T U
    Padding runs as identity steps (g = 0, beta = 0; the output there is zeroed). Exact to round-off, not invariant:
    the backward a GPU trainer takes (`kda_for_gradients`), a few batched GEMMs per chunk instead of a loop per
    token."""
    out_dtype = v.dtype
    q, k, v, g, beta = wide(q), wide(k), wide(v), wide(g), wide(beta)
    g, beta = _padding_as_identity(g, beta, valid)
    q, k, v, g, beta = (x.transpose(1, 2) for x in (q, k, v, g, beta))  # [B, H, T, ...]
    s = state.to(q.dtype)
    outs = []
    for t0 in range(0, q.shape[2], CHUNK):
        qc, kc, vc, gc, bc = (x[:, :, t0 : t0 + CHUNK] for x in (q, k, v, g, beta))
        c = qc.shape[2]
        cum = gc.cumsum(2)  # [B, H, C, K]
        upto = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        diff = (cum.unsqueeze(3) - cum.unsqueeze(2)).masked_fill(~upto[..., None], float("-inf"))
        decay = diff.exp()  # [B, H, C(t), C(s), K]: exp(G_t - G_s) for s <= t, else 0
        kk = torch.einsum("bhtc,bhsc,bhtsc->bhts", kc, kc, decay).tril(-1)
        qk = torch.einsum("bhtc,bhsc,bhtsc->bhts", qc, kc, decay)
        rhs = bc.unsqueeze(-1) * (vc - (kc * cum.exp()) @ s)
        eye = torch.eye(c, dtype=q.dtype, device=q.device)
        u = torch.linalg.solve_triangular(eye + bc.unsqueeze(-1) * kk, rhs, upper=False, unitriangular=True)
        outs.append(scale * ((qc * cum.exp()) @ s + qk @ u))
        last = cum[:, :, -1:]  # [B, H, 1, K]
        s = last.transpose(2, 3).exp() * s + (kc * (last - cum).exp()).transpose(2, 3) @ u
    if not outs:
        return v.new_zeros(v.transpose(1, 2).shape, dtype=out_dtype), s
    o = torch.cat(outs, dim=2).transpose(1, 2)  # [B, T, H, V]
    if valid is not None:
        o = o * valid[..., None, None]
    return o.to(out_dtype), s


def _fla_differentiates(q: torch.Tensor, v: torch.Tensor) -> bool:
    """fla's chunked kernels take the gradient of a layer that computes in bf16 (v, the value projection, is bf16; q,
    k, g and beta come widened to fp32, as vLLM's KDA kernel takes them) on CUDA: their products run in TF32, finer
    than the layer's bf16. An fp32 layer keeps fp32 products (`kda_chunked`)."""
    return _fla_runs(q) and v.dtype == torch.bfloat16


def kda_for_gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence a trainer on the Triton kernels differentiates (`parity.kernels.triton.autograd`): a bf16 layer
    on CUDA (`_fla_differentiates`), fla's chunked kernels (`chunk_kda`: its forward and its Triton backward), run
    inside `kda_gradient_context`; other CUDA inputs the chunked form (`kda_chunked`, batched GEMMs); elsewhere
    `kda_invariant` and its chunked backward. Each is the gradient of the same function, deterministic for fixed
    shapes."""
    if _fla_differentiates(q, v):
        return _kda_fla(q, k, v, g, beta, scale, state, valid)
    if q.is_cuda:
        return kda_chunked(q, k, v, g, beta, scale, state, valid)
    return kda_invariant(q, k, v, g, beta, scale, state, valid)


def kda_gradient_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args,
                         **kwargs) -> contextlib.AbstractContextManager:
    """Where `kda_for_gradients` runs and is differentiated: with fla's kernels, each with one fixed launch
    configuration (`parity.kernels.fla_pinned`: no autotuning, so a run and its resume get the same gradient bits)."""
    if _fla_differentiates(q, v):
        from parity.kernels import fla_pinned

        return fla_pinned.pinned()
    return contextlib.nullcontext()


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
