"""The DeepSpeed (ZeRO) trainer backend: `DeepSpeedK3Model` under `deepspeed.initialize`, optional PEFT LoRA, same log-probs.

`build_deepspeed_trainer` loads an official checkpoint into a `DeepSpeedK3Model` (fp32 masters, `trainer.deepspeed.io`),
optionally wraps it with PEFT (`trainer.deepspeed.lora`: a `LoraConfig` or an adapter directory), and hands it to
`deepspeed.initialize` with a client `torch.optim.AdamW` at ZeRO stage 1, 2 or 3. The `DeepSpeedTrainer` it
returns has the surface the PPO loop uses on the Megatron `Trainer`: `.model` is callable as
`model(input_ids, lens, temperature) -> [B, T]` log-probs (so `trainer.logprobs.token_logprobs` works), and
`train_step(trainer, loss_fn) -> (loss, grad_norm)`.

Numerics: the forward is the shared parity forward; DeepSpeed's gradient clipping is off and
`trainer.deepspeed.clip` clips with Megatron's arithmetic; the optimizer is torch's AdamW with megatron-core's
defaults (betas 0.9 / 0.999, eps 1e-8) and `weight_decay` on every trainable parameter, as zerokl's Megatron
trainer applies it (its optimizer groups carry a wd multiplier that only Megatron's lr/wd scheduler reads, and it
runs none). trainer/deepspeed/README.md lists what this makes bitwise equal to the Megatron trainer.

Process group: gloo, from the launcher's environment (torchrun / `deepspeed`), or a one-rank in-memory store.
DeepSpeed JIT-compiles its `deepspeed_shm_comm` op when it sets up communication, into `TORCH_EXTENSIONS_DIR`;
when that is unset it is set to the project's `.cache/torch_extensions` (the Makefile's location), so tests and CI
reuse one build.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import LoraConfig

from lora.adapter import Adapter
from trainer.deepspeed.clip import clip_grads, grad_norm_order
from trainer.deepspeed.io import load_official
from trainer.deepspeed.lora import attach_lora
from trainer.deepspeed.module import DeepSpeedK3Model
from trainer.deepspeed.trainer import DeepSpeedTrainer
from parity.io.checkpoint import load_checkpoint
from parity.weights import master_weights

ROOT = Path(__file__).resolve().parents[2]
EXTENSIONS_DIR = ROOT / ".cache" / "torch_extensions"
ZERO_STAGES = (1, 2, 3)
ADAM_BETAS = (0.9, 0.999)  # megatron-core OptimizerConfig defaults
ADAM_EPS = 1e-8


def init_dist() -> bool:
    """gloo for DeepSpeed (CPU): the launcher's env:// group, else a one-rank in-memory store; returns whether this
    call started the process group. Sets TORCH_EXTENSIONS_DIR (project cache) and, for one process without a
    launcher, LOCAL_RANK = 0 when unset."""
    if torch.cuda.is_available():
        raise RuntimeError("trainer.deepspeed.engine builds the CPU trainer (gloo, CPU parameters); "
                           "this host has a GPU")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))
    owns = not dist.is_initialized()
    if owns:
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if "LOCAL_RANK" not in os.environ and dist.get_world_size() == 1:
        os.environ["LOCAL_RANK"] = "0"  # launchers set it; DeepSpeed reads it at init and in ZeRO-3 checks
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return owns


def deepspeed_config(zero_stage: int, persistence_threshold: int) -> dict[str, Any]:
    """The engine config: one micro-batch per step, no DeepSpeed clipping (Megatron's is applied instead), fp32,
    ZeRO `zero_stage`; ZeRO-3 keeps parameters below `persistence_threshold` elements whole on every rank."""
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage}")
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch AdamW as the client optimizer
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def build_deepspeed_trainer(checkpoint: str | Path, lr: float, zero_stage: int = 3, kernels: str = "invariant",
                            lora: LoraConfig | Adapter | str | Path | None = None, clip_grad: float = 1.0,
                            weight_decay: float = 0.0, seed: int = 0,
                            persistence_threshold: int = 100_000) -> DeepSpeedTrainer:
    """Load `checkpoint` (official format) into a `DeepSpeedK3Model`, optionally put PEFT LoRA on it (`lora`: a `LoraConfig`,
    a `lora.adapter.Adapter` or an adapter directory; only the adapter trains), and initialise DeepSpeed ZeRO
    `zero_stage` with torch AdamW (`lr`, Megatron's betas/eps, `weight_decay`); `clip_grad` is Megatron's max grad
    norm (0: no clipping). ZeRO-3 keeps parameters of fewer than `persistence_threshold` elements whole on every rank
    (DeepSpeed's default; 0 partitions every one). `seed` fixes PEFT's initialisation of a new adapter. Collective
    over the process group."""
    owns = init_dist()
    import deepspeed

    model_cfg, weights = load_checkpoint(checkpoint)
    module = DeepSpeedK3Model(model_cfg.text, kernels)
    storage_dtypes, passthrough = load_official(module, master_weights(model_cfg.text, weights))
    del weights
    peft = None if lora is None else attach_lora(module, lora, seed)
    if zero_stage == 3:
        module.bind_zero3()
    order = grad_norm_order((peft or module).named_parameters())
    optimizer = torch.optim.AdamW([p for _, p in order], lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                                  weight_decay=weight_decay)
    engine, *_ = deepspeed.initialize(model=peft or module, optimizer=optimizer,
                                      config=deepspeed_config(zero_stage, persistence_threshold))
    return DeepSpeedTrainer(engine, module, peft, model_cfg, clip_grad, storage_dtypes, passthrough, order, owns)


def train_step(trainer: DeepSpeedTrainer, *loss_fns: Callable[[Any], torch.Tensor]) -> tuple[float, float]:
    """For each loss_fn in order (micro-batches) loss = loss_fn(trainer.model) and DeepSpeed's backward, the
    gradients accumulating (the last backward is the accumulation boundary: gradients averaged over data-parallel
    ranks), Megatron's grad norm and clipping (`trainer.deepspeed.clip`), optimizer step (DeepSpeed zeroes the
    gradients).

    Returns (the losses' sum, grad norm before clipping). Collective."""
    total = 0.0
    for i, loss_fn in enumerate(loss_fns):
        trainer.engine.set_gradient_accumulation_boundary(i == len(loss_fns) - 1)
        loss = loss_fn(trainer.engine)
        trainer.engine.backward(loss)
        total += float(loss.detach())
    grad_norm = clip_grads(trainer.norm_order, trainer.clip_grad)
    trainer.engine.step()
    return total, grad_norm


def destroy_dist() -> None:
    """End the process group through DeepSpeed, which also drops the groups it cached (its world clone, data
    parallel group), so a later `init_dist` starts clean."""
    import deepspeed

    deepspeed.comm.destroy_process_group()


def destroy(trainer: DeepSpeedTrainer) -> None:
    """End the engine's hooks and, when `build_deepspeed_trainer` started it, the process group."""
    trainer.engine.destroy()
    if trainer.owns_process_group and dist.is_initialized():
        destroy_dist()
