"""megatron-core 0.16.1's gradient norm and clipping kept on the GPU: no read back to the host inside a step.

Megatron computes the norm for clipping as a Python float (`clip_grads.get_grad_norm_fp32`: `total_norm.item()`;
without Apex, its local `multi_tensor_l2_norm` also builds a host tensor from every gradient's norm, one read back per
parameter) and clips only when the coefficient is below one (`clip_grad_by_total_norm_fp32`: a host-side `if`).
On CUDA `apply()` replaces both names where `megatron.core.optimizer.optimizer` imported them:
- the norm: every gradient's L2 norm in one `torch._foreach_norm`, their L2 norm, squared and summed over the
  statistics group as Megatron does, the square root in float64 (Megatron's `.item() ** 0.5`), returned as a 0-d
  float64 CUDA tensor (the optimizer step returns it; the trainer reads it once the step is queued);
- the clip: every gradient times min(1, max_norm / (norm + 1e-6)) in fp32 (multiplying by 1 is exact, so an
  unclipped step keeps its gradient bits).
Both are deterministic (fixed reductions for fixed shapes). Gradients on the CPU, and norms other than L2, go to
Megatron's own functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

from parity.patching import install, require

WRITTEN_FOR = ("0.16.1",)  # the megatron-core release whose clip_grads.py these replace
MARK = "trainer.megatron.device_norm"


def grad_norm(grads: list[torch.Tensor], group: Any = None) -> torch.Tensor:
    """The L2 norm of `grads` together, over `group`'s ranks: a 0-d float64 tensor on their device (nothing read
    back). Megatron's arithmetic: fp32 norms, the square summed over the group, the root in float64."""
    data_group = None
    for g in grads:
        data_group = get_data_parallel_group_if_dtensor(g, data_group)
    grads = [to_local_if_dtensor(g) for g in grads]
    device = grads[0].device if grads else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else torch.zeros((), device=device)
    total = (norm.float() ** 2).reshape(1)
    if data_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=data_group)
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.double().sqrt()[0]


def clip_grads(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """grads *= min(1, max_norm / (total_norm + 1e-6)) in place, the factor rounded to fp32 (Megatron's)."""
    if grads:
        torch._foreach_mul_(grads, (max_norm / (total_norm + 1.0e-6)).clamp(max=1.0).float())


def _norm_on_device(original: Callable) -> Callable:
    def get_grad_norm_fp32(grads_for_norm: Any, norm_type: float = 2, grad_stats_parallel_group: Any = None) -> Any:
        grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else list(grads_for_norm)
        if float(norm_type) != 2.0 or not all(to_local_if_dtensor(g).is_cuda for g in grads):
            return original(grads_for_norm, norm_type, grad_stats_parallel_group)
        return grad_norm(grads, grad_stats_parallel_group)

    return get_grad_norm_fp32


def _clip_on_device(original: Callable) -> Callable:
    def clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: Any,
                                     use_decoupled_grad: bool = False) -> None:
        if not isinstance(total_norm, torch.Tensor):
            return original(parameters, max_norm, total_norm, use_decoupled_grad)
        params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [to_local_if_dtensor(getattr(p, attr)).detach() for p in params if getattr(p, attr, None) is not None]
        clip_grads(grads, max_norm, total_norm)

    return clip_grad_by_total_norm_fp32


def apply() -> None:
    """Install both replacements (idempotent) after checking the installed megatron-core is the release they were
    written for."""
    from megatron.core import __version__

    require("megatron-core", __version__, WRITTEN_FOR, MARK)
    install(f"{megatron_optimizer.__name__}:get_grad_norm_fp32", _norm_on_device, MARK)
    install(f"{megatron_optimizer.__name__}:clip_grad_by_total_norm_fp32", _clip_on_device, MARK)
