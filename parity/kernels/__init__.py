"""The parity kernels: every op on the K3 log-prob path, in two named backends with one signature.

- `invariant`: a row's bits depend only on that row's inputs: not on batch size, batch composition,
  position in the batch, padding, or the prefill/decode split. What pins each property is documented in
  each module and in parity/README.md.
- `fast`: plain torch ops (F.linear, torch.sigmoid, SDPA, einsum); the non-invariant baseline for
  benchmarks and negative controls.

Choose one explicitly with `get_kernels(name)`; there is no automatic choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from parity.kernels import activations, attention, attn_res, conv, kda, linear, logprobs, moe, norms, primitives

BACKENDS = ("invariant", "fast")


@dataclass(frozen=True)
class Kernels:
    """One backend's implementation of each op (see the op modules for shapes and formulas)."""

    name: str
    sigmoid: Callable
    linear: Callable
    rmsnorm: Callable
    gated_rmsnorm: Callable
    l2norm: Callable
    situ_glu: Callable
    silu_glu: Callable
    short_conv: Callable
    kda_gate: Callable
    kda: Callable
    attention: Callable
    attn_res_mix: Callable
    route: Callable
    token_logprobs: Callable


INVARIANT = Kernels(
    name="invariant",
    sigmoid=primitives.sigmoid,
    linear=linear.linear_invariant,
    rmsnorm=norms.rmsnorm_invariant,
    gated_rmsnorm=norms.gated_rmsnorm_invariant,
    l2norm=norms.l2norm_invariant,
    situ_glu=activations.situ_glu_invariant,
    silu_glu=activations.silu_glu_invariant,
    short_conv=conv.short_conv_invariant,
    kda_gate=kda.kda_gate_invariant,
    kda=kda.kda_invariant,
    attention=attention.attention_invariant,
    attn_res_mix=attn_res.attn_res_mix_invariant,
    route=moe.route_invariant,
    token_logprobs=logprobs.token_logprobs_invariant,
)

FAST = Kernels(
    name="fast",
    sigmoid=torch.sigmoid,
    linear=linear.linear_fast,
    rmsnorm=norms.rmsnorm_fast,
    gated_rmsnorm=norms.gated_rmsnorm_fast,
    l2norm=norms.l2norm_fast,
    situ_glu=activations.situ_glu_fast,
    silu_glu=activations.silu_glu_fast,
    short_conv=conv.short_conv_fast,
    kda_gate=kda.kda_gate_fast,
    kda=kda.kda_fast,
    attention=attention.attention_fast,
    attn_res_mix=attn_res.attn_res_mix_fast,
    route=moe.route_fast,
    token_logprobs=logprobs.token_logprobs_fast,
)


def get_kernels(name: str) -> Kernels:
    """The backend called `name` ('invariant' or 'fast'); anything else is a user error.

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
    raise ValueError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
