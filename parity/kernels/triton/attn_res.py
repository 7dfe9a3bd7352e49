"""Attention Residuals mixing in Triton: out = sum_i softmax_i(w_proj . rmsnorm(c_i)) c_i, fp32.

Invariant: one program per token; each candidate's score is one fixed-width row reduction; the mix adds
the n weighted candidates in index order (a_0 c_0 + a_1 c_1 + ...), as the CPU kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parity.kernels.triton._common import check_dtype, check_weights, pow2


@triton.jit
def _mix_kernel(c_ptr, nw_ptr, pw_ptr, y_ptr, n, D, sc0, sc1, sy, eps, BN: tl.constexpr, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    cm = cols < D
    idx = tl.arange(0, BN)
    nw = tl.load(nw_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    pw = tl.load(pw_ptr + cols, mask=cm, other=0.0).to(tl.float32)
    scores = tl.full((BN,), float("-inf"), dtype=tl.float32)
    for i in range(0, n):
        c = tl.load(c_ptr + row * sc0 + i * sc1 + cols, mask=cm, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(c * c, axis=0) / D + eps)
        s = tl.sum(c * r * nw * pw, axis=0)
        scores = tl.where(idx == i, s, scores)
    e = tl.exp(scores - tl.max(scores, axis=0))
    a = e / tl.sum(e, axis=0)
    out = tl.zeros((BD,), dtype=tl.float32)
    for i in range(0, n):
        c = tl.load(c_ptr + row * sc0 + i * sc1 + cols, mask=cm, other=0.0).to(tl.float32)
        ai = tl.sum(tl.where(idx == i, a, 0.0), axis=0)  # exact: one non-zero term
        if i == 0:
            out = ai * c
        else:
            out = out + ai * c
    tl.store(y_ptr + row * sy + cols, out.to(y_ptr.dtype.element_ty), mask=cm)


def attn_res_mix(cands: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """cands: [N, n, D], norm_w: [D], proj_w: [D] -> [N, D] in cands' dtype."""
    check_dtype(cands)
    check_weights(norm_w, proj_w)
    n_tok, n, d = cands.shape
    c = cands if cands.stride(-1) == 1 else cands.contiguous()
    y = torch.empty(n_tok, d, dtype=cands.dtype, device=cands.device)
    if n_tok:
        bd = pow2(d)
        _mix_kernel[(n_tok,)](c, norm_w.contiguous(), proj_w.contiguous(), y, n, d, c.stride(0), c.stride(1),
                              y.stride(0), float(eps), BN=pow2(n, 2), BD=bd, num_warps=4 if bd <= 2048 else 8)
    return y
