"""bf16 values held in a wider tensor: the mark a trainer's rounded fp32 master carries into the kernels.

A trainer keeps fp32 masters and computes with their bf16 values (`parity.model.bf16_values`, MXFP4 fake
quantisation); the rollout engine holds the same values as bf16 tensors. A GEMM kernel whose bf16 path differs from
its fp32 path (the Triton GEMM's bf16 dots) must take such a master as the bf16 operand it equals. Checking the
values would cost a pass and a host sync per GEMM, so the function that rounds marks its output instead.

Invariant: a tensor is marked only by a function whose every output value is a bf16 value. A view or a copy made
later is not marked (it reads as the wider tensor it is: still correct, only not the bf16 path).
"""

from __future__ import annotations

import torch

_MARK = "_holds_bf16_values"


def mark_bf16_valued(t: torch.Tensor) -> torch.Tensor:
    """`t` marked as holding only bf16 values (the caller guarantees it); returns `t`."""
    setattr(t, _MARK, True)
    return t


def holds_bf16_values(t: torch.Tensor) -> bool:
    """`t` is bf16, or a wider tensor marked by `mark_bf16_valued`."""
    return t.dtype == torch.bfloat16 or getattr(t, _MARK, False)
