"""Short causal depthwise convolution with carried state, then SiLU (KDA's q/k/v conv).

y_t = silu(sum_{j=0}^{W-1} w[:, j] * x_{t-W+1+j}), where x before the sequence start comes from the
carried state (zeros for a new sequence). The invariant form adds the W products in the order j = 0..W-1
with plain element-wise ops, so a token's output depends only on its own W inputs. Products, sums and the
SiLU run in fp32 (the conv weights are fp32); the output is rounded to x's dtype, and the carried state
holds the inputs in x's dtype (bf16 inputs stay exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parity.kernels.primitives import silu, wide


def _window(x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """x: [B, T, D], state: [B, W-1, D] -> [B, T+W-1, D] (state first)."""
    return torch.cat([state.to(x.dtype), x], dim=1)


def short_conv_invariant(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, T, D] fp32 or bf16, w: [D, W] fp32, state: [B, W-1, D] -> (y [B, T, D], new state [B, W-1, D]),
    both in x's dtype.

    The new state holds the last W-1 inputs (state rows first when T < W-1); padded tokens must be
    handled by the caller (pass only valid tokens, or pass T = 0).
    """
    width = w.shape[1]
    t = x.shape[1]
    xx = _window(x, state)
    xf, wf = wide(xx), wide(w)
    acc = xf[:, 0:t] * wf[:, 0]
    for j in range(1, width):
        acc = acc + xf[:, j : j + t] * wf[:, j]
    return silu(acc).to(x.dtype), xx[:, t:]


def short_conv_fast(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same function through `F.conv1d` (depthwise)."""
    t = x.shape[1]
    xx = _window(x, state)
    y = F.conv1d(wide(xx).transpose(1, 2), wide(w).unsqueeze(1), groups=w.shape[0]).transpose(1, 2)
    return F.silu(y).to(x.dtype), xx[:, t:]
