"""Float64 reference primitives shared by the K3 reference blocks (norms, activations, short conv).

Every function is the plain formula, written for reading, never for speed. Shapes in the docstrings use
T = tokens, D = feature width; all tensors are float64 unless stated.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from parity.config import TextConfig

GLU = Callable[[Tensor, Tensor], Tensor]
"""A gated activation `act(gate, up) -> out`, all [..., I] f64."""


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """y = x W^T.  x: [..., in] f64, weight: [out, in] f64 -> [..., out] f64."""
    return x @ weight.T


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """y = x / sqrt(mean(x^2) + eps) * w over the last dim (vLLM `RMSNorm`: weight used as is, not 1 + w).

    x: [..., D] f64, weight: [D] f64 or None (no affine) -> [..., D] f64.
    """
    y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def l2_norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """y = x / sqrt(sum(x^2) + eps) over the last dim (fla `l2norm_fwd`: eps inside the root, not a clamp)."""
    return x / torch.sqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps)


def situ(gate: Tensor, up: Tensor, beta: float, linear_beta: float | None) -> Tensor:
    """SiTU GLU: b tanh(gate / b) sigmoid(gate) * up', up' = c tanh(up / c) if c is set else up.

    b = `activation_situ_beta`, c = `activation_situ_linear_beta` (vLLM `SituAndMul`). gate, up: [..., I] f64.
    """
    g = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    u = up if linear_beta is None else linear_beta * torch.tanh(up / linear_beta)
    return g * u


def silu_glu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU: silu(gate) * up (vLLM `SiluAndMul`)."""
    return F.silu(gate) * up


def glu_activation(cfg: TextConfig) -> GLU:
    """The config's gated activation; vLLM's `KimiMLP` uses b = `activation_situ_beta or 1.0`."""
    if cfg.hidden_act == "situ":
        beta = cfg.situ_beta or 1.0
        return lambda gate, up: situ(gate, up, beta, cfg.situ_linear_beta)
    return silu_glu


def gated_mlp(x: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, act: GLU) -> Tensor:
    """y = W_down act(W_gate x, W_up x).  x: [T, D] f64, w_gate/w_up: [I, D], w_down: [D, I] -> [T, D] f64."""
    return linear(act(linear(x, w_gate), linear(x, w_up)), w_down)


def causal_conv_silu(x: Tensor, weight: Tensor) -> Tensor:
    """Short causal depthwise conv then SiLU: y_t = silu(sum_i w[:, i] * x_{t - W + 1 + i}), x_{<0} = 0.

    The last tap multiplies the current token (vLLM `causal_conv1d_fn`, no bias, fresh sequence).
    x: [T, C] f64, weight: [C, 1, W] f64 (checkpoint layout) -> [T, C] f64.
    """
    w = weight[:, 0, :]  # [C, W]
    width = w.shape[1]
    padded = torch.cat([x.new_zeros(width - 1, x.shape[1]), x])  # [W - 1 + T, C]
    out = torch.zeros_like(x)
    for i in range(width):
        out = out + w[:, i] * padded[i : i + x.shape[0]]
    return F.silu(out)
