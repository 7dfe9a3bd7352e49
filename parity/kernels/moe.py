"""MoE routing, expert compute and combine. Router scores, weights and the combine are fp32; experts run
in the activations' dtype (fp32 or bf16) through the linear kernel.

Router (noaux_tc, one group): scores = sigmoid(x W_gate^T) (or softmax); experts are chosen by
scores + e_score_correction_bias with a fixed tie-break (higher biased score first, then lower expert
index); weights are the un-biased scores of the chosen experts, renormalised to sum 1 when asked, times
`routed_scaling_factor`. Expert compute runs each expert over the rows routed to it with the tiled
linear, so a row's result does not depend on which other rows chose that expert. Combine adds a token's
k expert outputs in ascending expert-id order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from parity.kernels.activations import silu_glu_fast, silu_glu_invariant, situ_glu_fast, situ_glu_invariant
from parity.kernels.linear import linear_fast, linear_invariant
from parity.kernels.primitives import sigmoid, tree_sum, wide
from parity.quant.mxfp4 import MXFP4Weight

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Act = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def route_invariant(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, scaling: float, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, E] fp32 -> (expert ids [N, k] ascending, weights [N, k] fp32)."""
    if activation == "sigmoid":
        scores = sigmoid(logits)
    else:
        e = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        scores = e / tree_sum(e).unsqueeze(-1)
    biased = scores if bias is None else scores + bias
    order = torch.sort(biased, dim=-1, descending=True, stable=True).indices
    ids = torch.sort(order[:, :top_k], dim=-1).values
    w = scores.gather(1, ids)
    if renormalize:
        w = w / tree_sum(w).unsqueeze(-1)
    return ids, w * scaling


def route_fast(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, scaling: float, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.sigmoid(logits) if activation == "sigmoid" else torch.softmax(logits, dim=-1)
    biased = scores if bias is None else scores + bias
    ids = torch.topk(biased, top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return ids, w * scaling


def experts_combine(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w1: list[torch.Tensor],
    w3: list[torch.Tensor],
    w2: list[torch.Tensor],
    linear: Linear,
    act: Act,
) -> torch.Tensor:
    """x: [N, L], ids/weights: [N, k] (weights fp32); expert e: w1[e], w3[e]: [I, L], w2[e]: [L, I] -> [N, L] fp32.

    out_n = sum_j weights[n, j] * w2[e] act(w1[e] x_n, w3[e] x_n) with e = ids[n, j], j = 0..k-1 in order; each
    expert output is in x's dtype, the weighted sum in fp32 (the caller rounds it).
    """
    n, k = ids.shape
    y = x.new_zeros(n, k, x.shape[-1])
    flat = ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        slots = (flat == e).nonzero().squeeze(1)  # positions in [N * k]
        rows = x[slots // k]
        h = linear(act(linear(rows, w1[e]), linear(rows, w3[e])), w2[e])
        y = y.index_put((slots // k, slots % k), h)
    weights, y = wide(weights), wide(y)
    out = weights[:, 0:1] * y[:, 0]
    for j in range(1, k):
        out = out + weights[:, j : j + 1] * y[:, j]
    return out


def expert_counts(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Slots per expert: ids [M] -> [n_experts] int64, exact (integer adds), no host read (`torch.bincount` on CUDA
    reads the maximum back to size its output; this is CUDA-graph capturable)."""
    return torch.zeros(n_experts, dtype=torch.long, device=ids.device).index_add_(0, ids, torch.ones_like(ids))


def unstack(w: torch.Tensor | MXFP4Weight) -> list:
    """Stacked expert weights [E, ...] (a tensor or a stacked `MXFP4Weight`) -> one per expert."""
    if isinstance(w, MXFP4Weight):
        return [MXFP4Weight(p, s) for p, s in zip(w.packed, w.scale)]
    return list(w.unbind(0))


def experts_stacked(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor | MXFP4Weight,
                    w3: torch.Tensor | MXFP4Weight, w2: torch.Tensor | MXFP4Weight, act: str = "situ",
                    beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """`experts_combine` on the invariant kernels over stacked experts (w1, w3: [E, I, L], w2: [E, L, I], or stacked
    `MXFP4Weight`s), the activation named as the grouped Triton op (`parity.kernels.triton.moe.experts`) names it:
    its torch reading, with the same signature (the Triton op's gradients come from this one)."""
    def glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu_glu_invariant(gate, up) if act == "silu" else situ_glu_invariant(gate, up, beta, linear_beta)

    return experts_combine(x, ids, weights, unstack(w1), unstack(w3), unstack(w2), linear_invariant, glu)


def experts_grouped_fast(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor | MXFP4Weight,
                         w3: torch.Tensor | MXFP4Weight, w2: torch.Tensor | MXFP4Weight, act: str = "situ",
                         beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """The fast baseline for stacked experts (`experts_stacked`'s signature; not batch-invariant): on CUDA in bf16,
    what a GPU user runs, `torch._grouped_mm` over the rows sorted by expert (MXFP4 weights dequantised to bf16
    first); elsewhere `experts_combine` on the fast kernels. Nothing is read back to the host on the grouped path."""
    if not (x.is_cuda and x.dtype == torch.bfloat16):
        def fast_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return silu_glu_fast(gate, up) if act == "silu" else situ_glu_fast(gate, up, beta, linear_beta)

        return experts_combine(x, ids, weights, unstack(w1), unstack(w3), unstack(w2), linear_fast, fast_glu)
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    ends = torch.cumsum(expert_counts(flat, w1.shape[0]), 0).to(torch.int32)

    def grouped(a: torch.Tensor, w: torch.Tensor | MXFP4Weight) -> torch.Tensor:
        dense = w.dequantize(torch.bfloat16) if isinstance(w, MXFP4Weight) else w.to(torch.bfloat16)
        return torch._grouped_mm(a, dense.transpose(-2, -1), offs=ends)

    rows = x[order // k]
    gate, up = grouped(rows, w1), grouped(rows, w3)
    h = silu_glu_fast(gate, up) if act == "silu" else situ_glu_fast(gate, up, beta, linear_beta)
    y = torch.empty_like(rows).index_copy(0, order, grouped(h, w2))  # back to slot order (token, j)
    return (wide(weights).unsqueeze(-1) * wide(y).view(n, k, -1)).sum(1)
