"""megatron-core 0.16.1 on a host without a GPU: the CUDA-assuming spots the K3 trainer's code path hits.

Megatron allocates some buffers with `device=torch.cuda.current_device()` or a literal `device='cuda'`, and
one assert checks a gradient's legacy type name `torch.cuda.FloatTensor`. On a CPU-only torch each of these
raises. `apply()` wraps exactly those upstream callables (listed in `PATCHES`, each with the file and lines
it covers) so that, while one of them runs, "CUDA" means the CPU: `torch.cuda.current_device()` answers
"cpu", a factory's CUDA `device=` becomes "cpu", and a CPU float tensor reports the CUDA type name. Nothing
else changes: outside those calls torch and Megatron are untouched, and `apply()` does nothing when a GPU
is present. Only spots this trainer reaches are patched (no Megatron attention, RoPE, router, token
dispatcher or RNG tracker is used: the K3 numerics come from `parity.model`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron.core.distributed import param_and_grad_buffer
from megatron.core.optimizer import distrib_optimizer
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.tensor_parallel import mappings

from parity.patching import require

_CPU_TYPE_AS_CUDA = {"torch.FloatTensor": "torch.cuda.FloatTensor"}


class _CudaMeansCpu(TorchFunctionMode):
    """Factory calls asking for a CUDA device get the CPU; `Tensor.type()` reports the CUDA type name."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CPU_TYPE_AS_CUDA.get(out, out)
        return out


@contextmanager
def _cuda_means_cpu() -> Iterator[None]:
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        with _CudaMeansCpu():
            yield
    finally:
        torch.cuda.current_device = saved


def _on_cpu(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _cuda_means_cpu():
            return fn(*args, **kwargs)

    wrapper.__zerokl_cpu_compat__ = True  # type: ignore[attr-defined]
    return wrapper


@dataclass(frozen=True)
class Patch:
    """One upstream callable run under `_cuda_means_cpu`: `owner.attr`, and the upstream lines it covers."""

    owner: Any
    attr: str
    covers: str


PATCHES: tuple[Patch, ...] = (
    # DDP's contiguous grad buffer: `torch.zeros(numel, device=torch.cuda.current_device())`.
    Patch(param_and_grad_buffer._ParamAndGradBuffer, "__init__",
          "megatron/core/distributed/param_and_grad_buffer.py:806 (grad_data on torch.cuda.current_device())"),
    # FP32Optimizer: `self._scale = torch.tensor([1.0], device='cuda')`.
    Patch(megatron_optimizer.FP32Optimizer, "__init__",
          "megatron/core/optimizer/optimizer.py:907 (_scale on device='cuda')"),
    # The distributed optimizer (ZeRO-1, several data-parallel ranks): its parameters' CUDA type names checked, then
    # MixedPrecisionOptimizer's buffers on device='cuda'.
    Patch(distrib_optimizer.DistributedOptimizer, "__init__",
          "megatron/core/optimizer/distrib_optimizer.py:361,420,431 (param.type() checks); "
          "optimizer.py:473,481,485 (found_inf / _dummy_overflow_buf / _scale_one on device='cuda')"),
    # Grad norm: `dummy_overflow_buf = torch.zeros(1, device='cuda')` (imported by name into optimizer.py).
    Patch(megatron_optimizer, "get_grad_norm_fp32",
          "megatron/core/optimizer/clip_grads.py:103,115 (dummy_overflow_buf / grad_norm on device='cuda')"),
    # Clipping: `assert param.grad.type() == 'torch.cuda.FloatTensor'`, then a device='cuda' buffer.
    Patch(megatron_optimizer, "clip_grad_by_total_norm_fp32",
          "megatron/core/optimizer/clip_grads.py:167 (grad-type assert), :174 (dummy_overflow_buf on 'cuda')"),
    # TP all-gather along the last dim (row-parallel inputs/weights, vocab-parallel logits).
    Patch(mappings, "_gather_along_last_dim",
          "megatron/core/tensor_parallel/mappings.py:91 (output on torch.cuda.current_device())"),
    # TP all-gather along the first dim (head-gathered weights, routed-expert token shares).
    Patch(mappings, "_gather_along_first_dim",
          "megatron/core/tensor_parallel/mappings.py:141,148,181 (output on torch.cuda.current_device())"),
    # EP token exchange: all-to-all-v output buffer.
    Patch(mappings._AllToAll, "forward",
          "megatron/core/tensor_parallel/mappings.py:442 (all2all-v output on torch.cuda.current_device())"),
)


WRITTEN_FOR = ("0.16.1",)  # the megatron-core release the PATCHES' lines are read from


def apply() -> list[str]:
    """Wrap every `PATCHES` entry once (idempotent) when no GPU is present, after checking the installed megatron-core
    is the release they were written for (`parity.patching.require`); returns what is patched."""
    if torch.cuda.is_available():
        return []
    from megatron.core import __version__

    require("megatron-core", __version__, WRITTEN_FOR, "trainer.megatron.cpu_compat")
    for p in PATCHES:
        current = p.owner.__dict__[p.attr]
        is_static = isinstance(current, staticmethod)
        fn = current.__func__ if is_static else current
        if not getattr(fn, "__zerokl_cpu_compat__", False):
            wrapped = _on_cpu(fn)
            setattr(p.owner, p.attr, staticmethod(wrapped) if is_static else wrapped)
    return [f"{getattr(p.owner, '__name__', p.owner)}.{p.attr}: {p.covers}" for p in PATCHES]
