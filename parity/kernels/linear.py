"""Linear layers: y = x W^T (+ LoRA term), in x's dtype (fp32 or bf16), products and sums in fp32.

bf16: operands are upcast to fp32 (exact), every product of two bf16 values is exact in fp32, sums run in
fp32 and the result is rounded to bf16 once (round to nearest even): a bf16 GEMM with fp32 accumulation,
its order fixed by the tiling below. fp32: nothing is cast.

Invariant form (`tiled_matmul`): rows are zero-padded to whole tiles of `TILE_ROWS`, outputs narrower than
`MIN_COLUMNS` are zero-padded to that width, and the reduction dim K is cut into S segments: one, or for the
projections tensor parallelism splits along K (`parity.weights.ROW_PARALLEL`, passed `segments=k_segments(K)` by the
model) a fixed count that depends on K alone. Each segment is one `bmm` whose every GEMM has the same shape
(TILE_ROWS, K/S) x (K/S, N), so no row's reduction order depends on how many rows the batch has (MKL's sgemm
otherwise treats the trailing `M mod 4` rows differently); the segment partials are added by `pairwise_sum`
(adjacent pairs, level by level).
That rows inside a tile are independent of their position in it, and columns of the width of the matrix, are
properties of the BLAS micro-kernel, not of this code: observed for MKL's paths on AVX2 and AVX-512 CPUs
(`tests/invariance/test_kernels.py` runs the properties on each path the host has) and checked on any machine by
`zerokl parity kernels` (`parity/host_check.py`).

Tensor parallelism: a contiguous, aligned block of segments is a subtree of the pairwise sum, so a rank that holds
K/TP of the reduction (TP dividing the segment count) computes its subtree with `tiled_matmul(x, w, segments / TP)`
and the ranks' partials, added by `pairwise_sum` in rank order, give the one-process bits (trainer/megatron/forward.py).

Autograd (`gemm`): the forward is the invariant GEMM; the backward is one tiled GEMM per gradient in fp32, each cast
to its input's dtype: grad_x = g W (rows: tokens) and grad_W = g^T x (rows: output channels, the reduction over all
tokens in one GEMM: no [tiles, K, N] partials). Plain sgemm would do, but MKL gives its products with few rows or a
short reduction other bits on another thread count. Gradients are exact to fp32 rounding, not batch-invariant, and
deterministic: the same bits on a rerun, on any thread count (observed for MKL, like the forward's properties).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from parity.kernels.primitives import needs_grad, wide
from parity.quant.mxfp4 import MXFP4Weight

TILE_ROWS = 16
MIN_COLUMNS = 16  # MKL's sgemm takes another path for outputs narrower than ~12 columns
K_SEGMENTS = 8  # segments of a reduction; the tensor-parallel sizes that split one are its divisors
MIN_SEGMENT = 8  # shorter reductions (K < K_SEGMENTS * MIN_SEGMENT, or K not a multiple of K_SEGMENTS) are one segment


@dataclass(frozen=True)
class LoRA:
    """A LoRA term scale * (x A^T) B^T; a: [r, K] fp32, b: [N, r] fp32."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def k_segments(k: int) -> int:
    """The number of fixed segments a reduction of length `k` is cut into (a function of `k` alone)."""
    return K_SEGMENTS if k % K_SEGMENTS == 0 and k >= K_SEGMENTS * MIN_SEGMENT else 1


