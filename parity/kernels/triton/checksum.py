"""The weight-sync checksum's word mix in one pass over the tensors' bytes on the GPU.

`parity.sync.checksum.checksum` reads a tensor's bytes as 64-bit words w_i and adds mix(w_i, i) mod 2^64. In torch that
is eight element-wise passes with int64 temporaries (about 16 bytes of memory traffic per byte hashed); this kernel
reads each word once and writes one partial sum per program. Integer addition mod 2^64 is exact and order-free, so
the total equals the torch form's bit for bit, whatever the block size or the order the partial sums are added in
(tests/invariance/test_kernels_triton.py checks it under the interpreter and on CUDA). Many tensors go in batches: one launch
and one read-back per batch, not per tensor (a weight sync has thousands of tensors).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

BLOCK = 4096  # words per program
BATCH_BYTES = 256 << 20  # most bytes copied into one batch buffer of `word_mix_sums`


def word_mix_sum(words: torch.Tensor, c1: int, c2: int, c3: int, c4: int) -> int:
    """sum_i ((w_i + i*c1) * c2 ^ (i*c3)) * c4 mod 2^64 over a contiguous 1-D int64 tensor, as an unsigned int."""
    return word_mix_sums([words], c1, c2, c3, c4)[0]


@triton.jit
def _segment_mix_sum_kernel(w_ptr, start_ptr, first_ptr, count_ptr, out_ptr, c1, c2, c3, c4, BLOCK: tl.constexpr):
    """Program p: `count[p]` words at `start[p]` of the batch buffer, indexed from `first[p]` within their tensor."""
    p = tl.program_id(0)
    start = tl.load(start_ptr + p)
    first = tl.load(first_ptr + p)
    count = tl.load(count_ptr + p)
    j = tl.arange(0, BLOCK)
    mask = j < count
    w = tl.load(w_ptr + start + j, mask=mask, other=0)
    idx = first + j
    mixed = ((w + idx * c1) * c2 ^ (idx * c3)) * c4
    tl.store(out_ptr + p, tl.sum(tl.where(mask, mixed, 0), axis=0))


def word_mix_sums(words: list[torch.Tensor], c1: int, c2: int, c3: int, c4: int) -> list[int]:
    """`word_mix_sum` of each contiguous 1-D int64 tensor (all on one device), the sums equal to it: the tensors are
    copied back to back into batch buffers of about `BATCH_BYTES`, each buffer is one launch over (tensor, block)
    programs and one read back, so many small tensors cost a few launches instead of one each."""
    for w in words:
        if w.dtype != torch.int64 or w.dim() != 1 or not w.is_contiguous():
            raise TypeError(f"word_mix_sums takes contiguous 1-D int64 tensors, got {w.dtype} {tuple(w.shape)}")
    out = [0] * len(words)
    consts = [torch.tensor(c, dtype=torch.int64).item() for c in (c1, c2, c3, c4)]
    batch: list[int] = []
    size = 0
    for i, w in enumerate(words):
        batch.append(i)
        size += w.numel() * 8
        if size >= BATCH_BYTES or i == len(words) - 1:
            for j, total in zip(batch, _batch_sums([words[j] for j in batch], consts)):
                out[j] = total
            batch, size = [], 0
    return out


def segment_table(counts: list[int], starts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The programs of segments (`counts[i]` words from word `starts[i]` of one buffer): (table [3, programs] of each
    program's start word, first index within its segment and word count; blocks per segment), on `device`."""
    blocks, owner, first, count = programs(counts, BLOCK)
    start = torch.tensor(starts, dtype=torch.int64)[owner] + first
    return torch.stack([start, first, count]).to(device), blocks.to(device)


def programs(counts: list[int], block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Segments of `counts[i]` elements cut into programs of at most `block` consecutive elements (none for an empty
    segment), on the CPU: (programs per segment; each program's segment, first element within it, element count)."""
    counts_t = torch.tensor(counts, dtype=torch.int64)
    blocks = (counts_t + block - 1) // block
    owner = torch.repeat_interleave(torch.arange(len(counts)), blocks)
    first = (torch.arange(int(blocks.sum())) - torch.repeat_interleave(blocks.cumsum(0) - blocks, blocks)) * block
    return blocks, owner, first, torch.clamp(counts_t[owner] - first, max=block)


def segment_sums(words: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor], c1: int, c2: int, c3: int,
                 c4: int) -> torch.Tensor:
    """Each segment's word-mix sum (int64 on the device, mod 2^64) of the 1-D int64 buffer `words` with the
    `segment_table` `plan`: one launch, nothing read back."""
    table, blocks = plan
    sums = torch.zeros(blocks.numel(), dtype=torch.int64, device=words.device)
    if not table.shape[1]:
        return sums
    consts = [torch.tensor(c, dtype=torch.int64).item() for c in (c1, c2, c3, c4)]
    partial = torch.empty(table.shape[1], dtype=torch.int64, device=words.device)
    _segment_mix_sum_kernel[(table.shape[1],)](words, table[0], table[1], table[2], partial, *consts, BLOCK=BLOCK)
    # a segment's programs are consecutive: its sum is a difference of the running sum (integer: exact, mod 2^64)
    running = torch.cat([partial.new_zeros(1), partial.cumsum(0)])
    ends = blocks.cumsum(0)
    return running[ends] - running[ends - blocks]


def _batch_sums(words: list[torch.Tensor], consts: list[int]) -> list[int]:
    """One batch of `word_mix_sums`: the tensors back to back in one buffer (one tensor: read in place)."""
    counts = [w.numel() for w in words]
    starts = [0, *itertools.accumulate(counts)][:-1]
    buffer = words[0] if len(words) == 1 else torch.cat(words)
    totals = segment_sums(buffer, segment_table(counts, starts, buffer.device), *consts)
    return [t & (2**64 - 1) for t in totals.tolist()]
