"""The `zerokl` weight-transfer backend: vLLM workers receive `parity.sync` weight bundles on CPU.

vLLM's built-in backends (NCCL, CUDA IPC) need GPUs. This one reads a bundle the trainer wrote with
`parity.sync.transports.Disk` (safetensors + a manifest of per-tensor blake2b checksums), through
vLLM's own weight-update API: `start_weight_update`, `update_weights({"path": DIR})`,
`finish_weight_update`.

All-or-nothing: `update_weights` verifies the whole bundle (every text weight present with the model's
shape and fp32 dtype, every checksum matching the bytes read, finite values, a version newer than the
worker's) and only stages it; `finish_weight_update` copies the staged tensors into the parameters and
re-checks each parameter's checksum, restoring the previous weights if any differs. A rejected update
raises and leaves the previous weights and version in place. Wire dtype is fp32, the dtype the parity
forward computes with, so the bits the trainer's forward uses are the bits the rollout uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.config import VllmConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from parity.sync.bundle import SyncError, WeightBundle, checksum, verify
from parity.sync.transports import Disk

@dataclass
class DiskInitInfo(WeightTransferInitInfo):
    """The disk transport needs no connection: bundles name their own directory."""


@dataclass
class DiskUpdateInfo(WeightTransferUpdateInfo):
    path: str  # a version directory written by `parity.sync.transports.Disk.send`


class ZeroKLWeightTransferEngine(WeightTransferEngine[DiskInitInfo, DiskUpdateInfo]):
    """Receives full fp32 weight bundles for zerokl's K3 model; see the module docstring for the guarantees."""

    init_info_cls = DiskInitInfo
    update_info_cls = DiskUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.version = 0  # of the weights in the model; the checkpoint's are version 0
        self._staged: WeightBundle | None = None

    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def init_transfer_engine(self, init_info: DiskInitInfo) -> None:
        self._staged = None

    def start_weight_update(self) -> None:
        self._staged = None

    def receive_weights(self, update_info: DiskUpdateInfo) -> None:
        bundle = Disk.read(update_info.path)
        if bundle.kind != "full":
            raise SyncError(f"zerokl's rollout model takes full weight bundles, got kind {bundle.kind!r}")
        expected = {name: (tuple(p.shape), torch.float32) for name, p in self._params().items()}
        verify(bundle, expected, self.version)
        for name, t in bundle.tensors.items():
            if not bool(torch.isfinite(t).all()):
                raise SyncError(f"{name}: non-finite values in update version {bundle.version}")
        self._staged = bundle

    def finish_weight_update(self) -> None:
        """Apply the staged bundle (if an `update_weights` verified one) in one step."""
        bundle, self._staged = self._staged, None
        if bundle is None:
            return
        params = self._params()
        backup = {name: p.detach().clone() for name, p in params.items()}
        with torch.no_grad():
            for name, t in bundle.tensors.items():
                params[name].copy_(t)
            bad = next((n for n, p in params.items() if checksum(p) != bundle.checksums[n]), None)
            if bad is not None:
                for name, t in backup.items():
                    params[name].copy_(t)
                raise SyncError(f"{bad}: checksum differs after applying version {bundle.version}; "
                                f"kept version {self.version}")
        self.version = bundle.version

    def shutdown(self) -> None:
        self._staged = None
