"""Gated activations of the K3 MLPs and experts, fp32.

SiTU-GLU: out = (b * tanh(gate / b) * sigmoid(gate)) * (c * tanh(up / c)), the up clip only when c is set
(vLLM `SituAndMul`; K3 uses b = 4, c = 25). SiLU-GLU: out = silu(gate) * up.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parity.kernels.primitives import sigmoid, silu


def situ_glu_invariant(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    g = beta * torch.tanh(gate / beta) * sigmoid(gate)
    u = up if linear_beta is None else linear_beta * torch.tanh(up / linear_beta)
    return g * u


def situ_glu_fast(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    g = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    u = up if linear_beta is None else linear_beta * torch.tanh(up / linear_beta)
    return g * u


def silu_glu_invariant(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu(gate) * up


def silu_glu_fast(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
