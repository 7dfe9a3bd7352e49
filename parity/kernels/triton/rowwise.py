"""Row-wise and element-wise ops in Triton: RMSNorm, gated RMSNorm, L2 norm, sigmoid, SiLU/SiTU GLU,
the KDA gate. fp32 arithmetic, output in the input dtype (the KDA gate outputs fp32).

Invariant: a row is reduced inside one program, over a block of fixed width (the next power of two of
the row length, zero-padded); each program holds a fixed number of rows, a function of the row length
only. Every row of a block is laid out across threads the same way, so its reduction tree is the same
whatever the number of rows or the row's place in the batch. Element-wise ops compute each element
with the same instruction sequence wherever it sits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parity.kernels.triton._common import (check_dtype, check_weights, row_blocks, sigmoid_f32, softplus_f32,
                                           tanh_f32)

ELEM_BLOCK = 1024


@triton.jit(do_not_specialize=["M"])
def _norm_kernel(x_ptr, g_ptr, w_ptr, y_ptr, M, D, sx, sg, sy, eps,
                 KIND: tl.constexpr, HAS_W: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    """KIND 0: rmsnorm, 1: gated rmsnorm (sigmoid gate), 2: l2norm (x * rsqrt(sum x^2 + eps))."""
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = (rows[:, None] < M) & (cols[None, :] < D)
    x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ss = tl.sum(x * x, axis=1)
    if KIND == 2:
        y = x * tl.rsqrt(ss + eps)[:, None]
    else:
        y = x * tl.rsqrt(ss / D + eps)[:, None]
    if HAS_W:
        if KIND == 0:  # rmsnorm: the normalised value is rounded to the output dtype before the weight multiply
            y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if KIND == 1:
        g = tl.load(g_ptr + rows[:, None] * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y * sigmoid_f32(g)
    tl.store(y_ptr + rows[:, None] * sy + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [M, D] with unit stride along D (a copy only when needed)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm(x: torch.Tensor, gate: torch.Tensor | None, w: torch.Tensor | None, eps: float, kind: int) -> torch.Tensor:
    check_dtype(*(t for t in (x, gate) if t is not None))
    check_weights(w)
    d = x.shape[-1]
    x2 = _rows(x)
    g2 = _rows(gate) if gate is not None else x2
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if m:
        br, bd, warps = row_blocks(d)
        _norm_kernel[(triton.cdiv(m, br),)](x2, g2, w if w is not None else x2, y, m, d, x2.stride(0), g2.stride(0),
                                           y.stride(0), float(eps), KIND=kind, HAS_W=w is not None, BR=br, BD=bd,
                                           num_warps=warps)
    return y.view(x.shape)


def rmsnorm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x: [..., D], w: [D] or None -> x * rsqrt(mean(x^2) + eps) * w."""
    return _norm(x, None, w, eps, 0)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(x) * w * sigmoid(gate) (the KDA output norm)."""
    return _norm(x, gate, w, eps, 1)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dim."""
    from parity.kernels.norms import L2_EPS

    return _norm(x, None, None, L2_EPS, 2)


# --- element-wise ---------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["n"])
def _elementwise_kernel(a_ptr, b_ptr, p_ptr, q_ptr, y_ptr, n, HK, KDIM, c0, c1,
                        OP: tl.constexpr, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    """OP 0: sigmoid(a). 1: silu(a) * b. 2: SiTU: c0 tanh(a / c0) sigmoid(a) * (c1 tanh(b / c1) if FLAG else b).
    3: KDA gate of f = a with A_log p [H] and dt_bias q [H*K]: -exp(A_log) softplus(f + dt_bias), or with a
    lower bound (FLAG) c0 * sigmoid(exp(A_log) (f + dt_bias))."""
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if OP == 0:
        y = sigmoid_f32(a)
    elif OP == 1:
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = a * sigmoid_f32(a) * b
    elif OP == 2:
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = c0 * tanh_f32(a / c0) * sigmoid_f32(a)
        if FLAG:
            b = c1 * tanh_f32(b / c1)
        y = g * b
    else:
        hk = offs % HK
        alog = tl.load(p_ptr + hk // KDIM, mask=mask, other=0.0).to(tl.float32)
        bias = tl.load(q_ptr + hk, mask=mask, other=0.0).to(tl.float32)
        A = tl.exp(alog)
        if FLAG:
            y = c0 * sigmoid_f32(A * (a + bias))
        else:
            y = -A * softplus_f32(a + bias)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _elementwise(op: int, a: torch.Tensor, b: torch.Tensor | None = None, p: torch.Tensor | None = None,
                 q: torch.Tensor | None = None, hk: int = 1, kdim: int = 1, c0: float = 1.0, c1: float = 1.0,
                 flag: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    a = a.contiguous()
    b = b.contiguous() if b is not None else a
    y = torch.empty(a.shape, dtype=out_dtype or a.dtype, device=a.device)
    n = a.numel()
    if n:
        _elementwise_kernel[(triton.cdiv(n, ELEM_BLOCK),)](a, b, p if p is not None else a, q if q is not None else a,
                                                          y, n, hk, kdim, float(c0), float(c1), OP=op, FLAG=flag,
                                                          BLOCK=ELEM_BLOCK, num_warps=4)
    return y


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x))."""
    check_dtype(x)
    return _elementwise(0, x)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    check_dtype(gate, up)
    return _elementwise(1, gate, up)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """(beta tanh(gate / beta) sigmoid(gate)) * (linear_beta tanh(up / linear_beta), or up when None)."""
    check_dtype(gate, up)
    return _elementwise(2, gate, up, c0=beta, c1=linear_beta or 1.0, flag=linear_beta is not None)


def kda_gate(f: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """f: [..., H, K], a_log: [H], dt_bias: [H, K] -> log-decay g [..., H, K] in fp32 (formulas as the CPU kernel)."""
    h, k = f.shape[-2], f.shape[-1]
    return _elementwise(3, f, p=a_log.contiguous(), q=dt_bias.contiguous().view(-1), hk=h * k, kdim=k,
                        c0=lower_bound if lower_bound is not None else 1.0, flag=lower_bound is not None,
                        out_dtype=torch.float32)