def pairwise_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """parts[0] + ... + parts[n-1] (n a power of two) as adjacent pairs, level by level: ((p0 + p1) + (p2 + p3)) ...
    Any contiguous block of 2^j parts starting at a multiple of 2^j is summed as one subtree."""
    if len(parts) & (len(parts) - 1):
        raise ValueError(f"pairwise_sum needs a power-of-two count of parts, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def tiled_matmul(x: torch.Tensor, w: torch.Tensor, segments: int = 1) -> torch.Tensor:
    """x: [M, K], w: [N, K], same dtype -> x w^T [M, N] by the invariant form: `segments` segment GEMMs of shape
    (TILE_ROWS, K / segments, max(N, MIN_COLUMNS)), added by `pairwise_sum`."""
    m, k = x.shape
    n = w.shape[0]
    if m == 0:
        return x.new_zeros(0, n)
    if n < MIN_COLUMNS:
        w = F.pad(w, (0, 0, 0, MIN_COLUMNS - n))
    pad = (-m) % TILE_ROWS
    tiles = F.pad(x, (0, 0, 0, pad)).view(-1, TILE_ROWS, k)  # [n_tiles, TILE_ROWS, K]
    n_tiles, n_out = tiles.shape[0], w.shape[0]
    if segments == 1:
        out = torch.bmm(tiles, w.t().expand(n_tiles, k, n_out))
    else:  # one bmm per segment over every tile (the weight's segment expanded, never copied: a copied weight
        # batch takes another path in MKL_CBWR=COMPATIBLE mode and changes the bits)
        width = k // segments
        parts = []
        for s in range(segments):
            ws = w[:, s * width : (s + 1) * width].t()  # [K/S, N]
            parts.append(torch.bmm(tiles[..., s * width : (s + 1) * width], ws.expand(n_tiles, *ws.shape)))
        out = pairwise_sum(parts)
    return out.reshape(-1, n_out)[:m, :n]


class _InvariantGEMM(torch.autograd.Function):
    """x: [M, K] fp32 (or float64), w: [N, K] (upcast here) -> x w^T [M, N] in x's dtype, unrounded."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, segments: int) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return tiled_matmul(x, w.to(x.dtype), segments)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, w_in = ctx.saved_tensors
        # Both through the tiled GEMM (rows: tokens for grad_x, output channels for grad_W; K: N, resp. the tokens):
        # MKL's plain sgemm gives products with few rows or a short reduction other bits on another thread count.
        gx = tiled_matmul(grad, w_in.to(x.dtype).t()) if ctx.needs_input_grad[0] else None
        gw = tiled_matmul(grad.t(), x.t()).to(w_in.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def gemm(x: torch.Tensor, w: torch.Tensor, segments: int = 1) -> torch.Tensor:
    """x: [M, K] fp32 (or float64), w: [N, K] any float dtype -> x w^T [M, N] in x's dtype, unrounded: the invariant
    forward of `tiled_matmul`, one tiled GEMM per gradient in the backward (module docstring)."""
    if needs_grad(x, w):
        return _InvariantGEMM.apply(x, w, segments)
    return tiled_matmul(x, w.to(x.dtype), segments)


def linear_invariant(x: torch.Tensor, w: torch.Tensor | MXFP4Weight, lora: LoRA | None = None,
                     segments: int = 1) -> torch.Tensor:
    """x: [..., K], w: [N, K] (or packed MXFP4, dequantised here, exactly) -> [..., N] in x's dtype;
    base + scale * ((x A^T) B^T), each GEMM invariant (`gemm`; the two reductions over K in `segments` segments), the
    LoRA term and the sum in fp32, one rounding to x's dtype."""
    if isinstance(w, MXFP4Weight):
        w = w.dequantize(torch.float32)
    lead = x.shape[:-1]
    x2 = wide(x.reshape(-1, x.shape[-1]))
    y = gemm(x2, w, segments)
    if lora is not None:
        y = y + gemm(gemm(x2, lora.a, segments), lora.b) * lora.scale
    return y.reshape(*lead, w.shape[0]).to(x.dtype)


def linear_fast(x: torch.Tensor, w: torch.Tensor | MXFP4Weight, lora: LoRA | None = None,
                segments: int = 1) -> torch.Tensor:
    """Plain `F.linear` in x's dtype (row bits depend on the batch's row count; no fixed K order, so `segments` has no
    meaning here)."""
    if isinstance(w, MXFP4Weight):
        w = w.dequantize(x.dtype)
    y = F.linear(x, w.to(x.dtype))
    if lora is not None:
        y = y + F.linear(F.linear(x, lora.a.to(x.dtype)), lora.b.to(x.dtype)) * lora.scale
    return y
