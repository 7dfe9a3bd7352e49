"""The kernel sets: one `Kernels` record of op implementations per name, and the explicit choice.

- `invariant`: a row's bits depend only on that row's inputs (parity/README.md says what pins each).
- `fast`: plain torch ops; the non-invariant baseline for benchmarks and negative controls (`FAST`; on a machine with
  CUDA `FAST_GROUPED`: the same with the routed experts as `torch._grouped_mm` over stacked weights, as GPU users run).
- `triton`: the invariant kernels in Triton (`parity.kernels.triton`; GPU, or CPU under `TRITON_INTERPRET=1`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from parity.kernels import activations, attention, attn_res, conv, dsa, kda, linear, logprobs, moe, norms, primitives

KERNEL_SETS = ("invariant", "fast", "triton")


@dataclass(frozen=True)
class Kernels:
    """One kernel set's implementation of each op (see the op modules for shapes and formulas)."""

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
    attention_paged: Callable
    index_scores: Callable
    sparse_attention: Callable
    sparse_attention_paged: Callable
    attn_res_mix: Callable
    route: Callable
    token_logprobs: Callable
    # Grouped experts over stacked weights (`parity.kernels.moe.experts_stacked`'s signature); None: the model runs
    # `experts_combine`, one expert at a time, through `linear`.
    experts: Callable | None = None


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
    attention_paged=attention.paged(attention.attention_invariant),
    index_scores=dsa.index_scores_invariant,
    sparse_attention=dsa.gathered(attention.attention_invariant),
    sparse_attention_paged=dsa.paged_sparse(dsa.gathered(attention.attention_invariant)),
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
    attention_paged=attention.paged(attention.attention_fast),
    index_scores=dsa.index_scores_fast,
    sparse_attention=dsa.gathered(attention.attention_fast),
    sparse_attention_paged=dsa.paged_sparse(dsa.gathered(attention.attention_fast)),
    attn_res_mix=attn_res.attn_res_mix_fast,
    route=moe.route_fast,
    token_logprobs=logprobs.token_logprobs_fast,
)

FAST_GROUPED = replace(FAST, experts=moe.experts_grouped_fast)
