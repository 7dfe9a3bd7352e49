"""K3's DSpark draft forward on a kernel set: context latents from the target's hidden states, one parallel block of
N draft rows, base logits and the Markov bias (`parity.dspark` has the format and the semantics).

Invariant: a sequence's draft logits are a function of its own context latents, anchor token and start position alone:
every op is a kernel-set op (row-invariant on the invariant sets) or element-wise, the rotary angles come from one
fixed table, and each row attends only its own cache rows, so batch size, batch order and padding never change them.
"""

from __future__ import annotations

import torch

from parity.absorbed_mla import absorb_queries, expand_values, split_heads
from parity.dspark import DSparkConfig, layer, rope_table, rotate
from parity.kernels import Kernels
from parity.kernels.primitives import wide


class DSparkDraft:
    """The draft over its weights (checkpoint names, `parity.dspark.dspark_specs`) and the target's embedding and
    lm_head, both [vocab, D] (shared, never stored with the draft). Logits and the Markov bias are summed in fp32."""

    def __init__(self, cfg: DSparkConfig, weights: dict[str, torch.Tensor], kernels: Kernels, embed: torch.Tensor,
                 lm_head: torch.Tensor) -> None:
        self.cfg, self.w, self.k = cfg, weights, kernels
        self.embed, self.lm_head = embed, lm_head
        self.table = rope_table(cfg)

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.k.linear(x, self.w[name])

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.k.rmsnorm(x, self.w[name], self.cfg.rms_norm_eps)

    def _latent(self, x: torch.Tensor, p: str, pos: torch.Tensor) -> torch.Tensor:
        """[normed latent ; rotated key] of x [B, T, D] at positions pos [B, T] through layer p's kv_a projection."""
        r = self.cfg.kv_lora_rank
        kv = self._lin(x, f"{p}.self_attn.kv_a_proj_with_mqa.weight")
        return torch.cat([self._norm(kv[..., :r], f"{p}.self_attn.kv_a_layernorm.weight"),
                          rotate(kv[..., r:], pos, self.table)], dim=-1)

    def context_latents(self, aux: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:
        """aux [B, T, len(target_layer_ids) * target_hidden_size] (the target's hidden states after those layers,
        concatenated in ascending order), pos [B, T] -> per draft layer [B, T, kv_lora_rank + rope]: what the draft's
        cache holds for those target positions. The context rows pass no input norm and compute no query."""
        ctx = self._norm(self._lin(aux.to(self.cfg.dtype), "context_proj.weight"), "context_norm.weight")
        return [self._latent(ctx, layer(i), pos) for i in range(self.cfg.num_hidden_layers)]

    def block_hidden(self, anchor: torch.Tensor, start: torch.Tensor, cache: list[torch.Tensor], n: int) -> torch.Tensor:
        """One parallel draft block: anchor [B] (the token at position start[b]), start [B] = the number of context
        positions row b holds (cache[l][b, :start[b]]), n block rows [anchor, noise x (n - 1)] at positions
        start .. start + n - 1, each attending every context position and every block row -> [B, n, D] after the
        final norm."""
        c = self.cfg
        b = anchor.shape[0]
        h, dn, dr, dv, r = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        ids = torch.full((b, n), c.noise_token_id, dtype=torch.long, device=anchor.device)
        ids[:, 0] = anchor
        pos = start.view(b, 1) + torch.arange(n, device=anchor.device).view(1, n)
        x = self.embed[ids].to(c.dtype)
        for i in range(c.num_hidden_layers):
            p = layer(i)
            a = self._norm(x, f"{p}.input_layernorm.weight")
            qa = self._norm(self._lin(a, f"{p}.self_attn.q_a_proj.weight"), f"{p}.self_attn.q_a_layernorm.weight")
            q = self._lin(qa, f"{p}.self_attn.q_b_proj.weight").view(b, n, h, dn + dr)
            keys = _with_block(cache[i], self._latent(a, p, pos), start)  # [B, S + n, W]
            uk_t, uv = split_heads(self.w[f"{p}.self_attn.kv_b_proj.weight"], h, dn)
            q_lat = absorb_queries(self.k, q[..., :dn], uk_t)
            q_abs = torch.cat([q_lat, rotate(q[..., dn:], pos, self.table)], dim=-1).reshape(b, n * h, 1, r + dr)
            last = (start + n - 1).view(b, 1).expand(b, n * h)  # non-causal: every row sees the whole block
            lat = keys.unsqueeze(2)
            o_lat = self.k.attention(q_abs, lat, lat[..., :r], last, start + n, (dn + dr) ** -0.5).view(b, n, h, r)
            o = expand_values(self.k, o_lat, uv)
            x = x + self._lin(o.reshape(b, n, h * dv), f"{p}.self_attn.o_proj.weight")
            m = self._norm(x, f"{p}.post_attention_layernorm.weight")
            act = self.k.silu_glu(self._lin(m, f"{p}.mlp.gate_proj.weight"), self._lin(m, f"{p}.mlp.up_proj.weight"))
            x = x + self._lin(act, f"{p}.mlp.down_proj.weight")
        return self._norm(x, "final_norm.weight")

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., vocab] fp32: the target's lm_head (no target final norm) times logit_scale."""
        return wide(self.k.linear(hidden, self.lm_head)) * self.cfg.logit_scale

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [B] token ids -> [B, vocab] fp32: logit_scale * markov_w2 markov_w1[prev], the bias of the next draft
        row's logits given the token drafted (or the anchor) before it."""
        e = self.w["markov_head.markov_w1.weight"][prev].to(self.cfg.dtype)
        return wide(self._lin(e, "markov_head.markov_w2.weight")) * self.cfg.logit_scale


def _with_block(context: torch.Tensor, block: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """context [B, S, W] (row b valid up to start[b]), block [B, n, W] -> [B, S + n, W] with row b's block at
    start[b] .. start[b] + n - 1 (written over whatever the context buffer held there)."""
    b, s, w = context.shape
    n = block.shape[1]
    out = torch.cat([context.to(block.dtype), block.new_zeros(b, n, w)], dim=1)
    idx = (start.view(b, 1) + torch.arange(n, device=block.device).view(1, n)).unsqueeze(-1).expand(b, n, w)
    return out.scatter(1, idx, block)
