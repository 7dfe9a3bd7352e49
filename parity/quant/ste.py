"""The straight-through estimator: a rounding in the forward, the identity in the backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rounding: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return rounding(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def straight_through(x: torch.Tensor, rounding: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`rounding(x)` (same shape and dtype as x) in the forward; x's gradient is the output's, unrounded (the
    quantisation-aware training rule: a master weight's gradient never passes through the rounding)."""
    return _StraightThrough.apply(x, rounding)
