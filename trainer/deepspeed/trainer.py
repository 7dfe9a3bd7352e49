"""`DeepSpeedTrainer`: what `trainer.deepspeed.engine.build_deepspeed_trainer` returns and the I/O, LoRA and step
functions take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from peft import PeftModel

from parity.config import ModelConfig
from trainer.deepspeed.module import DeepSpeedK3Model


@dataclass
class DeepSpeedTrainer:
    """DeepSpeed's engine (call it like `DeepSpeedK3Model`), the unwrapped `DeepSpeedK3Model`, the PEFT wrapper when LoRA is on.

    `storage_dtypes` / `passthrough` keep each text tensor's checkpoint dtype and the non-text tensors (vision
    tower), so `trainer.deepspeed.io.export_official` writes back what was loaded. `norm_order`: the trainable
    parameters in Megatron's grad-norm order. Resumable state: `trainer.deepspeed.io.save_state` / `load_state`
    (the engine's optimizer state is partitioned; there is no whole `optimizer.state_dict()`)."""

    engine: Any  # deepspeed.DeepSpeedEngine
    module: DeepSpeedK3Model
    peft: PeftModel | None
    model_cfg: ModelConfig
    clip_grad: float
    storage_dtypes: dict[str, torch.dtype]
    passthrough: dict[str, torch.Tensor]
    norm_order: list[tuple[str, torch.nn.Parameter]]
    owns_process_group: bool

    @property
    def model(self) -> Any:
        """What `loss_fn` receives: `model(input_ids, lens, temperature) -> [B, T]` log-probs."""
        return self.engine
