"""Process groups for the K3 trainer: torch.distributed (NCCL on a CUDA machine, gloo on CPU), then Megatron's
`parallel_state`.

On CUDA each rank takes the GPU of its local rank and runs deterministically (`torch.use_deterministic_algorithms`,
cuBLAS's fixed workspace): a step's gradient is then a function of its inputs, which a bitwise resume needs.

Layout (Megatron's default order tp-cp-ep-dp-pp, no pipeline or context parallelism): TP ranks hold slices of
the dense layers and see the same batch; EP ranks hold disjoint expert ranges and, unless they are also TP
peers (Megatron's TP-to-EP folding, e.g. TP = EP = 2 on two ranks), different batches. Experts are never
TP-split (`expert_tensor_parallel_size = 1`).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from parity.kernels import fla_pinned
from trainer.megatron import cpu_compat, device_norm


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in the TP, EP and data-parallel groups (sizes and ranks), with the groups."""

    tp: int
    tp_rank: int
    ep: int
    ep_rank: int
    dp: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    owns_process_group: bool  # init_parallel started torch.distributed (so destroy_parallel ends it)
    device: torch.device  # where this rank's parameters and activations live


def init_parallel(tp: int = 1, ep: int = 1) -> ParallelContext:
    """Start torch.distributed (from torchrun's env, or a one-rank in-memory store): NCCL on this rank's GPU where
    CUDA is available, else gloo with the CPU compat patches; build the groups.

    Call `destroy_parallel` before initialising again with other sizes. A process group that is already up is
    reused (and left up by `destroy_parallel`).
    """
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    else:
        device = torch.device("cpu")
    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if cuda else "gloo"
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if cuda:
        device_norm.apply()
        if importlib.util.find_spec("fla") is not None:
            fla_pinned.check_version()  # KDA's bf16 gradient runs fla's kernels pinned (at start, not mid-step)
    else:
        cpu_compat.apply()
    world = dist.get_world_size()
    if world % tp or world % ep:
        raise ValueError(f"world size {world} must be divisible by tp = {tp} and ep = {ep}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1
    )
    return ParallelContext(
        tp=tp,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        ep=ep,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        dp=parallel_state.get_data_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        ep_group=parallel_state.get_expert_model_parallel_group(),
        owns_process_group=owns,
        device=device,
    )


def destroy_parallel(par: ParallelContext) -> None:
    """Tear down Megatron's groups, and the default process group when `init_parallel` started it."""
    parallel_state.destroy_model_parallel()
    if par.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
