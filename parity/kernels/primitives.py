"""Element-wise and reduction primitives whose per-element bits never depend on tensor layout.

On CPU, ATen evaluates an element-wise op with a SIMD loop plus a scalar tail loop. For `exp`, `log`,
`log1p`, `expm1`, `tanh`, `sqrt` and `rsqrt` both loops give the same bits (observed, not guaranteed:
`test_primitives_are_layout_invariant` in tests/invariance/test_kernels.py on every ATen SIMD level the host has,
and `zerokl parity kernels` on any machine); for `sigmoid`, `silu` and `softplus` they do
not (about 5% of values differ by an ulp between a lone element and the same element inside a large
tensor). So the invariant kernels build those from the safe set with IEEE-exact `+ - * /`.

Reductions: `torch.sum` picks its vectorisation (and so its summation order) from the tensor's shape.
`tree_sum` instead adds halves pairwise in one fixed order, with zero padding to a power of two
(adding exact zeros changes nothing), so a row's sum is the same whatever else is in the tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    e = torch.exp(-x.abs())
    return torch.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


class _Sigmoid(torch.autograd.Function):
    """The invariant sigmoid; backward g * s * (1 - s) from the saved output alone."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        s = _sigmoid(x)
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (s,) = ctx.saved_tensors
        return grad * s * (1.0 - s)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) from layout-invariant primitives, via e = exp(-|x|) so that neither the value
    nor its gradient overflows: 1 / (1 + e) for x >= 0, e / (1 + e) below. Under autograd it saves only its output."""
    if needs_grad(x):
        return _Sigmoid.apply(x)
    return _sigmoid(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x)."""
    return x * sigmoid(x)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """log(1 + exp(x)), linear above `threshold` (as torch and the KDA gate kernels do)."""
    return torch.where(x > threshold, x, torch.log1p(torch.exp(torch.clamp(x, max=threshold))))


def _tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`tree_sum`'s halvings: zero padding to a power of two, then halves added pairwise in one fixed order."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


class _TreeSum(torch.autograd.Function):
    """`_tree_sum` with its exact gradient in one view: every input element enters the sum once with weight 1, so its
    gradient is the row's gradient itself (what autograd through the halvings gives, one slice and one add of zeros
    per halving, bit for bit up to the sign of a zero), broadcast over `dim`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.shape, ctx.dim = x.shape, dim % x.dim()
        return _tree_sum(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.unsqueeze(ctx.dim).expand(ctx.shape), None


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` by fixed pairwise halving; the result for one row depends on that row only. Under autograd its
    backward is one broadcast (`_TreeSum`), not the halvings' slices."""
    if needs_grad(x):
        return _TreeSum.apply(x, dim)
    return _tree_sum(x, dim)


def needs_grad(*xs: torch.Tensor) -> bool:
    """A gradient is being recorded and one of `xs` asks for one: an op then takes its `autograd.Function` path."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def wide(x: torch.Tensor) -> torch.Tensor:
    """x in the dtype the arithmetic runs in: bf16 (and fp16) upcast to fp32, exactly; fp32 and float64 as they are."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
