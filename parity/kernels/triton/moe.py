"""MoE in Triton: router (noaux_tc top-k), grouped expert GEMMs with a fused SiTU/SiLU, fixed-order combine.

Invariant:
- routing: a program holds a fixed number of tokens (a function of the expert count only), each token's row
  laid out the same way; k rounds of argmax over the biased scores with ties to the lowest expert index (the CPU
  kernel's stable sort), ids returned ascending;
- expert compute sorts the (token, slot) pairs by expert (stable) and cuts each expert's rows into
  tiles of BLOCK_M rows padded with zeros; every tile is one fixed-shape GEMM, and rows of a tile are
  independent, so a row's result does not depend on which other tokens chose that expert;
- combine adds a token's k expert outputs in ascending expert-id order: w_0 y_0 + w_1 y_1 + ... (element-wise,
  so the tokens a program holds do not matter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from parity.kernels.triton._common import (INTERPRET, check_dtype, dot_precision, mma, row_blocks, sigmoid_f32,
                                           tanh_f32, weight_tile)
from parity.kernels.moe import expert_counts
from parity.quant.bf16 import holds_bf16_values
from parity.quant.mxfp4 import MXFP4Weight


# --- routing --------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["N"])
def _route_kernel(l_ptr, bias_ptr, ids_ptr, w_ptr, N, E, sl, scaling,
                  TOPK: tl.constexpr, HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr, RENORM: tl.constexpr,
                  BR: tl.constexpr, BE: tl.constexpr):
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    rm = rows < N
    e = tl.arange(0, BE)
    em = e < E
    logits = tl.load(l_ptr + rows[:, None] * sl + e[None, :], mask=rm[:, None] & em[None, :], other=0.0)
    logits = tl.where(em[None, :], logits.to(tl.float32), float("-inf"))
    if SIGMOID:
        scores = sigmoid_f32(logits)
    else:
        ex = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = ex / tl.sum(ex, axis=1)[:, None]
    biased = scores
    if HAS_BIAS:
        biased = scores + tl.load(bias_ptr + e, mask=em, other=0.0).to(tl.float32)[None, :]
    biased = tl.where(em[None, :], biased, float("-inf"))
    chosen = tl.zeros((BR, BE), dtype=tl.int1)
    for _ in tl.static_range(TOPK):
        best = tl.argmax(biased, axis=1, tie_break_left=True)
        hit = e[None, :] == best[:, None]
        chosen = chosen | hit
        biased = tl.where(hit, float("-inf"), biased)
    w = tl.where(chosen, scores, 0.0)
    if RENORM:
        w = w / tl.sum(w, axis=1)[:, None]
    w = w * scaling
    slot = tl.cumsum(chosen.to(tl.int32), axis=1) - 1  # ascending expert id -> slot 0..k-1
    out = rows[:, None] * TOPK + slot
    keep = chosen & rm[:, None]
    tl.store(ids_ptr + out, e[None, :].to(tl.int64), mask=keep)
    tl.store(w_ptr + out, w, mask=keep)


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, scaling: float,
          activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, E] -> (expert ids [N, k] int64 ascending, weights [N, k] fp32)."""
    n, e = logits.shape
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    ids = torch.empty(n, top_k, dtype=torch.long, device=logits.device)
    w = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    if n:
        br, be, warps = row_blocks(e)
        _route_kernel[(triton.cdiv(n, br),)](x, bias.contiguous() if bias is not None else x, ids, w, n, e,
                                            x.stride(0), float(scaling), TOPK=top_k, HAS_BIAS=bias is not None,
                                            SIGMOID=activation == "sigmoid", RENORM=renormalize, BR=br, BE=be,
                                            num_warps=warps)
    return ids, w


# --- grouped expert GEMMs -------------------------------------------------------------------------

# Rows per expert tile. The interpreter computes every padded row, so it takes smaller tiles (a decode step routes
# one row to an expert); parity is within one platform, and both sides of one run use the same tile.
BLOCK_M = 16 if INTERPRET else 64


