"""The trainer-backend seam: one surface over the Megatron-core and the DeepSpeed ZeRO trainer, for
`zerokl parity check` and `zerokl ppo`.

`build_backend(name, checkpoint, ...)` returns a `TrainerBackend`:

- `"megatron"` (`trainer.train`): Megatron DDP + Megatron Adam, one process, TP = EP = 1;
- `"deepspeed"` (`trainer.deepspeed_backend`): DeepSpeed ZeRO-2 or -3 with torch AdamW and Megatron's clipping, one
  or more processes (torchrun-style env, e.g. from `zerokl.launch`). Every rank is given the same batches, so
  data parallelism partitions memory only and every update keeps Megatron's bits (trainer/DEEPSPEED.md).

Invariant: built from the same checkpoint (and adapter), the two backends give every token the same log-prob bits,
the same (loss, grad norm) for the same `train_step`s, and the same exported weights, bit for bit. With an adapter
(LoRA) only the adapter trains, the base stays the checkpoint's, and `export_weights` is the adapter.

Every method is collective: all ranks call it, in the same order. Whole tensors (exports) land on rank 0; other ranks
get {} / None.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lora.adapter import Adapter, load_adapter
from lora.spec import AdapterError
from parity.config import ConfigError, ModelConfig, load_model_config
from parity.weights import text_specs
from trainer.logprobs import PackedBatch, PaddedBatch, token_logprobs

BACKENDS = ("megatron", "deepspeed")
ZERO_STAGES = (2, 3)
# ZeRO-3 partitions every parameter, however small (DeepSpeed's default keeps those under 1e5 elements whole on
# every rank): the bits are then checked through the gather path for every tensor.
PERSISTENCE_THRESHOLD = 0
WEIGHTS_FILE = "weights.pt"  # in a saved state: every checkpoint tensor, text tensors as fp32 masters
ADAPTER_DIR = "adapter"  # in a saved state with LoRA: the trained adapter, a PEFT directory
OPTIMIZER_FILE = "optimizer.pt"  # Megatron's optimizer state dict (DeepSpeed: its checkpoint under `state/`)

LossFn = Callable[[Any], torch.Tensor]
T = TypeVar("T")


class TrainerBackend(ABC):
    """A trainer holding the model of one checkpoint (+ adapter). `model` is what a `loss_fn` receives: callable as
    `model(input_ids, lens, temperature) -> [B, T]` log-probs, so `trainer.logprobs.token_logprobs(model, ...)` works."""

    name: str
    model_cfg: ModelConfig
    has_adapter: bool
    trainer: Any  # the backend's own trainer (`trainer.train.Trainer` / `DeepSpeedTrainer`), for reaching past the seam

    @property
    @abstractmethod
    def model(self) -> Any:
        """The wrapped model (Megatron DDP / DeepSpeed engine)."""

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def logprobs(self, batch: PaddedBatch | PackedBatch, temperature: float) -> torch.Tensor:
        """Next-token log-probs of every token, no grad: [B, T] for a padded batch (0 at each row's last token and on
        padding), [N] for a packed one; the rollout engine's bits. Every rank gets them."""
        with torch.no_grad():
            return token_logprobs(self.model, batch, temperature)

    @abstractmethod
    def train_step(self, loss_fn: LossFn) -> tuple[float, float]:
        """loss = loss_fn(model), backward, Megatron's grad-norm clipping, one optimizer step; returns
        (loss, grad norm before clipping), the same on every rank."""

    @abstractmethod
    def export_official(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor by official name: text tensors as the fp32 masters, the others (vision tower) as
        loaded; on rank 0. Megatron's may be views of the live parameters: copy what must outlive the next step."""

    @abstractmethod
    def export_adapter(self) -> Adapter | None:
        """The adapter as trained (`lora.adapter.Adapter`, fp32) on rank 0, None elsewhere; ValueError without one."""

    def export_weights(self) -> dict[str, torch.Tensor]:
        """What the rollout engine must run, on rank 0: the fp32 text weights by official name, or with an adapter the
        adapter's tensors by PEFT name (`base_model.model.<module>.lora_A.weight`, `Adapter.tensors()`)."""
        if self.has_adapter:
            adapter = self.export_adapter()
            return {} if adapter is None else adapter.tensors()
        text = text_specs(self.model_cfg.text)
        return {n: t for n, t in self.export_official().items() if n in text}

    def save_state(self, path: str | Path) -> Path:
        """Everything the next `train_step` depends on, into directory `path`: `weights.pt` (`export_official`) or,
        with an adapter, `adapter/` (PEFT directory; the base is the checkpoint's), written by rank 0, plus the
        optimizer state. `load_state` on a backend built the same way continues bit for bit."""
        path = Path(path)
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()
        if self.has_adapter:
            self._save_adapter(path / ADAPTER_DIR)
        else:
            weights = self.export_official()
            if self.rank == 0:
                torch.save({n: t.clone() for n, t in weights.items()}, path / WEIGHTS_FILE)
        self._save_optimizer(path)
        self.barrier()
        return path

    @abstractmethod
    def load_state(self, path: str | Path) -> None:
        """Restore `save_state(path)` of a backend of the same kind, checkpoint, adapter config (and, for DeepSpeed,
        ZeRO stage and world size); FileNotFoundError naming what is missing."""

    @abstractmethod
    def _save_adapter(self, out: Path) -> None:
        """The trained adapter as a PEFT directory `out`, from rank 0."""

    @abstractmethod
    def _save_optimizer(self, path: Path) -> None:
        """The optimizer state `load_state` reads, into directory `path`."""

    def broadcast(self, obj: T | None) -> T:
        """Rank 0's `obj` on every rank (pickled)."""
        if self.world_size == 1:
            return obj  # type: ignore[return-value]
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[return-value]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    @abstractmethod
    def close(self) -> None:
        """Release the trainer and the process group it started."""


class MegatronBackend(TrainerBackend):
    """`trainer.train.build_trainer` at TP = EP = 1 in this process."""

    name = "megatron"

    def __init__(self, checkpoint: Path, lr: float, clip_grad: float, weight_decay: float, kernels: str,
                 adapter: Adapter | None):
        from trainer.parallel import init_parallel
        from trainer.train import build_trainer

        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("the megatron backend runs in one process (TP = EP = 1); "
                              "train on several processes with the deepspeed backend")
        self.par = init_parallel(1, 1)
        self.trainer = build_trainer(checkpoint, self.par, lr=lr, clip_grad=clip_grad, weight_decay=weight_decay,
                                     kernels=kernels, adapter=adapter)
        self.model_cfg = self.trainer.module.config.k3
        self.has_adapter = adapter is not None

    @property
    def model(self) -> Any:
        return self.trainer.model

    def train_step(self, loss_fn: LossFn) -> tuple[float, float]:
        from trainer.train import train_step

        return train_step(self.trainer, loss_fn)

    def export_official(self) -> dict[str, torch.Tensor]:
        from trainer.checkpoint_io import export_official

        return export_official(self.trainer.module, compute_dtype=True)

    def export_adapter(self) -> Adapter | None:
        from trainer.checkpoint_io import export_adapter

        return export_adapter(self.trainer.module)

    def _save_adapter(self, out: Path) -> None:
        from trainer.checkpoint_io import save_adapter

        save_adapter(self.trainer.module, out)

    def _save_optimizer(self, path: Path) -> None:
        torch.save(self.trainer.optimizer.state_dict(), path / OPTIMIZER_FILE)

    def load_state(self, path: str | Path) -> None:
        from trainer.checkpoint_io import load_official

        path = Path(path)
        if not (path / OPTIMIZER_FILE).is_file():
            raise FileNotFoundError(f"{path} holds no Megatron trainer state (no {OPTIMIZER_FILE})")
        if self.has_adapter:
            self._load_adapter(load_adapter(path / ADAPTER_DIR, self.model_cfg.text))
        else:
            load_official(self.trainer.module, torch.load(path / WEIGHTS_FILE))
        self.trainer.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=False))

    def _load_adapter(self, adapter: Adapter) -> None:
        """Copy `adapter`'s tensors into the attached LoRA modules (whole tensors: TP = 1)."""
        module = self.trainer.module
        if {f"{m}.weight" for m in adapter.weights} != set(module.lora_scales):
            raise AdapterError("the saved adapter adapts other modules than this trainer's")
        with torch.no_grad():
            for m, (a, b) in adapter.weights.items():
                target = module.lora_module(f"{m}.weight")
                target.lora_A.weight.copy_(a)
                target.lora_B.weight.copy_(b)

    def close(self) -> None:
        from trainer.parallel import destroy_parallel

        destroy_parallel(self.par)


