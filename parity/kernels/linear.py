"""Linear layers: y = x W^T (+ LoRA term), in x's dtype (fp32 or bf16), products and sums in fp32.

bf16: operands are upcast to fp32 (exact), every product of two bf16 values is exact in fp32, sums run in
fp32 and the result is rounded to bf16 once (round to nearest even): a bf16 GEMM with fp32 accumulation,
its order fixed by the tiling below. fp32: nothing is cast.

Invariant form: rows are zero-padded to whole tiles of `TILE_ROWS` and every tile is one GEMM of the
same fixed shape (TILE_ROWS, K) x (K, N) inside one `bmm`, so no row's reduction order depends on how
many rows the batch has (MKL's sgemm otherwise treats the trailing `M mod 4` rows differently). That
rows inside a tile are independent of their position in it is a property of the BLAS micro-kernel, not
of this code: observed for MKL's paths on AVX2 and AVX-512 CPUs (`tests/test_kernels.py` runs the
properties on each path the host has) and checked on any machine by `zerokl parity kernels`
(`parity/host_check.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from parity.kernels.primitives import wide
from parity.quant.mxfp4 import MXFP4Weight

TILE_ROWS = 16


@dataclass(frozen=True)
class LoRA:
    """A LoRA term scale * (x A^T) B^T; a: [r, K] fp32, b: [N, r] fp32."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def tiled_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, K] fp32, w: [N, K] fp32 -> [M, N]; every GEMM has shape (TILE_ROWS, K, N)."""
    m, k = x.shape
    n = w.shape[0]
    if m == 0:
        return x.new_zeros(0, n)
    pad = (-m) % TILE_ROWS
    tiles = F.pad(x, (0, 0, 0, pad)).view(-1, TILE_ROWS, k)  # [n_tiles, TILE_ROWS, K]
    out = torch.bmm(tiles, w.t().expand(tiles.shape[0], k, n))  # [n_tiles, TILE_ROWS, N]
    return out.reshape(-1, n)[:m]


def linear_invariant(x: torch.Tensor, w: torch.Tensor | MXFP4Weight, lora: LoRA | None = None) -> torch.Tensor:
    """x: [..., K], w: [N, K] (or packed MXFP4, dequantised here, exactly) -> [..., N] in x's dtype;
    base + scale * ((x A^T) B^T), each GEMM tiled, the LoRA term and the sum in fp32, one rounding to x's dtype."""
    if isinstance(w, MXFP4Weight):
        w = w.dequantize(torch.float32)
    lead = x.shape[:-1]
    x2 = wide(x.reshape(-1, x.shape[-1]))
    y = tiled_matmul(x2, wide(w))
    if lora is not None:
        y = y + tiled_matmul(tiled_matmul(x2, wide(lora.a)), wide(lora.b)) * lora.scale
    return y.reshape(*lead, w.shape[0]).to(x.dtype)


def linear_fast(x: torch.Tensor, w: torch.Tensor | MXFP4Weight, lora: LoRA | None = None) -> torch.Tensor:
    """Plain `F.linear` in x's dtype (row bits depend on the batch's row count)."""
    if isinstance(w, MXFP4Weight):
        w = w.dequantize(x.dtype)
    y = F.linear(x, w.to(x.dtype))
    if lora is not None:
        y = y + F.linear(F.linear(x, lora.a.to(x.dtype)), lora.b.to(x.dtype)) * lora.scale
    return y
