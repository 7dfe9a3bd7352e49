"""The parity kernels: every op on the K3 log-prob path, in three named kernel sets with one signature.

- `invariant`: a row's bits depend only on that row's inputs: not on batch size, batch composition,
  position in the batch, padding, or the prefill/decode split. What pins each property is documented in
  each module and in parity/README.md.
- `fast`: plain torch ops (F.linear, torch.sigmoid, SDPA, einsum); the non-invariant baseline for
  benchmarks and negative controls.
- `triton`: the invariant kernels in Triton (`parity.kernels.triton`); their bits are the Triton platform's,
  not the CPU kernels'.

Choose one explicitly with `get_kernels(name)`; there is no automatic choice.
"""

from __future__ import annotations

import os

import torch

from parity.kernels.registry import FAST, FAST_GROUPED, INVARIANT, KERNEL_SETS, Kernels

__all__ = ["KERNEL_SETS", "FAST", "INVARIANT", "Kernels", "get_kernels", "platform_device", "runs_triton"]


def get_kernels(name: str) -> Kernels:
    """The kernel set called `name` ('invariant', 'fast' or 'triton'); anything else is a user error.

    On a machine with CUDA, 'invariant' runs the Triton kernels on CUDA tensors and the CPU kernels on CPU
    tensors (`parity.kernels.triton.DEVICE_INVARIANT`, chosen per call by the input's device); Triton is
    imported only there. 'fast' there runs the routed experts as `torch._grouped_mm` (`FAST_GROUPED`). 'triton' is
    the Triton kernels on every tensor: CUDA, or CPU tensors in a process started with TRITON_INTERPRET=1 (Triton's
    interpreter; slow, for tests)."""
    if name == "invariant":
        if torch.cuda.is_available():
            from parity.kernels.triton import DEVICE_INVARIANT

            return DEVICE_INVARIANT
        return INVARIANT
    if name == "fast":
        return FAST_GROUPED if torch.cuda.is_available() else FAST
    if name == "triton":
        if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
            raise ValueError("the triton kernel set needs a CUDA GPU, or TRITON_INTERPRET=1 in the environment "
                             "of every process that runs it (Triton's interpreter on CPU tensors)")
        from parity.kernels.triton import TRITON

        return TRITON
    raise ValueError(f"unknown kernel set {name!r}; choose one of {', '.join(KERNEL_SETS)}")


def runs_triton(name: str, device: torch.device) -> bool:
    """Whether kernel set `name` runs the Triton kernels on tensors of `device`: 'triton' on every device, 'invariant'
    on CUDA (`get_kernels`). Their GEMM adds its own fixed K segments and their routed experts are one grouped op,
    which is what a tensor- or expert-parallel split has to follow."""
    return name == "triton" or (name == "invariant" and device.type == "cuda")


def platform_device() -> torch.device:
    """The device this machine computes on: its GPU where CUDA is available, else the CPU (an engine's tensors, and
    so which kernels `runs_triton` picks for it)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
