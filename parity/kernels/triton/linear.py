"""Invariant GEMM y = x W^T (+ scale * (x A^T) B^T) in Triton, bf16 or fp32, fp32 accumulation.

Invariant: a row's bits are a function of the row, W and the K order alone. K is cut into a fixed
number of segments (a function of K only); every output tile accumulates each segment from zero in
BLOCK_K steps, then adds the segment sums in order, total = ((0 + s_0) + s_1) + ... . Two launch shapes
compute exactly that sequence:
- fused (M > `SPLIT_MAX_M`): one program per tile walks the segments one after another;
- split (M <= `SPLIT_MAX_M`, decode): one program per (tile, segment) writes its fp32 segment sum, then counts
  itself in on the tile's arrival counter (an acquire-release atomic after a barrier); the program that arrives
  last reads the tile's sums back from L2 and adds them in segment order, so no second kernel runs,
so a row's bits are the same on both paths (the last arriver's own sum is read back too: fp32 stores are exact).
A row-parallel projection (`linear(..., segments=S)`) has S equal segments of K / S columns, whatever BLOCK_K (a
segment's last block is masked at the segment's end), so a tensor-parallel rank holding K / TP whole segments forms
their sums as one process does (`segment_sums`: the split programs' stores alone), and `combine_segments` adds all S
in order as the last arriver does: the one-process bits at 1 / TP of the GEMM's FLOPs. The rows of a tile are
independent inside the matrix instructions and padded rows are loaded as zeros, so a row's bits do not depend on how
many rows the batch has or where the row sits in it. Row counts are not specialised on (`do_not_specialize`).

Tile shapes: `gemm_config(n, k, dtype, m)` picks a 64-row tile for M <= `SPLIT_MAX_M` and a 128-row
tile above (bf16). Both share BLOCK_K and the segment rule, and on Hopper both issue the same
per-warpgroup `wgmma m64nNk16` sequence for a given row (the tile's rows and columns only change how
many such instructions run side by side), so the choice cannot move a row's bits;
tests/invariance/test_kernels_triton.py::test_gpu_linear_decode_and_prefill_tiles_bit_equal checks every pair the
table can pick with `torch.equal` over all 4096 rows, and the M = 1 ... 1000 row test crosses the switch.
The LoRA term is a second GEMM t = x A^T (stored in x's dtype) and a rank-R dot in the epilogue,
added as `base + (t B^T) * scale` like the CPU kernel.

Two load paths with the same contract: pointer loads (any strides, the interpreter) and Hopper tensor
descriptors (TMA; contiguous rows, 16-byte aligned). Which one runs is part of the per-shape config.

MXFP4 weights (`parity.quant.mxfp4.MXFP4Weight`: uint8 E2M1 code pairs and E8M0 scales) are read packed by the
pointer kernel and dequantised in registers to bf16, exactly (bits built from the code and scale, subnormals
included), then fed to the same MMA sequence as a bf16 weight of those values: the tile, K order and segments are
the bf16 config's, so an MXFP4 GEMM has the bits of the bf16 GEMM of the dequantised weight
(tests/invariance/test_kernels_triton.py checks `torch.equal`). Mixed operand dtypes (fp32 router activations on a bf16
weight) upcast the bf16 operand exactly and run the fp32 GEMM, as the CPU kernel does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from parity.kernels.linear import LoRA
from parity.kernels.triton._common import INTERPRET, check_dtype, dot_precision, mma, pow2, weight_tile
from parity.quant.bf16 import holds_bf16_values
from parity.quant.mxfp4 import GROUP, MXFP4Weight

try:  # host-side TMA descriptors (triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None


@dataclass(frozen=True)
class GemmConfig:
    """One GEMM tile configuration, chosen from the weight shape, dtype and which side of `SPLIT_MAX_M`
    the row count falls (`gemm_config`)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    warps: int = 8
    stages: int = 4
    tma: bool = False
    k_segments: int | None = None  # None: the rule in `segment_layout`


