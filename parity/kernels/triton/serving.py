"""The serving form of many master tensors written into one flat byte buffer, a few launches in all
(`parity.sync.serving.ServingBuffer` on a GPU).

Each kernel reads its sources through a table of their addresses, so thousands of tensors cost one launch per
(source dtype, kind), not one each. Both keep the bits of the torch forms they replace (tested against them under
the interpreter and on CUDA):

- `cast_into`: fp32 -> bf16 with round to nearest even by integer arithmetic (torch's CUDA conversion: a NaN becomes
  0x7FFF), or a plain copy of same-dtype elements;
- `mxfp4_into`: `parity.quant.mxfp4.quantize`'s codes and scale bytes, packed as it packs them (group amax, the
  exponent field rounded at E2M1 precision, the magnitudes counted against the strict bounds, the sign kept), plus
  one flag per tensor that `quantize`'s value checks would refuse (a non-finite value, a scale above
  `MAX_EXPONENT`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parity.kernels.triton.checksum import programs
from parity.quant import mxfp4

CAST_BLOCK = 8192  # elements a program of `cast_into`
GROUPS_BLOCK = 64  # MXFP4 groups (32 values) a program of `mxfp4_into`
_TL = {torch.float32: tl.int32, torch.bfloat16: tl.int16, torch.float16: tl.int16, torch.uint8: tl.uint8}


@triton.jit
def _cast_kernel(table_ptr, out_ptr, SRC: tl.constexpr, DST: tl.constexpr, F32_TO_BF16: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Program p: `count` elements of the source at address `src`, from element `first`, to element `dst` of out
    (out and the source read as integers of their widths)."""
    p = tl.program_id(0)
    src = tl.load(table_ptr + 4 * p).to(tl.pointer_type(SRC))
    first = tl.load(table_ptr + 4 * p + 1)
    count = tl.load(table_ptr + 4 * p + 2)
    dst = tl.load(table_ptr + 4 * p + 3)
    j = tl.arange(0, BLOCK)
    mask = j < count
    x = tl.load(src + first + j, mask=mask, other=0)
    if F32_TO_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        y = tl.where(nan, 0x7FFF, rounded).to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        y = x
    tl.store(out_ptr.to(tl.pointer_type(DST)) + dst + j, y, mask=mask)


def cast_into(out: torch.Tensor, sources: list[torch.Tensor], offsets: list[int], dtype: torch.dtype) -> None:
    """Write each contiguous source (one dtype, on out's device) as `dtype` at byte `offsets[i]` of the uint8 buffer
    `out` (each offset a multiple of the dtype's size): one launch. fp32 -> bf16 rounds to nearest even; same dtypes
    copy."""
    src_dtype = sources[0].dtype
    if any(s.dtype != src_dtype or not s.is_contiguous() for s in sources):
        raise TypeError("cast_into takes contiguous sources of one dtype")
    if not (src_dtype == dtype or (src_dtype, dtype) == (torch.float32, torch.bfloat16)):
        raise TypeError(f"cast_into casts fp32 to bf16 or copies, not {src_dtype} to {dtype}")
    _, owner, first, count = programs([s.numel() for s in sources], CAST_BLOCK)
    if not owner.numel():
        return
    addresses = torch.tensor([s.data_ptr() for s in sources], dtype=torch.int64)
    starts = torch.tensor(offsets, dtype=torch.int64) // dtype.itemsize
    table = torch.stack([addresses[owner], first, count, starts[owner] + first], dim=1).to(out.device)
    _cast_kernel[(table.shape[0],)](table, out, SRC=_TL[src_dtype], DST=_TL[dtype],
                                    F32_TO_BF16=src_dtype != dtype, BLOCK=CAST_BLOCK)


