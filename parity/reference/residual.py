"""Float64 reference of the plain pre-norm residual stream (configs without `attn_res_block_size`: Kimi Linear).

    h_i  = x_i + attn_i(RMSNorm_input(x_i))
    x_i+1 = h_i + mlp_i(RMSNorm_post(h_i))          x_0 = embedding;  model output = x_L (before `norm`)

as vLLM's `KimiDecoderLayer` computes it without AttnRes (its fused add-then-norm) and as transformers'
`KimiLinearDecoderLayer` writes it. Same call sequence as `AttnResStream`, without the scorer weights.
"""

from __future__ import annotations

from torch import Tensor

from parity.reference.ops import rms_norm


class ResidualStream:
    """The residual stream of one sequence. Call `before_attn`, `before_mlp`, `after_mlp` per layer, then `output`."""

    def __init__(self, embed: Tensor, eps: float) -> None:
        """embed: [T, D] f64; eps of the layers' RMSNorms."""
        self.eps = eps
        self.residual = embed

    def before_attn(self, input_norm: Tensor) -> Tensor:
        """Attention input: RMSNorm_input of the stream.  -> [T, D] f64."""
        return rms_norm(self.residual, input_norm, self.eps)

    def before_mlp(self, attn_out: Tensor, post_norm: Tensor) -> Tensor:
        """Adds the attention output to the stream; MLP input: RMSNorm_post of the sum.  -> [T, D] f64."""
        self.residual = self.residual + attn_out
        return rms_norm(self.residual, post_norm, self.eps)

    def after_mlp(self, mlp_out: Tensor) -> Tensor:
        """Adds the MLP output; returns the stream after the layer (transformers' per-layer hidden state)."""
        self.residual = self.residual + mlp_out
        return self.residual

    def output(self) -> Tensor:
        """Final hidden state before `norm`: the stream after the last layer.  -> [T, D] f64."""
        return self.residual
