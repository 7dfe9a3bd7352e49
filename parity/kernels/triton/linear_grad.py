"""The Triton linear's gradient: dX and dW as more GEMMs of the same machinery (`linear.matmul`), reading the saved
inputs (the forward is never run again).

For y = x W^T + scale (x A^T) B^T (`linear.linear`; t = x A^T is stored in the GEMM's dtype, as the forward has it)
and g = d loss / d y, in the dtype the forward's GEMM ran in (`linear.gemm_operand`: bf16 for bf16 activations on a
bf16 weight or on a trainer's master of bf16 values, else fp32):
dX = g W + dt A with dt = scale (g B) (rounded to that dtype, the operand of the next GEMM), dW = g^T x,
dA = dt^T x, dB = scale (g^T t). Each GEMM accumulates in fp32 and rounds once; gradients of fp32 masters stay fp32.

Invariant: deterministic. Each GEMM reduces over fixed K segments in order (`linear.segment_layout`), dW's over the
batch's rows, so the same inputs give the same gradient bits on every run; nothing is read back to the host. Not
batch invariant (dW sums over the batch), which a gradient need not be.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.kernels.linear import LoRA
from parity.kernels.primitives import needs_grad
from parity.kernels.triton.linear import gemm_operand, linear, matmul
from parity.quant.mxfp4 import MXFP4Weight


def _rows(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """t^T as a row-major matrix in `dtype` (t's own if None), in one copy (the tensor-descriptor path of `matmul`
    reads contiguous rows)."""
    return torch.empty(t.shape[1], t.shape[0], dtype=dtype or t.dtype, device=t.device).copy_(t.t())


def linear_grads(x: torch.Tensor, w: torch.Tensor | MXFP4Weight, a: torch.Tensor | None, b: torch.Tensor | None,
                 scale: float, t: torch.Tensor | None, g: torch.Tensor, dtype: torch.dtype,
                 needs: tuple[bool, bool, bool, bool]) -> tuple[torch.Tensor | None, ...]:
    """(dX, dW, dA, dB) of y = x W^T + scale t B^T, t = x A^T (the forward's t, in `dtype`), for g = d loss / d y;
    x: [M, K], g: [M, N], both already in `dtype` (the forward GEMM's); `needs`: which of the four to form. dX is
    in `dtype`, dW / dA / dB in their parameter's dtype."""
    f32 = torch.float32
    need_x, need_w, need_a, need_b = needs
    dx = None
    if need_x:
        wt = _rows(w.dequantize(dtype) if isinstance(w, MXFP4Weight) else w, dtype)
        dx = matmul(g, wt, out_dtype=f32 if a is not None else dtype)
    dw = matmul(_rows(g), _rows(x), out_dtype=f32).to(w.dtype) if need_w else None
    da = db = None
    if a is not None:
        ad, bd = a.to(dtype).contiguous(), b.to(dtype)
        dt = (matmul(g, _rows(bd), out_dtype=f32) * scale).to(dtype)  # [M, R]
        if need_x:
            dx = (dx + matmul(dt, _rows(ad), out_dtype=f32)).to(dtype)
        if need_a:
            da = matmul(_rows(dt), _rows(x), out_dtype=f32).to(a.dtype)
        if need_b:
            db = (matmul(_rows(g), _rows(t), out_dtype=f32) * scale).to(b.dtype)
    return dx, dw, da, db


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor | MXFP4Weight, a: torch.Tensor | None,
                b: torch.Tensor | None, scale: float, segments: int) -> torch.Tensor:
        lora = None if a is None else LoRA(a, b, scale)
        ctx.dtype = gemm_operand(x, w)[1]
        ctx.packed = w if isinstance(w, MXFP4Weight) else None
        ctx.scale, ctx.segments = scale, segments
        ctx.save_for_backward(x, None if ctx.packed else w, a, b)
        return linear(x, w, lora, segments)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, a, b = ctx.saved_tensors
        if x.numel() == 0:  # no rows: every gradient is zero
            return (torch.zeros_like(x), None if w is None else torch.zeros_like(w),
                    None if a is None else torch.zeros_like(a), None if b is None else torch.zeros_like(b), None, None)
        dtype = ctx.dtype
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        g2 = g.reshape(-1, g.shape[-1]).to(dtype)
        t = None
        if a is not None and ctx.needs_input_grad[3]:  # the forward's t, in the GEMM's dtype
            t = matmul(x2, a.to(dtype).contiguous(), segments=ctx.segments if ctx.segments > 1 else None)
        dx, dw, da, db = linear_grads(x2, ctx.packed if ctx.packed is not None else w, a, b, ctx.scale, t, g2, dtype,
                                      tuple(ctx.needs_input_grad[:4]))
        if dx is not None:
            dx = dx.to(x.dtype).reshape(x.shape)
        return dx, dw, da, db, None, None


def linear_trainable(x: torch.Tensor, w: torch.Tensor | MXFP4Weight, lora: LoRA | None = None,
                     segments: int = 1) -> torch.Tensor:
    """`linear.linear` (its signature and forward bits), differentiable through `_Linear`'s GEMMs when a gradient
    is recorded."""
    tensors = [x] + ([w] if isinstance(w, torch.Tensor) else []) + ([lora.a, lora.b] if lora is not None else [])
    if not needs_grad(*tensors):
        return linear(x, w, lora, segments)
    a, b, scale = (lora.a, lora.b, lora.scale) if lora is not None else (None, None, 0.0)
    return _Linear.apply(x, w, a, b, scale, segments)
