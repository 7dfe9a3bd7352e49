"""Causal softmax attention (the MLA core) in Triton, over contiguous or paged KV; bf16 or fp32 inputs.

Invariant: queries are cut into tiles of `BLOCK_Q` rows and keys into tiles of `BLOCK_KV` positions
anchored at position 0 (fixed constants, never chosen from the batch). Each query walks the key tiles
from position 0 with an fp32 online softmax (running max m, sum l, accumulator acc) and one code path
for every tile. A key tile that is fully masked for a query is a bit-exact no-op for it (exp(-inf) = 0,
rescale exp(0) = 1, acc + 0), so the number of tiles walked (prefill vs decode, other queries in the
tile, longer neighbours) never changes a query's output. Keys at or past kv_len are loaded as zeros
and their scores replaced by -inf, so stale cache contents (NaN included) never leak. The paged kernel
reads the same tiles through the block table, so paged and contiguous KV give the same bits.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from parity.kernels.triton._common import INTERPRET, check_dtype, dot_precision, mma, pow2

FP8 = torch.float8_e4m3fn
BLOCK_Q = 128
BLOCK_KV = 128  # tile sweep on the H200: 0.310 vs 0.367 ms prefill, 0.148 vs 0.171 ms decode B = 8
WIDE = 256  # heads with D or Dv above this take `_attn_wide_kernel` (a function of the head shape alone)
WIDE_Q, WIDE_KV, WIDE_DC, WIDE_DV = 64, 64, 64, 128  # its query / key tiles, D chunk, Dv columns per program
LOG2E = math.log2(math.e)


@triton.jit
def _key_rows(table_ptr, sel_ptr, b, ks, key_ok, stb, skb, skt, svb, svt, PAGE, ssb, ROW_TOKENS,
              PAGED: tl.constexpr, SPARSE: tl.constexpr):
    """Element offsets of keys `ks` of query row b in k and v. Dense: key slot = position, cache row b. SPARSE: query
    row b is one token, key slot ks its ks-th selected position (`sel_ptr`, row stride ssb), read from cache row
    b // ROW_TOKENS. Positions are read through the block table (PAGED) or contiguously."""
    if SPARSE:
        at = tl.load(sel_ptr + b * ssb + ks, mask=key_ok, other=0)  # int32 positions
        row = b // ROW_TOKENS
    else:
        at = ks
        row = b
    if PAGED:
        blk = tl.load(table_ptr + row * stb + at // PAGE, mask=key_ok, other=0).to(tl.int64)
        return blk * skb + (at % PAGE) * skt, blk * svb + (at % PAGE) * svt
    return row * skb + at.to(tl.int64) * skt, row * svb + at.to(tl.int64) * svt


@triton.jit
def _walk_start(pos_ptr, len_ptr, b, spb, rq, qmask, BQ: tl.constexpr, BDV: tl.constexpr):
    """A query tile's positions, its row's key count, the end of the key range it walks (its last visible key + 1)
    and empty running max, sum and accumulator."""
    pos = tl.load(pos_ptr + b * spb + rq, mask=qmask, other=0)
    kv_len = tl.load(len_ptr + b)
    hi = tl.minimum(tl.max(tl.where(qmask, pos, 0), axis=0) + 1, kv_len)
    return (pos, kv_len, hi, tl.full((BQ,), float("-inf"), dtype=tl.float32), tl.zeros((BQ,), dtype=tl.float32),
            tl.zeros((BQ, BDV), dtype=tl.float32))


@triton.jit
def _softmax_step(s, m, l, ks, key_ok, pos, qk_scale):
    """One key tile of the online softmax: scores s (unscaled) masked to visible keys -> (p, rescale alpha of the
    running sums, new l, new m). A fully masked tile gives p = 0 and alpha = 1 (a bit-exact no-op)."""
    s = s * qk_scale
    visible = (ks[None, :] <= pos[:, None]) & key_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    return p, alpha, l * alpha + tl.sum(p, axis=1), m_new


@triton.jit(do_not_specialize=["Tq"])
def _attn_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, len_ptr, o_ptr, table_ptr, H, Tq, D, DV, qk_scale,
                 sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, spb, stb, PAGE,
                 sel_ptr, ssb, ROW_TOKENS, PAGED: tl.constexpr, SPARSE: tl.constexpr, BQ: tl.constexpr, BKV: tl.constexpr, BD: tl.constexpr, BD2: tl.constexpr,
                 BDV: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """qk_scale = scale * log2(e) (scores in base 2). The head dim is covered by two blocks, BD then BD2
    (e.g. 192 = 128 + 64, no padding to 256; BD2 = 0: one block). PAGED: k/v are [blocks, PAGE, H, D]
    caches and key s of row b lives in block table[b, s // PAGE] at offset s % PAGE (skb/svb: block strides)."""
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rq = pid_q * BQ + tl.arange(0, BQ)
    qmask = rq < Tq
    d = tl.arange(0, BD)
    dv = tl.arange(0, BDV)
    q = tl.load(q_ptr + b * sqb + rq[:, None] * sqt + h * sqh + d[None, :], mask=qmask[:, None] & (d[None, :] < D),
                other=0.0)
    if BD2 > 0:
        d2 = BD + tl.arange(0, BD2)
        q2 = tl.load(q_ptr + b * sqb + rq[:, None] * sqt + h * sqh + d2[None, :],
                     mask=qmask[:, None] & (d2[None, :] < D), other=0.0)
    pos, kv_len, hi, m, l, acc = _walk_start(pos_ptr, len_ptr, b, spb, rq, qmask, BQ, BDV)
    for start in range(0, hi, BKV):
        ks = start + tl.arange(0, BKV)
        key_ok = ks < kv_len
        krow, vrow = _key_rows(table_ptr, sel_ptr, b, ks, key_ok, stb, skb, skt, svb, svt, PAGE, ssb,
                                ROW_TOKENS, PAGED, SPARSE)
        kt = tl.load(k_ptr + krow[None, :] + h * skh + d[:, None], mask=key_ok[None, :] & (d[:, None] < D),
                     other=0.0).to(q.dtype)
        vt = tl.load(v_ptr + vrow[:, None] + h * svh + dv[None, :], mask=key_ok[:, None] & (dv[None, :] < DV),
                     other=0.0).to(q.dtype)
        s = mma(q, kt, tl.zeros((BQ, BKV), dtype=tl.float32), PREC, INTERP)
        if BD2 > 0:
            kt2 = tl.load(k_ptr + krow[None, :] + h * skh + d2[:, None], mask=key_ok[None, :] & (d2[:, None] < D),
                          other=0.0).to(q.dtype)
            s = mma(q2, kt2, s, PREC, INTERP)
        p, alpha, l, m_new = _softmax_step(s, m, l, ks, key_ok, pos, qk_scale)
        acc = mma(p.to(vt.dtype), vt, acc * alpha[:, None], PREC, INTERP)
        m = m_new
    o = acc / l[:, None]
    tl.store(o_ptr + b * sob + rq[:, None] * sot + h * soh + dv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=qmask[:, None] & (dv[None, :] < DV))


@triton.jit(do_not_specialize=["Tq"])
def _attn_wide_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, len_ptr, o_ptr, table_ptr, H, Tq, D, DV, qk_scale,
                      sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh, spb, stb, PAGE,
                      sel_ptr, ssb, ROW_TOKENS, PAGED: tl.constexpr, SPARSE: tl.constexpr, BQ: tl.constexpr, BKV: tl.constexpr, BDC: tl.constexpr,
                      BDV: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """`_attn_kernel` for heads too wide to hold in one tile (K3's absorbed MLA: D = 512 + 64, Dv = 512): the
    scores are summed over D in chunks of BDC in order, and each program owns BDV of the Dv output columns (grid
    axis 2), recomputing the scores of its query tile; the softmax and masking are `_attn_kernel`'s."""
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    pid_v = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rq = pid_q * BQ + tl.arange(0, BQ)
    qmask = rq < Tq
    dc = tl.arange(0, BDC)
    dv = pid_v * BDV + tl.arange(0, BDV)
    q_row = q_ptr + b * sqb + rq[:, None] * sqt + h * sqh
    pos, kv_len, hi, m, l, acc = _walk_start(pos_ptr, len_ptr, b, spb, rq, qmask, BQ, BDV)
    for start in range(0, hi, BKV):
        ks = start + tl.arange(0, BKV)
        key_ok = ks < kv_len
        krow, vrow = _key_rows(table_ptr, sel_ptr, b, ks, key_ok, stb, skb, skt, svb, svt, PAGE, ssb,
                                ROW_TOKENS, PAGED, SPARSE)
        s = tl.zeros((BQ, BKV), dtype=tl.float32)
        for d0 in range(0, D, BDC):
            qc = tl.load(q_row + d0 + dc[None, :], mask=qmask[:, None] & (d0 + dc[None, :] < D), other=0.0)
            kc = tl.load(k_ptr + krow[None, :] + h * skh + d0 + dc[:, None],
                         mask=key_ok[None, :] & (d0 + dc[:, None] < D), other=0.0).to(qc.dtype)
            s = mma(qc, kc, s, PREC, INTERP)
        p, alpha, l, m_new = _softmax_step(s, m, l, ks, key_ok, pos, qk_scale)
        vt = tl.load(v_ptr + vrow[:, None] + h * svh + dv[None, :], mask=key_ok[:, None] & (dv[None, :] < DV),
                     other=0.0).to(q_ptr.dtype.element_ty)
        acc = mma(p.to(vt.dtype), vt, acc * alpha[:, None], PREC, INTERP)
        m = m_new
    o = acc / l[:, None]
    tl.store(o_ptr + b * sob + rq[:, None] * sot + h * soh + dv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=qmask[:, None] & (dv[None, :] < DV))


def _split_dim(d: int) -> tuple[int, int]:
    """Head dim d as two power-of-two blocks (the first the largest power of two <= d, at least 16)."""
    first = max(16, 1 << (max(d, 1).bit_length() - 1))
    return first, (pow2(d - first) if d > first else 0)


def _launch(q, k, v, q_pos, kv_len, scale, table=None, page=1, selected=None, row_tokens=1) -> torch.Tensor:
    """`selected` [B, K] int: the sparse mode (`_key_rows`), query row b reading cache row b // row_tokens."""
    b, tq, h, d = q.shape
    dv = v.shape[-1]
    o = torch.empty(b, tq, h, dv, dtype=q.dtype, device=q.device)
    if b == 0 or tq == 0:
        return o
    pos = q_pos.to(torch.int32).contiguous()
    lens = kv_len.to(torch.int32).contiguous()
    paged = table is not None
    tbl = table.to(torch.int32).contiguous() if paged else lens
    sparse = selected is not None
    sel = selected.to(torch.int32).contiguous() if sparse else lens
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
               pos.stride(0), tbl.stride(0) if paged else 0, page, sel, sel.stride(0) if sparse else 0, row_tokens)
    if d > WIDE or dv > WIDE:
        grid = (triton.cdiv(tq, WIDE_Q), b * h, triton.cdiv(dv, WIDE_DV))
        _attn_wide_kernel[grid](q, k, v, pos, lens, o, tbl, h, tq, d, dv, float(scale) * LOG2E, *strides,
                                PAGED=paged, SPARSE=sparse, BQ=WIDE_Q, BKV=WIDE_KV, BDC=WIDE_DC, BDV=WIDE_DV,
                                PREC=dot_precision(q.dtype), INTERP=INTERPRET, num_warps=4, num_stages=2)
        return o
    bd, bd2 = _split_dim(d)
    bdv = pow2(dv)
    warps = 8
    grid = (triton.cdiv(tq, BLOCK_Q), b * h)
    _attn_kernel[grid](q, k, v, pos, lens, o, tbl, h, tq, d, dv, float(scale) * LOG2E, *strides,
                       PAGED=paged, SPARSE=sparse, BQ=BLOCK_Q, BKV=BLOCK_KV, BD=bd, BD2=bd2, BDV=bdv, PREC=dot_precision(q.dtype),
                       INTERP=INTERPRET, num_warps=warps, num_stages=2)
    return o


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if k.dtype == v.dtype == FP8:  # an FP8 latent page: cast to q's dtype as it is loaded (exact)
        check_dtype(q)
    else:
        check_dtype(q, k, v)
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("attention inputs need unit stride along the head dim")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor,
              scale: float) -> torch.Tensor:
    """q: [B, Tq, H, D], k: [B, S, H, D], v: [B, S, H, Dv]; q_pos: [B, Tq] absolute positions (key s is
    visible to a query at position p iff s <= p and s < kv_len[b]); kv_len: [B] -> o: [B, Tq, H, Dv]."""
    _check(q, k, v)
    return _launch(q, k, v, q_pos, kv_len, scale)


