"""RMSNorm, gated RMSNorm (sigmoid gate) and L2 normalisation over the last dim.

Inputs fp32 or bf16; statistics and products in fp32, output in the input's dtype. The cast points are
vLLM's: RMSNorm rounds the normalised value to the input dtype before the weight multiply (vLLM's
`RMSNorm`); the gated norm (fla's `FusedRMSNormGated`) and the L2 norm stay fp32 to the end.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.kernels.primitives import needs_grad, sigmoid, tree_sum, wide

L2_EPS = 1e-6


def _rsqrt_ms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(x^2) + eps) per row, [..., 1]; the mean is a `tree_sum`, so each row is batch-independent."""
    return torch.rsqrt(tree_sum(xf * xf) / xf.shape[-1] + eps).unsqueeze(-1)


class _Normalised(torch.autograd.Function):
    """x * r in fp32, r = rsqrt(mean(x^2) + eps); backward r (g - y mean(g y)), saving x (in its dtype) and r."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, eps: float) -> torch.Tensor:
        r = _rsqrt_ms(wide(x), eps)
        ctx.save_for_backward(x, r)
        return wide(x) * r

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, r = ctx.saved_tensors
        y = wide(x) * r
        return (r * (grad - y * (grad * y).mean(-1, keepdim=True))).to(x.dtype), None


def _normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) in fp32 (`_rsqrt_ms`); under autograd it saves only x and the per-row scale."""
    if needs_grad(x):
        return _Normalised.apply(x, eps)
    xf = wide(x)
    return xf * _rsqrt_ms(xf, eps)


def rmsnorm_invariant(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """round(x * rsqrt(mean(x^2) + eps)) * w, in x's dtype: the product of the two bf16 values is exact in fp32 and
    rounded once (a bf16 multiply's bits), and the weight's gradient stays fp32."""
    y = _normalised(x, eps).to(x.dtype)
    return y if w is None else (wide(y) * wide(w)).to(x.dtype)


def rmsnorm_fast(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = wide(x)
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if w is None else (wide(y) * wide(w)).to(x.dtype)


def gated_rmsnorm_invariant(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * w * sigmoid(gate) in fp32, rounded once to x's dtype (KDA output norm)."""
    return (_normalised(x, eps) * wide(w) * sigmoid(wide(gate))).to(x.dtype)


def gated_rmsnorm_fast(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = wide(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * wide(w)
    return (y * torch.sigmoid(wide(gate))).to(x.dtype)


def layernorm_invariant(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) * rsqrt(var + eps) * w + b over the last dim, fp32 (`tree_sum` statistics, the affine in fp32); the
    caller rounds it once. Used outside the kernel sets (the DSA index keys, the vision tower's LayerNorms)."""
    xf = wide(x)
    centered = xf - tree_sum(xf).unsqueeze(-1) / xf.shape[-1]
    var = tree_sum(centered * centered) / xf.shape[-1]
    return centered * torch.rsqrt(var + eps).unsqueeze(-1) * wide(w) + wide(b)


def l2norm_invariant(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dim, in fp32, rounded to x's dtype."""
    xf = wide(x)
    return (xf * torch.rsqrt(tree_sum(xf * xf) + L2_EPS).unsqueeze(-1)).to(x.dtype)


def l2norm_fast(x: torch.Tensor) -> torch.Tensor:
    xf = wide(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + L2_EPS)).to(x.dtype)
