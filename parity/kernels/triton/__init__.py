"""Triton versions of the invariant parity kernels (GPU; CPU tensors only under the Triton interpreter).

`TRITON` is a `parity.kernels.Kernels` with the same op signatures as the CPU `INVARIANT` kernel set and
the same invariance guarantees: a row's bits never depend on batch size, composition, position in the
batch, padding, or the prefill/decode split. Parity holds within one platform: these bits are not the
CPU kernels' bits. What pins each property is in each module's docstring:

| op | module | what pins invariance |
|---|---|---|
| linear (+ LoRA) | `linear.py` | one K order per (K, dtype): fixed K segments added in order (a row-parallel weight's: 8 equal ones, which a TP rank forms alone); the 64- and 128-row tiles give equal bits (GPU test) |
| rmsnorm, gated_rmsnorm, l2norm, sigmoid, GLUs, KDA gate | `rowwise.py` | one row per fixed-width reduction; element-wise ops |
| short_conv | `conv.py` | W products added in a fixed order, state read by position |
| kda | `kda.py` | chunk grid anchored at 0, state at chunk boundaries, pending chunk recomputed |
| attention (+ paged) | `attention.py` | fixed Q/KV tiles from position 0, masked tiles are exact no-ops |
| DSA index scores | `dsa.py` | a token's index heads the rows of one dot over the whole head dim; heads added by one fixed-size reduction |
| sparse attention (+ paged) | `attention.py` | the attention kernel reading each token's selected positions as its key slots |
| attn_res_mix | `attn_res.py` | per-token scores, candidates added in index order |
| route, experts + combine | `moe.py` | argmax with lowest-index ties; fixed tiles per expert; combine in id order |
| token_logprobs | `parity.kernels.logprobs` | the rollout engine's sampler arithmetic (torch `log_softmax` on fp32 logits / T, one row-invariant reduction per row; tests check it on CUDA) |

Gradients: linear's and the grouped experts' in Triton (`linear_grad.py`: dX and dW as GEMMs of the same machinery;
`moe_grad.py`: grouped GEMMs over the forward's saved products, the routing on the device; both deterministic and
reading what the forward saved). Every other op (`autograd.py`) runs its Triton forward and takes its backward
from a torch op re-run on the saved inputs: the CPU invariant set's, on CUDA the fast set's for the row-wise ops
(`_FAST_GRADIENT_ON_CUDA`: fewer launches, deterministic); attention's from the invariant backward with the forward
untiled (`parity.kernels.attention.attention_for_gradients`). KDA's on CUDA comes from fla's chunked kernels for a bf16
layer (TF32 products), each pinned to one launch configuration (`parity.kernels.fla_pinned`), and from its chunked
form in torch for an fp32 one (`parity.kernels.kda.kda_for_gradients`).

Two differences from the CPU API, both needed by the chunked KDA and the grouped MoE GEMM:
- `kda` returns a `KDAChunkState` (state at the last chunk boundary plus the pending chunk's inputs)
  instead of a plain state tensor; it accepts either as `state` (a tensor means "at a chunk boundary").
- `experts` (grouped expert GEMMs + combine on stacked expert weights) is set here; the CPU kernel set has none
  and the model runs `parity.kernels.moe.experts_combine` over per-expert weight lists (`experts_stacked` is that
  over stacked weights: the gradient of this op and `DEVICE_INVARIANT`'s CPU side).

`DEVICE_INVARIANT` is the invariant kernel set that runs these kernels on CUDA tensors and the CPU kernels
on CPU tensors (chosen per call from the input's device; both are the invariant kernel set).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from parity.kernels.attention import attention_for_gradients
from parity.kernels.kda import kda_for_gradients, kda_gradient_context
from parity.kernels.moe import experts_stacked
from parity.kernels.registry import FAST, INVARIANT, Kernels
from parity.kernels.triton import attention, attn_res, conv, dsa, kda, moe, rowwise
from parity.kernels.triton.attention import attention_paged
from parity.kernels.triton.autograd import trainable
from parity.kernels.triton.kda import KDAChunkState
from parity.kernels.triton.moe import experts
from parity.kernels.triton.linear_grad import linear_trainable
from parity.kernels.triton.moe_grad import experts_trainable

_TRITON_OPS = dict(
    sigmoid=rowwise.sigmoid,
    rmsnorm=rowwise.rmsnorm,
    gated_rmsnorm=rowwise.gated_rmsnorm,
    l2norm=rowwise.l2norm,
    situ_glu=rowwise.situ_glu,
    silu_glu=rowwise.silu_glu,
    short_conv=conv.short_conv,
    kda_gate=rowwise.kda_gate,
    kda=kda.kda,
    attention=attention.attention,
    attention_paged=attention_paged,
    index_scores=dsa.index_scores,
    sparse_attention=attention.sparse_attention,
    sparse_attention_paged=attention.sparse_attention_paged,
    attn_res_mix=attn_res.attn_res_mix,
    route=moe.route,
)
def _by_device(cpu: Callable, gpu: Callable) -> Callable:
    def op(x: torch.Tensor, *args, **kwargs):
        return (gpu if x.is_cuda else cpu)(x, *args, **kwargs)

    op.__doc__ = f"{gpu.__module__}.{gpu.__name__} on CUDA tensors, else {cpu.__module__}.{cpu.__name__}"
    return op


# Where each Triton op's gradient comes from. The row-wise ops' on CUDA from the fast set's reading of the same
# function (torch's fused element-wise ops and reductions: a few launches where the invariant reading's `tree_sum`
# halvings take a dozen; deterministic for fixed shapes, as a gradient must be); elsewhere the invariant set's.
_FAST_GRADIENT_ON_CUDA = ("sigmoid", "rmsnorm", "gated_rmsnorm", "l2norm", "situ_glu", "silu_glu", "kda_gate",
                          "attn_res_mix")
_GRADIENTS_FROM = dataclasses.replace(INVARIANT, kda=kda_for_gradients, attention=attention_for_gradients,
                                      **{f: _by_device(getattr(INVARIANT, f), getattr(FAST, f))
                                         for f in _FAST_GRADIENT_ON_CUDA})
_AROUND = {"kda": kda_gradient_context}  # the context an op's backward runs in, where it needs one
TRITON = Kernels(name="triton", **{f: trainable(op, getattr(_GRADIENTS_FROM, f), _AROUND.get(f))
                                   for f, op in _TRITON_OPS.items()},
                 linear=linear_trainable, token_logprobs=INVARIANT.token_logprobs, experts=experts_trainable)


_CPU_SIDE = dataclasses.replace(INVARIANT, experts=experts_stacked)  # the grouped op's CPU reading, as TRITON has one
DEVICE_INVARIANT = Kernels(
    name="invariant",
    **{f: _by_device(getattr(_CPU_SIDE, f), getattr(TRITON, f)) for f in Kernels.__dataclass_fields__ if f != "name"},
)

__all__ = ["TRITON", "DEVICE_INVARIANT", "KDAChunkState", "attention_paged", "experts"]
