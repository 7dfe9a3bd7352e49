"""The weight-sync checksum's word mix in one pass over a tensor's bytes on the GPU.

`parity.sync.bundle.checksum` reads a tensor's bytes as 64-bit words w_i and adds mix(w_i, i) mod 2^64. In torch that
is eight element-wise passes with int64 temporaries (about 16 bytes of memory traffic per byte hashed); this kernel
reads each word once and writes one partial sum per program. Integer addition mod 2^64 is exact and order-free, so
the total equals the torch form's bit for bit, whatever the block size or the order the partial sums are added in
(tests/test_kernels_triton.py checks it under the interpreter and on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # words per program


@triton.jit(do_not_specialize=["n"])
def _mix_sum_kernel(w_ptr, out_ptr, n, c1, c2, c3, c4, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    w = tl.load(w_ptr + idx, mask=mask, other=0)
    mixed = ((w + idx * c1) * c2 ^ (idx * c3)) * c4
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.where(mask, mixed, 0), axis=0))


def word_mix_sum(words: torch.Tensor, c1: int, c2: int, c3: int, c4: int) -> int:
    """sum_i ((w_i + i*c1) * c2 ^ (i*c3)) * c4 mod 2^64 over a contiguous 1-D int64 tensor, as an unsigned int."""
    if words.dtype != torch.int64 or words.dim() != 1 or not words.is_contiguous():
        raise TypeError(f"word_mix_sum takes a contiguous 1-D int64 tensor, got {words.dtype} {tuple(words.shape)}")
    n = words.numel()
    if n == 0:
        return 0
    grid = triton.cdiv(n, BLOCK)
    partial = torch.empty(grid, dtype=torch.int64, device=words.device)
    consts = [torch.tensor(c, dtype=torch.int64).item() for c in (c1, c2, c3, c4)]
    _mix_sum_kernel[(grid,)](words, partial, n, *consts, BLOCK=BLOCK)
    return int(partial.sum().item()) & (2**64 - 1)
