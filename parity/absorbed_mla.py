"""MLA's per-head projections in absorbed form, shared by the K3 forward (`parity.model`) and the DSpark draft
(`parity.dspark_model`).

kv_b_proj [H * (dn + dv), r] splits per head h into W_UK[h] (its dn key rows) and W_UV[h] (its dv value rows). A
query's nope part enters the latent space as q_lat = W_UK[h]^T q_nope and the attention output leaves it as
o = W_UV[h] o_lat, each one kernel-set `linear` per head: a row's bits depend on that row and the weights alone.
"""

from __future__ import annotations

import torch

from parity.kernels import Kernels


def split_heads(kv_b: torch.Tensor, heads: int, nope_dim: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """kv_b [H * (dn + dv), r] -> (per head W_UK[h]^T [r, dn], per head W_UV[h] [dv, r]): views, as `linear` weights
    (q_nope -> latent, latent -> v)."""
    w = kv_b.view(heads, -1, kv_b.shape[-1])
    return [w[i, :nope_dim].t() for i in range(heads)], [w[i, nope_dim:] for i in range(heads)]


def absorb_queries(k: Kernels, q_nope: torch.Tensor, uk_t: list[torch.Tensor]) -> torch.Tensor:
    """q_nope [B, T, H, dn] -> q_lat [B, T, H, r]."""
    return torch.stack([k.linear(q_nope[:, :, i], w) for i, w in enumerate(uk_t)], dim=2)


def expand_values(k: Kernels, o_lat: torch.Tensor, uv: list[torch.Tensor]) -> torch.Tensor:
    """o_lat [B, T, H, r] -> o [B, T, H, dv]."""
    return torch.stack([k.linear(o_lat[:, :, i], w) for i, w in enumerate(uv)], dim=2)
