"""Building and stepping the trainer: K3 model on Megatron, Megatron's DDP, Megatron's optimizer (fp32 masters, on the
rank's device: its GPU, or the CPU).

`build_trainer` loads an official checkpoint into a fresh `MegatronK3Model` at the current TP/EP sizes and wraps it;
`train_step` is one forward/backward/step on a caller-supplied loss of the per-token log-probs. With an
`adapter` (LoRA), the base is frozen: Megatron's DDP and optimizer see only the adapter's parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import (MegatronOptimizer, OptimizerConfig, ParamKey, get_megatron_optimizer,
                                     get_standard_config_overrides)

from lora.adapter import Adapter
from parity.config import ModelConfig
from parity.image import ImageProcessing
from trainer.megatron.io import load_adapter, load_official, load_rank_shards
from trainer.megatron.config import k3_transformer_config
from trainer.megatron.modules import VALUE_HEAD_PREFIX, MegatronK3Model
from trainer.megatron.parallel import ParallelContext
from parity.io.checkpoint import CheckpointReader, open_checkpoint


@dataclass
class Trainer:
    """The wrapped model (call it like `MegatronK3Model`), its unwrapped module, and Megatron's optimizer."""

    model: DistributedDataParallel
    module: MegatronK3Model
    optimizer: MegatronOptimizer


def build_model(model_cfg: ModelConfig, weights: dict[str, torch.Tensor] | CheckpointReader, par: ParallelContext,
                kernels: str = "invariant", params_dtype: torch.dtype = torch.float32,
                adapter: Adapter | None = None, vision_grid_side: int | None = None) -> MegatronK3Model:
    """A `MegatronK3Model` at `par`'s TP/EP sizes holding this rank's shard of `weights` (official names, fp32
    masters; or an opened checkpoint, from which only this rank's shard is read: `load_rank_shards`), and of
    `adapter` when given (then every base parameter is frozen); with `vision_grid_side` (the preprocessor's side
    limit) it trains the vision tower too (`MegatronK3Model.add_vision_tower`)."""
    with torch.device(par.device):
        model = MegatronK3Model(k3_transformer_config(model_cfg, par, kernels, params_dtype))
    if vision_grid_side is not None:
        model.add_vision_tower(vision_grid_side)
    if isinstance(weights, CheckpointReader):
        load_rank_shards(model, weights)
    else:
        load_official(model, weights)
    if adapter is not None:
        load_adapter(model, adapter)
    return model


def build_trainer(checkpoint: str | Path, par: ParallelContext, lr: float, clip_grad: float = 1.0,
                  weight_decay: float = 0.0, kernels: str = "invariant", adapter: Adapter | None = None,
                  value_head_lr: float | None = None, train_vision: bool = False) -> Trainer:
    """Load `checkpoint` (and `adapter`: LoRA training, base frozen), add a value head when `value_head_lr` is given
    (`MegatronK3Model.add_value_head`: trained with the model, in its own parameter group at that learning rate),
    train the vision tower with the text model when `train_vision`, wrap the model in Megatron's DDP (fp32 grads) and
    build Megatron's Adam over the trainable parameters: with several data-parallel ranks its distributed optimizer
    (`wrap`'s `shard_optimizer`)."""
    reader = open_checkpoint(checkpoint)  # each rank reads its own shard (MXFP4 experts dequantised, exact)
    side = ImageProcessing.from_checkpoint(checkpoint).side_limit if train_vision else None
    module = build_model(reader.cfg, reader, par, kernels, adapter=adapter, vision_grid_side=side)
    if value_head_lr is not None:
        module.add_value_head()
    return wrap(module, lr, clip_grad, weight_decay, value_head_lr, shard_optimizer=par.dp > 1)


def wrap(module: MegatronK3Model, lr: float, clip_grad: float = 1.0, weight_decay: float = 0.0,
         value_head_lr: float | None = None, shard_optimizer: bool = False) -> Trainer:
    """Megatron DDP around `module` and `get_megatron_optimizer` (Adam, fp32); a value head gets its own parameter
    group at `value_head_lr` (the rest keeps Megatron's standard groups). `shard_optimizer`: Megatron's distributed
    optimizer (ZeRO-1 over the data-parallel ranks: the gradients reduce-scattered, each rank keeps and steps the Adam
    state of its 1/DP of every bucket, the updated parameters all-gathered); otherwise every rank keeps all of it (the
    gradients all-reduced: what the layout benchmarks read back)."""
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=shard_optimizer)
    ddp = DistributedDataParallel(module.config, ddp_cfg, module)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad,
                              params_dtype=module.config.params_dtype, use_distributed_optimizer=shard_optimizer)
    overrides = None
    if module.value_head is not None:
        overrides = {**get_standard_config_overrides(opt_cfg),
                     ParamKey(name=f"*{VALUE_HEAD_PREFIX}*"): {"lr": value_head_lr, "max_lr": value_head_lr,
                                                               "is_decoupled_lr": True}}  # its own key in saved states
    return Trainer(ddp, module, get_megatron_optimizer(opt_cfg, [ddp], config_overrides=overrides))


def train_step(trainer: Trainer, *loss_fns: Callable[[DistributedDataParallel], torch.Tensor]) -> tuple[float, float]:
    """`queue_train_step`, then its two numbers read: (the losses' sum, grad norm before clipping)."""
    total, grad_norm = queue_train_step(trainer, *loss_fns)
    return float(total), float(grad_norm)


def queue_train_step(trainer: Trainer, *loss_fns: Callable[[DistributedDataParallel], torch.Tensor]) -> tuple:
    """Zero grads; for each loss_fn in order (micro-batches) loss = loss_fn(model) and its backward, the gradients
    adding up in the DDP buffers; Megatron's grad finalisation (DP all-reduce), optimizer step. On CUDA nothing is
    read back to the host (`device_norm` keeps the clip's norm on the device): returns (the losses' sum, grad norm
    before clipping) as they are, tensors on the device there."""
    trainer.model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    total: Any = 0.0
    for loss_fn in loss_fns:
        loss = loss_fn(trainer.model)
        loss.backward()
        total = total + loss.detach().double()
    finalize_model_grads([trainer.model])
    with torch.device("cpu"):  # whatever the caller's default device: Adam makes its step counters host scalars,
        ok, grad_norm, _ = trainer.optimizer.step()  # which it reads every step (a CUDA one would be a sync each)
    if not ok:
        raise RuntimeError("Megatron optimizer step reported failure")
    return total, grad_norm
