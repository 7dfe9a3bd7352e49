"""The `zerokl` weight-transfer backend: vLLM workers receive `parity.sync` weight bundles on CPU.

vLLM's built-in backends (NCCL, CUDA IPC) need GPUs. This one takes any `parity.sync` transport through vLLM's own
weight-update API: `start_weight_update`, `update_weights({"transport": NAME, "message": MESSAGE})`,
`finish_weight_update`. The worker rebuilds the receiving side of the transport the trainer sent with
(`parity.sync.transports.by_name`): `memory` (the tensors travel inside vLLM's RPC message) or `disk` (the message
names a directory the trainer wrote once).

All-or-nothing: `update_weights` verifies the whole bundle (every text weight present with the model's shape and
dtype, every checksum matching the bytes that arrived, finite values, a version newer than the worker's) and
only stages it; `finish_weight_update` copies the staged tensors into the parameters (shapes and dtypes already
checked, so the copy cannot stop half way). A rejected update raises and leaves the previous weights and version in
place. Wire dtypes are the parameters' (`parity.weights.serving_weights`: fp32 for fp32-stored tensors, else the
compute dtype), the operands the parity forward computes with, so the bits the trainer's forward uses are the bits
the rollout uses.
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
from parity.sync.bundle import Message, SyncError, WeightBundle, verify
from parity.sync.transports import by_name


@dataclass
class SyncInitInfo(WeightTransferInitInfo):
    """No connection to set up: each update's message says how its bundle travels."""


@dataclass
class SyncUpdateInfo(WeightTransferUpdateInfo):
    transport: str  # `Transport.name` of the sender's transport
    message: Message  # what the sender's `Transport.send` returned


class ZeroKLWeightTransferEngine(WeightTransferEngine[SyncInitInfo, SyncUpdateInfo]):
    """Receives full weight bundles for zerokl's K3 model; see the module docstring for the guarantees."""

    init_info_cls = SyncInitInfo
    update_info_cls = SyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.version = 0  # of the weights in the model; the checkpoint's are version 0
        self._staged: WeightBundle | None = None

    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def init_transfer_engine(self, init_info: SyncInitInfo) -> None:
        self._staged = None

    def start_weight_update(self) -> None:
        self._staged = None

    def receive_weights(self, update_info: SyncUpdateInfo) -> None:
        bundle = by_name(update_info.transport).receive(update_info.message)
        if bundle.kind != "full":
            raise SyncError(f"zerokl's rollout model takes full weight bundles, got kind {bundle.kind!r}")
        expected = {name: (tuple(p.shape), p.dtype) for name, p in self._params().items()}
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
        with torch.no_grad():
            for name, t in bundle.tensors.items():
                params[name].copy_(t)
        self.version = bundle.version

    def shutdown(self) -> None:
        self._staged = None
