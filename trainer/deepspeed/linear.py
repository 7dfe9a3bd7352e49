"""The invariant linear for the DeepSpeed trainer: `parity.kernels.linear.linear_invariant`'s bits, but autograd keeps
the parameter, not a view of its ZeRO-3 gathered data.

Autograd through `linear_invariant` saves `w.t().expand(...)` for the backward: a view of the weight's storage. Under
ZeRO-3 that storage is the gathered copy, which DeepSpeed releases after the block's forward by swapping
`param.data`; a saved view keeps the gathered copy alive until the backward, so a forward would hold every weight of
the model at once (about ZeRO-2's peak). `TiledMatmul` saves the parameter object instead and reads `param.data` in
its backward, after ZeRO-3 has gathered the block again for its backward (what DeepSpeed does for `nn.Linear`).

Invariant: forward and backward have the bits of autograd through `linear_invariant`. The forward is its tiled fp32
GEMM; the backward runs the torch calls autograd runs for it (slice, pad, `bmm` against the same expanded weight, sum
over tiles, transpose) in fp32 and casts each gradient to its input's dtype (the backward of `linear_invariant`'s
upcast), so the gradients keep their bits. In a bf16 model the forward computes with its masters' bf16 roundings
(`parity.model.bf16_values`, fp32 tensors): those copies, not the parameters, are what a GEMM saves, so under ZeRO-3
a bf16 model holds one fp32 copy of each weight of a block from its forward to its backward
(`tests/test_trainer_backend.py::test_zero3_linear_saves_parameters_with_autograd_bits`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from parity.kernels import Kernels
from parity.kernels.linear import TILE_ROWS, LoRA, tiled_matmul, linear_invariant
from parity.kernels.primitives import wide
from parity.quant.mxfp4 import MXFP4Weight


class TiledMatmul(torch.autograd.Function):
    """x: [M, K], w: [N, K] (fp32 or bf16) -> x w^T [M, N] in fp32 (or float64) by `linear_invariant`'s tiled GEMM of
    the upcast operands, unrounded; saves (x, w) themselves."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        with torch.no_grad():
            return tiled_matmul(wide(x), wide(w))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x_in, w_in = ctx.saved_tensors
        x, w = wide(x_in), wide(w_in)
        m, k = x.shape
        n = w.shape[0]
        if m == 0:
            return (x.new_zeros(0, k) if ctx.needs_input_grad[0] else None), None
        pad = (-m) % TILE_ROWS
        tiles = (m + pad) // TILE_ROWS
        g = F.pad(grad, (0, 0, 0, pad)).view(tiles, TILE_ROWS, n)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = torch.bmm(g, w.t().expand(tiles, k, n).transpose(1, 2)).reshape(-1, k)[:m].to(x_in.dtype)
        if ctx.needs_input_grad[1]:
            x_tiles = F.pad(x, (0, 0, 0, pad)).view(tiles, TILE_ROWS, k)
            gw = torch.bmm(x_tiles.transpose(1, 2), g).sum(0, keepdim=True).view(k, n).t().to(w_in.dtype)
        return gx, gw


def linear_saving_parameters(x: torch.Tensor, w: torch.Tensor | MXFP4Weight, lora: LoRA | None = None) -> torch.Tensor:
    """`linear_invariant(x, w, lora)` (same composition, same bits) with every GEMM a `TiledMatmul`: the LoRA term and
    the sum in fp32, one rounding to x's dtype."""
    if isinstance(w, MXFP4Weight):  # packed weights have no gradient: nothing to save
        return linear_invariant(x, w, lora)
    lead = x.shape[:-1]
    x2 = wide(x.reshape(-1, x.shape[-1]))  # one upcast node, as in linear_invariant: its gradient is cast once
    y = TiledMatmul.apply(x2, w)
    if lora is not None:
        y = y + TiledMatmul.apply(TiledMatmul.apply(x2, lora.a), lora.b) * lora.scale
    return y.reshape(*lead, w.shape[0]).to(x.dtype)


def saving_parameters(kernels: Kernels) -> Kernels:
    """`kernels` with the invariant linear replaced by `linear_saving_parameters` (other kernel sets unchanged: `F.linear`
    already saves the parameter itself)."""
    if kernels.linear is not linear_invariant:
        return kernels
    return dataclasses.replace(kernels, linear=linear_saving_parameters)
