"""K3's per-layer caches inside vLLM's cache memory, seen by `parity.model` through its cache interface.

`LatentCacheLayer` (MLA) and `KDAStateLayer` (KDA) are vLLM attention layers that own no weights: they
declare a cache spec, receive their cache view from vLLM and hand `parity.model.K3Forward.hidden` a
per-step view of it:

- `PagedLatentCache` has `parity.caches.MLACache`'s interface: `append` writes each new latent at its
  token's slot (`slot_mapping`), `attend` runs the kernel set's paged attention over the request's blocks
  through the block table, `length` counts valid positions. Stale block contents past `length` are masked
  and zeroed by the attention kernel.
- `KDAStateLayer.read` returns a `parity.caches.KDACache` copied out of the request's state slot (zeros
  for a request with nothing computed yet, whatever the slot holds); `write` stores the updated state
  back. The slot is chosen by vLLM (`KDAStateMetadata.state_index`), so align-mode prefix caching and
  preemption work on these states like on any Mamba state.

Rows of a step are grouped (`StepGroup`): decodes together, prefill chunks together, each right-padded
to the group's longest query; the parity kernels make a row's bits independent of its group. A step of single-token
decodes is one group read straight off the layout (`StepGroup.uniform`), with no read back to the host: the step a CUDA
graph holds. Writes of padding tokens (slot -1) and padding requests (state block 0) land in vLLM's null block 0,
which no request owns and every kernel reads only below a request's length.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch
from torch import nn

from parity.config import TextConfig
from parity.kernels import Kernels, platform_device, runs_triton
from parity.caches import KDACache
from parity.kernels.attention import gather_paged
from rollout.generate.paged_pool import attend_paged, index_entry_size, pack_index, sparse_attend_paged, unpack_index
from rollout.vllm.backends import (
    KDAStateBackend,
    KDAStateMetadata,
    LatentMetadata,
    StepLayout,
    latent_backend,
    latent_spec,
)
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheSpec, MambaSpec


@dataclass(frozen=True)
class StepGroup:
    """Some requests of a step as a right-padded batch: row b is request `rows[b]`."""

    rows: torch.Tensor  # [B] int64 request indices within the step
    lens: torch.Tensor  # [B] int64 query tokens of each row
    token_index: torch.Tensor  # [B, T] int64 flat token index, -1 on padding
    dense: bool = False  # row b is request b and its one token is flat token b (`uniform`)

    @property
    def valid(self) -> torch.Tensor:
        return self.token_index >= 0

    @staticmethod
    def split(layout: StepLayout, short: int = 1) -> list[StepGroup]:
        """Rows of at most `short` tokens (decodes; with speculative decoding, verify rows of up to 1 + k tokens) and
        longer rows (prefill chunks), each group padded to its own longest row."""
        qlens = layout.query_lens
        groups = []
        for rows in ((qlens <= short).nonzero().view(-1), (qlens > short).nonzero().view(-1)):
            if rows.numel() == 0:
                continue
            lens = qlens[rows]
            t = int(lens.max())
            offs = torch.arange(t).view(1, t)
            index = layout.query_start[rows].view(-1, 1) + offs
            groups.append(StepGroup(rows, lens, torch.where(offs < lens.view(-1, 1), index, -1)))
        return groups

    @staticmethod
    def uniform(layout: StepLayout) -> StepGroup:
        """A step of single-token decodes (`layout.uniform_decode`) as one dense group, built on the device: request r
        is row r, its token flat token r. A padding request of a CUDA-graph batch computes one token as a fresh
        request would (its writes land in the null block)."""
        rows = torch.arange(layout.num_reqs, device=layout.query_start_loc.device)
        return StepGroup(rows, torch.ones_like(rows), rows.view(-1, 1), dense=True)

    def subset(self, keep: torch.Tensor) -> StepGroup:
        """The rows where `keep` [B] is true, padded to their own longest row."""
        lens = self.lens[keep]
        return StepGroup(self.rows[keep], lens, self.token_index[keep, : int(lens.max())])

    def gather(self, flat: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """flat: [N, ...] per-token values -> [B, T, ...], `fill` on padding."""
        out = flat[self.token_index.clamp(min=0)]
        mask = self.valid.view(*self.valid.shape, *([1] * (flat.dim() - 1)))
        return torch.where(mask, out, torch.full((), fill, dtype=flat.dtype))


def on_device_of(t: torch.Tensor) -> AbstractContextManager:
    """Tensors a step makes without naming a device land where `t` is: a `torch.device` context off the CPU, none on
    it (the CPU is the default already, and the context's per-op dispatch took ppo-tiny's generation on this 2-core
    CPU from 249-268 to 156 tokens/s, medians of steps 1-19)."""
    return nullcontext() if t.device.type == "cpu" else torch.device(t.device)


def _register(layer: nn.Module, prefix: str, vllm_config: VllmConfig) -> None:
    ctx = vllm_config.compilation_config.static_forward_context
    if prefix in ctx:
        raise ValueError(f"Duplicate layer name: {prefix}")
    ctx[prefix] = layer


class PagedLatentCache:
    """`parity.caches.MLACache` over vLLM's paged latents for one `StepGroup`; with the DSA indexer each token's entry
    holds its index key after the latent (`index_entry_size`)."""

    def __init__(self, pages: torch.Tensor, block_table: torch.Tensor, slots: torch.Tensor, length: torch.Tensor,
                 latent_size: int, index_dtype: torch.dtype | None = None):
        self.pages = pages  # [num_blocks, block_size, L (+ index entry)]
        self.block_table = block_table  # [B, max_blocks]
        self.slots = slots  # [B, T] flat slot of each new token, -1 on padding
        self.length = length  # [B] valid positions
        self.latent_size = latent_size
        self.index_dtype = index_dtype  # the index keys' compute dtype; None without the indexer

    @property
    def _latent_pages(self) -> torch.Tensor:
        return self.pages if self.index_dtype is None else self.pages[..., : self.latent_size]

    def append(self, new: torch.Tensor, lens: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Write `new[b, :lens[b]]` (and its index keys) where the slots say and extend each row's length; padding
        (slot -1) writes into slot 0, the null block's, in one unmasked scatter."""
        slots = self.slots.clamp(min=0)
        block_size = self.pages.shape[1]
        at = (slots // block_size, slots % block_size)
        self._latent_pages[at] = new.to(self.pages.dtype)  # exact (the model's values)
        if index is not None:
            self.pages[..., self.latent_size :][at] = pack_index(index, self.pages.dtype)
        self.length = self.length + lens

    def attend(self, kernels: Kernels, q: torch.Tensor, values: int, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
        """`parity.caches.MLACache.attend` with the keys read from vLLM's pages through the block table."""
        return attend_paged(kernels, self._latent_pages, self.block_table, self.length, q, values, q_pos, scale)

    def sparse_attend(self, kernels: Kernels, q: torch.Tensor, selected: torch.Tensor, count: torch.Tensor,
                      values: int, scale: float) -> torch.Tensor:
        """`parity.caches.MLACache.sparse_attend` with the selected latents read from vLLM's pages."""
        return sparse_attend_paged(kernels, self._latent_pages, self.block_table, self.length, q, selected, count,
                                   values, scale)

    @property
    def index(self) -> torch.Tensor | None:
        """[B, S, index_head_dim] every position's index key in the compute dtype (`parity.caches.MLACache.index`)."""
        if self.index_dtype is None:
            return None
        return unpack_index(gather_paged(self.pages[..., self.latent_size :], self.block_table), self.index_dtype)


class LatentCacheLayer(nn.Module, AttentionLayerBase):
    """One MLA layer's latents (and DSA index keys) in vLLM's paged KV cache (`[num_blocks, block_size, entry_size]` in
    `dtype` once bound)."""

    def __init__(self, cfg: TextConfig, dtype: torch.dtype, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.cfg = cfg
        self.entry_size = cfg.mla_latent_size + index_entry_size(cfg)  # a token's latent (+ index key)
        self.dtype = dtype
        self.prefix = prefix
        self.kv_cache = torch.tensor([])
        _register(self, prefix, vllm_config)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return latent_backend(self.entry_size, self.dtype)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        return latent_spec(vllm_config.cache_config.block_size, self.entry_size, self.dtype)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """vLLM's view is `[num_blocks, heads=1, block_size, L]`; keep `[num_blocks, block_size, L]`."""
        self.kv_cache = kv_cache.squeeze(1)

    def view(self, meta: LatentMetadata, group: StepGroup) -> PagedLatentCache:
        slots = group.gather(meta.slot_mapping.long(), fill=-1)
        return PagedLatentCache(self.kv_cache, meta.block_table[group.rows], slots,
                                meta.layout.context_lens[group.rows], self.cfg.mla_latent_size,
                                None if self.cfg.index_head_dim is None else self.cfg.compute_dtype)


class KDAStateLayer(nn.Module, MambaBase):
    """One KDA layer's state in vLLM's hybrid state cache (`kda_state_shapes`): the conv window `[W-1, 3P]` (q | k | v
    inputs, compute dtype) and the recurrent state `[H, K, V]` (fp32); with the Triton kernels the second tensor is
    a flat fp32 record of the whole `parity.kernels.triton.KDAChunkState`: the state at the last chunk boundary,
    then the pending chunk's inputs `[CHUNK, H, 4K + 1]` (q | k | g | v | beta).

    With k speculative tokens a request's slot holds k + 1 (conv window, state) pairs and the position `end` its last
    step ran to: pair i is the state after the first `end - k + i` tokens. A verify step writes the pairs after each
    of its last k + 1 tokens; the next step, whose context length says how many were accepted, resumes from the pair
    of exactly the accepted tokens (`read`), so a rejected draft leaves no trace in the state."""

    def __init__(self, cfg: TextConfig, kernels: str, prefix: str, vllm_config: VllmConfig):
        super().__init__()
        self.cfg = cfg
        self.chunked = runs_triton(kernels, platform_device())
        self.pairs = vllm_config.num_speculative_tokens + 1
        self.shapes = kda_state_shapes(cfg, kernels, self.pairs)
        self.state_shape = (cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)  # one recurrent state
        self.dtypes = kda_state_dtypes(cfg)
        self.prefix = prefix
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        _register(self, prefix, vllm_config)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.dtypes

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        """Only a key for the model's state copy functions; `get_attn_backend` names the real backend."""
        return MambaAttentionBackendEnum.CUSTOM

    def get_attn_backend(self) -> type[AttentionBackend]:
        return KDAStateBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec | None:
        """vLLM's state spec with no extra per-draft blocks: the slot itself holds the k + 1 pairs."""
        spec = super().get_kv_cache_spec(vllm_config)
        return replace(spec, num_speculative_blocks=0) if isinstance(spec, MambaSpec) else spec

    def read(self, meta: KDAStateMetadata, group: StepGroup) -> KDACache:
        """The state before this step (`_read_pairs` with speculative decoding, else `_read_one`)."""
        return self._read_one(meta, group) if self.pairs == 1 else self._read_pairs(meta, group)

    def write(self, meta: KDAStateMetadata, group: StepGroup, cache: KDACache) -> None:
        """Store the state after this step (`_write_pairs` with speculative decoding, else `_write_one`)."""
        if self.pairs == 1:
            self._write_one(meta, group, cache)
        else:
            self._write_pairs(meta, group, cache)

    def _read_pairs(self, meta: KDAStateMetadata, group: StepGroup) -> KDACache:
        """The pair of exactly the tokens in the cache (the context length): `end - context` tokens of the last step
        were rejected. Zeros for a request starting from token 0. A row of at most k + 1 tokens keeps a trail."""
        idx = meta.state_index[group.rows]
        context = meta.layout.context_lens[group.rows]
        k = self.pairs - 1
        flat = self.kv_cache[1][idx]
        end = flat[:, -1:].contiguous().view(torch.int32).view(-1).long()
        pair = context - end + k
        fresh = context == 0
        if bool(((pair < 0) | (pair > k))[~fresh].any()):
            raise RuntimeError(f"KDA state {self.prefix}: context lengths {context.tolist()} are not within the last "
                               f"{k + 1} tokens of the steps that wrote the states (ends {end.tolist()})")
        pair = torch.where(fresh, k, pair)
        rows = torch.arange(len(idx))
        conv = self.kv_cache[0][idx][rows, pair]
        state = flat[:, :-1].view(len(idx), self.pairs, *self.state_shape)[rows, pair]
        keep = (~fresh).view(-1, 1, 1)
        conv = torch.where(keep, conv, torch.zeros((), dtype=conv.dtype))
        state = torch.where(keep.view(-1, 1, 1, 1), state, torch.zeros((), dtype=state.dtype))
        trail = [] if group.token_index.shape[1] <= self.pairs else None
        return KDACache(conv, state, trail)

    def _write_pairs(self, meta: KDAStateMetadata, group: StepGroup, cache: KDACache) -> None:
        """Pair i <- the state after token `len - 1 - k + i` of the row (a trail), or pair k <- the final state (a
        longer row: a prefill chunk, all of whose tokens stay); `end` <- context + len."""
        idx = meta.state_index[group.rows]
        k, b = self.pairs - 1, len(idx)
        lens = group.lens
        conv_slots = self.kv_cache[0][idx]  # [B, k + 1, W-1, 3P]
        flat = self.kv_cache[1][idx]
        states = flat[:, :-1].view(b, self.pairs, *self.state_shape)
        rows = torch.arange(b)
        if cache.trail is None:
            conv_slots[rows, k], states[rows, k] = cache.conv, cache.state
        else:
            convs = torch.stack([c for c, _ in cache.trail], dim=1)  # [B, T, W-1, 3P]
            trail = torch.stack([s for _, s in cache.trail], dim=1)  # [B, T, H, K, V]
            token = (lens.view(-1, 1) - 1 - k + torch.arange(self.pairs).view(1, -1)).clamp(min=0)  # [B, k + 1]
            conv_slots = convs[rows.view(-1, 1), token]
            states = trail[rows.view(-1, 1), token]
        end = (meta.layout.context_lens[group.rows] + lens).to(torch.int32)
        self.kv_cache[0][idx] = conv_slots
        self.kv_cache[1][idx] = torch.cat([states.reshape(b, -1), end.view(-1, 1).view(torch.float32)], dim=1)

    def _read_one(self, meta: KDAStateMetadata, group: StepGroup) -> KDACache:
        """The state before this step: a copy of the slot, or zeros for a request starting from token 0. With the
        Triton kernels the state is a `KDAChunkState` whose pending-token count is the context length modulo the
        chunk (the chunk grid is anchored at position 0)."""
        idx = meta.state_index[group.rows]
        context = meta.layout.context_lens[group.rows]
        fresh = context == 0

        def slot(t: torch.Tensor) -> torch.Tensor:
            keep = (~fresh).view(-1, *([1] * (t.dim() - 1))).to(t.device)
            return torch.where(keep, t[idx], 0.0)  # a float cache: the scalar takes its dtype, no zeros made

        conv, state = slot(self.kv_cache[0]), slot(self.kv_cache[1])
        if not self.chunked:
            return KDACache(conv, state)
        from parity.kernels.triton.kda import CHUNK, KDAChunkState

        h, d = self.cfg.kda_num_heads, self.cfg.kda_head_dim
        b = state.shape[0]
        boundary, pending = state.split([h * d * d, CHUNK * h * (4 * d + 1)], dim=1)
        q, k, g, v, beta = pending.view(b, CHUNK, h, 4 * d + 1).split([d, d, d, d, 1], dim=-1)
        n = (context % CHUNK).to(state.device)
        return KDACache(conv, KDAChunkState(boundary.view(b, h, d, d), q, k, v, g, beta.squeeze(-1), n))

    def _write_one(self, meta: KDAStateMetadata, group: StepGroup, cache: KDACache) -> None:
        idx = meta.state_index[group.rows]
        self.kv_cache[0][idx] = cache.conv
        if not self.chunked:
            self.kv_cache[1][idx] = cache.state
            return
        st = cache.state
        b = st.state.shape[0]
        pending = torch.cat([st.q, st.k, st.g, st.v.float(), st.beta.unsqueeze(-1)], dim=-1)
        self.kv_cache[1][idx] = torch.cat([st.state.reshape(b, -1), pending.reshape(b, -1)], dim=1)


def kda_state_dtypes(cfg: TextConfig) -> tuple[torch.dtype, torch.dtype]:
    """(conv window, recurrent state) dtypes: the conv window holds activations (compute dtype, exact), the state
    is fp32 (`parity.model.new_cache`; the Triton kernels' pending chunk inputs are fp32 too: q, k after the fp32
    L2 norm, fp32 gate and beta, v upcast exactly)."""
    return cfg.compute_dtype, torch.float32


def kda_state_shapes(cfg: TextConfig, kernels: str, pairs: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv window [W-1, 3P], recurrent state [H, K, V]) of one KDA layer; with the Triton kernels the state is
    flat: [H * K * V + CHUNK * H * (4K + 1)] (the boundary state, then q | k | g | v | beta of the tokens past the
    last chunk boundary; two tensors, so vLLM's align-mode prefix caching copies both whole). With `pairs` > 1
    (speculative decoding, `KDAStateLayer`): [pairs, W-1, 3P] and [pairs * H * K * V + 1] (the pairs' states, then
    the step end as int32 bits)."""
    d, h = cfg.kda_head_dim, cfg.kda_num_heads
    conv = (cfg.conv_kernel - 1, 3 * cfg.kda_proj_size)
    chunked = runs_triton(kernels, platform_device())  # the Triton kernels' chunked KDA state
    if pairs > 1:
        if chunked:
            raise ValueError("speculative decoding runs on the invariant or fast kernels, not the Triton kernels")
        return (pairs, *conv), (pairs * h * d * d + 1,)
    if not chunked:
        return conv, (h, d, d)
    from parity.kernels.triton.kda import CHUNK

    return conv, (h * d * d + CHUNK * h * (4 * d + 1),)
