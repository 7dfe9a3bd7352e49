"""Float64 reference of Kimi Delta Attention (KDA), the K3 linear-attention block.

Per head, with a state S of shape [K, V] (fla's layout; vLLM's cache stores the transpose [V, K]):

    S <- diag(exp(g_t)) S                          (per-key-channel decay, g_t <= 0)
    S <- S + beta_t k_t (v_t - S^T k_t)^T          (delta rule)
    o_t = scale * S^T q_t

`kda_recurrent` is that loop, token by token. `kda_chunked` is an independent chunked (UT-transform) form of
the same recurrence, solved chunk by chunk with a triangular system; the tests check the two agree.
`kda_layer` is the whole K3 block as vLLM's `KimiK3DeltaAttention` computes it.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from parity.config import TextConfig
from parity.reference.ops import causal_conv_silu, l2_norm, linear, rms_norm

KDA_O_NORM_EPS = 1e-5
"""vLLM's KDA output norm is `FusedRMSNormGated(head_dim, activation="sigmoid")`: its default eps, not rms_norm_eps."""


def kda_gate(raw: Tensor, a_log: Tensor, dt_bias: Tensor, lower_bound: float | None) -> Tensor:
    """Per-channel log-decay g from the raw gate f = f_b(f_a(x)).

    lower_bound is None: g = -exp(A_log) * softplus(f + dt_bias)           (g in (-inf, 0))
    lower_bound = b:     g = b * sigmoid(exp(A_log) * (f + dt_bias))        (g in (b, 0))
    raw: [T, H, K] f64, a_log: [H] f64, dt_bias: [H, K] f64 -> g: [T, H, K] f64.
    """
    a = torch.exp(a_log)[:, None]  # [H, 1]
    f = raw + dt_bias
    if lower_bound is None:
        return -a * F.softplus(f)
    return lower_bound * torch.sigmoid(a * f)


