"""Float64 reference of K3's Multi-head Latent Attention (NoPE, sigmoid output gate), in the latent form.

Per token the cache holds only the normalised latent c (kv_lora_rank) and the key part k_pe (qk_rope_head_dim),
shared by all heads. With NoPE the "rope" part is never rotated, but it is still part of every head's key:
the full key of head n is [W_UK_n c ; k_pe] and the query is [q_nope_n ; q_pe_n], so

    score_ns = scale * (q_nope_n . W_UK_n c_s + q_pe_n . k_pe_s),   scale = (qk_nope_head_dim + qk_rope_head_dim)^-0.5
             = scale * ((W_UK_n^T q_nope_n) . c_s + q_pe_n . k_pe_s)           (W_UK absorbed into the query)
    o_n      = W_UV_n sum_{s<=t} softmax_s(score_ns) c_s

This is vLLM's decode (MQA) path; its prefill decompresses k and v per head instead. The tests compare this
form with that direct full-key one.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from parity.config import TextConfig
from parity.reference.dsa import index_scores, select
from parity.reference.ops import linear, rms_norm


def mla_query(x: Tensor, w: Mapping[str, Tensor], cfg: TextConfig) -> Tensor:
    """q = q_b_proj(RMSNorm(q_a_proj x)) (q-LoRA) or q_proj x.  x: [T, D] f64 -> [T, N, P + R] f64."""
    if cfg.q_lora_rank is None:
        q = linear(x, w["q_proj.weight"])
    else:
        q = linear(rms_norm(linear(x, w["q_a_proj.weight"]), w["q_a_layernorm.weight"], cfg.rms_norm_eps),
                   w["q_b_proj.weight"])
    return q.view(x.shape[0], cfg.num_attention_heads, cfg.qk_head_dim)  # [T, N*(P+R)] -> [T, N, P+R]


def mla_latent(x: Tensor, w: Mapping[str, Tensor], cfg: TextConfig) -> tuple[Tensor, Tensor]:
    """[c ; k_pe] = kv_a_proj_with_mqa x, c <- RMSNorm(c); k_pe is neither normalised nor rotated.

    x: [T, D] f64 -> c: [T, L] f64, k_pe: [T, R] f64 (what the MLA cache stores per token).
    """
    kv = linear(x, w["kv_a_proj_with_mqa.weight"])
    c = rms_norm(kv[:, : cfg.kv_lora_rank], w["kv_a_layernorm.weight"], cfg.rms_norm_eps)
    return c, kv[:, cfg.kv_lora_rank :]


def mla_layer(x: Tensor, w: Mapping[str, Tensor], cfg: TextConfig) -> Tensor:
    """K3 MLA block (vLLM `MultiHeadLatentAttention.forward`): causal latent attention, gate, o_proj.

    y = o_proj(attn(x) * sigmoid(g_proj x)) with the gate only when `mla_use_output_gate`; with the DSA indexer
    (`index_topk`) each query attends only the positions it selects (`parity.reference.dsa`).
    x: [T, D] f64; w: this layer's `self_attn.*` tensors by relative name -> [T, D] f64.
    """
    n_tokens, n_heads = x.shape[0], cfg.num_attention_heads
    nope, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
    q = mla_query(x, w, cfg)
    q_nope, q_pe = q[..., :nope], q[..., nope:]  # [T, N, P], [T, N, R]
    c, k_pe = mla_latent(x, w, cfg)
    w_kv = w["kv_b_proj.weight"].view(n_heads, nope + dv, cfg.kv_lora_rank)  # rows per head: [k_nope ; v]
    w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [N, P, L], [N, V, L]
    scale = cfg.qk_head_dim**-0.5
    keep = [list(range(t + 1)) for t in range(n_tokens)]  # keys 0..t
    if cfg.index_topk is not None:
        qr = rms_norm(linear(x, w["q_a_proj.weight"]), w["q_a_layernorm.weight"], cfg.rms_norm_eps)
        keep = select(index_scores(x, qr, w, cfg), cfg.index_topk)
    out = x.new_empty(n_tokens, n_heads, dv)
    for t in range(n_tokens):
        s = torch.tensor(keep[t])
        q_latent = torch.einsum("np,npl->nl", q_nope[t], w_uk)  # W_UK_n^T q_nope_n: [N, L]
        scores = scale * (q_latent @ c[s].T + q_pe[t] @ k_pe[s].T)  # [N, len(s)]
        probs = torch.softmax(scores, dim=-1)
        out[t] = torch.einsum("nl,nvl->nv", probs @ c[s], w_uv)  # W_UV_n (sum_s p_s c_s)
    attn = out.reshape(n_tokens, n_heads * dv)  # heads back to [T, N*V]
    if cfg.mla_use_output_gate:
        attn = attn * torch.sigmoid(linear(x, w["g_proj.weight"]))
    return linear(attn, w["o_proj.weight"])
