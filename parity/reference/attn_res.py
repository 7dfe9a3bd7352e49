"""Float64 reference of Attention Residuals (AttnRes), in vLLM's representation.

The residual stream is a list of sources: the token embedding, then one sum per finished block of
`attn_res_block_size` layers (the sum of that block's attention and MLP outputs, not a running total), then the
partial sum of the current block. Before every sub-layer the input is a softmax mix of the sources,

    mix = sum_i softmax_i(w_proj . RMSNorm_res(s_i)) s_i          (raw sources mixed, normalised only to score)

followed by the layer's own RMSNorm (input_layernorm before attention, post_attention_layernorm before the MLP).
The model output is the same mix with `output_attn_res_norm/proj` and no norm; `norm` follows in the LM head.

vLLM keeps the sources as `prefix` (the current partial sum), `delta` (the last sub-layer output, not yet added)
and `blocks` (the finished sources, written at the first layer of each block); `AttnResStream` replays
`KimiDecoderLayer._pre_attn_norm/_post_attn_norm` and `KimiLinearModel.forward` on that state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parity.reference.ops import rms_norm


def attn_res_mix(sources: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    """mix = sum_i softmax_i(w_proj . RMSNorm(s_i)) s_i, per token.

    sources: [S, T, D] f64, norm_weight: [D] f64, proj_weight: [D] f64 -> [T, D] f64.
    """
    scores = rms_norm(sources, norm_weight, eps) @ proj_weight  # [S, T]
    return torch.einsum("st,std->td", torch.softmax(scores, dim=0), sources)


def attn_res(
    prefix: Tensor,
    delta: Tensor | None,
    blocks: Tensor,
    norm_weight: Tensor,
    proj_weight: Tensor,
    output_norm_weight: Tensor | None,
    num_blocks: int,
    block_write_idx: int,
    eps: float,
    output_norm_eps: float,
) -> tuple[Tensor, Tensor]:
    """vLLM's `attn_res` op: prefix += delta; blocks[block_write_idx] = prefix (if >= 0);
    out = RMSNorm_out(mix(blocks[:num_blocks] ++ [prefix])) (no norm when output_norm_weight is None).

    prefix, delta: [T, D] f64, blocks: [B, T, D] f64 (written in place) -> (out [T, D] f64, new prefix [T, D] f64).
    With num_blocks = 0 the softmax has one source and the mix is the prefix itself.
    """
    if delta is not None:
        prefix = prefix + delta
    if block_write_idx >= 0:
        blocks[block_write_idx] = prefix
    mixed = attn_res_mix(torch.cat([blocks[:num_blocks], prefix[None]]), norm_weight, proj_weight, eps)
    out = mixed if output_norm_weight is None else rms_norm(mixed, output_norm_weight, output_norm_eps)
    return out, prefix


class AttnResStream:
    """The AttnRes residual stream of one sequence through the decoder layers, as vLLM carries it.

    Call `before_attn(i)`, `before_mlp(i, attn_out)`, `after_mlp(mlp_out)` for i = 0..L-1, then `output()`.
    """

    def __init__(self, embed: Tensor, block_size: int, num_blocks: int, eps: float) -> None:
        """embed: [T, D] f64; num_blocks = ceil(L / block_size) source slots; eps of every AttnRes RMSNorm."""
        self.block_size = block_size
        self.eps = eps
        self.prefix = embed
        self.delta: Tensor | None = None
        self.blocks = embed.new_zeros(num_blocks, *embed.shape)

    def before_attn(self, layer: int, res_norm: Tensor, res_proj: Tensor, input_norm: Tensor) -> Tensor:
        """Input of layer `layer`'s attention: adds the pending MLP output; a block's first layer files the
        finished block as a source. Sources: blocks 0..ceil(layer / bs) - 1 and the prefix."""
        first_of_block = layer % self.block_size == 0
        out, self.prefix = attn_res(
            self.prefix, self.delta, self.blocks, res_norm, res_proj, input_norm,
            num_blocks=-(-layer // self.block_size),
            block_write_idx=layer // self.block_size if first_of_block else -1,
            eps=self.eps, output_norm_eps=self.eps,
        )
        self.delta = None
        return out

    def before_mlp(self, layer: int, attn_out: Tensor, res_norm: Tensor, res_proj: Tensor, post_norm: Tensor) -> Tensor:
        """Input of layer `layer`'s MLP: a block's first layer starts the partial sum with its attention output,
        other layers add it to the partial sum."""
        first_of_block = layer % self.block_size == 0
        prefix, delta = (attn_out, None) if first_of_block else (self.prefix, attn_out)
        out, self.prefix = attn_res(
            prefix, delta, self.blocks, res_norm, res_proj, post_norm,
            num_blocks=-(-layer // self.block_size) + first_of_block,
            block_write_idx=-1, eps=self.eps, output_norm_eps=self.eps,
        )
        return out

    def after_mlp(self, mlp_out: Tensor) -> None:
        """The MLP output stays pending until the next sub-layer (or the output mix) adds it."""
        self.delta = mlp_out

    def output(self, res_norm: Tensor, res_proj: Tensor) -> Tensor:
        """Final hidden state (before `norm`): the mix over every block source and the last partial sum."""
        out, self.prefix = attn_res(
            self.prefix, self.delta, self.blocks, res_norm, res_proj, None,
            num_blocks=self.blocks.shape[0], block_write_idx=-1, eps=self.eps, output_norm_eps=0.0,
        )
        self.delta = None
        return out
