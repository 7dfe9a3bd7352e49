"""The DSA indexer's scores in Triton (K3.1 Pro's lightning indexer): `parity.kernels.dsa.index_scores_invariant`'s
signature and formula, score[t, s] = sum over index heads j of w_tj * ReLU(q_tj . k_s), -inf where key s is not
visible to query t.

Invariant: one program per (query token, tile of `BLOCK_S` keys, row): the token's index heads are the rows of one
`mma` over the whole index head dim against the key tile (one fixed K order for a given head dim), and the heads'
terms are added by one reduction over a fixed-size head axis, so a score's bits depend on its query's and key's
vectors alone: never on the batch, the number of queries (prefill vs decode) or the cache length. Sparse attention
over the selected latents is the attention kernel's sparse mode (`parity.kernels.triton.attention.sparse_attention`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parity.kernels.triton._common import INTERPRET, check_dtype, dot_precision, mma, pow2

BLOCK_S = 128


@triton.jit(do_not_specialize=["T", "S"])
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, pos_ptr, len_ptr, o_ptr, T, S, NH, D,
                         sqb, sqt, sqh, swb, swt, skb, sks, spb, sob, sot,
                         BH: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                         INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    j = tl.arange(0, BH)
    d = tl.arange(0, BD)
    rs = pid_s * BS + tl.arange(0, BS)
    heads = j < NH
    kv_len = tl.load(len_ptr + b)
    key_ok = rs < kv_len
    q = tl.load(q_ptr + b * sqb + t * sqt + j[:, None] * sqh + d[None, :], mask=heads[:, None] & (d[None, :] < D),
                other=0.0)
    kt = tl.load(k_ptr + b * skb + rs[None, :].to(tl.int64) * sks + d[:, None],
                 mask=key_ok[None, :] & (d[:, None] < D), other=0.0).to(q.dtype)
    dots = mma(q, kt, tl.zeros((BH, BS), dtype=tl.float32), PREC, INTERP)  # [heads, keys]
    w = tl.load(w_ptr + b * swb + t * swt + j, mask=heads, other=0.0)
    score = tl.sum(w[:, None] * tl.maximum(dots, 0.0), axis=0)
    pos = tl.load(pos_ptr + b * spb + t)
    visible = (rs <= pos) & key_ok
    tl.store(o_ptr + b * sob + t * sot + rs, tl.where(visible, score, float("-inf")), mask=rs < S)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor,
                 kv_len: torch.Tensor) -> torch.Tensor:
    """q [B, T, nh, d] (FP8-rounded index queries, fp32 or bf16), w [B, T, nh] fp32, keys [B, S, d] (q's dtype),
    q_pos [B, T], kv_len [B] -> scores [B, T, S] fp32 (-inf where not visible)."""
    check_dtype(q, keys)
    b, t, nh, d = q.shape
    s = keys.shape[1]
    out = torch.empty(b, t, s, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if q.stride(-1) != 1 or keys.stride(-1) != 1:
        raise ValueError("index scores need unit stride along the head dim")
    w = w.float().contiguous()
    pos = q_pos.to(torch.int32).contiguous()
    lens = kv_len.to(torch.int32).contiguous()
    grid = (t, triton.cdiv(s, BLOCK_S), b)
    _index_scores_kernel[grid](q, w, keys, pos, lens, out, t, s, nh, d,
                               q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
                               keys.stride(0), keys.stride(1), pos.stride(0), out.stride(0), out.stride(1),
                               BH=pow2(nh), BS=BLOCK_S, BD=pow2(d), PREC=dot_precision(q.dtype), INTERP=INTERPRET,
                               num_warps=4, num_stages=2)
    return out
