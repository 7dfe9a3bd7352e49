"""Gated activations of the K3 MLPs and experts: fp32 arithmetic, output in the inputs' dtype (fp32 or bf16).

SiTU-GLU: out = (b * tanh(gate / b) * sigmoid(gate)) * (c * tanh(up / c)), the up clip only when c is set
(vLLM `SituAndMul`; K3 uses b = 4, c = 25). SiLU-GLU: out = silu(gate) * up. Like vLLM's fused
activation-and-multiply kernels, bf16 inputs are upcast, the whole expression runs in fp32 and the product
is rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from parity.kernels.primitives import sigmoid, silu, wide


def situ_glu_invariant(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    gf, uf = wide(gate), wide(up)
    g = beta * torch.tanh(gf / beta) * sigmoid(gf)
    u = uf if linear_beta is None else linear_beta * torch.tanh(uf / linear_beta)
    return (g * u).to(gate.dtype)


def situ_glu_fast(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    gf, uf = wide(gate), wide(up)
    g = beta * torch.tanh(gf / beta) * torch.sigmoid(gf)
    u = uf if linear_beta is None else linear_beta * torch.tanh(uf / linear_beta)
    return (g * u).to(gate.dtype)


def silu_glu_invariant(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (silu(wide(gate)) * wide(up)).to(gate.dtype)


def silu_glu_fast(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(wide(gate)) * wide(up)).to(gate.dtype)
