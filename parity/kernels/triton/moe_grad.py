"""The grouped experts' gradient in Triton: grouped GEMMs over the forward's slot sort, the routing on the device.

Forward (`parity.kernels.triton.moe.experts`), per slot s = (token n, j) of expert e, sorted position p:
a1 = x_n w1_e^T, a3 = x_n w3_e^T (fp32), h = act(a1, a3) (x's dtype), y_s = h w2_e^T (fp32),
out_n = sum_j weights[n, j] y_(n, j). Given g = d loss / d out (fp32 here):
- d weights[n, j] = <g_n, y_(n, j)>;
- gy_p = weights[s] g_n, rounded to x's dtype (the operand of the next GEMMs, as a bf16 autograd graph has it);
- gh = gy w2_e, then ga1 = gh act_a(a1, a3), ga3 = gh act_b(a1, a3) in one kernel (`_down_grad_kernel`; stored in
  x's dtype);
- dx_s = ga1 w1_e + ga3 w3_e (fp32, `_up_grad_kernel`), dx_n = sum over j in slot order;
- dw1_e = ga1^T x, dw3_e = ga3^T x, dw2_e = gy^T h over the expert's rows (`_weight_grad_kernel`; fp32).

Invariant: deterministic. Every sum has one order fixed by the shapes and the routing alone: GEMMs reduce in BK
steps over a fixed range (a weight gradient walks its expert's sorted rows from the first to the last), the slot sum
and the weights' dot products are torch reductions over fixed shapes. Nothing is read back to the host (the tile
bound is the forward's), so the step runs under a CUDA graph or sync-debug mode. Not batch invariant (a weight
gradient sums over the batch), which a gradient need not be. `experts_grad_reference` is the plain float64 reading.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from parity.kernels.moe import expert_counts
from parity.kernels.primitives import needs_grad
from parity.kernels.triton._common import INTERPRET, dot_precision, mma, sigmoid_f32, tanh_f32
from parity.kernels.triton.moe import BLOCK_M, ExpertsPass, _tile_rows, combine_into, experts, experts_pass
from parity.quant.mxfp4 import MXFP4Weight


@triton.jit
def _act_grad(gh, a, b, ACT: tl.constexpr, C0, C1, CLIP_UP: tl.constexpr):
    """(d/da, d/db) of `moe._act`(a, b) times gh, in fp32."""
    s = sigmoid_f32(a)
    if ACT == 0:  # silu(a) b
        ga = gh * b * s * (1.0 + a * (1.0 - s))
        gb = gh * a * s
    else:  # SiTU: C0 tanh(a / C0) sigmoid(a) * up(b)
        t = tanh_f32(a / C0)
        g = C0 * t * s
        dg = (1.0 - t * t) * s + g * (1.0 - s)
        if CLIP_UP:
            tb = tanh_f32(b / C1)
            u = C1 * tb
            du = 1.0 - tb * tb
        else:
            u = b
            du = 1.0
        ga = gh * dg * u
        gb = gh * g * du
    return ga, gb


@triton.jit
def _down_grad_kernel(gy_ptr, w2_ptr, a1_ptr, a3_ptr, ga1_ptr, ga3_ptr, t_exp_ptr, t_start_ptr, t_rows_ptr, L, I,
                      sw_e, C0, C1, ACT: tl.constexpr, CLIP_UP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """gh[p] = gy[p] w2_e ([L] -> [I]) for the tile's sorted positions p, then ga1, ga3 = `_act_grad` at a1[p], a3[p].
    gy, a1, a3, ga1, ga3: row-major by sorted position; w2_e: [L, I] row-major."""
    expert, nrows, rmask, pos = _tile_rows(t_exp_ptr, t_start_ptr, t_rows_ptr, BM)
    if nrows == 0:
        return
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, L, BK):
        kmask = rk + k0 < L
        a = tl.load(gy_ptr + pos[:, None] * L + (k0 + rk)[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w2_ptr + expert * sw_e + (k0 + rk)[:, None] * I + rn[None, :],
                    mask=kmask[:, None] & (rn[None, :] < I), other=0.0)
        acc = mma(a, b, acc, PREC, INTERP)
    mask = rmask[:, None] & (rn[None, :] < I)
    cell = pos[:, None] * I + rn[None, :]
    a1 = tl.load(a1_ptr + cell, mask=mask, other=0.0)
    a3 = tl.load(a3_ptr + cell, mask=mask, other=0.0)
    ga1, ga3 = _act_grad(acc, a1, a3, ACT, C0, C1, CLIP_UP)
    tl.store(ga1_ptr + cell, ga1.to(ga1_ptr.dtype.element_ty), mask=mask)
    tl.store(ga3_ptr + cell, ga3.to(ga3_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _up_grad_kernel(ga1_ptr, ga3_ptr, w1_ptr, w3_ptr, dx_ptr, order_ptr, t_exp_ptr, t_start_ptr, t_rows_ptr, L, I,
                    sw_e, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                    INTERP: tl.constexpr):
    """dx[slot] = ga1[p] w1_e + ga3[p] w3_e ([I] -> [L], fp32; slot = order[p]), the two products of each BK block of
    I added in turn. w1_e, w3_e: [I, L] row-major."""
    expert, nrows, rmask, pos = _tile_rows(t_exp_ptr, t_start_ptr, t_rows_ptr, BM)
    if nrows == 0:
        return
    slot = tl.load(order_ptr + pos, mask=rmask, other=0)
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        kmask = rk + k0 < I
        amask = rmask[:, None] & kmask[None, :]
        bmask = kmask[:, None] & (rn[None, :] < L)
        ga1 = tl.load(ga1_ptr + pos[:, None] * I + (k0 + rk)[None, :], mask=amask, other=0.0)
        w1 = tl.load(w1_ptr + expert * sw_e + (k0 + rk)[:, None] * L + rn[None, :], mask=bmask, other=0.0)
        acc = mma(ga1, w1, acc, PREC, INTERP)
        ga3 = tl.load(ga3_ptr + pos[:, None] * I + (k0 + rk)[None, :], mask=amask, other=0.0)
        w3 = tl.load(w3_ptr + expert * sw_e + (k0 + rk)[:, None] * L + rn[None, :], mask=bmask, other=0.0)
        acc = mma(ga3, w3, acc, PREC, INTERP)
    tl.store(dx_ptr + slot[:, None] * L + rn[None, :], acc, mask=rmask[:, None] & (rn[None, :] < L))


@triton.jit
def _weight_grad_kernel(a_ptr, b_ptr, out_ptr, start_ptr, count_ptr, NA, NB, BA: tl.constexpr, BB: tl.constexpr,
                        BK: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """out[e] = a[rows]^T b[rows] ([NA, NB], fp32) over expert e's sorted rows start[e] .. start[e] + count[e] - 1 in
    order, BK rows a step (zeros for an expert no row chose). a: [P, NA], b: [P, NB] row-major."""
    expert = tl.program_id(0).to(tl.int64)
    tiles_b = tl.cdiv(NB, BB)
    ra = ((tl.program_id(1) // tiles_b) * BA + tl.arange(0, BA)).to(tl.int64)
    rb = ((tl.program_id(1) % tiles_b) * BB + tl.arange(0, BB)).to(tl.int64)
    start = tl.load(start_ptr + expert)
    end = start + tl.load(count_ptr + expert)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BA, BB), dtype=tl.float32)
    for p0 in range(start, end, BK):
        rows = (p0 + rk).to(tl.int64)
        kmask = rows < end
        at = tl.load(a_ptr + rows[None, :] * NA + ra[:, None], mask=kmask[None, :] & (ra[:, None] < NA), other=0.0)
        bt = tl.load(b_ptr + rows[:, None] * NB + rb[None, :], mask=kmask[:, None] & (rb[None, :] < NB), other=0.0)
        acc = mma(at, bt, acc, PREC, INTERP)
    tl.store(out_ptr + expert * NA * NB + ra[:, None] * NB + rb[None, :], acc,
             mask=(ra[:, None] < NA) & (rb[None, :] < NB))


BN, BK = 64, 64


def _dense(w: torch.Tensor | MXFP4Weight, dtype: torch.dtype) -> torch.Tensor:
    """A stacked expert weight as the backward's GEMMs read it: contiguous, in the activations' dtype (packed MXFP4
    dequantised: exact)."""
    return (w.dequantize(dtype) if isinstance(w, MXFP4Weight) else w.to(dtype)).contiguous()


def _weight_grad(a: torch.Tensor, b: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[E, NA, NB] fp32: per expert, a[rows]^T b[rows] over its sorted rows (`_weight_grad_kernel`)."""
    na, nb = a.shape[1], b.shape[1]
    out = torch.empty(starts.numel(), na, nb, dtype=torch.float32, device=a.device)
    ba = 16 if INTERPRET else 64
    grid = (starts.numel(), triton.cdiv(na, ba) * triton.cdiv(nb, ba))
    _weight_grad_kernel[grid](a, b, out, starts, counts, na, nb, BA=ba, BB=ba, BK=16 if INTERPRET else BK,
                              PREC=dot_precision(a.dtype), INTERP=INTERPRET, num_warps=4, num_stages=3)
    return out


