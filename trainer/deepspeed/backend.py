"""`DeepSpeedBackend`: the DeepSpeed ZeRO trainer (`trainer.deepspeed.engine`) behind `TrainerBackend`: ZeRO-2 or -3
with torch AdamW and Megatron's clipping, one or more processes (torchrun-style env, e.g. from `zerokl.launch`). The
PPO loop gives every rank the same batches (updates keep Megatron's bits) or, with `data_parallel: shard`, each rank
its own block of every minibatch, DeepSpeed averaging the gradients (trainer/deepspeed/README.md)."""

from __future__ import annotations

from pathlib import Path

import torch

from lora.adapter import Adapter
from trainer.base import LossFn, TrainerBackend
from trainer.deepspeed.engine import build_deepspeed_trainer, destroy, train_step
from trainer.deepspeed.io import export_official, load_state, save_state
from trainer.deepspeed.lora import export_adapter, save_adapter

# ZeRO-3 partitions every parameter, however small (DeepSpeed's default keeps those under 1e5 elements whole on
# every rank): the bits are then checked through the gather path for every tensor.
PERSISTENCE_THRESHOLD = 0


class DeepSpeedBackend(TrainerBackend):
    """`trainer.deepspeed.engine.build_deepspeed_trainer` at ZeRO `zero_stage`, every parameter partitioned."""

    name = "deepspeed"

    def __init__(self, checkpoint: Path, lr: float, clip_grad: float, weight_decay: float, kernels: str,
                 adapter: Adapter | None, zero_stage: int):
        self.trainer = build_deepspeed_trainer(checkpoint, lr, zero_stage=zero_stage, kernels=kernels, lora=adapter,
                                               clip_grad=clip_grad, weight_decay=weight_decay,
                                               persistence_threshold=PERSISTENCE_THRESHOLD)
        self.model_cfg = self.trainer.model_cfg
        self.has_adapter = adapter is not None

    def train_step(self, *loss_fns: LossFn) -> tuple[float, float]:
        return train_step(self.trainer, *loss_fns)

    def export_official(self) -> dict[str, torch.Tensor]:
        return export_official(self.trainer, compute_dtype=True)

    def export_adapter(self) -> Adapter | None:
        return export_adapter(self.trainer)

    def _save_adapter(self, out: Path) -> None:
        save_adapter(self.trainer, out)

    def _save_optimizer(self, path: Path) -> None:
        save_state(self.trainer, path)

    def load_state(self, path: str | Path) -> None:
        load_state(self.trainer, path)

    def close(self) -> None:
        destroy(self.trainer)