SPLIT_MAX_M = 128  # at most this many rows: one program per (tile, K segment), then an ordered add
DECODE_BF16 = GemmConfig(64, 128, 64, 8, 4, 4, tma=True)  # M <= SPLIT_MAX_M: one warpgroup, twice the programs
PREFILL_BF16 = GemmConfig(128, 256, 64, 8, 8, 4, tma=True)  # N, K >= LARGE: the sweep's best at 4096^2, 7168^2
DEFAULT_BF16 = GemmConfig(128, 128, 64, 8, 8, 4, tma=True)
DEFAULT_FP32 = GemmConfig(64, 64, 32, 8, 4, 3, k_segments=1)
LARGE = 4096
# (N, K) -> prefill config for bf16 weights, from the sweep in bench/kernels_gpu.py on the H200.
TABLE_BF16: dict[tuple[int, int], GemmConfig] = {
    (1024, 384): GemmConfig(128, 64, 64, 8, 4, 4, tma=True),  # k3-small up / gate
    (384, 1024): GemmConfig(128, 64, 64, 8, 4, 4, tma=True),  # k3-small down
}


def gemm_config(n: int, k: int, dtype: torch.dtype, m: int) -> GemmConfig:
    """The tile configuration for an (N, K) weight and M rows. bf16: `DECODE_BF16` for M <= SPLIT_MAX_M,
    else the table / size rule; every bf16 choice has BLOCK_K = 64 and the default segment rule, so a
    row's K order (and, with one wgmma shape per row, its bits) is the same whichever is picked.
    fp32: one config for every M (IEEE dots on CUDA cores)."""
    if dtype != torch.bfloat16:
        return DEFAULT_FP32
    if m <= SPLIT_MAX_M:
        return DECODE_BF16
    if (n, k) in TABLE_BF16:
        return TABLE_BF16[(n, k)]
    return PREFILL_BF16 if n >= LARGE and k >= LARGE else DEFAULT_BF16