def _routing_weight_grad(g: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """d weights[n, j] = <g_n, y_(n, j)> for g: [N, L] fp32 and the slots' fp32 outputs y: [N * k, L] -> [N, k]."""
    return (g.unsqueeze(1) * y.view(g.shape[0], k, -1)).sum(-1)


def experts_grad(kept: ExpertsPass, g: torch.Tensor, need: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
    """(d x, d weights, d w1, d w3, d w2) of one `experts_pass` for g = d loss / d out ([N, L]), each in its
    input's dtype (None where `need`, in that order, is False; packed weights get none)."""
    x, dtype = kept.x, kept.x.dtype
    n, k = kept.ids.shape
    n_exp, inter, lat = kept.w1.shape
    g = g.float()
    order = kept.order
    tok = order // k
    d_weights = _routing_weight_grad(g, kept.y, k) if need[1] else None
    gy = (kept.weights.reshape(-1).float()[order].unsqueeze(1) * g[tok]).to(dtype)  # by sorted position
    w1, w3, w2 = (_dense(w, dtype) for w in (kept.w1, kept.w3, kept.w2))
    ga1, ga3 = (torch.empty(n * k, inter, dtype=dtype, device=x.device) for _ in range(2))
    t_exp, t_start, t_rows = kept.tiles
    prec, n_tiles = dot_precision(dtype), t_exp.numel()
    if n:
        _down_grad_kernel[(n_tiles, triton.cdiv(inter, BN))](
            gy, w2, kept.a1, kept.a3, ga1, ga3, t_exp, t_start, t_rows, lat, inter, w2.stride(0),
            float(kept.beta), float(kept.linear_beta or 1.0), ACT=0 if kept.act == "silu" else 1,
            CLIP_UP=kept.linear_beta is not None, BM=BLOCK_M, BN=BN, BK=BK, PREC=prec, INTERP=INTERPRET,
            num_warps=4, num_stages=3)
    d_x = None
    if need[0]:
        dx = torch.empty(n * k, lat, dtype=torch.float32, device=x.device)
        if n:
            _up_grad_kernel[(n_tiles, triton.cdiv(lat, BN))](
                ga1, ga3, w1, w3, dx, order, t_exp, t_start, t_rows, lat, inter, w1.stride(0), BM=BLOCK_M, BN=BN,
                BK=BK, PREC=prec, INTERP=INTERPRET, num_warps=4, num_stages=3)
        d_x = dx.view(n, k, lat).sum(1).to(dtype)
    grads: list[torch.Tensor | None] = [None, None, None]
    if any(need[2:]):
        counts = expert_counts(kept.ids.reshape(-1), n_exp)
        starts = torch.cumsum(counts, 0) - counts
        xs = x[tok]
        for i, (a, b) in enumerate(((ga1, xs), (ga3, xs), (gy, kept.h))):
            if need[2 + i]:
                grads[i] = _weight_grad(a, b, starts, counts)
    return (d_x, d_weights, *grads)


class _GroupedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weights: torch.Tensor, w1: Any, w3: Any, w2: Any, ids: torch.Tensor,
                spec: tuple) -> torch.Tensor:
        out, kept = experts_pass(x, ids, weights, w1, w3, w2, *spec, keep=True)
        ctx.kept = kept
        ctx.dtypes = [t.dtype if isinstance(t, torch.Tensor) else None for t in (x, weights, w1, w3, w2)]
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        need = tuple(ctx.needs_input_grad[:5])
        grads = experts_grad(ctx.kept, g, need)
        out = tuple(None if t is None else t.to(dt) for t, dt in zip(grads, ctx.dtypes))
        return (*out, None, None)


def experts_trainable(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor | MXFP4Weight,
                      w3: torch.Tensor | MXFP4Weight, w2: torch.Tensor | MXFP4Weight, act: str = "situ",
                      beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """`experts` (its signature and forward bits), differentiable in x, weights, w1, w3 and w2 through
    `experts_grad` when a gradient is recorded."""
    tensors = [t for t in (x, weights, w1, w3, w2) if isinstance(t, torch.Tensor)]
    if not needs_grad(*tensors):
        return experts(x, ids, weights, w1, w3, w2, act, beta, linear_beta)
    return _GroupedExperts.apply(x, weights, w1, w3, w2, ids, (act, beta, linear_beta))


class _ExpertOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w1: Any, w3: Any, w2: Any, ids: torch.Tensor, spec: tuple) -> torch.Tensor:
        ones = torch.ones(ids.shape, dtype=torch.float32, device=x.device)
        ctx.kept = experts_pass(x, ids, ones, w1, w3, w2, *spec, keep=True)[1]
        ctx.dtypes = [t.dtype if isinstance(t, torch.Tensor) else None for t in (x, w1, w3, w2)]
        return ctx.kept.y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        need = ctx.needs_input_grad
        d_x, _, *dw = experts_grad(ctx.kept, g, (need[0], False, *need[1:4]))
        out = tuple(None if t is None else t.to(dt) for t, dt in zip((d_x, *dw), ctx.dtypes))
        return (*out, None, None)


def expert_outputs(x: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor | MXFP4Weight, w3: torch.Tensor | MXFP4Weight,
                   w2: torch.Tensor | MXFP4Weight, act: str, beta: float, linear_beta: float | None) -> torch.Tensor:
    """x: [R, L], ids: [R, 1] -> [R, L] fp32: each row's own expert output y = w2_e act(w1_e x, w3_e x), unweighted,
    with the bits `experts` gives that (token, slot) (its rows are independent), differentiable through
    `experts_grad` (g read as the weighted gradient weights * d out, which the slots' `combine_slots` returns). An
    expert-parallel rank runs this on the rows dispatched to the experts it owns."""
    return _ExpertOutputs.apply(x, w1, w3, w2, ids, (act, beta, linear_beta))


class _CombineSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(y, weights)
        return combine_into(torch.empty(weights.shape[0], y.shape[-1], dtype=dtype, device=y.device), y, weights)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, weights = ctx.saved_tensors
        n, k = weights.shape
        g = g.float()
        dy = (weights.float().unsqueeze(-1) * g.unsqueeze(1)).reshape(n * k, -1) if ctx.needs_input_grad[0] else None
        dw = _routing_weight_grad(g, y, k).to(weights.dtype) if ctx.needs_input_grad[1] else None
        return dy, dw, None


def combine_slots(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y: [N * k, L] fp32 expert outputs by slot (`expert_outputs`, gathered back to the tokens' rank), weights:
    [N, k] -> [N, L] in `dtype`: the grouped `experts` op's combine, so the bits of `experts` on the whole batch;
    differentiable (d y = weights * g in fp32, d weights = <g, y>: `experts_grad`'s)."""
    return _CombineSlots.apply(y, weights, dtype)


def experts_grad_reference(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                           w3: torch.Tensor, w2: torch.Tensor, g: torch.Tensor, act: str, beta: float,
                           linear_beta: float | None, magnitudes: bool = False) -> tuple[torch.Tensor, ...]:
    """The plain float64 reading of `experts_grad` (no rounding to x's dtype anywhere): (d x, d weights, d w1, d w3,
    d w2), one slot at a time. `magnitudes`: the same sums over absolute values of every factor (the scale of each
    result's rounding error, for a bound derived from the arithmetic)."""
    f = (lambda t: t.double().abs()) if magnitudes else (lambda t: t.double())
    x, weights, w1, w3, w2, g = (t.double() for t in (x, weights, w1, w3, w2, g))
    n, k = ids.shape
    d_x, d_w = torch.zeros_like(x), torch.zeros_like(weights)
    d1, d3, d2 = torch.zeros_like(w1), torch.zeros_like(w3), torch.zeros_like(w2)
    for tok in range(n):
        for j in range(k):
            e = int(ids[tok, j])
            a1, a3 = w1[e] @ x[tok], w3[e] @ x[tok]
            s = torch.sigmoid(a1)
            if act == "silu":
                h, da, db = a1 * s * a3, a3 * s * (1 + a1 * (1 - s)), a1 * s
            else:
                t = torch.tanh(a1 / beta)
                gate = beta * t * s
                up, dup = (a3, torch.ones_like(a3)) if linear_beta is None else (
                    linear_beta * torch.tanh(a3 / linear_beta), 1 - torch.tanh(a3 / linear_beta) ** 2)
                h, da, db = gate * up, ((1 - t * t) * s + gate * (1 - s)) * up, gate * dup
            gy = f(weights[tok, j]) * f(g[tok])
            gh = f(w2[e]).t() @ gy
            ga1, ga3 = gh * f(da), gh * f(db)
            d_x[tok] += f(w1[e]).t() @ ga1 + f(w3[e]).t() @ ga3
            d_w[tok, j] = f(g[tok]) @ (f(w2[e]) @ f(h))
            d1[e] += torch.outer(ga1, f(x[tok]))
            d3[e] += torch.outer(ga3, f(x[tok]))
            d2[e] += torch.outer(gy, f(h))
    return d_x, d_w, d1, d3, d2
