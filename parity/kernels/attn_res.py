"""Attention Residuals mixing: a softmax-weighted mix of residual-stream candidates, all in fp32 (bf16
candidates are upcast), the mix rounded once to the candidates' dtype.

For candidates c_0..c_{n-1} (block snapshots and the current partial sum) of one token:
    s_i = w_proj . rmsnorm(c_i; w_norm, eps)     a = softmax(s)     out = sum_i a_i c_i
The invariant form sums with `tree_sum` (scores) and adds the n weighted candidates in index order.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.kernels.norms import rmsnorm_fast, rmsnorm_invariant
from parity.kernels.primitives import needs_grad, tree_sum, wide


def _mix(a: torch.Tensor, cands: torch.Tensor) -> torch.Tensor:
    """sum_i a_i c_i, the n weighted candidates added in index order: a: [N, n], cands: [N, n, D] -> [N, D]."""
    out = a[:, 0:1] * cands[:, 0]
    for i in range(1, cands.shape[1]):
        out = out + a[:, i : i + 1] * cands[:, i]
    return out


class _Mix(torch.autograd.Function):
    """`_mix` with its backward in two broadcast products, d c_i = a_i g (the products autograd through the loop
    forms) and d a_i = g . c_i (one reduction over D per candidate): two launches, not a slice, product and
    accumulation per candidate. Deterministic; not the loop's reduction order for d a."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, cands: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, cands)
        return _mix(a, cands)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, cands = ctx.saved_tensors
        return (g.unsqueeze(1) * cands).sum(-1), a.unsqueeze(-1) * g.unsqueeze(1)


def attn_res_mix_invariant(cands: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """cands: [N, n, D], norm_w: [D], proj_w: [D] -> [N, D] in cands' dtype."""
    out_dtype = cands.dtype
    cands = wide(cands)
    scores = tree_sum(rmsnorm_invariant(cands, wide(norm_w), eps) * wide(proj_w))  # [N, n]
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    a = e / tree_sum(e).unsqueeze(-1)
    out = _Mix.apply(a, cands) if needs_grad(a, cands) else _mix(a, cands)
    return out.to(out_dtype)


def attn_res_mix_fast(cands: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    out_dtype = cands.dtype
    cands = wide(cands)
    scores = rmsnorm_fast(cands, wide(norm_w), eps) @ wide(proj_w)  # [N, n]
    a = torch.softmax(scores, dim=-1)
    return torch.einsum("nc,ncd->nd", a, cands).to(out_dtype)
