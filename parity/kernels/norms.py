"""RMSNorm, gated RMSNorm (sigmoid gate) and L2 normalisation over the last dim, fp32."""

from __future__ import annotations

import torch
from parity.kernels.primitives import sigmoid, tree_sum

L2_EPS = 1e-6


def rmsnorm_invariant(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w; the mean is a `tree_sum` so each row is batch-independent."""
    ms = tree_sum(x * x) / x.shape[-1]
    y = x * torch.rsqrt(ms + eps).unsqueeze(-1)
    return y if w is None else y * w


def rmsnorm_fast(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def gated_rmsnorm_invariant(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * w * sigmoid(gate) (KDA output norm)."""
    return rmsnorm_invariant(x, w, eps) * sigmoid(gate)


def gated_rmsnorm_fast(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return rmsnorm_fast(x, w, eps) * torch.sigmoid(gate)


def l2norm_invariant(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dim."""
    return x * torch.rsqrt(tree_sum(x * x) + L2_EPS).unsqueeze(-1)


def l2norm_fast(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)
