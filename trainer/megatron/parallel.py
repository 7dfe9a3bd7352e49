"""Process groups for the K3 trainer: torch.distributed on gloo, then Megatron's `parallel_state`.

Layout (Megatron's default order tp-cp-ep-dp-pp, no pipeline or context parallelism): TP ranks hold slices of
the dense layers and see the same batch; EP ranks hold disjoint expert ranges and, unless they are also TP
peers (Megatron's TP-to-EP folding, e.g. TP = EP = 2 on two ranks), different batches. Experts are never
TP-split (`expert_tensor_parallel_size = 1`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from trainer.megatron import cpu_compat


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


def init_parallel(tp: int = 1, ep: int = 1) -> ParallelContext:
    """Start gloo (from torchrun's env, or a one-rank in-memory store), apply the CPU compat patches, build groups.

    Call `destroy_parallel` before initialising again with other sizes. A process group that is already up is
    reused (and left up by `destroy_parallel`).
    """
    if torch.cuda.is_available():
        raise RuntimeError("trainer.megatron.parallel builds the CPU trainer (gloo, CPU parameters); this host has a GPU")
    owns = not dist.is_initialized()
    if owns:
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
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
    )


def destroy_parallel(par: ParallelContext) -> None:
    """Tear down Megatron's groups, and the default process group when `init_parallel` started it."""
    parallel_state.destroy_model_parallel()
    if par.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
