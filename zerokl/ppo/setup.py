"""What a PPO run needs before its first step, each checked before any engine or trainer starts: the starting
checkpoint, the task's prompts against the context, the chat dialogue of a chat task, the reference checkpoint's
architecture, the data-parallel split, the LoRA adapter to start from, and how rollout servers serve it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lora.adapter import Adapter
from parity.config import ConfigError, load_model_config
from parity.image import ImageEncoder
from parity.io.checkpoint import init_checkpoint
from parity.kernels import get_kernels
from zerokl.ppo.config import PPOConfig
from zerokl.ppo.state import resume_point
from zerokl.tasks.chat import ChatDialogue

if TYPE_CHECKING:
    from rollout.server.serve import LoraServing


def base_checkpoint(cfg: PPOConfig, out: Path) -> Path:
    """The run's starting checkpoint: `cfg.model` when it is a checkpoint directory, else `out/init-checkpoint`,
    created from the model config (seed `cfg.seed`) when missing. Under a multi-process launcher it must exist
    already (`zerokl ppo --nproc-per-node N` creates it before starting the processes)."""
    model = Path(cfg.model)
    if model.is_dir():
        return model
    ckpt = out / "init-checkpoint"
    if not (ckpt / "config.json").exists():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(f"{ckpt} does not exist: on several processes start with `zerokl ppo --nproc-per-node N` "
                              "(it creates the checkpoint first) or set `model` to a checkpoint directory")
        init_checkpoint(model, ckpt, seed=cfg.seed)
    return ckpt


def eos_token_id(ckpt: Path) -> int:
    cfg = json.loads((ckpt / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return int(text.get("eos_token_id", 2))


def image_encoder(base: Path, model_cfg: Any, kernels: str) -> ImageEncoder | None:
    """The trainer side's image rows for a checkpoint with a vision tower (frozen; its tensors read once), else None."""
    if model_cfg.vision is None:
        return None
    from parity.io.checkpoint import load_checkpoint

    return ImageEncoder(base, model_cfg, load_checkpoint(base)[1], get_kernels(kernels))


def chat_dialogue(base: Path, task: Any) -> ChatDialogue:
    """Before the engine starts: the K3 chat dialogue of a chat task; ConfigError when the checkpoint's tokenizer
    has no chat format or the task's tools are malformed."""
    from parity.io.chat_format import ChatError

    try:
        return ChatDialogue(base, task)
    except ChatError as e:
        raise ConfigError(f"task {task.name}: {e}") from None


def check_prompt_lengths(task: Any, tokenizer: Any, room: int) -> None:
    """Before the engine starts: every prompt of a dataset task (one with `samples`) fits in `room` tokens (the
    engine's context less `max_tokens`); ConfigError naming the first line that does not."""
    for sample in getattr(task, "samples", ()):
        n = len(tokenizer.encode(sample.prompt).ids)
        if n > room:
            raise ConfigError(f"task {task.name}: dataset {task.path}:{sample.line}: the prompt has {n} tokens; at most "
                              f"{room} fit (the rollout context less max_tokens)")


def check_reference(path: Path, base: Path) -> None:
    """Before anything starts: the reference checkpoint `path` has the policy's (`base`'s) text architecture."""
    if load_model_config(path).text != load_model_config(base).text:
        raise ConfigError(f"ref_model {path}: its text model config differs from the policy's ({base}); the reference "
                          "must have the policy's architecture")


def data_parallel_ranks(cfg: PPOConfig, processes: int) -> int:
    """The run's data-parallel size on `processes` ranks (processes / tp); ConfigError unless tp and ep divide the
    process count (Megatron's layout: TP ranks share a batch, EP ranks split the experts across the DP ranks)."""
    for name in ("tp", "ep"):
        size = getattr(cfg, name)
        if processes % size:
            raise ConfigError(f"ppo config: {name}: {size} does not divide the {processes} processes "
                              f"(--nproc-per-node); run a multiple of {size} processes")
    return processes // cfg.tp


def check_sharding(cfg: PPOConfig, ranks: int) -> bool:
    """Whether the run shards each minibatch over its `ranks` data-parallel ranks (`data_parallel: shard`, the
    default, on several of them); ConfigError unless every minibatch then splits evenly over them (every rank runs the
    same passes)."""
    if cfg.data_parallel != "shard" or ranks < 2:
        return False
    samples = cfg.prompts_per_step * cfg.samples_per_prompt
    if samples % (cfg.num_minibatches * ranks):
        raise ConfigError(f"ppo config: data_parallel: shard splits each minibatch over the {ranks} data-parallel "
                          f"ranks: the {samples} samples of a step (prompts_per_step x samples_per_prompt) must divide "
                          f"into num_minibatches = {cfg.num_minibatches} x {ranks} equal parts; change them or set "
                          "data_parallel: replicate")
    return True


def initial_adapter(cfg: PPOConfig, checkpoint: Path, resume: Path | None) -> Adapter:
    """The adapter a LoRA run starts from: the resumed checkpoint's, `lora_init`, or PEFT's init (B = 0)."""
    from lora.adapter import load_adapter
    from lora.init import peft_default_adapter
    from trainer.base import ADAPTER_DIR

    text = load_model_config(checkpoint).text
    if resume is not None:
        return load_adapter(resume / ADAPTER_DIR, text)
    if cfg.lora_init is not None:
        return load_adapter(cfg.lora_init, text)
    return peft_default_adapter(text, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, seed=cfg.seed)


def adapter_rank(adapter: Adapter) -> int:
    return max(adapter.spec.rank(m) for m in adapter.weights)


def server_lora(cfg: PPOConfig, checkpoint: Path, resume: str | None, root: Path) -> LoraServing | None:
    """How the rollout servers a LoRA run starts serve its adapter (None for a full-weight run): from `root`, two
    adapters at a time (a push loads the new version before it unloads the old), the run's adapter rank."""
    from rollout.engine import lora_engine_args
    from rollout.server.serve import LoraServing

    if not cfg.lora:
        return None
    rank = adapter_rank(initial_adapter(cfg, checkpoint, resume_point(Path(resume)) if resume else None))
    args = lora_engine_args(rank, max_loras=2)
    root.mkdir(parents=True, exist_ok=True)
    return LoraServing(root, args["max_loras"], args["max_lora_rank"])
