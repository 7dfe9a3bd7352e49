"""Kimi Delta Attention, chunked, in Triton, with a chunk grid anchored at position 0.

Per head, state S: [K, V]; per token t (as the CPU kernel): S <- diag(exp(g_t)) S;
S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = scale S^T q_t.

Chunked form (chunks of C = `CHUNK` tokens, gc = cumsum of g inside the chunk, S0 = state at the chunk start):
    L[t, j] = beta_t sum_c k_t[c] k_j[c] exp(gc_t[c] - gc_j[c])          (j < t)
    A[t, j] = scale sum_c q_t[c] k_j[c] exp(gc_t[c] - gc_j[c])          (j <= t)
    T = (I + L)^{-1};  W = T (beta k exp(gc));  U = T (beta v) - W S0
    O = (scale q exp(gc)) S0 + A U;   S_next = exp(gc_C) S0 + (k exp(gc_C - gc))^T U
Five kernels: chunk-local cumsum (parallel), the 16x16 blocks of L and A (parallel; diagonal blocks
element-wise, off-diagonal blocks as dots with every exponent <= 0), the triangular solve (16x16
diagonal blocks by substitution, the rest as dots) and W, U0 (parallel), the state walk over chunks
(sequential per head and V block) and the outputs (parallel). Intermediates are fp32 except W and
k exp(gc_C - gc), stored in the input dtype (bf16 inputs: half the bytes the state walk reads per chunk;
each element is rounded on its own, so the rounding cannot depend on other rows). Dots run on tensor cores for
either input dtype (`tensor_core_precision`: tf32 for bf16 inputs, tf32x3 for the fp32 q, k the model passes), not as fp32
FMA loops on the CUDA cores.

Invariant (the parity contract's KDA technique): the grid of chunks is anchored at absolute position 0
and the state is carried only at chunk boundaries. Every row-t quantity above (L, A, T, W, U, O rows)
depends only on tokens <= t of its chunk: the matrices are lower triangular and the entries past t are
exact zeros multiplying finite values, so whether the rest of the chunk holds real tokens (prefill) or
zero padding (decode) does not change row t. The tokens of an unfinished chunk are kept in
`KDAChunkState` and the chunk is recomputed with the same kernels as tokens arrive, so prefill, chunked
prefill at any split, decode, and resuming from a saved `KDAChunkState` give the same bits; each
(sequence, head) is computed by its own programs, so batch size and composition never matter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from parity.kernels.triton._common import INTERPRET, check_dtype, mma, pow2, tensor_core_precision

CHUNK = 64
SUB = 16  # sub-block of the L / A matrices
DIAG_K = 32  # key channels per step of the element-wise diagonal blocks
STATE_BV = 32  # V columns of the state per program in the sequential walk (fixed: part of the bits)
OUT_BV = 64  # V columns per program of the output kernel


@dataclass
class KDAChunkState:
    """A sequence batch's KDA state: S after the last complete chunk (positions multiple of CHUNK from 0)
    and the inputs of the unfinished chunk (first n[b] rows of each pending tensor)."""

    state: torch.Tensor  # [B, H, K, V] fp32
    q: torch.Tensor  # [B, CHUNK, H, K]
    k: torch.Tensor  # [B, CHUNK, H, K]
    v: torch.Tensor  # [B, CHUNK, H, V]
    g: torch.Tensor  # [B, CHUNK, H, K]
    beta: torch.Tensor  # [B, CHUNK, H]
    n: torch.Tensor  # [B] int64, pending tokens

    @classmethod
    def at_boundary(cls, state: torch.Tensor, q: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> KDAChunkState:
        """A state with no pending tokens (a new sequence, or S saved exactly at a chunk boundary)."""
        b, h, k, dv = state.shape
        z = lambda *s, like: torch.zeros(*s, dtype=like.dtype, device=state.device)  # noqa: E731
        return cls(state.to(torch.float32), z(b, CHUNK, h, k, like=q), z(b, CHUNK, h, k, like=q),
                   z(b, CHUNK, h, dv, like=v), z(b, CHUNK, h, k, like=g), z(b, CHUNK, h, like=beta),
                   torch.zeros(b, dtype=torch.long, device=state.device))

    def clone(self) -> KDAChunkState:
        return KDAChunkState(*(t.clone() for t in (self.state, self.q, self.k, self.v, self.g, self.beta, self.n)))


# --- kernels --------------------------------------------------------------------------------------

@triton.jit
def _cumsum_kernel(g_ptr, gc_ptr, len_ptr, H, K, sgb, sgt, sgh, scb, sct, sch, C: tl.constexpr, BK: tl.constexpr):
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    n = tl.load(len_ptr + b)
    if c * C < n:
        t = c * C + tl.arange(0, C)
        kk = tl.arange(0, BK)
        g = tl.load(g_ptr + b * sgb + t[:, None].to(tl.int64) * sgt + h * sgh + kk[None, :],
                    mask=(t[:, None] < n) & (kk[None, :] < K), other=0.0).to(tl.float32)
        gc = tl.cumsum(g, axis=0)
        tl.store(gc_ptr + b * scb + t[:, None].to(tl.int64) * sct + h * sch + kk[None, :], gc, mask=kk[None, :] < K)


@triton.jit
def _blocks_kernel(q_ptr, k_ptr, gc_ptr, beta_ptr, akk_ptr, aqk_ptr, len_ptr, H, K, scale,
                   sqb, sqt, sqh, scb, sct, sch, sbb, sbt, sab, sat, sah,
                   C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DK: tl.constexpr,
                   PREC: tl.constexpr, INTERP: tl.constexpr):
    """Row block r of chunk c: the 16x16 blocks (r, s) of L (beta folded in) and A (scale folded in)."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    r = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    n = tl.load(len_ptr + b)
    if c * C < n:
        i = tl.arange(0, BC)
        kk = tl.arange(0, BK)
        km = kk[None, :] < K
        tr = (c * C + r * BC + i).to(tl.int64)
        rm = tr[:, None] < n
        k_r = tl.load(k_ptr + b * sqb + tr[:, None] * sqt + h * sqh + kk[None, :], mask=rm & km, other=0.0).to(tl.float32)
        q_r = tl.load(q_ptr + b * sqb + tr[:, None] * sqt + h * sqh + kk[None, :], mask=rm & km, other=0.0).to(tl.float32)
        g_r = tl.load(gc_ptr + b * scb + tr[:, None] * sct + h * sch + kk[None, :], mask=km, other=0.0)
        beta_r = tl.load(beta_ptr + b * sbb + tr * sbt + h, mask=tr < n, other=0.0).to(tl.float32)
        a_rows = b * sab + tr[:, None] * sat + h * sah
        for s in range(0, r):  # off-diagonal: exp(gc_t - gn) * exp(gn - gc_j), gn = gc at the end of block s
            tj = (c * C + s * BC + i).to(tl.int64)
            jm = tj[:, None] < n
            k_s = tl.load(k_ptr + b * sqb + tj[:, None] * sqt + h * sqh + kk[None, :], mask=jm & km, other=0.0).to(tl.float32)
            g_s = tl.load(gc_ptr + b * scb + tj[:, None] * sct + h * sch + kk[None, :], mask=km, other=0.0)
            gn = tl.load(gc_ptr + b * scb + tl.cast(c * C + s * BC + BC - 1, tl.int64) * sct + h * sch + kk, mask=kk < K, other=0.0)
            dec_r = tl.exp(g_r - gn[None, :])
            ks = k_s * tl.exp(gn[None, :] - g_s)
            zero = tl.zeros((BC, BC), dtype=tl.float32)
            akk = mma(k_r * dec_r, tl.trans(ks), zero, PREC, INTERP) * beta_r[:, None]
            aqk = mma(q_r * dec_r, tl.trans(ks), zero, PREC, INTERP) * scale
            tl.store(akk_ptr + a_rows + (s * BC + i)[None, :], akk)
            tl.store(aqk_ptr + a_rows + (s * BC + i)[None, :], aqk)
        # diagonal block: element-wise exp(gc_t - gc_j) (any gate strength), DK channels at a time
        akk = tl.zeros((BC, BC), dtype=tl.float32)
        aqk = tl.zeros((BC, BC), dtype=tl.float32)
        lower = i[None, :] <= i[:, None]  # j <= t
        kd = tl.arange(0, DK)
        for k0 in range(0, BK, DK):
            cm = (k0 + kd)[None, :] < K
            base = b * sqb + tr[:, None] * sqt + h * sqh + (k0 + kd)[None, :]
            kt = tl.load(k_ptr + base, mask=rm & cm, other=0.0).to(tl.float32)
            qt = tl.load(q_ptr + base, mask=rm & cm, other=0.0).to(tl.float32)
            gt = tl.load(gc_ptr + b * scb + tr[:, None] * sct + h * sch + (k0 + kd)[None, :], mask=cm, other=0.0)
            diff = gt[:, None, :] - gt[None, :, :]  # [t, j, c]
            e = tl.exp(tl.where(lower[:, :, None], diff, 0.0))
            kj = kt[None, :, :] * e
            akk += tl.sum(kt[:, None, :] * kj, axis=2)
            aqk += tl.sum(qt[:, None, :] * kj, axis=2)
        strict = i[None, :] < i[:, None]
        tl.store(akk_ptr + a_rows + (r * BC + i)[None, :], tl.where(strict, akk * beta_r[:, None], 0.0))
        tl.store(aqk_ptr + a_rows + (r * BC + i)[None, :], tl.where(lower, aqk * scale, 0.0))
        zero = tl.zeros((BC, BC), dtype=tl.float32)
        for s in range(r + 1, C // BC):
            tl.store(akk_ptr + a_rows + (s * BC + i)[None, :], zero)
            tl.store(aqk_ptr + a_rows + (s * BC + i)[None, :], zero)


@triton.jit
def _diag_inverses(a_base, c, sat, C: tl.constexpr, BC: tl.constexpr):
    """The C / BC diagonal blocks of T = (I + L)^{-1}, [C / BC, BC, BC]: forward substitution inside each
    block (row i from rows < i), all blocks at once, fp32 element-wise; row i reads only L rows <= i."""
    bi = tl.arange(0, C // BC)
    ii = tl.arange(0, BC)
    rows = (c * C + bi[:, None, None] * BC + ii[None, :, None]).to(tl.int64)
    l3 = tl.load(a_base + rows * sat + bi[:, None, None] * BC + ii[None, None, :])  # L[blk BC + i, blk BC + j]
    t3 = tl.zeros((C // BC, BC, BC), dtype=tl.float32) + (ii[:, None] == ii[None, :]).to(tl.float32)[None, :, :]
    for row in range(1, BC):
        sel = ii[None, :, None] == row
        l_row = tl.sum(tl.where(sel, l3, 0.0), axis=1)  # [blocks, BC]: L[row, :] of each block
        new = -tl.sum(l_row[:, :, None] * t3, axis=1)  # -sum_k L[row, k] T[k, :]
        new = tl.where(ii[None, :] == row, 1.0, new)
        t3 = tl.where(sel, new[:, None, :], t3)
    return t3


@triton.jit
def _unit_lower_inverse(a_base, c, sat, C: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
                        INTERP: tl.constexpr):
    """T = (I + L)^{-1} for the chunk's strictly lower L ([C, C] at a_base rows c C ...), by blocks of BC:
    D = the diagonal blocks' inverses, then block row r: T[r, :r] = -T[r, r] (L[r, :r] T[:r, :r]) as two
    dots (rows outside block r see exact zeros). Row t of T reads only L rows <= t."""
    t2 = tl.reshape(_diag_inverses(a_base, c, sat, C, BC), (C, BC))  # row r: its block's row r % BC
    i = tl.arange(0, C)
    spread = ((i[None, :] % BC) == tl.arange(0, BC)[:, None]).to(tl.float32)  # [BC, C] one-hot
    zero = tl.zeros((C, C), dtype=tl.float32)
    d = mma(t2, spread, zero, "ieee", INTERP)  # t2[r, c % BC]: one non-zero product per entry, exact
    d = tl.where(i[:, None] // BC == i[None, :] // BC, d, 0.0)
    l_full = tl.load(a_base + (c * C + i)[:, None].to(tl.int64) * sat + i[None, :])
    tm = d
    for r in tl.static_range(1, C // BC):
        lr = tl.where((i[:, None] // BC == r) & (i[None, :] < r * BC), l_full, 0.0)
        tm = tm - mma(d, mma(lr, tm, zero, PREC, INTERP), zero, PREC, INTERP)
    return tm


@triton.jit
def _solve_kernel(k_ptr, v_ptr, gc_ptr, beta_ptr, akk_ptr, w_ptr, u_ptr, kh_ptr, len_ptr, H, K, V,
                  sqb, sqt, sqh, svb, svt, svh, scb, sct, sch, sbb, sbt, sab, sat, sah, swb, swt, swh, sub, sut, suh,
                  C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                  INTERP: tl.constexpr):
    """T = (I + L)^{-1} (`_unit_lower_inverse`), then W = T (beta k exp(gc)), U0 = T (beta v), and
    kh = k exp(gc_last - gc) for the state update (used for complete chunks only)."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    n = tl.load(len_ptr + b)
    if c * C < n:
        i = tl.arange(0, C)
        t = (c * C + i).to(tl.int64)
        tm = _unit_lower_inverse(akk_ptr + b * sab + h * sah, c, sat, C, BC, PREC, INTERP)
        rm = t[:, None] < n
        kk = tl.arange(0, BK)
        beta = tl.load(beta_ptr + b * sbb + t * sbt + h, mask=t < n, other=0.0).to(tl.float32)
        kt = tl.load(k_ptr + b * sqb + t[:, None] * sqt + h * sqh + kk[None, :], mask=rm & (kk[None, :] < K),
                     other=0.0).to(tl.float32)
        gt = tl.load(gc_ptr + b * scb + t[:, None] * sct + h * sch + kk[None, :], mask=kk[None, :] < K, other=0.0)
        w = mma(tm, beta[:, None] * kt * tl.exp(gt), tl.zeros((C, BK), dtype=tl.float32), PREC, INTERP)
        tl.store(w_ptr + b * swb + t[:, None] * swt + h * swh + kk[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=kk[None, :] < K)
        gl = tl.load(gc_ptr + b * scb + tl.cast(c * C + C - 1, tl.int64) * sct + h * sch + kk, mask=kk < K, other=0.0)
        kh = kt * tl.exp(gl[None, :] - gt)
        tl.store(kh_ptr + b * swb + t[:, None] * swt + h * swh + kk[None, :], kh.to(kh_ptr.dtype.element_ty),
                 mask=kk[None, :] < K)
        vv = tl.arange(0, BV)
        vt = tl.load(v_ptr + b * svb + t[:, None] * svt + h * svh + vv[None, :], mask=rm & (vv[None, :] < V),
                     other=0.0).to(tl.float32)
        u = mma(tm, beta[:, None] * vt, tl.zeros((C, BV), dtype=tl.float32), PREC, INTERP)
        tl.store(u_ptr + b * sub + t[:, None] * sut + h * suh + vv[None, :], u, mask=vv[None, :] < V)


@triton.jit
def _state_kernel(kh_ptr, gc_ptr, w_ptr, u_ptr, s0_ptr, sc_ptr, sout_ptr, len_ptr, H, K, V,
                  scb, sct, sch, swb, swt, swh, sub, sut, suh,
                  ssb, ssh, ssk, scb2, scc, sch2, sck,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """Walk the chunks of one (sequence, head, V block): save S at each chunk start, U = U0 - W S
    (in place), and advance S over complete chunks only; write S after the last complete chunk."""
    pv = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    n = tl.load(len_ptr + b)
    n_full = n // C
    n_chunks = tl.cdiv(n, C)
    kk = tl.arange(0, BK)
    vv = pv * BV + tl.arange(0, BV)
    km = kk < K
    vm = vv < V
    smask = km[:, None] & vm[None, :]
    s = tl.load(s0_ptr + b * ssb + h * ssh + kk[:, None] * ssk + vv[None, :], mask=smask, other=0.0)
    i = tl.arange(0, C)
    for c in range(0, n_chunks):
        tl.store(sc_ptr + b * scb2 + tl.cast(c, tl.int64) * scc + h * sch2 + kk[:, None] * sck + vv[None, :], s, mask=smask)
        t = (c * C + i).to(tl.int64)
        w = tl.load(w_ptr + b * swb + t[:, None] * swt + h * swh + kk[None, :], mask=km[None, :],
                    other=0.0).to(tl.float32)
        u_ptrs = u_ptr + b * sub + t[:, None] * sut + h * suh + vv[None, :]
        u0 = tl.load(u_ptrs, mask=vm[None, :], other=0.0)
        u = u0 - mma(w, s, tl.zeros((C, BV), dtype=tl.float32), PREC, INTERP)
        tl.store(u_ptrs, u, mask=vm[None, :])
        kh = tl.load(kh_ptr + b * swb + t[:, None] * swt + h * swh + kk[None, :], mask=km[None, :],
                     other=0.0).to(tl.float32)
        gl = tl.load(gc_ptr + b * scb + tl.cast(c * C + C - 1, tl.int64) * sct + h * sch + kk, mask=km, other=0.0)
        s_new = s * tl.exp(gl)[:, None] + mma(tl.trans(kh), u, tl.zeros((BK, BV), dtype=tl.float32), PREC, INTERP)
        s = tl.where(c < n_full, s_new, s)
    tl.store(sout_ptr + b * ssb + h * ssh + kk[:, None] * ssk + vv[None, :], s, mask=smask)


@triton.jit
def _output_kernel(q_ptr, gc_ptr, aqk_ptr, u_ptr, sc_ptr, o_ptr, len_ptr, H, K, V, scale,
                   sqb, sqt, sqh, scb, sct, sch, sab, sat, sah, sub, sut, suh, scb2, scc, sch2, sck, sob, sot, soh,
                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """O = (scale q exp(gc)) S_c + A U for one chunk and V block."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    pv = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    n = tl.load(len_ptr + b)
    if c * C < n:
        i = tl.arange(0, C)
        t = (c * C + i).to(tl.int64)
        kk = tl.arange(0, BK)
        km = kk[None, :] < K
        vv = pv * BV + tl.arange(0, BV)
        vm = vv[None, :] < V
        q = tl.load(q_ptr + b * sqb + t[:, None] * sqt + h * sqh + kk[None, :], mask=(t[:, None] < n) & km,
                    other=0.0).to(tl.float32)
        g = tl.load(gc_ptr + b * scb + t[:, None] * sct + h * sch + kk[None, :], mask=km, other=0.0)
        qs = scale * q * tl.exp(g)
        s = tl.load(sc_ptr + b * scb2 + tl.cast(c, tl.int64) * scc + h * sch2 + kk[:, None] * sck + vv[None, :],
                    mask=(kk[:, None] < K) & vm, other=0.0)
        a = tl.load(aqk_ptr + b * sab + t[:, None] * sat + h * sah + i[None, :])
        u = tl.load(u_ptr + b * sub + t[:, None] * sut + h * suh + vv[None, :], mask=vm, other=0.0)
        o = mma(a, u, mma(qs, s, tl.zeros((C, BV), dtype=tl.float32), PREC, INTERP), PREC, INTERP)
        tl.store(o_ptr + b * sob + t[:, None] * sot + h * soh + vv[None, :], o.to(o_ptr.dtype.element_ty), mask=vm)


# --- launcher -------------------------------------------------------------------------------------

def _chunked(q, k, v, g, beta, scale: float, s0: torch.Tensor, lens: torch.Tensor, out_dtype) -> tuple[torch.Tensor, ...]:
    """q, k, g: [B, T, H, K], v: [B, T, H, V], beta: [B, T, H] (rows t >= lens[b] are ignored), s0: [B, H, K, V]
    fp32 at a chunk boundary -> (o [B, T', H, V] with T' = chunks * C, S after the last complete chunk)."""
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    dev = q.device
    lens32 = lens.to(torch.int32).contiguous()
    n_chunks = triton.cdiv(t, CHUNK)
    tp = n_chunks * CHUNK
    bk, bv = pow2(kd), pow2(vd)
    f32 = dict(dtype=torch.float32, device=dev)
    gc = torch.empty(b, tp, h, kd, **f32)
    akk = torch.empty(b, tp, h, CHUNK, **f32)
    aqk = torch.empty(b, tp, h, CHUNK, **f32)
    w = torch.empty(b, tp, h, kd, dtype=q.dtype, device=dev)  # bf16 inputs: W and kh stored in bf16
    kh = torch.empty(b, tp, h, kd, dtype=q.dtype, device=dev)
    u = torch.empty(b, tp, h, vd, **f32)
    sc = torch.empty(b, n_chunks, h, kd, vd, **f32)
    s_out = torch.empty(b, h, kd, vd, **f32)
    o = torch.empty(b, tp, h, vd, dtype=out_dtype, device=dev)
    prec = tensor_core_precision(q.dtype)  # fp32 q, k (the model's cast points) stay on tensor cores
    common = dict(C=CHUNK, PREC=prec, INTERP=INTERPRET)
    qs = (q.stride(0), q.stride(1), q.stride(2))
    assert k.stride() == q.stride(), "q and k must share strides"
    gcs = (gc.stride(0), gc.stride(1), gc.stride(2))
    bs = (beta.stride(0), beta.stride(1))
    a_s = (akk.stride(0), akk.stride(1), akk.stride(2))
    ws = (w.stride(0), w.stride(1), w.stride(2))
    us = (u.stride(0), u.stride(1), u.stride(2))
    s0s = (s0.stride(0), s0.stride(1), s0.stride(2))
    scs = (sc.stride(0), sc.stride(1), sc.stride(2), sc.stride(3))
    _cumsum_kernel[(n_chunks, b * h)](g, gc, lens32, h, kd, g.stride(0), g.stride(1), g.stride(2), *gcs,
                                      C=CHUNK, BK=bk, num_warps=4)
    _blocks_kernel[(n_chunks, b * h, CHUNK // SUB)](q, k, gc, beta, akk, aqk, lens32, h, kd, float(scale), *qs, *gcs,
                                                    *bs, *a_s, BC=SUB, BK=bk, DK=min(DIAG_K, bk), num_warps=4, **common)
    _solve_kernel[(n_chunks, b * h)](k, v, gc, beta, akk, w, u, kh, lens32, h, kd, vd, *qs, v.stride(0), v.stride(1),
                                     v.stride(2), *gcs, *bs, *a_s, *ws, *us, BC=SUB, BK=bk, BV=bv, num_warps=8,
                                     **common)
    _state_kernel[(triton.cdiv(vd, STATE_BV), b * h)](kh, gc, w, u, s0, sc, s_out, lens32, h, kd, vd, *gcs, *ws,
                                                      *us, *s0s[:2], s0.stride(2), *scs, BK=bk,
                                                      BV=min(STATE_BV, bv), num_warps=4, num_stages=2, **common)
    _output_kernel[(n_chunks, b * h, triton.cdiv(vd, OUT_BV))](q, gc, aqk, u, sc, o, lens32, h, kd, vd, float(scale),
                                                               *qs, *gcs, *a_s, *us, *scs, o.stride(0), o.stride(1),
                                                               o.stride(2), BK=bk, BV=min(OUT_BV, bv), num_warps=8,
                                                               **common)
    return o, s_out


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
        state: torch.Tensor | KDAChunkState, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, KDAChunkState]:
    """`_kda`, also for v narrower than q, k (the bf16 model's cast points: fp32 L2-normalised q, k and bf16 v): v is
    upcast exactly and the output rounded once to v's dtype, as the CPU kernel does."""
    if v.dtype == q.dtype:
        return _kda(q, k, v, g, beta, scale, state, valid)
    o, st = _kda(q, k, v.to(q.dtype), g, beta, scale, state, valid)
    return o.to(v.dtype), st


def _kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
         state: torch.Tensor | KDAChunkState, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, KDAChunkState]:
    """q, k: [B, T, H, K], v: [B, T, H, V] (fp32 or bf16, one dtype), g: [B, T, H, K] log-decay, beta: [B, T, H];
    state: a `KDAChunkState`, or a [B, H, K, V] tensor taken to sit at a chunk boundary (a new sequence);
    valid: [B, T] bool (False = padding: no output (zeros), no state change).
    Returns (o [B, T, H, V] in v's dtype, the new `KDAChunkState`). No host synchronisation (graph-capturable)."""
    check_dtype(q, k, v)
    b, t, h, kd = q.shape
    vd = v.shape[-1]
    dev = q.device
    fresh = not isinstance(state, KDAChunkState)
    if t == 0:
        st = KDAChunkState.at_boundary(state, q, v, g, beta) if fresh else state
        return v.new_zeros(b, 0, h, vd), st.clone()
    if fresh and valid is None:  # prefill from a boundary: the inputs are the chunked sequence as they are
        lens = torch.full((b,), t, dtype=torch.long, device=dev)
        if k.stride() != q.stride():  # the kernels index q and k with one set of strides
            q, k = q.contiguous(), k.contiguous()
        o_c, s_new = _chunked(q, k, v, g, beta, scale, state.to(torch.float32).contiguous(), lens, v.dtype)
        done = (t // CHUNK) * CHUNK

        def tail(x: torch.Tensor) -> torch.Tensor:
            z = x.new_zeros(b, CHUNK, *x.shape[2:])
            z[:, : t - done] = x[:, done:t]
            return z

        n_new = torch.full((b,), t - done, dtype=torch.long, device=dev)
        return o_c[:, :t], KDAChunkState(s_new, tail(q), tail(k), tail(v), tail(g), tail(beta), n_new)
    st = KDAChunkState.at_boundary(state, q, v, g, beta) if fresh else state
    if valid is None:
        valid = torch.ones(b, t, dtype=torch.bool, device=dev)
    lens = valid.sum(1)
    total = st.n + lens
    # combined sequence per row: the pending tokens, then this call's valid tokens in order, then zeros;
    # its length is a static bound (no host sync): at most CHUNK - 1 pending tokens
    tc = t if fresh else t + CHUNK - 1
    tau = torch.arange(tc, device=dev).view(1, -1)
    src = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # valid positions first, in order
    rank = tau - st.n.view(-1, 1)  # index among this call's valid tokens
    from_new = (rank >= 0) & (rank < lens.view(-1, 1))
    from_old = tau < st.n.view(-1, 1)
    new_idx = src.gather(1, rank.clamp(0, t - 1))
    old_idx = tau.clamp(max=CHUNK - 1).expand(b, -1)

    def combine(x: torch.Tensor, pend: torch.Tensor) -> torch.Tensor:
        tail = x.shape[2:]
        ex = lambda i: i.view(b, -1, *([1] * len(tail))).expand(b, i.shape[1], *tail)  # noqa: E731
        xn = x.gather(1, ex(new_idx))
        xo = pend.to(x.dtype).gather(1, ex(old_idx))
        shp = (b, -1, *([1] * len(tail)))
        return torch.where(from_old.view(shp), xo, torch.where(from_new.view(shp), xn, 0.0))

    qc, kc, vc, gcomb, bc = (combine(x, p) for x, p in ((q, st.q), (k, st.k), (v, st.v), (g, st.g), (beta, st.beta)))
    o_c, s_new = _chunked(qc, kc, vc, gcomb, bc, scale, st.state.contiguous(), total, v.dtype)
    # outputs back to this call's positions
    vrank = (torch.cumsum(valid.to(torch.long), 1) - 1 + st.n.view(-1, 1)).clamp(min=0)
    o = o_c.gather(1, vrank.view(b, t, 1, 1).expand(b, t, h, vd))
    o = torch.where(valid.view(b, t, 1, 1), o, 0.0)
    # the unfinished chunk becomes the pending inputs
    done = (total // CHUNK) * CHUNK
    n_new = total - done
    j = torch.arange(CHUNK, device=dev).view(1, -1)
    pidx = (done.view(-1, 1) + j).clamp(max=tc - 1)
    keep = j < n_new.view(-1, 1)

    def pending(x: torch.Tensor) -> torch.Tensor:
        tail = x.shape[2:]
        got = x.gather(1, pidx.view(b, CHUNK, *([1] * len(tail))).expand(b, CHUNK, *tail))
        return torch.where(keep.view(b, CHUNK, *([1] * len(tail))), got, 0.0)

    new = KDAChunkState(s_new, pending(qc), pending(kc), pending(vc), pending(gcomb), pending(bc), n_new)
    return o, new
