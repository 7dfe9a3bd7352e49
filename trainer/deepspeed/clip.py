"""Gradient-norm clipping for the DeepSpeed trainer with megatron-core 0.16.1's arithmetic, at every ZeRO stage.

DeepSpeed's own clipping (`gradient_clipping`) sums squared norms per partition and scales by
`1 / (((norm + 1e-6) / clip))`; Megatron's fp32 optimizer (`megatron/core/optimizer/clip_grads.py` with the
torch fallbacks of `megatron/core/utils.py`, what runs without Apex or Transformer Engine) computes
`torch.norm` of each whole gradient, `torch.norm` of those norms, squares it in fp32, takes the square root in
Python and multiplies every gradient by `clip / (norm + 1e-6)` when that is below 1. Both are "clip to norm 1";
their bits differ. The DeepSpeed trainer turns DeepSpeed's clipping off and runs this module between
`engine.backward` and `engine.step`, so the clipped gradients, and with them the Adam update, are Megatron's.

Invariants:
- each per-parameter norm is taken over the whole, data-parallel-averaged gradient (ZeRO-3: all-gathered one
  parameter at a time; ZeRO-1/2: assembled from the partitions), so it does not depend on the partitioning;
- the norms are combined in Megatron's order: its optimizer groups put multi-dimensional parameters first and
  1-D parameters (its `wd_mult = 0` group) second, each in module order (`grad_norm_order`), and the module
  orders agree because both models name their parameters by the official checkpoint names;
- scaling multiplies each element once by the same fp32 factor, so scaling a partition gives the bits of
  scaling the whole gradient.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from deepspeed.utils import safe_get_full_grad, safe_get_local_grad, safe_set_full_grad, safe_set_local_grad
from torch import nn


def grad_norm_order(params: Iterable[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters in Megatron's optimizer-group order: multi-dimensional first, then 1-D (the group
    `get_megatron_optimizer` gives `wd_mult = 0`), module order inside each group."""
    trainable = [(n, p) for n, p in params if p.requires_grad]
    shape = [len(getattr(p, "ds_shape", p.shape)) for _, p in trainable]
    return [t for t, d in zip(trainable, shape) if d != 1] + [t for t, d in zip(trainable, shape) if d == 1]


def megatron_grad_norm(per_tensor: list[torch.Tensor]) -> float:
    """megatron-core's `get_grad_norm_fp32` (L2, `local_multi_tensor_l2_norm`) on one model-parallel rank, from
    the per-gradient norms `torch.norm(g)` in Megatron's order: torch.norm of those norms, squared in fp32,
    square root in Python."""
    l2 = torch.norm(torch.tensor([per_tensor]))
    squared = torch.tensor([float(l2)], dtype=torch.float) ** 2.0
    return squared.item() ** 0.5


def clip_coefficient(max_norm: float, total_norm: float) -> float:
    """megatron-core's `clip_grad_by_total_norm_fp32` factor; gradients are scaled only when it is below 1."""
    return max_norm / (total_norm + 1.0e-6)


def clip_grads(ordered: list[tuple[str, nn.Parameter]], max_norm: float) -> float:
    """Megatron's grad norm of the reduced, not yet stepped DeepSpeed gradients of `ordered`, and Megatron's
    clipping of them in place when `max_norm > 0`. Collective: every data-parallel rank calls it with the same
    list. Holds one whole gradient at a time. Returns the norm before clipping."""
    norm = megatron_grad_norm([torch.norm(safe_get_full_grad(p)) for _, p in ordered])
    coeff = clip_coefficient(max_norm, norm)
    if max_norm > 0.0 and coeff < 1.0:
        for _, p in ordered:
            if hasattr(p, "ds_id"):  # ZeRO-3: scale this rank's partition
                safe_set_local_grad(p, safe_get_local_grad(p) * coeff)
            else:  # ZeRO-1/2: the API takes the whole gradient and keeps this rank's fragment
                safe_set_full_grad(p, safe_get_full_grad(p) * coeff)
    return norm
