"""Gated activations of the K3 MLPs and experts: fp32 arithmetic, output in the inputs' dtype (fp32 or bf16).

SiTU-GLU: out = (b * tanh(gate / b) * sigmoid(gate)) * (c * tanh(up / c)), the up clip only when c is set
(vLLM `SituAndMul`; K3 uses b = 4, c = 25). SiLU-GLU: out = silu(gate) * up. Like vLLM's fused
activation-and-multiply kernels, bf16 inputs are upcast, the whole expression runs in fp32 and the product
is rounded once. Under autograd the invariant ones save only their two inputs; their backward is plain fp32 torch
(exact to rounding, not invariant).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from parity.kernels.primitives import needs_grad, sigmoid, silu, wide


def _situ(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    gf, uf = wide(gate), wide(up)
    g = beta * torch.tanh(gf / beta) * sigmoid(gf)
    u = uf if linear_beta is None else linear_beta * torch.tanh(uf / linear_beta)
    return g * u


def _silu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu(wide(gate)) * wide(up)


class _GLU(torch.autograd.Function):
    """An invariant gated activation (fp32, rounded once); backward from the saved inputs alone, in fp32 with plain
    torch ops (`beta` None: SiLU-GLU, else SiTU-GLU)."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, beta: float | None,
                linear_beta: float | None) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.beta, ctx.linear_beta = beta, linear_beta
        out = _silu(gate, up) if beta is None else _situ(gate, up, beta, linear_beta)
        return out.to(gate.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up = ctx.saved_tensors
        gf, uf, g_out = wide(gate), wide(up), wide(grad)
        s = torch.sigmoid(gf)
        if ctx.beta is None:
            g, dg = gf * s, s * (1.0 + gf * (1.0 - s))
        else:
            t = torch.tanh(gf / ctx.beta)
            g, dg = ctx.beta * t * s, (1.0 - t * t) * s + ctx.beta * t * s * (1.0 - s)
        if ctx.beta is None or ctx.linear_beta is None:
            u, du = uf, torch.ones_like(uf)
        else:
            tu = torch.tanh(uf / ctx.linear_beta)
            u, du = ctx.linear_beta * tu, 1.0 - tu * tu
        return (g_out * u * dg).to(gate.dtype), (g_out * g * du).to(up.dtype), None, None


def _glu(gate: torch.Tensor, up: torch.Tensor, beta: float | None, linear_beta: float | None) -> torch.Tensor:
    if needs_grad(gate, up):
        return _GLU.apply(gate, up, beta, linear_beta)
    out = _silu(gate, up) if beta is None else _situ(gate, up, beta, linear_beta)
    return out.to(gate.dtype)


def situ_glu_invariant(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    return _glu(gate, up, beta, linear_beta)


def situ_glu_fast(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    gf, uf = wide(gate), wide(up)
    g = beta * torch.tanh(gf / beta) * torch.sigmoid(gf)
    u = uf if linear_beta is None else linear_beta * torch.tanh(uf / linear_beta)
    return (g * u).to(gate.dtype)


def silu_glu_invariant(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _glu(gate, up, None, None)


def silu_glu_fast(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(wide(gate)) * wide(up)).to(gate.dtype)
