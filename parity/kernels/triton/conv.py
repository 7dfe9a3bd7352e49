"""Short causal depthwise conv with carried state, then SiLU, in Triton (KDA's q/k/v conv).

y_t = silu(sum_{j=0}^{W-1} w[:, j] * x_{t-W+1+j}); inputs before the call come from the carried state.
Invariant: every output element adds its W products in the order j = 0..W-1 with the same instructions,
reading each input from the state or from x by its position alone, so a token's output depends only on
its own W inputs: any split into chunks with carried state gives the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from parity.kernels.triton._common import check_dtype, sigmoid_f32

BLOCK_T = 16
BLOCK_D = 128


@triton.jit(do_not_specialize=["T"])
def _conv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, T, D, sxb, sxt, ssb, sst, syb, syt,
                 W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    d = tl.program_id(2) * BD + tl.arange(0, BD)
    dmask = d < D
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    for j in tl.static_range(W):
        src = t + j - (W - 1)  # input position; < 0 reads the carried state row W - 1 + src
        from_x = (src >= 0) & (t < T)
        from_s = (src < 0) & (t < T)
        xv = tl.load(x_ptr + b * sxb + src[:, None] * sxt + d[None, :], mask=from_x[:, None] & dmask[None, :], other=0.0)
        sv = tl.load(s_ptr + b * ssb + (W - 1 + src)[:, None] * sst + d[None, :], mask=from_s[:, None] & dmask[None, :],
                     other=0.0)
        v = tl.where(from_x[:, None], xv.to(tl.float32), sv.to(tl.float32))
        wj = tl.load(w_ptr + d * W + j, mask=dmask, other=0.0).to(tl.float32)
        if j == 0:
            acc = v * wj[None, :]
        else:
            acc = acc + v * wj[None, :]
    y = acc * sigmoid_f32(acc)
    tl.store(y_ptr + b * syb + t[:, None] * syt + d[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(t[:, None] < T) & dmask[None, :])


def short_conv(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, T, D] (fp32 or bf16), w: [D, W] (any float dtype: read as fp32), state: [B, W-1, D] -> (y [B, T, D] in
    x's dtype, new state [B, W-1, D]: the last W-1 inputs)."""
    check_dtype(x)
    b, t, d = x.shape
    width = w.shape[1]
    state = state.to(x.dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()
    st = state.contiguous()
    wc = w.contiguous()
    y = torch.empty(b, t, d, dtype=x.dtype, device=x.device)
    if b and t and d:
        grid = (b, triton.cdiv(t, BLOCK_T), triton.cdiv(d, BLOCK_D))
        _conv_kernel[grid](x, wc, st, y, t, d, x.stride(0), x.stride(1), st.stride(0), st.stride(1), y.stride(0),
                           y.stride(1), W=width, BT=BLOCK_T, BD=BLOCK_D, num_warps=4)
    new_state = torch.cat([st, x], dim=1)[:, t:]
    return y, new_state
