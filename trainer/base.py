"""`TrainerBackend`: the surface `zerokl parity check` and `zerokl ppo` train and score through (the Megatron trainer,
`trainer/megatron/`, built by `trainer.backend.build_backend`): what the PPO loop may ask of a trainer and nothing of
its framework.

Invariant: built from the same checkpoint (and adapter), every token's log-prob has the shared forward's bits
(`parity.model`), whatever the layout. With an adapter (LoRA) only the adapter trains, the base stays the
checkpoint's, and `export_weights` is the adapter.

Every method is collective: all ranks call it, in the same order. Whole tensors (exports) land on rank 0; other ranks
get {} / None.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lora.adapter import Adapter
from parity.config import ModelConfig
from parity.weights import text_specs
from parity.kernels.logprobs import Sampling
from trainer.logprobs import PackedBatch, PaddedBatch, token_logprobs

WEIGHTS_FILE = "weights.pt"  # in a saved state: every checkpoint tensor, text tensors as fp32 masters
ADAPTER_DIR = "adapter"  # in a saved state with LoRA: the trained adapter, a PEFT directory

LossFn = Callable[[Any], torch.Tensor]
T = TypeVar("T")


class TrainerBackend(ABC):
    """A trainer holding the model of one checkpoint (+ adapter). `model` is what a `loss_fn` receives: callable as
    `model(input_ids, lens, temperature) -> [B, T]` log-probs, so `trainer.logprobs.token_logprobs(model, ...)` works."""

    name: str
    model_cfg: ModelConfig
    has_adapter: bool
    trainer: Any  # the backend's own trainer (`trainer.megatron.train.Trainer`), for reaching past the seam

    @property
    def model(self) -> Any:
        """The wrapped model (Megatron DDP): the backend's trainer exposes it as `.model`."""
        return self.trainer.model

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: those that train on different samples (every rank but a tensor-parallel peer's)."""
        return self.world_size

    @property
    def dp_rank(self) -> int:
        return self.rank

    def dp_all_gather(self, obj: T) -> list[T]:
        """Every data-parallel rank's `obj`, in DP-rank order, on every rank (pickled)."""
        return self.all_gather(obj)

    def logprobs(self, batch: PaddedBatch | PackedBatch, temperature: float | Sampling) -> torch.Tensor:
        """Next-token log-probs of every token, no grad: [B, T] for a padded batch (0 at each row's last token and on
        padding), [N] for a packed one; the rollout engine's bits. Every rank gets them."""
        with torch.no_grad():
            return token_logprobs(self.model, batch, temperature)

    def logprobs_and_raw(self, batch: PaddedBatch, temperature: float | Sampling) -> tuple[torch.Tensor, torch.Tensor]:
        """`logprobs` of a padded batch and the raw ones (temperature 1, no truncation), [B, T] each, from one no-grad
        forward."""
        with torch.no_grad():
            return self.model(batch.input_ids, batch.lens, temperature, raw=True, **batch.model_kwargs())

    def logprobs_raw_and_values(self, batch: PaddedBatch,
                                temperature: float | Sampling) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`logprobs_and_raw` (the same bits) and the value head's values [B, T], aligned alike, from one no-grad
        forward; only a backend built with a value head has them."""
        with torch.no_grad():
            return self.model(batch.input_ids, batch.lens, temperature, values=True, raw=True, **batch.model_kwargs())

    @abstractmethod
    def train_step(self, *loss_fns: LossFn) -> tuple[float, float]:
        """One optimizer step on the gradients of every `loss_fn(model)`, backward run after each in order and the
        gradients summed (gradient accumulation: one loss_fn per micro-batch), Megatron's grad-norm clipping; returns
        (the losses' sum, grad norm before clipping), the same on every rank."""

    @abstractmethod
    def export_official(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor by official name: text tensors (and a vision tower the backend trains) as the fp32
        masters, the others (a frozen vision tower) as loaded; on rank 0. Megatron's may be views of the live parameters: copy what must outlive the next step."""

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
        """Everything the next `train_step` depends on, into directory `path`: the weights (`_save_weights`) or, with
        an adapter, `adapter/` (PEFT directory, written by rank 0; the base is the checkpoint's), plus the optimizer
        state. `load_state` on a backend built the same way continues bit for bit."""
        path = Path(path)
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()
        if self.has_adapter:
            self._save_adapter(path / ADAPTER_DIR)
        else:
            self._save_weights(path)
        self._save_optimizer(path)
        self.barrier()
        return path

    @abstractmethod
    def load_state(self, path: str | Path) -> None:
        """Restore `save_state(path)` of a backend built the same way (checkpoint, adapter config, layout);
        FileNotFoundError naming what is missing."""

    @abstractmethod
    def _save_adapter(self, out: Path) -> None:
        """The trained adapter as a PEFT directory `out`, from rank 0."""

    def _save_weights(self, path: Path) -> None:
        """The weights `load_state` reads: WEIGHTS_FILE from rank 0 (collective: `export_official` gathers them)."""
        weights = self.export_official()
        if self.rank == 0:
            torch.save({n: t.clone() for n, t in weights.items()}, path / WEIGHTS_FILE)

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

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank (pickled)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    @abstractmethod
    def close(self) -> None:
        """Release the trainer and the process group it started."""
