"""`MegatronBackend`: the Megatron-core trainer (`trainer.megatron.train`) behind `TrainerBackend`: Megatron DDP +
Megatron Adam over the processes of the run (`WORLD_SIZE`, one when alone) at a TP x EP x DP layout
(`trainer.megatron.parallel`: DP = processes / TP, EP splitting the experts across the DP ranks). On several
data-parallel ranks the optimizer is Megatron's distributed one (ZeRO-1): the gradients are reduce-scattered (averaged
over the DP ranks), each rank steps its 1/DP share of its fp32 parameters with its share of the Adam state, and the
parameters are all-gathered, so every DP rank holds the same weights."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from lora.adapter import Adapter, load_adapter
from trainer.base import ADAPTER_DIR, WEIGHTS_FILE, LossFn, T, TrainerBackend
from trainer.megatron.io import (copy_adapter, export_adapter, export_official, load_official, load_rank_weights,
                                 save_adapter, save_rank_weights)
from trainer.megatron.parallel import destroy_parallel, init_parallel
from trainer.megatron.train import build_trainer, train_step

OPTIMIZER_FILE = "optimizer.pt"  # in a saved state of one process: Megatron's optimizer state dict
SHARD_FILE = "optimizer-rank{rank}.pt"  # on several processes: rank r's Adam state (its shard, its share)
VALUE_HEAD_FILE = "value_head.pt"  # in a saved state with a value head: its [1, hidden + 1] fp32 weight


class MegatronBackend(TrainerBackend):
    """`trainer.megatron.train.build_trainer` at `tp` x `ep` over the ranks of the run (DP = world size / tp), with a
    value head (GAE's critic) when `value_head_lr` is given: trained in the same optimizer step at its own learning
    rate, saved and restored with the state, never exported. On one process the state is WEIGHTS_FILE and
    OPTIMIZER_FILE; on several every rank writes its part of the weights with nothing gathered
    (`trainer.megatron.io.save_rank_weights`) and its own Adam state (SHARD_FILE), and reads back only its own, so a
    saved state resumes on the same layout."""

    name = "megatron"

    def __init__(self, checkpoint: Path, lr: float, clip_grad: float, weight_decay: float, kernels: str,
                 adapter: Adapter | None, value_head_lr: float | None = None, train_vision: bool = False,
                 tp: int = 1, ep: int = 1):
        self.par = init_parallel(tp, ep)
        self.trainer = build_trainer(checkpoint, self.par, lr=lr, clip_grad=clip_grad, weight_decay=weight_decay,
                                     kernels=kernels, adapter=adapter, value_head_lr=value_head_lr,
                                     train_vision=train_vision)
        self.model_cfg = self.trainer.module.config.k3
        self.has_adapter = adapter is not None

    @property
    def dp_size(self) -> int:
        return self.par.dp

    @property
    def dp_rank(self) -> int:
        return self.par.dp_rank

    def dp_all_gather(self, obj: T) -> list[T]:
        if self.par.dp == 1:
            return [obj]
        out: list = [None] * self.par.dp
        dist.all_gather_object(out, obj, group=parallel_state.get_data_parallel_group())
        return out

    def train_step(self, *loss_fns: LossFn) -> tuple[float, float]:
        return train_step(self.trainer, *loss_fns)

    def export_official(self) -> dict[str, torch.Tensor]:
        """`TrainerBackend.export_official`: gathered onto rank 0 alone (`onto_rank0`), {} on the other ranks."""
        return export_official(self.trainer.module, compute_dtype=True, onto_rank0=True)

    def export_adapter(self) -> Adapter | None:
        return export_adapter(self.trainer.module)

    def _save_adapter(self, out: Path) -> None:
        save_adapter(self.trainer.module, out)  # collective; rank 0 writes

    def save_state(self, path: str | Path) -> Path:
        """`TrainerBackend.save_state` plus, with a value head, its weight (VALUE_HEAD_FILE; its Adam moments are in
        the optimizer state)."""
        path = super().save_state(path)
        head = self.trainer.module.value_head
        if head is not None and self.rank == 0:
            torch.save(head.weight.detach().clone(), path / VALUE_HEAD_FILE)
        return path

    def _save_weights(self, path: Path) -> None:
        if self.world_size > 1:
            save_rank_weights(self.trainer.module, path)
        else:
            super()._save_weights(path)

    def _save_optimizer(self, path: Path) -> None:
        if self.world_size > 1:
            torch.save([part.optimizer.state_dict() for part in self._optimizers()],
                       path / SHARD_FILE.format(rank=self.rank))
        elif self.rank == 0:
            torch.save(self.trainer.optimizer.state_dict(), path / OPTIMIZER_FILE)

    def _optimizers(self) -> list:
        """Megatron's optimizers of this trainer (a `ChainedOptimizer` holds one per parameter-group kind)."""
        optimizer = self.trainer.optimizer
        return list(getattr(optimizer, "chained_optimizers", [optimizer]))

    def load_state(self, path: str | Path) -> None:
        path = Path(path)
        shards = sorted(path.glob(SHARD_FILE.format(rank="*")))
        if not shards and not (path / OPTIMIZER_FILE).is_file():
            raise FileNotFoundError(f"{path} holds no Megatron trainer state (no {OPTIMIZER_FILE})")
        if len(shards) != (self.world_size if self.world_size > 1 else 0):
            saved = f"{len(shards)} processes" if shards else "one process"
            raise FileNotFoundError(f"{path} holds the Megatron optimizer state of {saved}; resume it on as many "
                                    f"(this run has {self.world_size})")
        if self.has_adapter:
            copy_adapter(self.trainer.module, load_adapter(path / ADAPTER_DIR, self.model_cfg.text))
        elif self.world_size > 1:
            load_rank_weights(self.trainer.module, path)
        else:
            load_official(self.trainer.module, torch.load(path / WEIGHTS_FILE))
        head = self.trainer.module.value_head
        if head is not None:
            if not (path / VALUE_HEAD_FILE).is_file():
                raise FileNotFoundError(f"{path} holds no value head ({VALUE_HEAD_FILE}): not a state saved with one")
            with torch.no_grad():
                head.weight.copy_(torch.load(path / VALUE_HEAD_FILE, weights_only=True))
        if shards:
            mine = torch.load(path / SHARD_FILE.format(rank=self.rank), weights_only=True)
            for part, state in zip(self._optimizers(), mine, strict=True):
                part.optimizer.load_state_dict(state)
        else:
            self.trainer.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=True))

    def close(self) -> None:
        destroy_parallel(self.par)
