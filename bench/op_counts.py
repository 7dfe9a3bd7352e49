"""Where a trainer step's launches come from: every aten op of one Megatron trainer step (forward, backward, grad
finalisation, optimizer), counted by op and by the repository lines that issued it.

On CUDA each aten op that computes (not a view, not an empty allocation) is about one kernel launch, and each Triton
kernel (zerokl's, fla's) adds one that is not counted here; `bench/profile_gpu.py --parts tprofile` counts the
launches themselves but cannot say which line of zerokl made them. Run on a GPU, this is the GPU step's table. It also
runs on a CPU, the Triton kernel set under Triton's interpreter (set `TRITON_INTERPRET=1`): the torch ops around the
kernels are then the GPU step's, with two exceptions that make a CPU count larger - KDA's gradient (on CUDA in bf16
fla's chunked kernels, `parity.kernels.kda.kda_for_gradients`; on a CPU the token-by-token recurrence) and Adam (a
single-tensor loop on a CPU, multi-tensor launches on CUDA). Ops run by Triton's own package are not counted.

    TRITON_INTERPRET=1 python bench/op_counts.py --config configs/k3-micro.yaml --kernels triton
    python bench/op_counts.py --config configs/k3-1b.yaml --kernels invariant --batch 4 --len 256   # on CUDA
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from parity.io.checkpoint import init_checkpoint  # noqa: E402
from trainer.megatron.backend import MegatronBackend  # noqa: E402
from trainer.megatron.train import queue_train_step  # noqa: E402

# ops that launch nothing on CUDA: views, metadata, empty allocations
NO_LAUNCH = {"detach", "view", "_unsafe_view", "t", "as_strided", "alias", "expand", "permute", "transpose",
             "unsqueeze", "squeeze", "slice", "select", "split", "split_with_sizes", "unbind", "empty", "empty_strided",
             "new_empty", "empty_like", "lift_fresh", "reshape", "_reshape_alias", "scalar_tensor"}


def caller() -> str:
    """The innermost two frames of this repository (outside this script) on the stack: `path:line < path:line`, the
    line that issued the op and the line that called into it (a shared helper such as `tree_sum` is then told apart
    by its callers)."""
    here = Path(__file__).resolve()
    lines = []
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = Path(frame.filename)
        if path.is_relative_to(REPO) and path != here and ".venv" not in path.parts:
            lines.append(f"{path.relative_to(REPO)}:{frame.lineno}")
            if len(lines) == 2:
                break
    return " < ".join(lines) or "?"


class OpCounter(TorchDispatchMode):
    """Counts each launching aten op by name and by `name @ caller()`; ops Triton's own package runs (its interpreter)
    are left out."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH and not any(f"site-packages{os.sep}triton{os.sep}" in f.filename
                                             for f in traceback.extract_stack()[-14:-2]):
            self.ops[name] += 1
            self.sites[f"{name} @ {caller()}"] += 1
        return func(*args, **(kwargs or {}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/k3-micro.yaml")
    p.add_argument("--kernels", default="triton")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--len", type=int, default=40)
    p.add_argument("--top", type=int, default=40, help="lines of the by-site table")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(REPO / args.config, Path(tmp) / "ckpt", seed=0)
        backend = MegatronBackend(ckpt, lr=1e-5, clip_grad=1.0, weight_decay=0.0, kernels=args.kernels, adapter=None)
        try:
            device = "cuda" if torch.cuda.is_available() else "cpu"  # where the trainer runs (as the GPU tests feed it)
            ids = torch.randint(4, backend.model_cfg.text.vocab_size, (args.batch, args.len),
                                generator=torch.Generator().manual_seed(0)).to(device)
            lens = torch.full((args.batch,), args.len).to(device)

            def loss_fn(model: torch.nn.Module) -> torch.Tensor:
                return model(ids, lens, 1.0).sum() / ids.numel()

            backend.train_step(loss_fn)  # the first step builds the optimizer state
            counter = OpCounter()
            with counter:
                queue_train_step(backend.trainer, loss_fn)
        finally:
            backend.close()
    print(f"{args.config}, kernels {args.kernels}, {args.batch} x {args.len} tokens: "
          f"{sum(counter.ops.values())} launching aten ops in one trainer step")
    for name, n in counter.ops.most_common(15):
        print(f"{n:8d}  {name}")
    print("by the line that issued them:")
    for site, n in counter.sites.most_common(args.top):
        print(f"{n:8d}  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
