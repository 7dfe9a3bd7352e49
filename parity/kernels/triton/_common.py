"""Shared pieces of the Triton kernels: launch-time constants, dtype rules, and arithmetic helpers.

Every Triton kernel here computes in fp32 and stores in the input dtype (bf16 or fp32). Tensor-core
dots take bf16 operands as they are; fp32 operands use IEEE fp32 (`ieee`) so fp32 results stay close
to the CPU kernels. Each choice is a function of dtypes and weight shapes only, never of the number of
rows, so it cannot move a row's bits.

Under the Triton interpreter (`TRITON_INTERPRET=1` when triton and this package are first imported),
`mma` never calls `tl.dot`: the interpreter turns it into numpy's `matmul`, i.e. the host BLAS, whose bits
for a row change with where the row sits in the matrix and with the CPU the run lands on (OpenBLAS on
AVX2 vs AVX-512). `mma` there forms the fp32 products and sums them along K with one reduction, the same
for every output element, so interpreted kernels keep their invariances on any CPU. (It also computes
bf16 operands in fp32: triton 3.9's interpreter multiplies bf16 bit patterns as integers.) Triton
decorates its own library at its first import too, so a process is either interpreted or compiled
throughout (tests/invariance/test_kernels_triton.py runs the interpreter suite in a child process).
Row counts are passed with `do_not_specialize`, so M = 1 and M = 4096 run the same compiled code.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:
    INTERPRET: bool = bool(triton.knobs.runtime.interpret)
except AttributeError:  # triton < 3.4 has no knobs
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SUPPORTED = (torch.float32, torch.bfloat16)


def check_dtype(*xs: torch.Tensor) -> None:
    """All floating inputs of one op share a supported dtype (fp32 or bf16)."""
    dt = xs[0].dtype
    for x in xs:
        if x.dtype != dt or dt not in SUPPORTED:
            raise TypeError(f"Triton parity kernels take fp32 or bf16 inputs of one dtype, got {[t.dtype for t in xs]}")


def check_weights(*ws: torch.Tensor | None) -> None:
    """Element-wise weights (norm scales, projections read as vectors) are fp32 or bf16, whatever the activations'
    dtype: the kernels load them as fp32, so an fp32 master holding bf16 values (the trainer's) has the bits of
    the bf16 weight (the rollout engine's)."""
    for w in ws:
        if w is not None and w.dtype not in SUPPORTED:
            raise TypeError(f"Triton parity kernels take fp32 or bf16 weights, got {w.dtype}")


def dot_precision(dtype: torch.dtype) -> str:
    """`input_precision` for dots whose operands are fp32 when the op's inputs have `dtype`.

    fp32 inputs: IEEE fp32 dots. bf16 inputs: tf32 (the operands were bf16 to begin with)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def tensor_core_precision(dtype: torch.dtype) -> str:
    """`input_precision` for dots that run on tensor cores whatever the inputs' dtype.

    fp32 inputs: `tf32x3` (each fp32 operand split into a tf32 high part and a tf32 remainder, three tensor-core
    products a_hi b_hi + a_hi b_lo + a_lo b_hi: close to fp32's accuracy; a fixed decomposition per element, so rows
    stay independent and exact zeros stay exact zeros). bf16 inputs: tf32, as `dot_precision`."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


def pow2(n: int, floor: int = 16) -> int:
    """The next power of two >= max(n, floor) (Triton block sizes are powers of two)."""
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


@triton.jit
def mma(a, b, acc, PREC: tl.constexpr, INTERP: tl.constexpr):
    """acc + a @ b with fp32 accumulation; a: [M, K], b: [K, N], acc: [M, N] fp32.

    Compiled: `tl.dot` at `PREC`. Interpreted (`INTERP`): the fp32 products a[m, k] * b[k, n] summed over
    k by one reduction of the [M, K, N] tile, whose order depends on the tile's shape alone, never on m,
    n, the other rows or the host BLAS."""
    if INTERP:
        prod = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]  # [M, K, N]
        out = acc + tl.sum(prod, axis=1)
    else:
        out = tl.dot(a, b, acc, input_precision=PREC)
    return out


@triton.jit
def sigmoid_f32(x):
    """1 / (1 + exp(-x)) in fp32."""
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh_f32(x):
    """tanh in fp32 from exp only (no libdevice, which the interpreter lacks): odd Taylor polynomial for
    |x| < 0.125 (error < 1e-10 relative), (1 - e) / (1 + e) with e = exp(-2|x|) above."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    t = tl.where(ax < 0.125, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def softplus_f32(x):
    """log(1 + exp(x)), linear above 20 (as torch and the CPU kernel)."""
    return tl.where(x > 20.0, x, log1p_f32(tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def log1p_f32(y):
    """log(1 + y) accurate for small y: log(u) * y / (u - 1) with u = 1 + y (Goldberg), y when u == 1."""
    u = 1.0 + y
    d = u - 1.0
    return tl.where(d == 0.0, y, tl.log(u) * (y / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def dequant_mxfp4_tile(byte, sc, BN: tl.constexpr, BK: tl.constexpr):
    """byte: [BN, BK/2] uint8 E2M1 code pairs (element 2j in the low nibble), sc: [BN, BK/32] uint8 E8M0 scales
    -> [BN, BK] bf16, exactly E2M1 * 2^(sc - 127) (subnormal results included), built from bits."""
    b = byte.to(tl.int32)
    code = tl.reshape(tl.interleave(b & 0xF, b >> 4), (BN, BK))
    s = tl.reshape(tl.broadcast_to(sc.to(tl.int32)[:, :, None], (BN, BK // 32, 32)), (BN, BK))
    mag = code & 7
    sign = (code >> 3) & 1
    e = tl.where(mag >= 2, (mag >> 1) - 1, -1)  # exponent of the leading bit: 0.5 -> -1, 1 / 1.5 -> 0, ...
    m = tl.where(mag >= 2, mag & 1, 0)
    p = e + s - 127  # the value is (1 + m / 2) * 2^p
    normal = ((p + 127) << 7) | (m << 6)
    sub = (2 + m) << tl.maximum(p + 132, 0)  # p < -126: a bf16 subnormal, (2 + m) * 2^(p + 132) * 2^-133
    bits = tl.where(mag == 0, 0, tl.where(p >= -126, normal, sub)) | (sign << 15)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def weight_tile(w_ptr, ws_ptr, rn, k0, N, K, swn, swk, sws, BN: tl.constexpr, BK: tl.constexpr,
                 W_MXFP4: tl.constexpr):
    """[BK, BN] view of W^T for columns rn and K offsets k0..k0+BK (zeros past N and K): loaded as is, or (W_MXFP4)
    from the packed codes and scales, dequantised to bf16."""
    if W_MXFP4:
        rk2 = tl.arange(0, BK // 2)
        rg = tl.arange(0, BK // 32)
        byte = tl.load(w_ptr + rn[:, None] * swn + (k0 // 2 + rk2)[None, :],
                       mask=(rn[:, None] < N) & ((k0 // 2 + rk2)[None, :] < K // 2), other=0)
        sc = tl.load(ws_ptr + rn[:, None] * sws + (k0 // 32 + rg)[None, :],
                     mask=(rn[:, None] < N) & ((k0 // 32 + rg)[None, :] < K // 32), other=127)
        b = tl.trans(dequant_mxfp4_tile(byte, sc, BN, BK))
    else:
        rk = tl.arange(0, BK)
        b = tl.load(w_ptr + rn[None, :] * swn + (k0 + rk)[:, None] * swk,
                    mask=(rn[None, :] < N) & (rk[:, None] + k0 < K), other=0.0)
    return b


MAX_ROW = 65536


def row_blocks(d: int) -> tuple[int, int, int]:
    """(rows per program, block width, warps) for rows of length d; depends on d only, so a row's place in a
    program, and its reduction tree, never depends on how many rows there are."""
    bd = pow2(d)
    if bd > MAX_ROW:
        raise ValueError(f"row length {d} exceeds {MAX_ROW}")
    rows = max(1, min(64, 4096 // bd))
    warps = 4 if bd * rows <= 4096 else 8
    return rows, bd, warps
