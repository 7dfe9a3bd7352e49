"""K3's full-attention layer: NoPE MLA in its absorbed form over the cached latents, and K3.1's DSA indexer.

`MLAttention` is a part of `parity.model.K3Forward` (its methods read the forward's weights, kernels and config). Every
schedule (prefill, decode, trainer) runs the absorbed form: per head h, q_lat = W_UK[h]^T q_nope, attention of
[q_lat ; q_rope] over the cached latents [c ; k_rope] with values c (one latent head shared by all query heads), then
o = W_UV[h] o_lat; with the DSA indexer each query attends only its top-k positions by index score.
"""

from __future__ import annotations

import torch

from parity.absorbed_mla import absorb_queries, expand_values, split_heads
from parity.caches import MLACache
from parity.kernels.dsa import top_positions
from parity.kernels.norms import layernorm_invariant
from parity.kernels.primitives import wide
from parity.quant import fp8
from parity.quant.bf16 import holds_bf16_values, mark_bf16_valued

INDEX_NORM_EPS = 1e-6  # the DSA indexer's key LayerNorm (DeepSeek-V3.2's, as vLLM builds it)


class MLAttention:
    """`K3Forward`'s MLA layer (`_mla`) and DSA indexer (`index_scores`, `_select`)."""

    def _kv_b_heads(self, p: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """kv_b_proj per head: (its k_nope rows transposed, [r, dn]: q_nope -> latent; its v rows, [dv, r]: latent -> v),
        each a `linear` weight; with a LoRA the effective weight W + scale * B A in fp32 (one invariant GEMM: it depends on the weights only, never on the
        batch). The per-head views keep the weight's bf16-values mark (`parity.quant.bf16`)."""
        c = self.cfg
        name = f"{p}.kv_b_proj.weight"
        w = self.weight(name)
        lora = self._lora(name)
        if lora is not None:
            w = wide(w) + self.k.linear(wide(lora.b), wide(lora.a).t()) * lora.scale
        uk_t, uv = split_heads(w, c.num_attention_heads, c.qk_nope_head_dim)
        if holds_bf16_values(w):
            uk_t, uv = [mark_bf16_valued(v) for v in uk_t], [mark_bf16_valued(v) for v in uv]
        return uk_t, uv

    def _mla(self, x: torch.Tensor, p: str, cache: MLACache, pos: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """NoPE MLA on normalised input x: [B, T, D]; appends this step's latents to `cache`.

        Absorbed form, on every schedule (prefill, decode, trainer): per head h, q_lat = W_UK[h]^T q_nope, attention
        of [q_lat ; q_rope] over the cached latents [c ; k_rope] with values c (one latent head shared by all query
        heads), then o = W_UV[h] o_lat. kv_b_proj never touches the cache: a decode step costs O(S * H * (2r + dr))
        instead of O(S * r * H * (dn + dv)) for S cached positions (parity/README.md)."""
        c = self.cfg
        b, t, _ = x.shape
        h, dn, dr, dv, r = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        if c.q_lora_rank is not None:
            qr = self._norm(self._lin(x, f"{p}.q_a_proj.weight"), f"{p}.q_a_layernorm.weight")
            q = self._lin(qr, f"{p}.q_b_proj.weight")
        else:
            q = self._lin(x, f"{p}.q_proj.weight")
        q = q.view(b, t, h, dn + dr)
        kv_a = self._lin(x, f"{p}.kv_a_proj_with_mqa.weight")  # [B, T, r + dr]
        latent = torch.cat([self._norm(kv_a[..., :r], f"{p}.kv_a_layernorm.weight"), kv_a[..., r:]], dim=-1)
        if c.latent_cache == "fp8_e4m3":
            latent = fp8.round_trip(latent)  # the values the FP8 cache holds, for every reader
        if c.index_topk is None:
            cache.append(latent, lens)
        else:  # a cache holding index keys (the shared forward's `MLACache`; not yet the engines' paged ones)
            cache.append(latent, lens, self._index_keys(x, p))
        uk_t, uv = self._kv_b_heads(p)
        q_lat = absorb_queries(self.k, q[..., :dn], uk_t)  # [B, T, H, r]
        q_abs = torch.cat([q_lat, q[..., dn:]], dim=-1).reshape(b, t * h, 1, r + dr)  # rows (token, head)
        if c.index_topk is None:
            o_lat = cache.attend(self.k, q_abs, r, pos.repeat_interleave(h, dim=1), (dn + dr) ** -0.5)
        else:
            selected, count = self._select(x, qr, p, cache, pos)
            o_lat = cache.sparse_attend(self.k, q_abs.view(b, t, h, r + dr), selected, count, r, (dn + dr) ** -0.5)
        o_lat = o_lat.view(b, t, h, r)
        o = expand_values(self.k, o_lat, uv)  # [B, T, H, dv]
        if c.mla_use_output_gate:  # sigmoid gate and product in fp32, rounded once
            o = (wide(o) * self.k.sigmoid(wide(self._lin(x, f"{p}.g_proj.weight")).view(b, t, h, dv))).to(o.dtype)
        return self._lin(o.reshape(b, t, h * dv), f"{p}.o_proj.weight")

    # --- DSA: the lightning indexer and sparse MLA (K3.1 Pro) -----------------------------------
    def _index_keys(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """x [B, T, D] -> one index key per token [B, T, index_head_dim]: LayerNorm(wk x) (fp32 statistics, the
        affine in fp32, rounded once), as the FP8 index-key cache holds it (`fp8.round_trip_scaled`)."""
        out = layernorm_invariant(self._lin(x, f"{p}.indexer.wk.weight"), self.weight(f"{p}.indexer.k_norm.weight"),
                                  self.weight(f"{p}.indexer.k_norm.bias"), INDEX_NORM_EPS)
        return fp8.round_trip_scaled(out.to(x.dtype))

    def index_scores(self, x: torch.Tensor, qr: torch.Tensor, p: str, cache: MLACache,
                     pos: torch.Tensor) -> torch.Tensor:
        """The indexer's score of every cached key for every query: [B, T, S] fp32, -inf where key s is not a candidate
        (s > the query's position, or past the cache).

        Score of key s for the query at position t: sum over index heads j of w_j * ReLU(q_j . k_s) (the kernel set's
        `index_scores`; q_j: the FP8-rounded index query of head j; w = weights_proj x / sqrt(index_head_dim *
        index_n_heads)). The scores only choose positions (no gradient reaches them), so they are computed from
        detached inputs."""
        c = self.cfg
        assert c.index_n_heads is not None and c.index_head_dim is not None
        b, t, _ = x.shape
        nh, d = c.index_n_heads, c.index_head_dim
        x, qr = x.detach(), qr.detach()
        q = fp8.round_trip_scaled(self._lin(qr, f"{p}.indexer.wq_b.weight").view(b, t, nh, d))
        w = wide(self._lin(x, f"{p}.indexer.weights_proj.weight")) * (d * nh) ** -0.5  # [B, T, nh]
        keys = cache.index
        assert keys is not None
        return self.k.index_scores(q.detach(), w.detach(), keys.detach().to(q.dtype), pos, cache.length)

    def _select(self, x: torch.Tensor, qr: torch.Tensor, p: str, cache: MLACache,
                pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions each query attends (`parity.kernels.dsa.top_positions` of `index_scores`): (selected
        [B, T, K] ascending, padded with 0; count [B, T])."""
        assert self.cfg.index_topk is not None
        return top_positions(self.index_scores(x, qr, p, cache, pos), self.cfg.index_topk)
