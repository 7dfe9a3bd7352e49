"""Causal softmax attention (the MLA core), over contiguous or paged KV: fp32 scores, softmax and value
sums (bf16 inputs are upcast, exactly); the output is rounded to q's dtype.

Invariant form: queries are cut into tiles of `Q_TILE` rows and keys into tiles of `KV_TILE` positions
anchored at position 0; every score and value GEMM has one fixed shape. Each query walks the key tiles
from position 0 with an online softmax (running max m, running sum l, accumulator acc). A tile that is
fully masked for a query changes nothing bit-wise (exp(-inf) = 0, rescale factor exp(0) = 1), so the
number of tiles walked (prefill vs decode, longer neighbours in the batch) never changes a query's
output. Masked values are zeroed before use, so stale cache contents never leak (0 * NaN).

Autograd (`attention_invariant` when a gradient is needed): the forward is the tiled kernel, which also keeps each
query's log-sum-exp; the backward recomputes the probabilities from it with plain GEMMs over the whole key range
(the flash-attention backward, untiled): exact to fp32 rounding, deterministic, not batch-invariant, and nothing
per key tile is saved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from parity.kernels.primitives import needs_grad, tree_sum, wide

Q_TILE = 16
KV_TILE = 64


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    n = x.shape[dim]
    pad = (-n) % multiple
    if pad == 0:
        return x
    widths = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, pad]
    return F.pad(x, widths)


def _tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The invariant kernel on wide inputs -> (o [B, Tq, H, Dv], log-sum-exp of the scaled scores [B, H, Tq])."""
    b, tq, h, d = q.shape
    dv = v.shape[-1]
    qt = _pad_to(q, 1, Q_TILE).permute(0, 2, 1, 3)  # [B, H, Tq', D]
    nq = qt.shape[2] // Q_TILE
    qt = qt.reshape(b * h * nq, Q_TILE, d)
    pos = _pad_to(q_pos, 1, Q_TILE).view(b, 1, nq, Q_TILE, 1).expand(b, h, nq, Q_TILE, 1).reshape(-1, Q_TILE, 1)
    lens = kv_len.view(b, 1, 1, 1, 1).expand(b, h, nq, 1, 1).reshape(-1, 1, 1)
    kp = _pad_to(k, 1, KV_TILE).permute(0, 2, 1, 3)  # [B, H, S', D]
    vp = _pad_to(v, 1, KV_TILE).permute(0, 2, 1, 3)
    dev = q.device
    m = torch.full((b * h * nq, Q_TILE, 1), float("-inf"), device=dev)
    l = torch.zeros(b * h * nq, Q_TILE, 1, device=dev)
    acc = torch.zeros(b * h * nq, Q_TILE, dv, device=dev)
    for start in range(0, kp.shape[2], KV_TILE):
        kt = kp[:, :, start : start + KV_TILE].unsqueeze(2).expand(b, h, nq, KV_TILE, d).reshape(-1, KV_TILE, d)
        vt = vp[:, :, start : start + KV_TILE].unsqueeze(2).expand(b, h, nq, KV_TILE, dv).reshape(-1, KV_TILE, dv)
        key_pos = torch.arange(start, start + KV_TILE, device=dev).view(1, 1, KV_TILE)
        visible = (key_pos <= pos) & (key_pos < lens)  # [N, Q_TILE, KV_TILE]
        key_ok = (key_pos < lens).view(-1, KV_TILE, 1)
        vt = torch.where(key_ok, vt, 0.0)
        s = torch.bmm(qt, kt.transpose(1, 2)) * scale
        s = torch.where(visible, s, float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
        p = torch.exp(s - m_safe)
        alpha = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, float("-inf")), m - m_safe))
        l = l * alpha + tree_sum(p).unsqueeze(-1)
        acc = acc * alpha + torch.bmm(p, vt)
        m = m_new
    o = acc / l
    lse = (m + torch.log(l)).view(b, h, nq * Q_TILE)[:, :, :tq]
    return o.view(b, h, nq * Q_TILE, dv)[:, :, :tq].permute(0, 2, 1, 3), lse


def _visible(q_pos: torch.Tensor, kv_len: torch.Tensor, s_len: int) -> torch.Tensor:
    """[B, 1, Tq, S] bool: key s visible to the query at q_pos."""
    key_pos = torch.arange(s_len, device=q_pos.device).view(1, 1, s_len)
    return ((key_pos <= q_pos.unsqueeze(-1)) & (key_pos < kv_len.view(-1, 1, 1))).unsqueeze(1)


