"""Float64 reference of K3's DSpark draft (vLLM's `K3DSparkForCausalLM` with the DSpark speculator's sampling
inputs), for one sequence, with full per-head keys and values (the direct form, where `parity.dspark_model` runs the
absorbed one) and rotary angles in float64.

    ctx_t            = RMSNorm(context_proj [a_{l1,t} ; a_{l2,t} ; ...])            (target layers ascending)
    [c_t ; kpe_t]_l  = [RMSNorm(kv_a_l ctx_t)[:L] ; RoPE(kv_a_l ctx_t [L:], t)]      (context: no input norm)
    block rows j = 0..n-1: token (anchor, noise, ...), position P + j, P = number of context positions
    per layer:  a = RMSNorm_in(x);  q = q_b(RMSNorm(q_a a)) -> per head [q_nope ; RoPE(q_pe)]
                keys of head h at s: [W_UK_h c_s ; kpe_s], values W_UV_h c_s, s over the context and the whole block
                x += o_proj(softmax(scale q.k) v);  x += down(SiLU(gate m) * up m), m = RMSNorm_post(x)
    logits_j = logit_scale * lm_head RMSNorm_final(x_j);  bias(prev) = logit_scale * markov_w2 markov_w1[prev]

Follows `vllm/models/kimi_k3/nvidia/dspark_mla.py` and `v1/worker/gpu/spec_decode/dspark/speculator.py`.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from parity.dspark import DSparkConfig, layer
from parity.reference.ops import linear, rms_norm, silu_glu

F64 = torch.float64


def rope(x: Tensor, pos: Tensor, cfg: DSparkConfig) -> Tensor:
    """GPT-J interleaved rotation of x [T, ..., R] at positions pos [T], angles in float64."""
    r = cfg.qk_rope_head_dim
    inv = cfg.rope_theta ** (-torch.arange(0, r, 2, dtype=F64) / r)
    ang = pos.to(F64).view(-1, *([1] * (x.dim() - 2)), 1) * inv
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1).flatten(-2)


def _latent(x: Tensor, w: Mapping[str, Tensor], p: str, pos: Tensor, cfg: DSparkConfig) -> Tensor:
    kv = linear(x, w[f"{p}.self_attn.kv_a_proj_with_mqa.weight"])
    r = cfg.kv_lora_rank
    return torch.cat([rms_norm(kv[:, :r], w[f"{p}.self_attn.kv_a_layernorm.weight"], cfg.rms_norm_eps),
                      rope(kv[:, r:], pos, cfg)], dim=-1)


def draft_logits(cfg: DSparkConfig, weights: Mapping[str, Tensor], embed: Tensor, lm_head: Tensor, aux: Tensor,
                 anchor: int, n: int) -> Tensor:
    """aux [P, len(target_layer_ids) * target_hidden_size]: the target's hidden states at positions 0..P-1 ->
    base logits [n, vocab] of the block [anchor, noise x (n - 1)] at positions P..P + n - 1 (no Markov bias)."""
    w = {k: v.to(F64) for k, v in weights.items()}
    h, dn, dr, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    eps = cfg.rms_norm_eps
    p_ctx = aux.shape[0]
    ctx = rms_norm(linear(aux.to(F64), w["context_proj.weight"]), w["context_norm.weight"], eps)
    ctx_pos = torch.arange(p_ctx)
    pos = torch.arange(p_ctx, p_ctx + n)
    x = embed.to(F64)[torch.tensor([anchor] + [cfg.noise_token_id] * (n - 1))]
    for i in range(cfg.num_hidden_layers):
        p = layer(i)
        a = rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
        qa = rms_norm(linear(a, w[f"{p}.self_attn.q_a_proj.weight"]), w[f"{p}.self_attn.q_a_layernorm.weight"], eps)
        q = linear(qa, w[f"{p}.self_attn.q_b_proj.weight"]).view(n, h, dn + dr)
        q = torch.cat([q[..., :dn], rope(q[..., dn:], pos, cfg)], dim=-1)
        lat = torch.cat([_latent(ctx, w, p, ctx_pos, cfg), _latent(a, w, p, pos, cfg)])  # [P + n, r + dr]
        heads = w[f"{p}.self_attn.kv_b_proj.weight"].view(h, dn + dv, r)
        k_nope = torch.einsum("hdr,sr->shd", heads[:, :dn], lat[:, :r])
        v = torch.einsum("hdr,sr->shd", heads[:, dn:], lat[:, :r])
        k = torch.cat([k_nope, lat[:, None, r:].expand(-1, h, dr)], dim=-1)  # [S, H, dn + dr]
        scores = torch.einsum("thd,shd->hts", q, k) * (dn + dr) ** -0.5
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, h * dv)
        x = x + linear(o, w[f"{p}.self_attn.o_proj.weight"])
        m = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        x = x + linear(silu_glu(linear(m, w[f"{p}.mlp.gate_proj.weight"]), linear(m, w[f"{p}.mlp.up_proj.weight"])),
                       w[f"{p}.mlp.down_proj.weight"])
    hidden = rms_norm(x, w["final_norm.weight"], eps)
    return linear(hidden, lm_head.to(F64)) * cfg.logit_scale


def markov_bias(cfg: DSparkConfig, weights: Mapping[str, Tensor], prev: int) -> Tensor:
    """[vocab]: logit_scale * markov_w2 markov_w1[prev]."""
    e = weights["markov_head.markov_w1.weight"].to(F64)[prev]
    return weights["markov_head.markov_w2.weight"].to(F64) @ e * cfg.logit_scale
