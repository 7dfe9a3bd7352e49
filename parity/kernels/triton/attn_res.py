"""Attention Residuals mixing in Triton: out = sum_i softmax_i(w_proj . rmsnorm(c_i)) c_i, fp32.

Invariant: each program holds a fixed number of tokens, a function of the row width only (`row_blocks`), every
token laid out the same way; each candidate's score is one fixed-width row reduction; the mix adds the n weighted
candidates in index order (a_0 c_0 + a_1 c_1 + ...), as the CPU kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parity.kernels.triton._common import check_dtype, check_weights, pow2, row_blocks


@triton.jit(do_not_specialize=["M"])
def _mix_kernel(c_ptr, nw_ptr, pw_ptr, y_ptr, M, n, D, sc0, sc1, sy, eps,
                BR: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BD)
    cm = cols < D
    mask = (rows[:, None] < M) & cm[None, :]
    idx = tl.arange(0, BN)
    nw = tl.load(nw_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    pw = tl.load(pw_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
    scores = tl.full((BR, BN), float("-inf"), dtype=tl.float32)
    for i in range(0, n):
        c = tl.load(c_ptr + rows[:, None] * sc0 + i * sc1 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(c * c, axis=1) / D + eps)
        s = tl.sum(c * r[:, None] * nw * pw, axis=1)
        scores = tl.where(idx[None, :] == i, s[:, None], scores)
    e = tl.exp(scores - tl.max(scores, axis=1)[:, None])
    a = e / tl.sum(e, axis=1)[:, None]
    out = tl.zeros((BR, BD), dtype=tl.float32)
    for i in range(0, n):
        c = tl.load(c_ptr + rows[:, None] * sc0 + i * sc1 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        ai = tl.sum(tl.where(idx[None, :] == i, a, 0.0), axis=1)[:, None]  # exact: one non-zero term
        if i == 0:
            out = ai * c
        else:
            out = out + ai * c
    tl.store(y_ptr + rows[:, None] * sy + cols[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


def attn_res_mix(cands: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """cands: [N, n, D], norm_w: [D], proj_w: [D] -> [N, D] in cands' dtype."""
    check_dtype(cands)
    check_weights(norm_w, proj_w)
    n_tok, n, d = cands.shape
    c = cands if cands.stride(-1) == 1 else cands.contiguous()
    y = torch.empty(n_tok, d, dtype=cands.dtype, device=cands.device)
    if n_tok:
        br, bd, warps = row_blocks(d)
        _mix_kernel[(triton.cdiv(n_tok, br),)](c, norm_w.contiguous(), proj_w.contiguous(), y, n_tok, n, d,
                                              c.stride(0), c.stride(1), y.stride(0), float(eps), BR=br,
                                              BN=pow2(n, 2), BD=bd, num_warps=warps)
    return y
