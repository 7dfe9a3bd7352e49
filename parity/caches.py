"""The shared forward's per-sequence caches: a KDA layer's conv window and recurrent state (`KDACache`), an MLA
layer's contiguous latents (`MLACache`, with DSA index keys beside them), and `new_cache` for a batch of new sequences.

The engines bring their own forms with the same interface (vLLM's paged blocks and state slots: `rollout.vllm.caches`;
a paged pool without vLLM: `rollout.generate.paged_pool`); `K3Forward` reads and writes any of them the same way, so
every schedule computes a token from the same cached values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.config import TextConfig
from parity.kernels import Kernels


@dataclass
class KDACache:
    """Per-sequence KDA state: conv inputs of the last W-1 tokens and the recurrent state after the last token."""

    conv: torch.Tensor  # [B, W-1, 3P] activation dtype (q | k | v pre-conv projections)
    state: torch.Tensor  # [B, H, K, V] fp32 (float64 in gradient checks)
    # When a list: receives (conv, state) after every token of the next step, token by token (a speculative verify
    # step, whose accepted length is known only after it: `rollout.vllm.caches`). The same bits as one pass.
    trail: list[tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass
class MLACache:
    """Contiguous per-sequence MLA latents: normalised compressed kv and the (unrotated) key part; with the DSA
    indexer, each position's index key beside its latent."""

    latent: torch.Tensor  # [B, S, kv_lora_rank + rope] activation dtype
    length: torch.Tensor  # [B] int64, valid positions
    index: torch.Tensor | None = None  # [B, S, index_head_dim] activation dtype (FP8-rounded values), DSA only

    def append(self, new: torch.Tensor, lens: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Write `new[b, :lens[b]]` (and `index[b, :lens[b]]`) after the current end of row b (grows the buffers as
        needed)."""
        end = self.length + lens
        self.latent = _appended(self.latent, new, self.length, lens)
        if index is not None:
            assert self.index is not None
            self.index = _appended(self.index, index, self.length, lens)
        self.length = end

    def attend(self, kernels: Kernels, q: torch.Tensor, values: int, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
        """`kernels.attention` of q [B, Tq, 1, L] over the cached latents as one key head (keys: the whole latent;
        values: its first `values` channels) -> [B, Tq, 1, values]."""
        lat = self.latent.to(q.dtype).unsqueeze(2)  # an FP8-rounded latent is held exactly in the compute dtype
        return kernels.attention(q, lat, lat[..., :values], q_pos, self.length, scale)

    def sparse_attend(self, kernels: Kernels, q: torch.Tensor, selected: torch.Tensor, count: torch.Tensor,
                      values: int, scale: float) -> torch.Tensor:
        """`kernels.sparse_attention` of q [B, T, H, L] over each token's selected latents ([B, T, K] positions, the
        first `count` [B, T] real) -> [B, T, H, values]."""
        return kernels.sparse_attention(q, self.latent.to(q.dtype).unsqueeze(2), selected, count, values, scale)


def _appended(buf: torch.Tensor, new: torch.Tensor, length: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """`buf` [B, S, D] with `new[b, :lens[b]]` written from `length[b]` on, grown as needed; zeros elsewhere past
    each row's end. Into an empty buffer (S = 0, so every `length` is 0: a whole forward's one append, the trainer's)
    nothing is read back to the host: the result is `new` [B, T, D] with each row's positions past lens[b] zeroed."""
    b, t, d = new.shape
    if buf.shape[1] == 0:
        valid = torch.arange(t, device=new.device) < lens.view(b, 1)
        return new.to(buf.dtype).masked_fill(~valid.unsqueeze(-1), 0)
    need = int((length + lens).max()) if b else 0
    if need > buf.shape[1]:
        grown = buf.new_zeros(b, need, d)
        grown[:, : buf.shape[1]] = buf
        buf = grown
    for i in range(b):
        start, n = int(length[i]), int(lens[i])
        buf[i, start : start + n] = new[i, :n]
    return buf


def new_cache(cfg: TextConfig, batch: int, dtype: torch.dtype | None = None) -> list[KDACache | MLACache]:
    """Empty caches for `batch` new sequences, one per layer; `dtype` is the activation dtype (`K3Forward.dtype`;
    default the config's compute dtype; float64 only for gradient checks). KDA states are at least fp32."""
    dtype = dtype or cfg.compute_dtype
    caches: list[KDACache | MLACache] = []
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_kda(layer):
            d = cfg.kda_head_dim
            caches.append(KDACache(torch.zeros(batch, cfg.conv_kernel - 1, 3 * cfg.kda_proj_size, dtype=dtype),
                                   torch.zeros(batch, cfg.kda_num_heads, d, d,
                                               dtype=torch.promote_types(dtype, torch.float32))))
        else:
            index = None if cfg.index_head_dim is None else torch.zeros(batch, 0, cfg.index_head_dim, dtype=dtype)
            caches.append(MLACache(torch.zeros(batch, 0, cfg.mla_latent_size, dtype=dtype),
                                   torch.zeros(batch, dtype=torch.long), index))
    return caches
