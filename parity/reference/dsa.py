"""Float64 reference of the DSA lightning indexer (K3.1 Pro; DeepSeek-V3.2's indexer as vLLM reads it), one sequence.

    k_s      = LayerNorm(wk x_s)                                   (FP8-rounded: one power-of-two scale per key)
    q_tj     = wq_b qr_t, head j                                   (FP8-rounded: one scale per token and head)
    w_tj     = (weights_proj x_t)_j / sqrt(index_head_dim * index_n_heads)
    score_ts = sum_j w_tj * ReLU(q_tj . k_s)          for s <= t

Query t attends the `index_topk` keys with the highest scores (ties: the lowest position), all of them when t + 1 <=
`index_topk`. The FP8 rounding is the cache's (`parity.quant.fp8.round_trip_scaled`), applied to float64 values here;
everything else is exact arithmetic in float64.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from parity.config import TextConfig
from parity.quant import fp8
from parity.reference.ops import linear

INDEX_NORM_EPS = 1e-6


def index_keys(x: Tensor, w: Mapping[str, Tensor]) -> Tensor:
    """x: [T, D] f64 -> [T, index_head_dim] f64 index keys (layer-relative names `indexer.*`)."""
    k = linear(x, w["indexer.wk.weight"])
    k = torch.nn.functional.layer_norm(k, k.shape[-1:], w["indexer.k_norm.weight"], w["indexer.k_norm.bias"],
                                       INDEX_NORM_EPS)
    return fp8.round_trip_scaled(k)


def index_scores(x: Tensor, qr: Tensor, w: Mapping[str, Tensor], cfg: TextConfig) -> Tensor:
    """x: [T, D], qr: [T, q_lora_rank] (the normalised low-rank query) f64 -> scores [T, T] f64, -inf where s > t."""
    assert cfg.index_n_heads is not None and cfg.index_head_dim is not None
    t, nh, d = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
    q = fp8.round_trip_scaled(linear(qr, w["indexer.wq_b.weight"]).view(t, nh, d))
    weights = linear(x, w["indexer.weights_proj.weight"]) * (d * nh) ** -0.5  # [T, nh]
    k = index_keys(x, w)
    scores = torch.einsum("tj,tjs->ts", weights, torch.relu(torch.einsum("tjd,sd->tjs", q, k)))
    causal = torch.arange(t).view(1, -1) <= torch.arange(t).view(-1, 1)
    return torch.where(causal, scores, torch.full((), float("-inf"), dtype=scores.dtype))


def select(scores: Tensor, topk: int) -> list[list[int]]:
    """The positions each query attends, ascending: all of 0..t when t + 1 <= topk, else the topk highest scores
    (ties: the lowest position)."""
    out = []
    for t, row in enumerate(scores):
        if t + 1 <= topk:
            out.append(list(range(t + 1)))
            continue
        ranked = sorted(range(t + 1), key=lambda s: (-float(row[s]), s))
        out.append(sorted(ranked[:topk]))
    return out
