"""Gradients for the Triton kernel set: the Triton kernel's forward, a torch op's backward.

`trainable(forward, backward)` is an op with `forward`'s signature. With no gradient needed it is `forward` itself.
Otherwise it returns `forward`'s outputs (so the log-probs a trainer computes are the Triton kernels' bits, the
ones the rollout side computes) and, on backward, re-runs `backward` (the invariant set's torch op, whose own
`autograd.Function` keeps its backward lean: attention's log-sum-exp; for KDA on CUDA fla's chunked kernels or
the chunked form, `parity.kernels.kda.kda_for_gradients`) on the saved inputs and takes its gradients. The
recompute costs one more forward of the op; what is saved per op is its inputs, as activation checkpointing saves
them.

Invariant: the gradient is a function of the op's inputs alone (the backward op is deterministic for fixed
shapes), so two runs of one step give the same gradient bits. It is not the gradient of the Triton forward's
exact bits, only of the same function (the forward's two readings agree to round-off; tests/invariance/test_kernels_triton.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from parity.kernels.linear import LoRA
from parity.kernels.primitives import needs_grad


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _leaves(args: tuple) -> list[torch.Tensor]:
    """The floating tensors among `args`, and inside LoRA terms, in a fixed order."""
    out = []
    for a in args:
        if isinstance(a, LoRA):
            out += [a.a, a.b]
        elif _differentiable(a):
            out.append(a)
    return out


def _rebuild(args: tuple, leaves: list[torch.Tensor]) -> tuple:
    """`args` with its leaves (in `_leaves` order) replaced by `leaves`."""
    it = iter(leaves)
    out = []
    for a in args:
        if isinstance(a, LoRA):
            out.append(dataclasses.replace(a, a=next(it), b=next(it)))
        elif _differentiable(a):
            out.append(next(it))
        else:
            out.append(a)
    return tuple(out)


def _outputs(result: Any) -> list[Any]:
    return list(result) if isinstance(result, tuple) else [result]


class _ForwardThenBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op: tuple[Callable, Callable, Callable | None], call: tuple[tuple, dict], box: list,
                *leaves: torch.Tensor):
        forward, backward, around = op
        args, kwargs = call
        result = forward(*args, **kwargs)
        outs = _outputs(result)
        ctx.diff = [i for i, o in enumerate(outs) if _differentiable(o)]
        ctx.backward_op, ctx.around, ctx.args, ctx.kwargs = backward, around, args, kwargs
        ctx.save_for_backward(*leaves)
        box.append(result)  # the whole result (non-tensor outputs such as a KDAChunkState included)
        return tuple(outs[i] for i in ctx.diff)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        args = _rebuild(ctx.args, leaves)
        # the backward thread has no device context; `around` holds over the recompute and its gradient both
        around = ctx.around(*args, **ctx.kwargs) if ctx.around else contextlib.nullcontext()
        with torch.enable_grad(), torch.device(leaves[0].device), around:
            outs = _outputs(ctx.backward_op(*args, **ctx.kwargs))
            pairs = [(outs[i], g) for i, g in zip(ctx.diff, grads) if g is not None and outs[i].requires_grad]
            want = [t for t in leaves if t.requires_grad]
            got = iter(torch.autograd.grad([o for o, _ in pairs], want, [g for _, g in pairs], allow_unused=True)
                       if pairs else [None] * len(want))
        return (None, None, None, *(next(got) if t.requires_grad else None for t in leaves))


def trainable(forward: Callable, backward: Callable, around: Callable | None = None) -> Callable:
    """`forward`, with gradients from `backward` (same signature and outputs, up to non-tensor state) when any
    positional input requires one (keyword arguments are constants: `segments=`, never tensors). `around(*args,
    **kwargs)`, if given, is the context the backward's recompute and gradient run in (`kda_gradient_context`)."""

    def op(*args: Any, **kwargs: Any) -> Any:
        leaves = _leaves(args)
        if not needs_grad(*leaves):
            return forward(*args, **kwargs)
        box: list = []
        diff_outs = _ForwardThenBackward.apply((forward, backward, around), (args, kwargs), box, *leaves)
        outs = _outputs(box[0])
        it = iter(diff_outs)
        merged = [next(it) if _differentiable(o) else o for o in outs]
        return tuple(merged) if isinstance(box[0], tuple) else merged[0]

    op.__doc__ = forward.__doc__
    op.__name__ = getattr(forward, "__name__", "op")
    return op