def segment_layout(k: int, cfg: GemmConfig, count: int | None = None) -> tuple[int, int]:
    """(number of K segments, segment length) for reduction length k: a function of k, the config and `count` only.
    `count` given (a row-parallel projection: `parity.kernels.linear.k_segments`, which divides k): k / count
    columns each, whatever BLOCK_K (a segment's last block is masked at the segment's end), so a tensor-parallel
    rank holding whole segments computes them exactly as one process does. Else one segment per 1024 of K, at most 4,
    each a multiple of BLOCK_K."""
    if count is not None:
        if k % count:
            raise ValueError(f"{count} segments do not divide a reduction of {k}")
        return count, k // count
    n = cfg.k_segments or max(1, min(4, k // 1024))
    seg = triton.cdiv(triton.cdiv(k, n), cfg.block_k) * cfg.block_k
    return triton.cdiv(k, seg), seg


@triton.jit
def _tile_ids(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order (better L2 reuse); changes which program computes a tile, not its arithmetic."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _lora_epilogue(acc, t_ptr, b_ptr, rm, rn, M, N, R, stm, str_, sbn, sbr, scale,
                   BM: tl.constexpr, BN: tl.constexpr, R_PAD: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """acc + (t B^T) * scale for the tile's rows rm and columns rn (rank padded with zeros to R_PAD)."""
    rr = tl.arange(0, R_PAD)
    t = tl.load(t_ptr + rm[:, None] * stm + rr[None, :] * str_, mask=(rm[:, None] < M) & (rr[None, :] < R), other=0.0)
    b = tl.load(b_ptr + rn[None, :] * sbn + rr[:, None] * sbr, mask=(rn[None, :] < N) & (rr[:, None] < R), other=0.0)
    lora = mma(t, b, tl.zeros((BM, BN), dtype=tl.float32), PREC, INTERP)
    return acc + lora * scale


@triton.jit
def _store_y(total, y_ptr, t_ptr, b_ptr, rm, rn, M, N, sym, syn, R, stm, str_, sbn, sbr, scale,
             HAS_LORA: tl.constexpr, R_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             PREC: tl.constexpr, INTERP: tl.constexpr):
    """(+ LoRA) cast and store the tile's rows rm, columns rn of y."""
    if HAS_LORA:
        total = _lora_epilogue(total, t_ptr, b_ptr, rm, rn, M, N, R, stm, str_, sbn, sbr, scale, BM, BN, R_PAD,
                               PREC, INTERP)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, total.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ordered_total(p_ptr, cell, mask, M, N, n_seg, BM: tl.constexpr, BN: tl.constexpr):
    """((0 + s_0) + s_1) + ... of the fp32 segment sums stored at p_ptr[s] (the fused path's additions), read from
    L2 (.cg: other programs' sums are not in this SM's L1)."""
    total = tl.zeros((BM, BN), dtype=tl.float32)
    for s in range(0, n_seg):
        total = total + tl.load(p_ptr + tl.cast(s, tl.int64) * M * N + cell, mask=mask, other=0.0,
                                cache_modifier=".cg")
    return total


@triton.jit
def _epilogue(total, y_ptr, p_ptr, c_ptr, t_ptr, b_ptr, rm, rn, M, N, K, SEG, sym, syn, R, stm, str_, sbn, sbr,
              scale, SPLIT: tl.constexpr, PARTS: tl.constexpr, HAS_LORA: tl.constexpr, R_PAD: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """Not SPLIT: store y. SPLIT: store this segment's fp32 sum at p_ptr[segment]; PARTS: that is all (the sums are
    the result: `segment_sums`); else count in on the tile's counter c_ptr[tile], and the last of the tile's segments
    to arrive resets the counter and stores y = ((0 + s_0) + s_1) + ... from the stored sums, in segment order."""
    if SPLIT:
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        cell = rm[:, None] * N + rn[None, :]
        tl.store(p_ptr + tl.program_id(1).to(tl.int64) * M * N + cell, total, mask=mask)
        if not PARTS:
            n_seg = tl.cdiv(K, SEG)
            tl.debug_barrier()  # every thread's stores precede the release below
            arrived = tl.atomic_add(c_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
            if arrived == n_seg - 1:
                tl.atomic_xchg(c_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")
                total = _ordered_total(p_ptr, cell, mask, M, N, n_seg, BM, BN)
                _store_y(total, y_ptr, t_ptr, b_ptr, rm, rn, M, N, sym, syn, R, stm, str_, sbn, sbr, scale,
                         HAS_LORA, R_PAD, BM, BN, PREC, INTERP)
    else:
        _store_y(total, y_ptr, t_ptr, b_ptr, rm, rn, M, N, sym, syn, R, stm, str_, sbn, sbr, scale, HAS_LORA, R_PAD,
                 BM, BN, PREC, INTERP)


@triton.jit
def _segment_range(K, SEG, SPLIT: tl.constexpr):
    """The K segments this program sums: its own (split path, axis 1 of the grid) or all of them."""
    if SPLIT:
        s_lo = tl.program_id(1)
        s_hi = s_lo + 1
    else:
        s_lo = 0
        s_hi = tl.cdiv(K, SEG)
    return s_lo, s_hi


@triton.jit(do_not_specialize=["M"])
def _gemm_ptr_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, p_ptr, c_ptr, t_ptr, b_ptr, M, N, K, SEG, sxm, sxk, swn, swk, sws, sym,
                     syn, R, stm, str_, sbn, sbr, scale, SPLIT: tl.constexpr, PARTS: tl.constexpr,
                     HAS_LORA: tl.constexpr, R_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, GROUP_M: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
                     W_MXFP4: tl.constexpr):
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK)
    s_lo, s_hi = _segment_range(K, SEG, SPLIT)
    total = tl.zeros((BM, BN), dtype=tl.float32)
    for s in range(s_lo, s_hi):
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        end = tl.minimum(s * SEG + SEG, K)  # the segment's last block is masked here, not at K
        for k0 in range(s * SEG, end, BK):
            a = tl.load(x_ptr + rm[:, None] * sxm + (k0 + rk)[None, :] * sxk,
                        mask=(rm[:, None] < M) & (rk[None, :] + k0 < end), other=0.0)
            b = weight_tile(w_ptr, ws_ptr, rn, k0, N, end, swn, swk, sws, BN, BK, W_MXFP4)
            acc = mma(a, b, acc, PREC, INTERP)
        total = total + acc
    _epilogue(total, y_ptr, p_ptr, c_ptr, t_ptr, b_ptr, rm, rn, M, N, K, SEG, sym, syn, R, stm, str_, sbn, sbr,
              scale, SPLIT, PARTS, HAS_LORA, R_PAD, BM, BN, PREC, INTERP)


@triton.jit(do_not_specialize=["M"])
def _gemm_tma_kernel(x_desc, w_desc, y_ptr, p_ptr, c_ptr, t_ptr, b_ptr, M, N, K, SEG, sym, syn, R, stm, str_, sbn, sbr,
                     scale, SPLIT: tl.constexpr, PARTS: tl.constexpr,
                     HAS_LORA: tl.constexpr, R_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, GROUP_M: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """SEG a multiple of BK (`matmul` picks this kernel only then): blocks never cross a segment's end."""
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    s_lo, s_hi = _segment_range(K, SEG, SPLIT)
    total = tl.zeros((BM, BN), dtype=tl.float32)
    for s in range(s_lo, s_hi):
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(s * SEG, tl.minimum(s * SEG + SEG, K), BK):
            a = x_desc.load([pid_m * BM, k0])  # out-of-bounds rows and columns arrive as zeros
            b = w_desc.load([pid_n * BN, k0])
            acc = mma(a, tl.trans(b), acc, PREC, INTERP)
        total = total + acc
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    _epilogue(total, y_ptr, p_ptr, c_ptr, t_ptr, b_ptr, rm, rn, M, N, K, SEG, sym, syn, R, stm, str_, sbn, sbr,
              scale, SPLIT, PARTS, HAS_LORA, R_PAD, BM, BN, PREC, INTERP)


@triton.jit(do_not_specialize=["M"])
def _combine_kernel(p_ptr, y_ptr, t_ptr, b_ptr, M, N, n_seg, sym, syn, R, stm, str_, sbn, sbr, scale,
                    HAS_LORA: tl.constexpr, R_PAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    GROUP_M: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):
    """y = ((0 + s_0) + s_1) + ... (+ LoRA) from the fp32 segment sums p_ptr[s]: the split path's last arriver."""
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    total = _ordered_total(p_ptr, rm[:, None] * N + rn[None, :], mask, M, N, n_seg, BM, BN)
    _store_y(total, y_ptr, t_ptr, b_ptr, rm, rn, M, N, sym, syn, R, stm, str_, sbn, sbr, scale, HAS_LORA, R_PAD, BM,
             BN, PREC, INTERP)


MAX_SPLIT_TILES = 1 << 16
_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}


def arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split path's per-tile arrival counters for work on `device`'s current stream: int32 zeros that every
    launch leaves at zero again (the last arriver resets its tile's). One buffer per (device, stream), allocated
    once at its full size and never replaced, so a CUDA graph that captured its address can replay safely; two
    streams never share one, so concurrent GEMMs cannot count into each other's tiles."""
    if tiles > MAX_SPLIT_TILES:
        raise ValueError(f"{tiles} output tiles exceed the split path's {MAX_SPLIT_TILES} arrival counters")
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def _tma_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    if TensorDescriptor is None:
        return False
    for t in (x, w):
        if t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


def _lora_args(y: torch.Tensor, lora_t: torch.Tensor | None, lora_b: torch.Tensor | None, scale: float) -> tuple:
    """The kernels' LoRA arguments (t, B, R, their strides, scale); placeholders without LoRA."""
    if lora_t is None:
        return (y, y, 0, 0, 0, 0, 0, 0.0)
    assert lora_b is not None
    return (lora_t, lora_b, lora_t.shape[1], lora_t.stride(0), lora_t.stride(1), lora_b.stride(0), lora_b.stride(1),
            float(scale))


def _launch(x: torch.Tensor, w: torch.Tensor | MXFP4Weight, y: torch.Tensor, t_args: tuple, cfg: GemmConfig,
            n_seg: int, seg: int, split: bool, parts: torch.Tensor | None) -> None:
    """One GEMM launch over x's K (`n_seg` segments of `seg`): fused, split (one program per (tile, segment), the last
    arriver adding), or with `parts` given the split programs' segment sums stored there and nothing else."""
    m, k = x.shape
    n = w.shape[0]
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = split or parts is not None
    part = parts if parts is not None else (
        torch.empty(n_seg, m, n, dtype=torch.float32, device=x.device) if split else y)
    counters = arrival_counters(x.device, tiles) if split and parts is None else y
    grid = (tiles, n_seg) if split else (tiles,)
    meta = dict(HAS_LORA=t_args[2] > 0, R_PAD=pow2(t_args[2]), BM=cfg.block_m, BN=cfg.block_n, GROUP_M=cfg.group_m,
                PREC=dot_precision(x.dtype), INTERP=INTERPRET, num_warps=cfg.warps, SPLIT=split,
                PARTS=parts is not None, BK=cfg.block_k, num_stages=cfg.stages)
    if isinstance(w, MXFP4Weight):
        assert x.dtype == torch.bfloat16 and cfg.block_k % GROUP == 0 and seg % GROUP == 0
        wp, ws = w.packed.contiguous(), w.scale.contiguous()
        _gemm_ptr_kernel[grid](x, wp, ws, y, part, counters, t_args[0], t_args[1], m, n, k, seg, x.stride(0),
                               x.stride(1), wp.stride(0), 1, ws.stride(0), y.stride(0), y.stride(1), *t_args[2:],
                               W_MXFP4=True, **meta)
    elif cfg.tma and seg % cfg.block_k == 0 and _tma_ok(x, w):
        xd = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
        wd = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
        _gemm_tma_kernel[grid](xd, wd, y, part, counters, t_args[0], t_args[1], m, n, k, seg, y.stride(0),
                               y.stride(1), *t_args[2:], **meta)
    else:
        _gemm_ptr_kernel[grid](x, w, w, y, part, counters, t_args[0], t_args[1], m, n, k, seg, x.stride(0),
                               x.stride(1), w.stride(0), w.stride(1), 0, y.stride(0), y.stride(1), *t_args[2:],
                               W_MXFP4=False, **meta)


def matmul(x: torch.Tensor, w: torch.Tensor | MXFP4Weight, lora_t: torch.Tensor | None = None,
           lora_b: torch.Tensor | None = None, scale: float = 0.0, config: GemmConfig | None = None,
           out_dtype: torch.dtype | None = None, segments: int | None = None) -> torch.Tensor:
    """x: [M, K], w: [N, K] (same dtype; or packed MXFP4 with bf16 x) -> [M, N] in `out_dtype` (default x's dtype;
    the fp32 total rounded once); optional epilogue + (t B^T) * scale with t: [M, R], lora_b: [N, R]. `segments`:
    the K segment count (`segment_layout`; default the config's rule). `config` overrides the per-shape table (benchmark
    sweeps only)."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    cfg = config or gemm_config(n, k, x.dtype if isinstance(w, MXFP4Weight) else w.dtype, m)
    n_seg, seg = segment_layout(k, cfg, segments)
    _launch(x, w, y, _lora_args(y, lora_t, lora_b, scale), cfg, n_seg, seg, n_seg > 1 and m <= SPLIT_MAX_M, None)
    return y


def segment_sums(x: torch.Tensor, w: torch.Tensor, seg: int, config: GemmConfig) -> torch.Tensor:
    """x: [M, K'], w: [N, K'] (same dtype), K' whole segments of `seg` columns -> [K' / seg, M, N] fp32: each segment's
    sum exactly as `matmul` forms it under `config` (a tensor-parallel rank's share of a row-parallel GEMM: pass the
    whole GEMM's config, `gemm_config(N, K, dtype, M)`); `combine_segments` adds them."""
    m, k = x.shape
    n = w.shape[0]
    if k % seg:
        raise ValueError(f"{k} columns are not whole segments of {seg}")
    parts = torch.empty(k // seg, m, n, dtype=torch.float32, device=x.device)
    if m and n:
        _launch(x, w, parts, _lora_args(parts, None, None, 0.0), config, k // seg, seg, True, parts)
    return parts


def combine_segments(parts: torch.Tensor, out_dtype: torch.dtype, config: GemmConfig,
                     lora_t: torch.Tensor | None = None, lora_b: torch.Tensor | None = None,
                     scale: float = 0.0) -> torch.Tensor:
    """parts: [S, M, N] fp32 segment sums (`segment_sums`, all S of them in segment order) -> [M, N] in `out_dtype`:
    ((0 + s_0) + s_1) + ... (+ (t B^T) * scale), rounded once: `matmul`'s result for the whole K under `config`."""
    n_seg, m, n = parts.shape
    y = torch.empty(m, n, dtype=out_dtype, device=parts.device)
    if m == 0 or n == 0:
        return y
    parts = parts.contiguous()
    t_args = _lora_args(y, lora_t, lora_b, scale)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _combine_kernel[grid](parts, y, t_args[0], t_args[1], m, n, n_seg, y.stride(0), y.stride(1), *t_args[2:],
                          HAS_LORA=t_args[2] > 0, R_PAD=pow2(t_args[2]), BM=config.block_m, BN=config.block_n,
                          GROUP_M=config.group_m, PREC=dot_precision(lora_t.dtype if lora_t is not None else out_dtype),
                          INTERP=INTERPRET, num_warps=config.warps)
    return y


def gemm_operand(x: torch.Tensor, w: torch.Tensor | MXFP4Weight) -> tuple[torch.Tensor | MXFP4Weight, torch.dtype]:
    """(the weight as `linear`'s GEMM reads it, the dtype the GEMM runs in) for activations x (`linear`'s rules)."""
    if isinstance(w, MXFP4Weight):
        return (w, torch.bfloat16) if x.dtype == torch.bfloat16 else (w.dequantize(x.dtype), x.dtype)
    if x.dtype == torch.bfloat16 and w.dtype == torch.float32 and holds_bf16_values(w):
        return w.to(torch.bfloat16), torch.bfloat16  # a trainer's master rounded for the bf16 forward: the engine's
    dtype = torch.promote_types(x.dtype, w.dtype)
    return w.to(dtype), dtype


def linear(x: torch.Tensor, w: torch.Tensor | MXFP4Weight, lora: LoRA | None = None, segments: int = 1) -> torch.Tensor:
    """x: [..., K], w: [N, K] (fp32, bf16 or packed MXFP4) -> [..., N] in x's dtype: x W^T + ((x A^T) B^T) * scale.
    Operands of different dtypes run in fp32 (the bf16 one upcast exactly), except bf16 x on an fp32 weight marked as
    holding only bf16 values (a trainer's rounded master: `parity.quant.bf16`), which runs as the bf16 GEMM on that
    weight, so a trainer and an engine holding the weight in bf16 get the same bits; MXFP4 with fp32 x is
    dequantised first.
    `segments` > 1 (a row-parallel projection: `parity.kernels.linear.k_segments`): both reductions over K (x W^T and
    x A^T) add that many equal K segments in order, so a tensor-parallel rank holding whole segments forms its share
    with these bits (`segment_sums`, `combine_segments`); else the GEMM's own segment rule."""
    out_dtype = x.dtype
    w, dtype = gemm_operand(x, w)
    x = x.to(dtype)
    check_dtype(x, *(() if isinstance(w, MXFP4Weight) else (w,)))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    count = segments if segments > 1 else None
    if lora is None:
        y = matmul(x2, w, segments=count)
    else:
        a, b = lora.a.to(dtype), lora.b.to(dtype)
        t = matmul(x2, a, segments=count)
        y = matmul(x2, w, t, b, lora.scale, segments=count)
    return y.reshape(*lead, w.shape[0]).to(out_dtype)
