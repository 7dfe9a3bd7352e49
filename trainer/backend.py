"""The trainer seam: `build_backend(checkpoint, ...)` returns a `TrainerBackend` (`trainer.base`), the Megatron-core
trainer (`trainer.megatron.backend.MegatronBackend`: Megatron DDP + Megatron Adam, its distributed optimizer over the
data-parallel ranks, at a TP x EP x DP layout over the run's processes).

The DeepSpeed backend (ZeRO-2/3) was retired: it never ran on CUDA, and Megatron covers what it did (several
processes, sharded optimizer state) and more (TP, EP); `RETIRED_DEEPSPEED` is the message a run that asks for it gets.
"""

from __future__ import annotations

from pathlib import Path

from lora.adapter import Adapter, load_adapter
from parity.config import ConfigError, load_model_config
from trainer.base import TrainerBackend

RETIRED_DEEPSPEED = ("the deepspeed backend was retired: zerokl trains on Megatron-core alone (several processes with "
                     "`--nproc-per-node N`, `data_parallel: shard` or `replicate`, tp and ep; Megatron's distributed "
                     "optimizer shards the fp32 masters and Adam over the data-parallel ranks); see docs/ppo.md, "
                     "\"The DeepSpeed backend, retired\"")

__all__ = ["RETIRED_DEEPSPEED", "TrainerBackend", "build_backend"]


def build_backend(checkpoint: str | Path, *, lr: float = 0.0, clip_grad: float = 1.0, weight_decay: float = 0.0,
                  kernels: str = "invariant", adapter: Adapter | str | Path | None = None,
                  value_head_lr: float | None = None, train_vision: bool = False, tp: int = 1,
                  ep: int = 1) -> TrainerBackend:
    """The Megatron trainer on an official checkpoint directory, with `adapter` (an `Adapter` or a PEFT adapter
    directory: LoRA, base frozen) when given. `lr`, `clip_grad` (Megatron's max grad norm, 0: off) and
    `weight_decay` configure the optimizer (lr 0: a backend that only scores). `value_head_lr` adds GAE's critic at
    that learning rate (`TrainerBackend.logprobs_raw_and_values`). `train_vision` (no adapter): the vision tower
    trains with the text model (its forward takes `parity.vision.ImageInputs`; exports carry it). `tp`, `ep`: the
    tensor- and expert-parallel sizes over the run's processes. Collective; raises ConfigError on a bad choice,
    AdapterError on a bad adapter."""
    checkpoint = Path(checkpoint)
    if train_vision:
        if adapter is not None:
            raise ConfigError("the vision tower trains without an adapter only")
        if load_model_config(checkpoint).vision is None:
            raise ConfigError(f"{checkpoint} has no vision tower (no vision_config) to train")
    if adapter is not None and not isinstance(adapter, Adapter):
        adapter = load_adapter(adapter, load_model_config(checkpoint).text)
    from trainer.megatron.backend import MegatronBackend

    return MegatronBackend(checkpoint, lr, clip_grad, weight_decay, kernels, adapter, value_head_lr, train_vision, tp,
                           ep)
