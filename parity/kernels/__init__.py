"""The parity kernels: every op on the K3 log-prob path, in two named kernel sets with one signature.

- `invariant`: a row's bits depend only on that row's inputs: not on batch size, batch composition,
  position in the batch, padding, or the prefill/decode split. What pins each property is documented in
  each module and in parity/README.md.
- `fast`: plain torch ops (F.linear, torch.sigmoid, SDPA, einsum); the non-invariant baseline for
  benchmarks and negative controls.

Choose one explicitly with `get_kernels(name)`; there is no automatic choice.
"""

from __future__ import annotations

import torch

from parity.kernels.registry import KERNEL_SETS, FAST, INVARIANT, Kernels

__all__ = ["KERNEL_SETS", "FAST", "INVARIANT", "Kernels", "get_kernels"]


def get_kernels(name: str) -> Kernels:
    """The kernel set called `name` ('invariant' or 'fast'); anything else is a user error.

    On a machine with CUDA, 'invariant' runs the Triton kernels on CUDA tensors and the CPU kernels on CPU
    tensors (`parity.kernels.triton.DEVICE_INVARIANT`, chosen per call by the input's device); Triton is
    imported only there."""
    if name == "invariant":
        if torch.cuda.is_available():
            from parity.kernels.triton import DEVICE_INVARIANT

            return DEVICE_INVARIANT
        return INVARIANT
    if name == "fast":
        return FAST
    raise ValueError(f"unknown kernel set {name!r}; choose one of {', '.join(KERNEL_SETS)}")
