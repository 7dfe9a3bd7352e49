"""What one trainer rank keeps resident at a TP x EP x DP layout, counted from the one sharding table
(`trainer.megatron.sharding.split_roles`), for `zerokl plan --train`.

A rank holds fp32 masters of its shard of every text tensor (TP splits the COLUMN / ROW / VOCAB ones, EP gives it
num_experts / EP whole routed experts, the rest is whole), fp32 gradients of the trainable ones (Megatron's DDP
buffer, `grad_reduce_in_fp32`; the DSA indexer stays frozen), and Adam's two fp32 moments of its share of the
trainable ones: with several data-parallel ranks (DP = world / TP > 1, `build_trainer`'s `shard_optimizer`)
Megatron's distributed optimizer gives each DP rank about 1/DP of the dense parameters' moments and each expert-DP
rank (world / EP of them: experts are never TP-split, so TP peers are expert-DP peers) about 1 / (world / EP) of the
experts'; with DP = 1 every rank keeps the moments of all its parameters.
Tensors trained whole on every rank beside the text model (a trained vision tower, GAE's value head) count as dense
(`replicated`). Not counted: activations, communication buffers, the buckets' padding (at most lcm(DP, 128) elements a
bucket), LoRA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from parity.config import TextConfig
from parity.weights import is_indexer, text_specs
from trainer.megatron.sharding import Split, check_divisible, split_roles

FP32_BYTES = 4


@dataclass(frozen=True)
class RankMemory:
    """Element counts of one rank's resident training state (the same on every rank: the splits are even)."""

    dense: int  # trainable non-expert parameters of this rank's shard
    experts: int  # trainable routed-expert parameters of this rank
    frozen: int  # frozen parameters (the DSA indexer)
    dp: int  # the dense moments' split: the data-parallel ranks (world / TP)
    expert_dp: int  # the experts' moments' split: the expert-data-parallel ranks (world / EP) when DP > 1, else 1

    @property
    def parameters(self) -> int:
        return self.dense + self.experts + self.frozen

    @property
    def gradients(self) -> int:
        return self.dense + self.experts

    @property
    def adam(self) -> int:
        """Both moments' elements of this rank's share (about: a bucket's share ends on a parameter boundary)."""
        return 2 * (math.ceil(self.dense / self.dp) + math.ceil(self.experts / self.expert_dp))

    @property
    def bytes(self) -> int:
        return FP32_BYTES * (self.parameters + self.gradients + self.adam)


def rank_memory(cfg: TextConfig, tp: int, ep: int, world: int, replicated: int = 0) -> RankMemory:
    """One rank's `RankMemory` at `tp` x `ep` over `world` ranks, with `replicated` more trainable elements held whole
    on every rank; ValueError for a layout the trainer refuses."""
    if world % tp or world % ep:
        raise ValueError(f"tp = {tp} and ep = {ep} must divide the {world} ranks")
    check_divisible(cfg, tp, ep)
    specs = text_specs(cfg)
    counts = {"dense": replicated, "experts": 0, "frozen": 0}
    for name, split in split_roles(cfg).items():
        n = math.prod(specs[name].shape)
        if split is Split.EXPERT:
            counts["experts"] += n // ep  # the same share of every expert's tensors: num_experts / EP of them
        elif is_indexer(name):
            counts["frozen"] += n
        else:
            counts["dense"] += n // tp if split.tp_dim is not None else n
    dp = world // tp
    return RankMemory(**counts, dp=dp, expert_dp=world // ep if dp > 1 else 1)