def _tiles(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """Sort the N*k slots by expert (stable) and cut each expert's run into tiles of block_m rows.

    Returns (order [N*k] slot index by sorted position, tile_expert, tile_start (sorted position of the tile's first
    row), tile_rows (valid rows), each [n_tiles]). n_tiles is a bound known from the shapes alone,
    cdiv(N*k, block_m) + min(E, N*k) (each expert hit adds at most one partial tile), so nothing is read back to the
    host (CUDA-graph capturable); tiles past the real ones have 0 rows and their programs return at once. Under
    Triton's interpreter n_tiles is the exact count."""
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = expert_counts(flat, n_experts)
    starts = torch.cumsum(counts, 0) - counts
    per_expert = (counts + block_m - 1) // block_m
    ends = torch.cumsum(per_expert, 0)  # tiles of experts 0..e
    bound = -(-flat.numel() // block_m) + min(n_experts, flat.numel())
    if INTERPRET:  # CPU tensors under the interpreter, which pays per program: the exact count (no graph there)
        bound = int(ends[-1])
    tile = torch.arange(bound, device=ids.device)
    tile_expert = torch.searchsorted(ends, tile, right=True).clamp(max=n_experts - 1)
    j = tile - (ends - per_expert)[tile_expert]  # tile index within its expert
    tile_start = starts[tile_expert] + j * block_m
    tile_rows = torch.clamp(counts[tile_expert] - j * block_m, min=0, max=block_m)
    return order, tile_expert, tile_start, tile_rows


@triton.jit
def _tile_rows(t_exp_ptr, t_start_ptr, t_rows_ptr, BM: tl.constexpr):
    """Grid axis 0's expert tile (`_tiles`): (its expert, its valid row count (0: a tile past the real ones, the
    static bound's), the row mask, the rows' sorted positions)."""
    tile = tl.program_id(0)
    expert = tl.load(t_exp_ptr + tile).to(tl.int64)
    nrows = tl.load(t_rows_ptr + tile)
    r = tl.arange(0, BM)
    return expert, nrows, r < nrows, (tl.load(t_start_ptr + tile) + r).to(tl.int64)


@triton.jit
def _act(a, b, ACT: tl.constexpr, C0, C1, CLIP_UP: tl.constexpr):
    """ACT 0: silu(a) * b. 1: SiTU (C0 tanh(a / C0) sigmoid(a)) * (C1 tanh(b / C1) if CLIP_UP else b)."""
    if ACT == 0:
        y = a * sigmoid_f32(a) * b
    else:
        g = C0 * tanh_f32(a / C0) * sigmoid_f32(a)
        if CLIP_UP:
            b = C1 * tanh_f32(b / C1)
        y = g * b
    return y


@triton.jit
def _gate_up_kernel(x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, a1_ptr, a3_ptr, order_ptr, t_exp_ptr, t_start_ptr,
                    t_rows_ptr, L, I, TOPK, sx, sw_e, sw_n, ss_e, ss_n, sh, C0, C1, ACT: tl.constexpr,
                    CLIP_UP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                    INTERP: tl.constexpr, W_MXFP4: tl.constexpr, SAVE_PRE: tl.constexpr):
    """h[p] = act(x[tok] w1_e^T, x[tok] w3_e^T) for the tile's sorted positions p (tok = order[p] // k); SAVE_PRE:
    also the two fp32 products at a1[p], a3[p] (row stride I: what the gradient's activation derivative reads)."""
    expert, nrows, rmask, pos = _tile_rows(t_exp_ptr, t_start_ptr, t_rows_ptr, BM)
    if nrows == 0:
        return
    tok = tl.load(order_ptr + pos, mask=rmask, other=0) // TOPK
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, L, BK):
        kmask = rk + k0 < L
        a = tl.load(x_ptr + tok[:, None] * sx + (k0 + rk)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w1 = weight_tile(w1_ptr + expert * sw_e, s1_ptr + expert * ss_e, rn, k0, I, L, sw_n, 1, ss_n, BN, BK, W_MXFP4)
        w3 = weight_tile(w3_ptr + expert * sw_e, s3_ptr + expert * ss_e, rn, k0, I, L, sw_n, 1, ss_n, BN, BK, W_MXFP4)
        acc1 = mma(a, w1, acc1, PREC, INTERP)
        acc3 = mma(a, w3, acc3, PREC, INTERP)
    h = _act(acc1, acc3, ACT, C0, C1, CLIP_UP)
    mask = rmask[:, None] & (rn[None, :] < I)
    tl.store(h_ptr + pos[:, None] * sh + rn[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
    if SAVE_PRE:
        tl.store(a1_ptr + pos[:, None] * I + rn[None, :], acc1, mask=mask)
        tl.store(a3_ptr + pos[:, None] * I + rn[None, :], acc3, mask=mask)


@triton.jit
def _down_kernel(h_ptr, w2_ptr, s2_ptr, y_ptr, order_ptr, t_exp_ptr, t_start_ptr, t_rows_ptr, L, I, sh, sw_e, sw_n,
                 ss_e, ss_n, sy, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                 INTERP: tl.constexpr, W_MXFP4: tl.constexpr):
    """y[slot] = h[p] w2_e^T (fp32) for the tile's sorted positions p, slot = order[p]."""
    expert, nrows, rmask, pos = _tile_rows(t_exp_ptr, t_start_ptr, t_rows_ptr, BM)
    if nrows == 0:
        return
    slot = tl.load(order_ptr + pos, mask=rmask, other=0)
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        kmask = rk + k0 < I
        a = tl.load(h_ptr + pos[:, None] * sh + (k0 + rk)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = weight_tile(w2_ptr + expert * sw_e, s2_ptr + expert * ss_e, rn, k0, L, I, sw_n, 1, ss_n, BN, BK, W_MXFP4)
        acc = mma(a, b, acc, PREC, INTERP)
    tl.store(y_ptr + slot[:, None] * sy + rn[None, :], acc, mask=rmask[:, None] & (rn[None, :] < L))


@triton.jit(do_not_specialize=["N"])
def _combine_kernel(y_ptr, w_ptr, out_ptr, N, L, TOPK, BR: tl.constexpr, BL: tl.constexpr):
    """out[n] = w[n,0] y[n,0] + w[n,1] y[n,1] + ... (slots in ascending expert id)."""
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    rm = rows < N
    cols = tl.program_id(1) * BL + tl.arange(0, BL)
    mask = rm[:, None] & (cols < L)[None, :]
    out = tl.zeros((BR, BL), dtype=tl.float32)
    for j in range(0, TOPK):
        wj = tl.load(w_ptr + rows * TOPK + j, mask=rm, other=0.0)[:, None]
        yj = tl.load(y_ptr + (rows[:, None] * TOPK + j) * L + cols[None, :], mask=mask, other=0.0)
        if j == 0:
            out = wj * yj
        else:
            out = out + wj * yj
    tl.store(out_ptr + rows[:, None] * L + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _operands(w: torch.Tensor | MXFP4Weight) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int]:
    """(codes or values, scales (the values again when dense), expert stride, row stride, scale expert stride, scale
    row stride) of a stacked expert weight."""
    if isinstance(w, MXFP4Weight):
        p, s = w.packed.contiguous(), w.scale.contiguous()
        return p, s, p.stride(0), p.stride(1), s.stride(0), s.stride(1)
    w = w.contiguous()
    return w, w, w.stride(0), w.stride(1), 0, 0


@dataclass
class ExpertsPass:
    """What one forward of the grouped experts leaves for its gradient (`parity.kernels.triton.moe_grad`): the
    inputs as the GEMMs read them (x contiguous, the weights in x's dtype or packed), the slot sort and tiles, h (x's
    dtype, by sorted position), y (fp32, by slot) and the fp32 gate / up products a1, a3 (by sorted position)."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    w1: torch.Tensor | MXFP4Weight
    w3: torch.Tensor | MXFP4Weight
    w2: torch.Tensor | MXFP4Weight
    act: str
    beta: float
    linear_beta: float | None
    order: torch.Tensor
    tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    h: torch.Tensor
    y: torch.Tensor
    a1: torch.Tensor | None
    a3: torch.Tensor | None


def experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor | MXFP4Weight,
            w3: torch.Tensor | MXFP4Weight, w2: torch.Tensor | MXFP4Weight, act: str = "situ", beta: float = 4.0,
            linear_beta: float | None = 25.0) -> torch.Tensor:
    """x: [N, L], ids/weights: [N, k] (ids ascending per row, from `route`); stacked experts
    w1, w3: [E, I, L], w2: [E, L, I] (one dtype with x, or with bf16 x fp32 marked as bf16 values (`parity.quant.bf16`);
    or all three packed MXFP4, dequantised inside the GEMMs with bf16 x (the bits of the bf16 weights of those
    values) and dequantised first with fp32 x, as `linear` does) -> [N, L]:
    out_n = sum_j weights[n, j] * w2[e] act(w1[e] x_n, w3[e] x_n), e = ids[n, j], j = 0..k-1 in order.
    act: 'situ' (beta, linear_beta) or 'silu'. h = act(...) is stored in x's dtype, y in fp32."""
    return experts_pass(x, ids, weights, w1, w3, w2, act, beta, linear_beta, keep=False)[0]


def experts_pass(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor | MXFP4Weight,
                 w3: torch.Tensor | MXFP4Weight, w2: torch.Tensor | MXFP4Weight, act: str, beta: float,
                 linear_beta: float | None, keep: bool) -> tuple[torch.Tensor, ExpertsPass | None]:
    """`experts`' output and, with `keep`, its `ExpertsPass` (the same kernels and bits; the gate / up products
    are also stored)."""
    if isinstance(w1, MXFP4Weight) and x.dtype != torch.bfloat16:
        w1, w3, w2 = (w.dequantize(x.dtype) if isinstance(w, MXFP4Weight) else w for w in (w1, w3, w2))
    packed = isinstance(w1, MXFP4Weight)
    if not packed and x.dtype == torch.bfloat16:  # a trainer's stacked masters of bf16 values: the engine's weights
        w1, w3, w2 = (w.to(torch.bfloat16) if holds_bf16_values(w) else w for w in (w1, w3, w2))
    if packed:
        assert isinstance(w3, MXFP4Weight) and isinstance(w2, MXFP4Weight) and x.dtype == torch.bfloat16
        check_dtype(x)
    else:
        check_dtype(x, w1, w3, w2)
    n, k = ids.shape
    n_exp, inter, lat = w1.shape
    x = x.contiguous()
    out = torch.empty(n, lat, dtype=x.dtype, device=x.device)
    h = torch.empty(n * k, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(n * k, lat, dtype=torch.float32, device=x.device)
    a1, a3 = (torch.empty(n * k, inter, dtype=torch.float32, device=x.device) for _ in range(2)) if keep else (h, h)
    order, t_exp, t_start, t_rows = _tiles(ids, n_exp, BLOCK_M)
    kept = ExpertsPass(x, ids, weights, w1, w3, w2, act, beta, linear_beta, order, (t_exp, t_start, t_rows), h, y,
                       a1, a3) if keep else None
    if n == 0:
        return out, kept
    (w1, s1, sw_e, sw_n, ss_e, ss_n), (w3, s3, *_) = _operands(w1), _operands(w3)
    w2, s2, sw2_e, sw2_n, ss2_e, ss2_n = _operands(w2)
    n_tiles = t_exp.numel()
    prec = dot_precision(x.dtype)
    bn, bk = 64, 64
    _gate_up_kernel[(n_tiles, triton.cdiv(inter, bn))](
        x, w1, w3, s1, s3, h, a1, a3, order, t_exp, t_start, t_rows, lat, inter, k, x.stride(0), sw_e, sw_n, ss_e,
        ss_n, h.stride(0), float(beta), float(linear_beta or 1.0), ACT=0 if act == "silu" else 1,
        CLIP_UP=linear_beta is not None, BM=BLOCK_M, BN=bn, BK=bk, PREC=prec, INTERP=INTERPRET, W_MXFP4=packed,
        SAVE_PRE=keep, num_warps=4, num_stages=3)
    _down_kernel[(n_tiles, triton.cdiv(lat, bn))](
        h, w2, s2, y, order, t_exp, t_start, t_rows, lat, inter, h.stride(0), sw2_e, sw2_n, ss2_e, ss2_n, y.stride(0),
        BM=BLOCK_M, BN=bn, BK=bk, PREC=prec, INTERP=INTERPRET, W_MXFP4=packed, num_warps=4, num_stages=3)
    combine_into(out, y, weights)
    return out, kept


def combine_into(out: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[n] = w[n, 0] y[n, 0] + w[n, 1] y[n, 1] + ... in fp32, rounded to out's dtype once; y: [N * k, L] fp32 by
    slot (token n's slot j at row n k + j), weights: [N, k]. Returns out."""
    n, k = weights.shape
    lat = out.shape[1]
    if n:
        br, bl, warps = row_blocks(min(lat, 1024))  # column tiles of at most 1024
        _combine_kernel[(triton.cdiv(n, br), triton.cdiv(lat, bl))](y.contiguous(), weights.contiguous(), out, n, lat,
                                                                     k, BR=br, BL=bl, num_warps=warps)
    return out
