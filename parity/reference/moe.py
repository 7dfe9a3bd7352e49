"""Float64 reference of K3's LatentMoE block: noaux_tc sigmoid router, latent routed experts, shared experts.

    scores = sigmoid(W_gate x)                       (softmax when moe_router_activation_func = softmax)
    chosen = top-k of (scores + e_score_correction_bias), ties to the lowest expert index
    w_e    = scores_e / sum_{chosen} scores          (unbiased scores; renormalised when moe_renormalize)
             * routed_scaling_factor
    z      = routed_expert_down_proj x                                         (latent width)
    r      = routed_expert_norm(sum_{e in chosen} w_e * W2_e act(W1_e z, W3_e z))  (norm when latent_moe_use_norm)
    y      = routed_expert_up_proj r + shared_experts(x)

As in vLLM (`KimiRoutedOutputTransform`), the latent RMSNorm sits after the expert combine, so the routing
scale reaches the output only through the norm's eps.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from parity.config import TextConfig
from parity.reference.ops import GLU, gated_mlp, linear, rms_norm


def route(x: Tensor, gate_weight: Tensor, correction_bias: Tensor, cfg: TextConfig) -> tuple[Tensor, Tensor]:
    """Router (vLLM `grouped_topk` with one group): the bias picks the experts, the unbiased scores weight them.

    x: [T, D] f64, gate_weight: [E, D] f64, correction_bias: [E] f64
    -> expert ids [T, k] int64 (by biased score, descending; ties to the lower index), weights [T, k] f64.
    """
    logits = linear(x, gate_weight)
    scores = torch.sigmoid(logits) if cfg.router_activation == "sigmoid" else torch.softmax(logits, dim=-1)
    order = torch.sort(scores + correction_bias, dim=-1, descending=True, stable=True).indices
    ids = order[:, : cfg.num_experts_per_token]
    weights = scores.gather(1, ids)
    if cfg.moe_renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights * cfg.routed_scaling_factor


def moe_layer(x: Tensor, w: Mapping[str, Tensor], cfg: TextConfig, act: GLU) -> Tensor:
    """K3 LatentMoE block (vLLM `KimiMoE.forward`); experts are combined in ascending expert order.

    x: [T, D] f64; w: this layer's `block_sparse_moe.*` tensors by relative name -> [T, D] f64.
    """
    assert cfg.num_experts is not None
    ids, weights = route(x, w["gate.weight"], w["gate.e_score_correction_bias"], cfg)
    latent = cfg.routed_expert_hidden_size is not None
    z = linear(x, w["routed_expert_down_proj.weight"]) if latent else x  # [T, latent]
    routed = torch.zeros_like(z)
    for e in range(cfg.num_experts):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        y = gated_mlp(z[tokens], w[f"experts.{e}.w1.weight"], w[f"experts.{e}.w3.weight"],
                      w[f"experts.{e}.w2.weight"], act)
        routed[tokens] += weights[tokens, slots, None] * y  # each token meets expert e at most once
    if latent and cfg.latent_moe_use_norm:
        routed = rms_norm(routed, w["routed_expert_norm.weight"], cfg.rms_norm_eps)
    out = linear(routed, w["routed_expert_up_proj.weight"]) if latent else routed
    if cfg.num_shared_experts:
        out = out + gated_mlp(x, w["shared_experts.gate_proj.weight"], w["shared_experts.up_proj.weight"],
                              w["shared_experts.down_proj.weight"], act)
    return out