def kda_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The KDA recurrence, one token at a time (the definition).

    q, k: [T, H, K] f64 (already L2-normalised), v: [T, H, V] f64, g: [T, H, K] f64 log-decay,
    beta: [T, H] f64, initial_state: [H, K, V] f64 or None (zeros).
    Returns o: [T, H, V] f64 and the final state [H, K, V] f64.
    """
    n_tokens, n_heads, dk = q.shape
    state = q.new_zeros(n_heads, dk, v.shape[-1]) if initial_state is None else initial_state.clone()
    out = q.new_empty(n_tokens, n_heads, v.shape[-1])
    for t in range(n_tokens):
        state = state * torch.exp(g[t])[:, :, None]  # decay each key row
        error = v[t] - torch.einsum("hk,hkv->hv", k[t], state)  # v_t - S^T k_t
        state = state + beta[t][:, None, None] * k[t][:, :, None] * error[:, None, :]
        out[t] = scale * torch.einsum("hk,hkv->hv", q[t], state)
    return out, state


def kda_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float,
    initial_state: Tensor | None = None,
    chunk_size: int = 16,
) -> tuple[Tensor, Tensor]:
    """The same recurrence in chunks of `chunk_size` tokens (UT-transform form); same arguments as `kda_recurrent`.

    Within a chunk starting from state S0, with cumulative decay G_t = sum_{s<=t} g_s and
    D_ts = exp(G_t - G_s) (s <= t, per key channel), the delta-rule updates u_t satisfy the unit lower-triangular
    system
        u_t + beta_t sum_{s<t} (k_t . D_ts k_s) u_s = beta_t (v_t - S0^T (exp(G_t) k_t)),
    and then
        o_t   = scale * (S0^T (exp(G_t) q_t) + sum_{s<=t} (q_t . D_ts k_s) u_s)
        S_end = exp(G_C) S0 + sum_s (exp(G_C - G_s) k_s) u_s^T.
    The last chunk may be shorter; nothing is padded.
    """
    n_tokens, n_heads, dk = q.shape
    state = q.new_zeros(n_heads, dk, v.shape[-1]) if initial_state is None else initial_state.clone()
    out = q.new_empty(n_tokens, n_heads, v.shape[-1])
    for start in range(0, n_tokens, chunk_size):
        end = min(start + chunk_size, n_tokens)
        size = end - start
        lower = torch.tril(torch.ones(size, size, dtype=torch.bool))  # s <= t
        strict = torch.tril(torch.ones(size, size, dtype=torch.bool), diagonal=-1)  # s < t
        for h in range(n_heads):
            qc, kc, vc, bc = q[start:end, h], k[start:end, h], v[start:end, h], beta[start:end, h]
            cum = torch.cumsum(g[start:end, h], dim=0)  # G: [C, K]
            diff = cum[:, None, :] - cum[None, :, :]  # G_t - G_s: [C(t), C(s), K]
            decay = torch.where(lower[:, :, None], diff, float("-inf")).exp()  # D_ts, zero above the diagonal
            kk = torch.einsum("tk,sk,tsk->ts", kc, kc, decay) * strict
            system = torch.eye(size, dtype=q.dtype) + bc[:, None] * kk
            rhs = bc[:, None] * (vc - (kc * cum.exp()) @ state[h])
            u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [C, V]
            qk = torch.einsum("tk,sk,tsk->ts", qc, kc, decay)  # zero above the diagonal
            out[start:end, h] = scale * ((qc * cum.exp()) @ state[h] + qk @ u)
            state[h] = cum[-1].exp()[:, None] * state[h] + (kc * (cum[-1] - cum).exp()).T @ u
    return out, state


def kda_layer(x: Tensor, w: Mapping[str, Tensor], cfg: TextConfig) -> Tensor:
    """KDA block (vLLM `KimiK3DeltaAttention.forward` / `KimiGatedDeltaNetAttention.forward`), one sequence
    from an empty state.

    q, k, v = silu(causal_conv(W_{q,k,v} x)); q, k <- l2norm per head; g = kda_gate(f_b(f_a(x)));
    beta = sigmoid(W_b x); o = KDA(q, k, v, g, beta, scale = head_dim^-0.5);
    y = o_proj(RMSNorm_head(o) * sigmoid(G x)), G = W_g (K3's full-rank gate) or W_gb W_ga (Kimi Linear).
    x: [T, D] f64; w: this layer's `self_attn.*` tensors by relative name -> [T, D] f64.
    """
    n_tokens = x.shape[0]
    n_heads, dk = cfg.kda_num_heads, cfg.kda_head_dim

    def conv_branch(name: str) -> Tensor:
        y = causal_conv_silu(linear(x, w[f"{name}_proj.weight"]), w[f"{name}_conv1d.weight"])
        return y.view(n_tokens, n_heads, dk)  # [T, H*K] -> [T, H, K]

    q, k, v = l2_norm(conv_branch("q")), l2_norm(conv_branch("k")), conv_branch("v")
    raw_gate = linear(linear(x, w["f_a_proj.weight"]), w["f_b_proj.weight"]).view(n_tokens, n_heads, dk)
    a_log = w["A_log"].view(n_heads)  # K3 stores [H], Kimi Linear [1, 1, H, 1]
    g = kda_gate(raw_gate, a_log, w["dt_bias"].view(n_heads, dk), cfg.gate_lower_bound)
    beta = torch.sigmoid(linear(x, w["b_proj.weight"]))  # [T, H]
    o, _ = kda_recurrent(q, k, v, g, beta, scale=dk**-0.5)
    if cfg.use_full_rank_gate:
        out_gate = linear(x, w["g_proj.weight"])
    else:
        out_gate = linear(linear(x, w["g_a_proj.weight"]), w["g_b_proj.weight"])
    out_gate = out_gate.view(n_tokens, n_heads, dk)  # [T, H*K] -> [T, H, K]
    o = rms_norm(o, w["o_norm.weight"], KDA_O_NORM_EPS) * torch.sigmoid(out_gate)
    return linear(o.reshape(n_tokens, n_heads * dk), w["o_proj.weight"])  # heads back to [T, H*K]