class DeepSpeedBackend(TrainerBackend):
    """`trainer.deepspeed_backend.build_deepspeed_trainer` at ZeRO `zero_stage`, every parameter partitioned."""

    name = "deepspeed"

    def __init__(self, checkpoint: Path, lr: float, clip_grad: float, weight_decay: float, kernels: str,
                 adapter: Adapter | None, zero_stage: int):
        from trainer.deepspeed_backend import build_deepspeed_trainer

        self.trainer = build_deepspeed_trainer(checkpoint, lr, zero_stage=zero_stage, kernels=kernels, lora=adapter,
                                               clip_grad=clip_grad, weight_decay=weight_decay,
                                               persistence_threshold=PERSISTENCE_THRESHOLD)
        self.model_cfg = self.trainer.model_cfg
        self.has_adapter = adapter is not None

    @property
    def model(self) -> Any:
        return self.trainer.model

    def train_step(self, loss_fn: LossFn) -> tuple[float, float]:
        from trainer.deepspeed_backend import train_step

        return train_step(self.trainer, loss_fn)

    def export_official(self) -> dict[str, torch.Tensor]:
        from trainer.deepspeed_io import export_official

        return export_official(self.trainer, compute_dtype=True)

    def export_adapter(self) -> Adapter | None:
        from trainer.deepspeed_lora import export_adapter

        return export_adapter(self.trainer)

    def _save_adapter(self, out: Path) -> None:
        from trainer.deepspeed_lora import save_adapter

        save_adapter(self.trainer, out)

    def _save_optimizer(self, path: Path) -> None:
        from trainer.deepspeed_io import save_state

        save_state(self.trainer, path)

    def load_state(self, path: str | Path) -> None:
        from trainer.deepspeed_io import load_state

        load_state(self.trainer, path)

    def close(self) -> None:
        from trainer.deepspeed_backend import destroy

        destroy(self.trainer)


