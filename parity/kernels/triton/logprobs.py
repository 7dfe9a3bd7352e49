"""Token log-probabilities log_softmax(logits / T)[token] in Triton, one program per row, fp32.

Invariant: each row is reduced by one program walking the vocabulary in fixed blocks of `BLOCK_V`
from index 0, with a per-lane online max/sum (m, s) and one final cross-lane combine; the order depends
on the vocabulary size alone, never on the number of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096


@triton.jit
def _logprob_kernel(x_ptr, tok_ptr, out_ptr, V, sx, temp, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BV)
    m = tl.full((BV,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BV,), dtype=tl.float32)
    for v0 in range(0, V, BV):
        z = tl.load(x_ptr + row * sx + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32) / temp
        m_new = tl.maximum(m, z)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(z - m_safe)
        m = m_new
    mx = tl.max(m, axis=0)
    tot = tl.sum(s * tl.exp(m - mx), axis=0)
    tok = tl.load(tok_ptr + row)
    zt = tl.load(x_ptr + row * sx + tok).to(tl.float32) / temp
    tl.store(out_ptr + row, (zt - mx) - tl.log(tot))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits: [N, V] fp32 or bf16, tokens: [N] int -> [N] fp32."""
    n, v = logits.shape
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _logprob_kernel[(n,)](x, tokens.contiguous(), out, v, x.stride(0), float(temperature), BV=BLOCK_V, num_warps=8)
    return out