def _scores(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, ...]:
    """Head-major q, k, v ([B, H, T, D]; the keys' and values' stale cache rows, past kv_len, zeroed) and the scaled
    scores over the whole key range, [B, H, Tq, S], unmasked: the plain-GEMM reading both untiled passes share."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    key_ok = torch.arange(k.shape[1], device=k.device).view(1, 1, -1, 1) < kv_len.view(-1, 1, 1, 1)
    kh, vh = torch.where(key_ok, kh, 0.0), torch.where(key_ok, vh, 0.0)
    return qh, kh, vh, torch.matmul(qh, kh.transpose(2, 3)) * scale


class _Attention(torch.autograd.Function):
    """The tiled invariant forward; a recomputing plain-GEMM backward from the saved log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                kv_len: torch.Tensor, scale: float) -> torch.Tensor:
        o, lse = _tiled(q, k, v, q_pos, kv_len, scale)
        ctx.save_for_backward(q, k, v, q_pos, kv_len, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, q_pos, kv_len, o, lse = ctx.saved_tensors
        scale = ctx.scale
        qh, kh, vh, s = _scores(q, k, v, kv_len, scale)
        oh, doh = o.transpose(1, 2), do.transpose(1, 2)
        p = torch.where(_visible(q_pos, kv_len, k.shape[1]), torch.exp(s - lse.unsqueeze(-1)), 0.0)
        dv = torch.matmul(p.transpose(2, 3), doh)
        dp = torch.matmul(doh, vh.transpose(2, 3))
        ds = p * (dp - (doh * oh).sum(-1, keepdim=True)) * scale
        dq = torch.matmul(ds, kh)
        dk = torch.matmul(ds.transpose(2, 3), qh)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None


class _AttentionUntiled(_Attention):
    """`_Attention`'s function with its forward untiled too: plain GEMMs over the whole key range (what the backward
    recomputes anyway) give the output and the log-sum-exp in a few launches, where the tiled loop takes a dozen per
    key tile. Not batch invariant: for a caller that takes its forward bits elsewhere (`attention_for_gradients`)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                kv_len: torch.Tensor, scale: float) -> torch.Tensor:
        _, _, vh, s = _scores(q, k, v, kv_len, scale)
        s = torch.where(_visible(q_pos, kv_len, k.shape[1]), s, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [B, H, Tq], as `_tiled` returns it
        o = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), vh).transpose(1, 2)
        ctx.save_for_backward(q, k, v, q_pos, kv_len, o, lse)
        ctx.scale = scale
        return o


def _widened(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in fp32, a single key / value head expanded to q's heads."""
    q, k, v = wide(q), wide(k), wide(v)
    h = q.shape[2]
    return q, k.expand(*k.shape[:2], h, k.shape[3]), v.expand(*v.shape[:2], h, v.shape[3])


def attention_invariant(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [B, Tq, H, D], k: [B, S, H, D], v: [B, S, H, Dv] fp32 or bf16 (k, v may have 1 head, shared by all query
    heads); q_pos: [B, Tq] absolute positions (key s is visible to a query at position p iff s <= p and
    s < kv_len[b]); kv_len: [B]. Returns o: [B, Tq, H, Dv] in q's dtype. Padded query rows must carry a
    position >= 0."""
    out_dtype = q.dtype
    q, k, v = _widened(q, k, v)
    if needs_grad(q, k, v):
        return _Attention.apply(q, k, v, q_pos, kv_len, scale).to(out_dtype)
    return _tiled(q, k, v, q_pos, kv_len, scale)[0].to(out_dtype)


def attention_for_gradients(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor, scale: float
) -> torch.Tensor:
    """`attention_invariant`'s function and backward, its forward untiled (`_AttentionUntiled`): what the Triton
    kernel set differentiates (`parity.kernels.triton`: its forward bits are the Triton kernel's). Deterministic for
    fixed shapes; the output agrees with the invariant forward to fp32 rounding."""
    out_dtype = q.dtype
    return _AttentionUntiled.apply(*_widened(q, k, v), q_pos, kv_len, scale).to(out_dtype)





def attention_fast(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor, scale: float
) -> torch.Tensor:
    """`scaled_dot_product_attention` with an explicit mask (bits depend on shapes)."""
    s_len = k.shape[1]
    key_pos = torch.arange(s_len, device=q.device).view(1, 1, s_len)
    mask = (key_pos <= q_pos.unsqueeze(-1)) & (key_pos < kv_len.view(-1, 1, 1))  # [B, Tq, S]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.to(q.dtype).transpose(1, 2), v.to(q.dtype).transpose(1, 2), attn_mask=mask.unsqueeze(1),
        scale=scale,
    )
    return o.transpose(1, 2)


def paged(attention: Callable) -> Callable:
    """`attention` over keys and values read through a block table: (q, k_cache [blocks, page, Hk, D],
    v_cache [blocks, page, Hk, Dv], block_table [B, max_blocks], q_pos, kv_len, scale). The torch kernels gather
    the blocks into contiguous keys (a copy) and cast them to q's dtype (exact from an FP8 page)."""

    def attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        q_pos: torch.Tensor, kv_len: torch.Tensor, scale: float) -> torch.Tensor:
        k = gather_paged(k_cache, block_table).to(q.dtype)
        v = gather_paged(v_cache, block_table).to(q.dtype)
        held = (torch.arange(k.shape[1], device=k.device).view(1, -1) < kv_len.view(-1, 1)).view(*k.shape[:2], 1, 1)
        return attention(q, torch.where(held, k, 0.0), torch.where(held, v, 0.0), q_pos, kv_len, scale)

    attention_paged.__qualname__ = f"paged({attention.__name__})"
    return attention_paged


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """cache: [num_blocks, block_size, ...], block_table: [B, max_blocks] int -> contiguous
    [B, max_blocks * block_size, ...]; positions past a row's length hold whatever the blocks hold (`paged`'s torch
    kernels zero them)."""
    b, nb = block_table.shape
    gathered = cache[block_table.clamp(min=0).reshape(-1)]  # [B * nb, block_size, ...]
    return gathered.reshape(b, nb * cache.shape[1], *cache.shape[2:])