@triton.jit
def _mxfp4_kernel(table_ptr, out_ptr, bad_ptr, blocks, b0, b1, b2, b3, b4, b5, b6, SRC: tl.constexpr,
                  BF16: tl.constexpr, BLOCK: tl.constexpr):
    """Program (b, t): groups [b * BLOCK, (b + 1) * BLOCK) of tensor t, read as [BLOCK, 32] contiguous rows: codes
    packed two a byte (even position in the low nibble) at `packed`, scale bytes at `scale`; bad[t, b] = 1 where
    `quantize` would refuse a group."""
    b = tl.program_id(0)
    t = tl.program_id(1)
    src = tl.load(table_ptr + 4 * t).to(tl.pointer_type(SRC))
    groups = tl.load(table_ptr + 4 * t + 1)
    packed = tl.load(table_ptr + 4 * t + 2)
    scale = tl.load(table_ptr + 4 * t + 3)
    g = b * BLOCK + tl.arange(0, BLOCK)
    live = g < groups
    k = tl.arange(0, 32)
    x = tl.load(src + g[:, None].to(tl.int64) * 32 + k[None, :], mask=live[:, None], other=0)
    if BF16:  # read as int16, widened by its bits (exact for subnormals, which the interpreter's conversion is not)
        x = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    amax = tl.max(tl.abs(x), axis=1)
    field = ((amax.to(tl.int32, bitcast=True) + 0x200000) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(field - 129, -127), 127)
    down = ((127 - tl.minimum(e, 125)) << 23).to(tl.float32, bitcast=True)  # 2^-e (normal for every e <= 125)
    finite = tl.abs(x) < float("inf")
    refused = (tl.min(finite.to(tl.int32), axis=1) == 0) | (e > 125)
    codes = _e2m1_code(x * down[:, None], b0, b1, b2, b3, b4, b5, b6) << ((k[None, :] % 2) * 4)
    byte = tl.sum(tl.reshape(codes, (BLOCK, 16, 2)), axis=2).to(tl.uint8)  # low | high << 4: the nibbles are apart
    j = tl.arange(0, 16)
    tl.store(out_ptr + packed + g[:, None].to(tl.int64) * 16 + j[None, :], byte, mask=live[:, None])
    tl.store(out_ptr + scale + g, (e + 127).to(tl.uint8), mask=live)
    tl.store(bad_ptr + t * blocks + b, tl.max(tl.where(live & refused, 1, 0), axis=0))


@triton.jit
def _e2m1_code(v, b0, b1, b2, b3, b4, b5, b6):
    """`parity.quant.mxfp4._e2m1_codes` of fp32 v: the strict bounds below |v| counted (NaN counts none), the sign
    bit (of v's bits, -0 included) as bit 3."""
    a = tl.abs(v)
    code = ((a > b0).to(tl.int32) + (a > b1).to(tl.int32) + (a > b2).to(tl.int32) + (a > b3).to(tl.int32)
            + (a > b4).to(tl.int32) + (a > b5).to(tl.int32) + (a > b6).to(tl.int32))
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << 3)


def mxfp4_into(out: torch.Tensor, sources: list[torch.Tensor], packed: list[int], scales: list[int]) -> torch.Tensor:
    """Quantise each contiguous 2-D source (one dtype, fp32 or bf16, K a multiple of 32, on out's device) into the
    uint8 buffer `out`: its codes from byte `packed[i]`, its scale bytes from `scales[i]` (`quantize`'s bytes). One
    launch; returns the int32 flags, one a source, 1 where `quantize` would refuse it (read them before trusting
    out)."""
    src_dtype = sources[0].dtype
    if src_dtype not in (torch.float32, torch.bfloat16) or any(
            s.dtype != src_dtype or not s.is_contiguous() or s.dim() != 2 or s.shape[1] % mxfp4.GROUP for s in sources):
        raise TypeError("mxfp4_into takes contiguous 2-D fp32 or bf16 sources of one dtype, K a multiple of 32")
    groups = [s.numel() // mxfp4.GROUP for s in sources]
    table = torch.tensor([[s.data_ptr(), n, p, q] for s, n, p, q in zip(sources, groups, packed, scales)],
                         dtype=torch.int64).to(out.device)
    bounds = [float(b) for b in mxfp4._strict_bounds(torch.device("cpu")).tolist()]
    grid = (triton.cdiv(max(groups), GROUPS_BLOCK), len(sources))
    bad = torch.zeros(grid[1], grid[0], dtype=torch.int32, device=out.device)
    bf16 = src_dtype == torch.bfloat16
    _mxfp4_kernel[grid](table, out, bad, grid[0], *bounds, SRC=tl.int16 if bf16 else tl.float32, BF16=bf16,
                        BLOCK=GROUPS_BLOCK)
    return bad.amax(1)
