"""The DSA indexer's ops (K3.1 Pro's lightning indexer and sparse MLA): index scores, the top-k positions, and
attention over each token's selected latents. The top-k (`top_positions`) is one function for every kernel set: exact
(no arithmetic), a top-k over keys made unique by the tie rule, so any device picks the same positions from the same
scores.

Invariant form: a score is `linear_invariant`'s dot of one FP8-rounded index query head with one index key (one
element of the invariant GEMM: its bits depend on the two vectors alone), the heads' terms w_j * ReLU(dot_j) added in
head order in fp32. Sparse attention gathers each token's selected latents and runs the kernel set's attention with
the token's heads as the query rows over its selected keys in position order; with every visible position selected
these are the dense attention's keys in the dense attention's key tiles, so the bits equal the dense op's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from parity.kernels.attention import gather_paged
from parity.kernels.linear import linear_invariant
from parity.kernels.primitives import wide


def _visible(scores: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor) -> torch.Tensor:
    """`scores` [B, T, S] with -inf where key s is not a candidate of the query (s > its position, or s >= kv_len)."""
    b, _, s = scores.shape
    key_pos = torch.arange(s, device=scores.device).view(1, 1, s)
    visible = (key_pos <= q_pos.unsqueeze(-1)) & (key_pos < kv_len.view(b, 1, 1))
    return torch.where(visible, scores, float("-inf"))


def index_scores_invariant(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor,
                           kv_len: torch.Tensor) -> torch.Tensor:
    """q [B, T, nh, d] (FP8-rounded index queries), w [B, T, nh] fp32 head weights, keys [B, S, d] (FP8-rounded),
    q_pos [B, T], kv_len [B] -> [B, T, S] fp32: sum over heads j, in order, of w_j * ReLU(q_j . k_s), -inf where s
    is not visible. Each dot is one element of the invariant GEMM, so a score has the same bits on every schedule."""
    b, t, nh, d = q.shape
    s = keys.shape[1]
    rows = []
    for i in range(b):
        dots = linear_invariant(wide(q[i]).reshape(t * nh, d), wide(keys[i])).view(t, nh, s).clamp(min=0)
        score = w[i, :, 0:1] * dots[:, 0]
        for j in range(1, nh):
            score = score + w[i, :, j : j + 1] * dots[:, j]
        rows.append(score)
    return _visible(torch.stack(rows), q_pos, kv_len)


def index_scores_fast(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor,
                      kv_len: torch.Tensor) -> torch.Tensor:
    """`index_scores_invariant` as one einsum pair (the heads' sum in the library's order)."""
    dots = torch.einsum("btjd,bsd->btjs", wide(q), wide(keys)).clamp(min=0)
    return _visible(torch.einsum("btj,btjs->bts", w, dots), q_pos, kv_len)


def ranking_keys(scores: torch.Tensor) -> torch.Tensor:
    """scores [..., S] fp32 -> int64 keys, unique along the last dim, in the order "higher score, then lower
    position": the score's bits mapped to an integer of the same order (-0 counted as +0, as float comparison does)
    in the high 32 bits, S - 1 - position in the low 32."""
    s = scores.shape[-1]
    bits = (scores + 0.0).view(torch.int32).to(torch.int64)  # -0 + 0 = +0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative floats: larger magnitude, smaller key
    return ordered * (1 << 32) + (s - 1 - torch.arange(s, device=scores.device))


def top_positions(scores: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B, T, S] (-inf: not a candidate) -> the positions each query attends: (selected [B, T, K] ascending,
    padded with 0; count [B, T]), K = min(topk, S). When a query has at most `topk` candidates (its positions 0..t)
    all are kept (dense attention), else the `topk` highest scores, ties to the lowest position: the `topk` largest
    `ranking_keys`, which are unique, so any correct top-k (a radix select on the GPU) picks the same set."""
    b, t, s = scores.shape
    k_sel = min(topk, s)
    top = torch.sort(torch.topk(ranking_keys(scores), k_sel, dim=-1, sorted=False).indices, dim=-1).values
    candidates = (scores > float("-inf")).sum(-1)  # position t + 1 of each query (its keys are 0..t)
    ranks = torch.arange(k_sel, device=scores.device).view(1, 1, k_sel)
    dense = (candidates <= k_sel).unsqueeze(-1)  # every candidate kept: positions 0..t
    selected = torch.where(dense, torch.where(ranks < candidates.unsqueeze(-1), ranks, 0), top)
    return selected, candidates.clamp(max=k_sel)


def gathered(attention: Callable) -> Callable:
    """The sparse attention op over contiguous latents, from a kernel set's attention: (q [B, T, H, L], latents
    [B, S, 1, L], selected [B, T, K] positions ascending, count [B, T] how many of them are real (the rest padding),
    values, scale) -> [B, T, H, values]. Each token's selected latents are gathered (a copy) and attended as one
    sequence of `count` keys, the token's H heads its query rows (keys: the whole latent; values: its first
    `values` channels)."""

    def sparse_attention(q: torch.Tensor, latents: torch.Tensor, selected: torch.Tensor, count: torch.Tensor,
                         values: int, scale: float) -> torch.Tensor:
        b, t, h, l = q.shape
        keys = torch.stack([latents[i, :, 0][selected[i]] for i in range(b)]).to(q.dtype)  # [B, T, K, L]
        keys = keys.reshape(b * t, -1, 1, l)
        n = count.reshape(b * t).clamp(min=1)
        o = attention(q.reshape(b * t, h, 1, l), keys, keys[..., :values], (n - 1).view(-1, 1).expand(b * t, h), n,
                      scale)
        return o.view(b, t, h, values)

    sparse_attention.__qualname__ = f"gathered({attention.__name__})"
    return sparse_attention


def paged_sparse(sparse_attention: Callable) -> Callable:
    """`sparse_attention` over latent pages [num_blocks, block_size, 1, L] read through a block table [B, max_blocks]
    (q, pages, block_table, selected, count, values, scale): the torch kernels gather the blocks first (a copy)."""

    def sparse_attention_paged(q: torch.Tensor, pages: torch.Tensor, block_table: torch.Tensor,
                               selected: torch.Tensor, count: torch.Tensor, values: int, scale: float) -> torch.Tensor:
        lat = gather_paged(pages, block_table).to(q.dtype)  # positions past a row: never selected
        return sparse_attention(q, lat, selected, count, values, scale)

    sparse_attention_paged.__qualname__ = f"paged_sparse({getattr(sparse_attention, '__qualname__', 'op')})"
    return sparse_attention_paged