def build_backend(name: str, checkpoint: str | Path, *, lr: float = 0.0, clip_grad: float = 1.0,
                  weight_decay: float = 0.0, kernels: str = "invariant",
                  adapter: Adapter | str | Path | None = None, zero_stage: int = 3) -> TrainerBackend:
    """The `name` backend ("megatron" | "deepspeed") on an official checkpoint directory, with `adapter` (an `Adapter`
    or a PEFT adapter directory: LoRA, base frozen) when given. `lr`, `clip_grad` (Megatron's max grad norm, 0: off)
    and `weight_decay` configure the optimizer (lr 0: a backend that only scores); `zero_stage` (2 or 3) applies to
    DeepSpeed. Collective; raises ConfigError on a bad choice, AdapterError on a bad adapter."""
    if name not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "deepspeed" and zero_stage not in ZERO_STAGES:
        raise ConfigError(f"zero_stage must be one of {', '.join(map(str, ZERO_STAGES))}, got {zero_stage!r}")
    checkpoint = Path(checkpoint)
    if adapter is not None and not isinstance(adapter, Adapter):
        adapter = load_adapter(adapter, load_model_config(checkpoint).text)
    if name == "megatron":
        return MegatronBackend(checkpoint, lr, clip_grad, weight_decay, kernels, adapter)
    return DeepSpeedBackend(checkpoint, lr, clip_grad, weight_decay, kernels, adapter, zero_stage)