def attention_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    q_pos: torch.Tensor, kv_len: torch.Tensor, scale: float) -> torch.Tensor:
    """As `attention`, with keys read through a block table: k_cache: [num_blocks, page, H, D],
    v_cache: [num_blocks, page, H, Dv] (q's dtype, or FP8 e4m3, cast exactly on load), block_table:
    [B, max_blocks] int. Same bits as the contiguous kernel on the gathered keys (no copy is made)."""
    _check(q, k_cache, v_cache)
    return _launch(q, k_cache, v_cache, q_pos, kv_len, scale, block_table, k_cache.shape[1])


def _sparse(q: torch.Tensor, keys: torch.Tensor, selected: torch.Tensor, count: torch.Tensor, values: int,
            scale: float, table: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, T, H, L] over each token's selected keys (one key head; values: their first `values` channels): token
    (b, t) is one query row block of the attention kernel, its H heads the rows, its `count` selected positions the
    key slots, in order -> [B, T, H, values]. The key tiles and arithmetic are the dense kernel's."""
    b, t, h, l = q.shape
    _check(q, keys, keys[..., :values])
    n = count.reshape(b * t).clamp(min=1)
    pos = (n - 1).view(-1, 1).expand(b * t, h)
    page = keys.shape[1] if table is not None else 1
    o = _launch(q.reshape(b * t, h, 1, l), keys, keys[..., :values], pos, n, scale, table, page,
                selected.reshape(b * t, -1), t)
    return o.view(b, t, h, values)


def sparse_attention(q: torch.Tensor, latents: torch.Tensor, selected: torch.Tensor, count: torch.Tensor,
                     values: int, scale: float) -> torch.Tensor:
    """`parity.kernels.dsa.gathered`'s op without the gather: latents [B, S, 1, L] are read at the selected positions
    [B, T, K] in place; with every visible position selected, the bits of `attention` (the same key tiles)."""
    return _sparse(q, latents, selected, count, values, scale)


def sparse_attention_paged(q: torch.Tensor, pages: torch.Tensor, block_table: torch.Tensor, selected: torch.Tensor,
                           count: torch.Tensor, values: int, scale: float) -> torch.Tensor:
    """`sparse_attention` over latent pages [num_blocks, page, 1, L] (q's dtype or FP8 e4m3) through a block table
    [B, max_blocks]: the same bits as on the gathered latents."""
    return _sparse(q, pages, selected, count, values, scale, block_table)
