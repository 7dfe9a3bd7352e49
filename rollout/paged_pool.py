"""A paged MLA latent pool without vLLM: the GPU generation path and its tests, where vLLM cannot run.

`PagedLatentPool` has `parity.model.MLACache`'s interface over one block pool shared by a batch of requests, laid
out as vLLM's paged KV cache is (`[num_blocks, block_size, L]`, a block table per request). Each request owns
`per_request` blocks drawn in shuffled order and unwritten slots hold NaN, so a kernel that read past a request's
length, or in another block order, would show it. `attend` reads the blocks through the block table with the kernel
set's paged attention, as `rollout.caches.PagedLatentCache` does inside vLLM.
"""

from __future__ import annotations

import torch

from parity.kernels import Kernels


class PagedLatentPool:
    """Latents of `batch` requests in a shuffled block pool of `dtype` (the compute dtype, or FP8 e4m3). Block
    `batch * per_request` (the last) belongs to no request: padding rows' writes land there, so an append is one
    unmasked scatter. Every buffer is updated in place (a CUDA graph can hold them)."""

    def __init__(self, batch: int, width: int, block: int, per_request: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", generator: torch.Generator | None = None) -> None:
        n = batch * per_request
        self.pool = torch.full((n + 1, block, width), float("nan"), dtype=dtype, device=device)
        self.table = torch.randperm(n, generator=generator, device="cpu").view(batch, per_request).to(device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)

    def append(self, new: torch.Tensor, lens: torch.Tensor) -> None:
        """Write `new[b, :lens[b]]` after row b's current end (values already representable in the pool's dtype);
        one scatter for the whole batch, nothing read back to the host."""
        block = self.pool.shape[1]
        lens = lens.to(self.length.device)
        t = new.shape[1]
        step = torch.arange(t, device=self.pool.device).view(1, -1)
        pos = self.length.view(-1, 1) + step  # [B, T]
        keep = step < lens.view(-1, 1)
        pos = torch.where(keep, pos, 0)
        blocks = torch.where(keep, self.table.gather(1, pos // block), self.pool.shape[0] - 1)
        self.pool[blocks, pos % block] = new.to(self.pool.dtype)
        self.length.add_(lens)

    def attend(self, kernels: Kernels, q: torch.Tensor, values: int, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
        """`parity.model.MLACache.attend` with the keys read through the block table (`kernels.attention_paged`)."""
        return attend_paged(kernels, self.pool, self.table, self.length, q, values, q_pos, scale)


def attend_paged(kernels: Kernels, pages: torch.Tensor, block_table: torch.Tensor, length: torch.Tensor,
                 q: torch.Tensor, values: int, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """`parity.model.MLACache.attend` over latent pages [num_blocks, block_size, L] (one key head; values: the first
    `values` channels) through `block_table` [B, max_blocks], rows holding `length` [B] positions: the kernel set's
    `attention_paged` (the Triton kernel reads the blocks in place; the torch kernels gather them). The table is cut
    to the longest row's blocks, except under CUDA-graph capture (the kernels read no block past a row's length)."""
    if not (pages.is_cuda and torch.cuda.is_current_stream_capturing()):  # in a CUDA graph: the whole table
        block_table = block_table[:, : -(-int(length.max()) // pages.shape[1])]  # the kernels mask past `length`
    heads = pages.unsqueeze(2)  # [num_blocks, block_size, 1, L]
    return kernels.attention_paged(q, heads, heads[..., :values], block_table, q_pos, length, scale)
