"""The trainer-backend seam: `build_backend(name, checkpoint, ...)` returns a `TrainerBackend` (`trainer.base`):

- `"megatron"` (`trainer.megatron.backend.MegatronBackend`): Megatron DDP + Megatron Adam over the run's
  processes at a TP x EP x DP layout (`tp`, `ep`);
- `"deepspeed"` (`trainer.deepspeed.backend.DeepSpeedBackend`): DeepSpeed ZeRO-2 or -3, one or more processes.

Only the chosen backend's framework is imported.
"""

from __future__ import annotations

from pathlib import Path

from lora.adapter import Adapter, load_adapter
from parity.config import ConfigError, load_model_config
from trainer.base import TrainerBackend

BACKENDS = ("megatron", "deepspeed")
ZERO_STAGES = (2, 3)
DEFAULT_ZERO_STAGE = 3  # what a deepspeed run gets when it names no stage

__all__ = ["BACKENDS", "DEFAULT_ZERO_STAGE", "ZERO_STAGES", "TrainerBackend", "build_backend"]


def build_backend(name: str, checkpoint: str | Path, *, lr: float = 0.0, clip_grad: float = 1.0,
                  weight_decay: float = 0.0, kernels: str = "invariant",
                  adapter: Adapter | str | Path | None = None, zero_stage: int = DEFAULT_ZERO_STAGE,
                  value_head_lr: float | None = None, train_vision: bool = False, tp: int = 1,
                  ep: int = 1) -> TrainerBackend:
    """The `name` backend ("megatron" | "deepspeed") on an official checkpoint directory, with `adapter` (an `Adapter`
    or a PEFT adapter directory: LoRA, base frozen) when given. `lr`, `clip_grad` (Megatron's max grad norm, 0: off)
    and `weight_decay` configure the optimizer (lr 0: a backend that only scores); `zero_stage` (2 or 3) applies to
    DeepSpeed. `value_head_lr` (megatron only) adds GAE's critic at that learning rate
    (`TrainerBackend.logprobs_raw_and_values`). `train_vision` (megatron only, no adapter): the vision tower trains with
    the text model (its forward takes `parity.vision.ImageInputs`; exports carry it). `tp`, `ep` (megatron only): the
    tensor- and expert-parallel sizes over the run's processes. Collective; raises ConfigError on a bad choice,
    AdapterError on a bad adapter."""
    if name not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "deepspeed" and zero_stage not in ZERO_STAGES:
        raise ConfigError(f"zero_stage must be one of {', '.join(map(str, ZERO_STAGES))}, got {zero_stage!r}")
    if (tp > 1 or ep > 1) and name != "megatron":
        raise ConfigError(f"tensor and expert parallelism (tp {tp}, ep {ep}) run on the megatron backend only, not "
                          f"{name!r}")
    if value_head_lr is not None and name != "megatron":
        raise ConfigError(f"a value head (advantage: gae) trains on the megatron backend only, not {name!r}")
    checkpoint = Path(checkpoint)
    if train_vision:
        if name != "megatron" or adapter is not None:
            raise ConfigError("the vision tower trains on the megatron backend without an adapter only")
        if load_model_config(checkpoint).vision is None:
            raise ConfigError(f"{checkpoint} has no vision tower (no vision_config) to train")
    if adapter is not None and not isinstance(adapter, Adapter):
        adapter = load_adapter(adapter, load_model_config(checkpoint).text)
    if name == "megatron":
        from trainer.megatron.backend import MegatronBackend

        return MegatronBackend(checkpoint, lr, clip_grad, weight_decay, kernels, adapter, value_head_lr, train_vision,
                               tp, ep)
    from trainer.deepspeed.backend import DeepSpeedBackend

    return DeepSpeedBackend(checkpoint, lr, clip_grad, weight_decay, kernels, adapter, zero_stage)
