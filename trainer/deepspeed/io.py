"""Official checkpoints and resumable state in and out of the DeepSpeed trainer, at any ZeRO stage.

Load: the official checkpoint (what `zerokl init-checkpoint` writes and vLLM loads) is copied into the fp32 master
parameters of a fresh `DeepSpeedK3Model` before `deepspeed.initialize` partitions them. Export: ZeRO-3 parameters are
gathered one at a time (`deepspeed.zero.GatheredParameters`) and only the receiving rank keeps a copy, cast back
to each tensor's checkpoint dtype; a load followed by an export returns the checkpoint bit for bit (bf16 -> fp32
-> bf16 is exact). Resumable state (masters, Adam moments, step counts) is DeepSpeed's own checkpoint, one file
per rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from parity.weights import is_mtp, text_names
from trainer.deepspeed.module import DeepSpeedK3Model
from trainer.deepspeed.trainer import DeepSpeedTrainer
from parity.io.checkpoint import CheckpointError, save_checkpoint

STATE_TAG = "state"


def load_official(module: DeepSpeedK3Model, weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.dtype],
                                                                                dict[str, torch.Tensor]]:
    """Copy every official text tensor into `module` (before `deepspeed.initialize`). Returns (checkpoint dtype
    per text tensor, the non-text tensors and the MTP draft layers, kept verbatim). Fails naming the first missing,
    unexpected or misshapen text tensor."""
    params = module.official_parameters()
    missing = [n for n in params if n not in weights]
    if missing:
        raise CheckpointError(f"{len(missing)} text tensors missing, first: {missing[0]}")
    root = text_names(module.cfg).root
    extra = [n for n in weights if n.startswith(root) and n not in params and not is_mtp(module.cfg, n)]
    if extra:
        raise CheckpointError(f"{len(extra)} unexpected text tensors, first: {extra[0]}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(weights[name].shape) != tuple(p.shape):
                raise CheckpointError(f"{name}: checkpoint shape {tuple(weights[name].shape)}, model {tuple(p.shape)}")
            p.copy_(weights[name])
    return {n: weights[n].dtype for n in params}, {n: t for n, t in weights.items() if n not in params}


def gathered(params: list[torch.nn.Parameter]) -> Any:
    """DeepSpeed's ZeRO-3 gather of `params` for reading (no write-back; a no-op for unpartitioned parameters)."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def export_official(trainer: DeepSpeedTrainer, compute_dtype: bool = False, rank: int = 0) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor, whole and in its checkpoint dtype, on `rank`; the other ranks get {}. Collective.
    `compute_dtype`: text tensors as the fp32 master weights instead (what a weight sync must send: the bits the
    trainer computes with), like `trainer.megatron.io.export_official`.

    Only `rank` accumulates the model; every rank holds at most one gathered parameter beyond its partitions.
    The base weights are exported whether or not LoRA is on (the adapter: `trainer.deepspeed.lora`)."""
    me = dist.get_rank()
    out: dict[str, torch.Tensor] = {}
    for name, p in trainer.module.official_parameters().items():
        with gathered([p]):
            if me == rank:
                out[name] = p.detach().to(p.dtype if compute_dtype else trainer.storage_dtypes[name]).clone()
    if me == rank:
        out.update(trainer.passthrough)
    return out


def save_official(trainer: DeepSpeedTrainer, out: str | Path) -> Path:
    """Export and write an official checkpoint directory from rank 0 (collective)."""
    weights = export_official(trainer)
    path = Path(out)
    if dist.get_rank() == 0:
        save_checkpoint(trainer.model_cfg, weights, path)
    dist.barrier()
    return path


def save_state(trainer: DeepSpeedTrainer, path: str | Path) -> Path:
    """DeepSpeed checkpoint of everything the next step depends on: fp32 master partitions, Adam moments and
    step counts, one file per rank under `path/state`. Collective."""
    trainer.engine.save_checkpoint(str(path), tag=STATE_TAG)
    return Path(path)


def load_state(trainer: DeepSpeedTrainer, path: str | Path) -> None:
    """Restore `save_state` into a trainer built from the same checkpoint, ZeRO stage, world size and LoRA
    config; the next `train_step` then has the bits of an uninterrupted run. Collective."""
    if not (Path(path) / STATE_TAG).is_dir():
        raise FileNotFoundError(f"{path} holds no DeepSpeed trainer state (no {STATE_TAG}/)")
    trainer.engine.load_checkpoint(str(path), tag=STATE_TAG, load_optimizer_states=True,
                                   load_lr_scheduler_states=False)
