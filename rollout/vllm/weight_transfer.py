"""The `zerokl` weight-transfer backend: vLLM workers receive `parity.sync` weight bundles, on CPU or GPU.

vLLM's built-in backends (NCCL, CUDA IPC) need GPUs. This one takes any `parity.sync` transport through vLLM's own
weight-update API: `start_weight_update`, `update_weights({"transport": NAME, "message": MESSAGE})`,
`finish_weight_update`. The worker rebuilds the receiving side of the transport the trainer sent with
(`parity.sync.transports.by_name`): `memory` (the tensors travel inside vLLM's RPC message), `shared_memory` (a
segment on this host), `disk` (the message names a directory the trainer wrote once), or `torch_distributed`: a
broadcast from the trainer over the group that `init_weight_transfer_engine` set up (`init_info`: `master_address`,
`master_port`, `rank_offset`, `world_size`, `backend` gloo or nccl; each worker joins as `rank_offset` + its rank
across vLLM's data-parallel replicas, the trainer is rank 0; the bundle arrives on the worker's device), which is how a
trainer reaches servers it does not own (`rollout.client.remote`). A flat bundle arrives flat and is verified in one
pass over its buffer.

All-or-nothing, across servers too: `update_weights` verifies the whole bundle (every text weight present with the
model's shape and dtype, every checksum matching the bytes that arrived, finite values, a version newer than the
worker's) and only stages it; `finish_weight_update` commits it: copies the staged tensors into the parameters (shapes
and dtypes already checked, so the copy cannot stop half way) and keeps the values they replace, so that
`rollback_weight_update` can put the previous weights and version back (another server of the same sync failed to
commit) until `confirm_weight_update` (every server committed) or the next update drops them. A rejected update
raises and leaves the previous weights and version in place. Wire dtypes are the parameters' (`parity.weights.serving_weights`: fp32 for fp32-stored tensors, else the
compute dtype), the operands the parity forward computes with, so the bits the trainer's forward uses are the bits
the rollout uses.
"""

from __future__ import annotations

from collections.abc import Mapping
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
from parity.sync.group import StandaloneGroup
from parity.sync.transports import TorchDistributed, by_name


@dataclass
class SyncInitInfo(WeightTransferInitInfo):
    """The trainer's group for `torch_distributed` updates; empty for the other transports (each update's message
    says how its bundle travels)."""

    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int = 1
    world_size: int | None = None
    backend: str = "gloo"
    timeout_s: float = 120.0


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
        self._previous: tuple[int, dict[str, torch.Tensor]] | None = None  # a commit's (old version, old values)
        self._group: StandaloneGroup | None = None

    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def init_transfer_engine(self, init_info: SyncInitInfo) -> None:
        """Join the trainer's group (replacing any earlier one); blocks until every rank has joined."""
        self._staged = None
        self._close_group()
        if init_info.master_address is None:
            return
        if init_info.master_port is None or init_info.world_size is None:
            raise SyncError("init_info for a torch_distributed group needs master_address, master_port and world_size")
        par = self.parallel_config
        rank = init_info.rank_offset + par.data_parallel_index * par.world_size + par.rank
        self._group = StandaloneGroup(init_info.master_address, int(init_info.master_port), rank,
                                      int(init_info.world_size), init_info.backend, init_info.timeout_s)

    def start_weight_update(self) -> None:
        self._staged = None
        self._previous = None  # a new sync: the last commit stands

    def receive_weights(self, update_info: SyncUpdateInfo) -> None:
        if update_info.transport == TorchDistributed.name:
            if self._group is None:
                raise SyncError("a torch_distributed update before init_weight_transfer_engine set up its group")
            bundle = TorchDistributed(src=0, group=self._group, device=self.device).receive()
        else:
            bundle = by_name(update_info.transport).receive(update_info.message)
        if bundle.kind != "full":
            raise SyncError(f"zerokl's rollout model takes full weight bundles, got kind {bundle.kind!r}")
        expected = {name: (tuple(p.shape), p.dtype) for name, p in self._params().items()}
        verify(bundle, expected, self.version)
        floats = {n: t for n, t in bundle.tensors.items() if t.is_floating_point()}
        if floats and not bool(torch.stack([torch.isfinite(t).all() for t in floats.values()]).all()):  # one read
            name = next(n for n, t in floats.items() if not bool(torch.isfinite(t).all()))
            raise SyncError(f"{name}: non-finite values in update version {bundle.version}")
        self._staged = bundle

    def finish_weight_update(self) -> None:
        """Commit the staged bundle (if an `update_weights` verified one) in one step, keeping what it replaces."""
        bundle, self._staged = self._staged, None
        if bundle is None:
            return
        params = self._params()
        with torch.no_grad():
            self._previous = (self.version, {name: params[name].detach().clone() for name in bundle.tensors})
            _copy_into(params, bundle.tensors)
        self.version = bundle.version

    def rollback_weight_update(self) -> None:
        """Undo the last commit (another server of the same sync could not commit): the previous weights and version
        back, bit for bit. Nothing to undo: nothing changes."""
        previous, self._previous = self._previous, None
        if previous is None:
            return
        version, values = previous
        with torch.no_grad():
            _copy_into(self._params(), values)
        self.version = version

    def confirm_weight_update(self) -> None:
        """Every server committed: the replaced values are dropped."""
        self._previous = None

    def abort_weight_update(self) -> None:
        """Drop a staged update (another server of the same sync rejected its copy): the weights stay as they are."""
        self._staged = None

    def _close_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def shutdown(self) -> None:
        self._staged = None
        self._close_group()


def _copy_into(params: dict[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> None:
    """params[name] <- values[name] for every name of `values` (same shapes and dtypes: `verify` checked), in batched
    launches (`torch._foreach_copy_`) rather than one copy each."""
    names = list(values)
    if names:
        torch._foreach_copy_([params[n] for n in names], [values[n] for n in names])
