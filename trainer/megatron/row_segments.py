"""A row-parallel projection on the Triton kernels at 1 / TP of its GEMM FLOPs, with the one-process bits.

The Triton GEMM of a row-parallel weight adds S = `parity.kernels.linear.k_segments(K)` equal K segments in order
(`parity.kernels.triton.linear`), and TP divides S (`trainer.megatron.sharding.check_divisible`), so this rank's K / TP
input features are S / TP whole segments. Each rank forms only its segments' fp32 sums (`segment_sums`, under the
whole GEMM's tile configuration), the sums are all-gathered in rank order (which is segment order), and every rank adds
all S in order, with the LoRA epilogue, and rounds once (`combine_segments`): the bits of one process's
`linear(x, W, lora, segments=S)`. A LoRA's t = x A^T is a reduction over the same K: its A columns are split and
combined the same way (rounded to the GEMM's dtype, as one process stores t), then B applies on every rank.

Communication per call: each rank receives (TP - 1) / TP * S * M * N fp32 sums (and as many of t's, [M, R]), where
Megatron's all-reduce of a bf16 output moves 2 (TP - 1) / TP * M * N * 2 bytes. Adding the sums in order as they pass
from rank to rank (a chained scan: each rank receives one running total) would move M * N * 4 per rank; not built.

Gradients: the output is used whole on every rank, so each rank gets the whole gradient g of it, and its shard's
gradients are the one-process linear's restricted to its columns: dX_r = g W_r (+ dt A_r), dW_r = g^T X_r,
dA_r = dt^T X_r, dB = scale g^T t (`parity.kernels.triton.linear_grad.linear_grads`); nothing is communicated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from parity.kernels.linear import LoRA
from parity.kernels.triton.linear import combine_segments, gemm_config, gemm_operand, segment_sums
from parity.kernels.triton.linear_grad import linear_grads


def _gathered(parts: torch.Tensor, tp: int, group: Any) -> torch.Tensor:
    """[S / TP, M, N] of every TP rank -> [S, M, N] in rank order."""
    out = parts.new_empty(parts.shape[0] * tp, *parts.shape[1:])
    dist.all_gather_into_tensor(out, parts.contiguous(), group=group)
    return out


def _reduced(x: torch.Tensor, w: torch.Tensor, segments: int, tp: int, group: Any, out_dtype: torch.dtype,
             lora_t: torch.Tensor | None = None, lora_b: torch.Tensor | None = None, scale: float = 0.0
             ) -> torch.Tensor:
    """x: [M, K / TP], w: [N, K / TP] in one GEMM dtype -> the whole [M, N] reduction over K in `segments` segments
    (+ the LoRA epilogue), as one process's Triton GEMM forms it."""
    m, k_local = x.shape
    cfg = gemm_config(w.shape[0], k_local * tp, x.dtype, m)
    parts = segment_sums(x, w.contiguous(), k_local * tp // segments, cfg)
    return combine_segments(_gathered(parts, tp, group), out_dtype, cfg, lora_t, lora_b, scale)


class _RowSegments(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, a: torch.Tensor | None, b: torch.Tensor | None,
                scale: float, segments: int, tp: int, group: Any) -> torch.Tensor:
        wd, dtype = gemm_operand(x, w)
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        t = None
        if a is not None:
            t = _reduced(x2, a.to(dtype), segments, tp, group, dtype)
        y = _reduced(x2, wd, segments, tp, group, dtype, t, None if b is None else b.to(dtype), scale)
        ctx.dtype, ctx.scale = dtype, scale
        ctx.save_for_backward(x, w, a, b, t)
        return y.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, a, b, t = ctx.saved_tensors
        if x.numel() == 0:  # no rows: every gradient is zero
            zero = [None if v is None else torch.zeros_like(v) for v in (x, w, a, b)]
            return (*zero, None, None, None, None)
        dtype = ctx.dtype
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        g2 = g.reshape(-1, g.shape[-1]).to(dtype)
        dx, dw, da, db = linear_grads(x2, w, a, b, ctx.scale, t, g2, dtype, tuple(ctx.needs_input_grad[:4]))
        if dx is not None:
            dx = dx.to(x.dtype).reshape(x.shape)
        return dx, dw, da, db, None, None, None, None


def row_segments(x: torch.Tensor, w: torch.Tensor, lora: LoRA | None, segments: int, tp: int, group: Any
                 ) -> torch.Tensor:
    """This rank's share x: [..., K / TP] of a row-parallel projection with its weight shard w: [N, K / TP] (and the
    LoRA's A columns lora.a: [R, K / TP], B whole) -> the whole [..., N] on every rank, bitwise the one-process
    `linear(x, W, lora, segments)` of the Triton kernels; differentiable (module docstring)."""
    a, b, scale = (lora.a, lora.b, lora.scale) if lora is not None else (None, None, 0.0)
    return _RowSegments.apply(x, w, a, b, scale, segments, tp, group)
