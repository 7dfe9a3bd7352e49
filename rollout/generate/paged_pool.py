"""A paged MLA latent pool without vLLM: the GPU generation path and its tests, where vLLM cannot run.

`PagedLatentPool` has `parity.caches.MLACache`'s interface over one block pool shared by a batch of requests, laid
out as vLLM's paged KV cache is (`[num_blocks, block_size, L]`, a block table per request). Each request owns
`per_request` blocks drawn in shuffled order and unwritten slots hold NaN, so a kernel that read past a request's
length, or in another block order, would show it. `attend` reads the blocks through the block table with the kernel
set's paged attention, as `rollout.vllm.caches.PagedLatentCache` does inside vLLM; with the DSA indexer each token's entry
holds its index key after its latent, in the layout vLLM's cache holds it (`pack_index`), and `sparse_attend` reads
each token's selected latents in place.
"""

from __future__ import annotations

import torch

from parity.config import TextConfig
from parity.kernels import Kernels
from parity.kernels.attention import gather_paged
from parity.quant import fp8


def index_entry_size(cfg: TextConfig) -> int:
    """What a token's DSA index key takes in its MLA layer's cache entry, beside the latent, in cache elements: the FP8
    codes and their fp32 scale's bytes (`fp8.pack_scaled`) in an FP8 cache, the values themselves (FP8-rounded,
    exact) in a compute-dtype cache; 0 without the indexer."""
    if cfg.index_head_dim is None:
        return 0
    return cfg.index_head_dim + (fp8.SCALE_BYTES if cfg.latent_cache else 0)


def pack_index(index: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """Index keys [..., d] (values the FP8 index cache holds) -> their cache entries in `storage`: FP8 codes and the
    row scale's bytes (`fp8.pack_scaled`) in an FP8 cache, the values themselves in a compute-dtype cache."""
    return fp8.pack_scaled(index) if storage == fp8.STORAGE_DTYPE else index.to(storage)


def unpack_index(entries: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`pack_index` entries [..., entry] -> the index keys [..., d] in `dtype` (exact)."""
    return fp8.unpack_scaled(entries, dtype) if entries.dtype == fp8.STORAGE_DTYPE else entries.to(dtype)


class PagedLatentPool:
    """Latents of `batch` requests in a shuffled block pool of `dtype` (the compute dtype, or FP8 e4m3), each entry
    `width` latent channels and, with `index_dtype` (DSA: the index keys' compute dtype), `index_entry` more for its
    index key (`pack_index`). Block `batch * per_request` (the last) belongs to no request: padding rows' writes land
    there, so an append is one unmasked scatter. Every buffer is updated in place (a CUDA graph can hold them)."""

    def __init__(self, batch: int, width: int, block: int, per_request: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", generator: torch.Generator | None = None,
                 index_entry: int = 0, index_dtype: torch.dtype | None = None) -> None:
        n = batch * per_request
        self.width = width
        self.index_dtype = index_dtype
        self.pool = torch.full((n + 1, block, width + index_entry), float("nan"), dtype=dtype, device=device)
        self.table = torch.randperm(n, generator=generator, device="cpu").view(batch, per_request).to(device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)

    @classmethod
    def for_config(cls, cfg: TextConfig, batch: int, block: int, per_request: int, device: torch.device | str = "cpu",
                   generator: torch.Generator | None = None) -> PagedLatentPool:
        """A pool for one MLA layer of `cfg` as vLLM's cache holds it: FP8 e4m3 entries when its latent cache is FP8,
        else the compute dtype; with the DSA indexer each entry's index key after its latent."""
        dtype = fp8.STORAGE_DTYPE if cfg.latent_cache else cfg.compute_dtype
        return cls(batch, cfg.mla_latent_size, block, per_request, dtype, device, generator,
                   index_entry=index_entry_size(cfg), index_dtype=None if cfg.index_head_dim is None else cfg.compute_dtype)

    def append(self, new: torch.Tensor, lens: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Write `new[b, :lens[b]]` (and its index keys) after row b's current end (values already representable in
        the pool's dtype); one scatter for the whole batch, nothing read back to the host."""
        block = self.pool.shape[1]
        lens = lens.to(self.length.device)
        t = new.shape[1]
        step = torch.arange(t, device=self.pool.device).view(1, -1)
        pos = self.length.view(-1, 1) + step  # [B, T]
        keep = step < lens.view(-1, 1)
        pos = torch.where(keep, pos, 0)
        blocks = torch.where(keep, self.table.gather(1, pos // block), self.pool.shape[0] - 1)
        entry = new.to(self.pool.dtype)
        if index is not None:
            entry = torch.cat([entry, pack_index(index, self.pool.dtype)], dim=-1)
        self.pool[blocks, pos % block] = entry
        self.length.add_(lens)

    @property
    def _latents(self) -> torch.Tensor:
        return self.pool[..., : self.width]

    @property
    def index(self) -> torch.Tensor | None:
        """[B, S, index_head_dim] every position's index key in `index_dtype` (`parity.caches.MLACache.index`)."""
        if self.index_dtype is None:
            return None
        return unpack_index(gather_paged(self.pool[..., self.width :], self.table), self.index_dtype)

    def attend(self, kernels: Kernels, q: torch.Tensor, values: int, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
        """`parity.caches.MLACache.attend` with the keys read through the block table (`kernels.attention_paged`)."""
        return attend_paged(kernels, self._latents, self.table, self.length, q, values, q_pos, scale)

    def sparse_attend(self, kernels: Kernels, q: torch.Tensor, selected: torch.Tensor, count: torch.Tensor,
                      values: int, scale: float) -> torch.Tensor:
        """`parity.caches.MLACache.sparse_attend` with the selected latents read through the block table."""
        return sparse_attend_paged(kernels, self._latents, self.table, self.length, q, selected, count, values, scale)


def _in_use(pages: torch.Tensor, block_table: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """The table cut to the longest row's blocks, except under CUDA-graph capture (the whole table: the kernels read
    no block past a row's length)."""
    if pages.is_cuda and torch.cuda.is_current_stream_capturing():
        return block_table
    return block_table[:, : -(-int(length.max()) // pages.shape[1])]


def attend_paged(kernels: Kernels, pages: torch.Tensor, block_table: torch.Tensor, length: torch.Tensor,
                 q: torch.Tensor, values: int, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """`parity.caches.MLACache.attend` over latent pages [num_blocks, block_size, L] (one key head; values: the first
    `values` channels) through `block_table` [B, max_blocks] (`_in_use` of it), rows holding `length` [B] positions:
    the kernel set's `attention_paged` (the Triton kernel reads the blocks in place; the torch kernels gather them)."""
    heads = pages.unsqueeze(2)  # [num_blocks, block_size, 1, L]
    return kernels.attention_paged(q, heads, heads[..., :values], _in_use(pages, block_table, length), q_pos, length,
                                   scale)


def sparse_attend_paged(kernels: Kernels, pages: torch.Tensor, block_table: torch.Tensor, length: torch.Tensor,
                        q: torch.Tensor, selected: torch.Tensor, count: torch.Tensor, values: int,
                        scale: float) -> torch.Tensor:
    """`parity.caches.MLACache.sparse_attend` over latent pages through `block_table`: the kernel set's
    `sparse_attention_paged` (the Triton kernel reads the selected positions in place; the torch kernels gather)."""
    return kernels.sparse_attention_paged(q, pages.unsqueeze(2), _in_use(pages, block_table, length), selected, count,
                                          values, scale)
