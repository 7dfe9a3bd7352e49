"""The sync stage: the trainer's weights into the rollout engine as versioned, checksummed bundles.

After each step's updates every rank exports (collective) and rank 0 sends the next version (`parity.sync`): the full
text weights in their serving form (`parity.weights.serving_weights` of the fp32 masters: the operands the trainer's
forward computes with; a trained vision tower's too), or with LoRA only the adapter's PEFT tensors. The engine checks
every tensor's checksum and installs all or nothing; on rejection, or weights that cannot take their serving form
(NaN or inf in an MXFP4 expert), the run stops with `SyncFailed` and the engine keeps its version.

Variations: rollout servers (`RemoteSync`, over HTTP; before the first step `align_servers` brings servers that are
behind to the run's version), LoRA (`start_lora`: version 1 is the base installed by one timed full-weight sync plus
the initial adapter), staleness (`kept`: the serving weights of the versions queued rollouts may come from).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lora.adapter import Adapter
from parity.config import ConfigError
from parity.io.vision import vision_specs
from parity.quant.mxfp4 import QuantError
from parity.sync.bundle import SyncError, Transport, WeightBundle, weights_checksum
from parity.sync.serving import ServingBuffer
from parity.sync.transports import CudaIpc, Disk, SharedMemory, SyncResult, WeightSync
from parity.weights import serving_weights
from zerokl.ppo.config import PPOConfig


class SyncFailed(RuntimeError):
    """A weight sync the engine rejected; the engine stays on its previous version."""


def sync_transport(cfg: PPOConfig, out: Path) -> Transport | None:
    """The transport `sync` names (None: torch_distributed, which `rollout.client.remote` sets up per sync)."""
    return {"disk": lambda: Disk(out / "sync"), "shared_memory": SharedMemory, "cuda_ipc": CudaIpc,
            "torch_distributed": lambda: None}[cfg.sync]()


@dataclass
class RemoteSync:
    """`WeightSync`'s call for rollout servers: `RemoteRollout.sync` with `transport`."""

    remote: Any  # rollout.client.remote.RemoteRollout
    transport: Transport | None

    def __call__(self, bundle: WeightBundle) -> SyncResult:
        return self.remote.sync(bundle, self.transport)


def kept_copy(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of serving weights to keep: an export may hand out the trainer's own tensors (fp32 masters served as
    they are), which the next optimizer step changes in place."""
    return {n: t.detach().clone() for n, t in weights.items()}


class Sync:
    """Weight sync from `backend` into `engine` (rank 0's; None elsewhere). `send` is rank 0's one-bundle sync
    (`WeightSync` or `RemoteSync`), `last` its latest result, `full` a LoRA run's full-weight sync; `kept` holds the
    serving weights of recent versions when `keep` > 0 (max_staleness)."""

    def __init__(self, cfg: PPOConfig, backend: Any, engine: Any, out: Path, log: Callable[[str], None]):
        self.cfg, self.backend, self.engine, self.out, self.log = cfg, backend, engine, out, log
        self.send: WeightSync | RemoteSync | None = None
        if engine is not None:
            transport = sync_transport(cfg, out)
            self.send = RemoteSync(engine, transport) if cfg.rollout_servers else WeightSync(transport, engine)
        self.last: SyncResult | None = None
        self.full: SyncResult | None = None
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        self._serving: ServingBuffer | None = None

    def __call__(self, bundle: WeightBundle) -> None:
        self.last = self.send(bundle)

    def export_base(self) -> dict[str, torch.Tensor]:
        """The trainer's text weights as the engine holds them, official names; a trained vision tower's too, in the
        compute dtype (its forward's operands). Collective; {} off rank 0."""
        exported = self.backend.export_official()
        if not exported:
            return {}
        return {**serving_weights(self.backend.model_cfg.text, exported), **self._vision(exported)}

    def base_bundle(self, version: int) -> WeightBundle:
        """`export_base` as the bundle a sync sends: the same bytes written into one reused flat buffer
        (`parity.sync.serving.ServingBuffer`; the next call overwrites it). Collective; empty off rank 0."""
        exported = self.backend.export_official()
        if not exported:
            return WeightBundle.make(version, {})
        if self._serving is None:
            self._serving = ServingBuffer(self.backend.model_cfg.text)
        return self._serving.bundle(version, exported, self._vision(exported))

    def _vision(self, exported: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A trained vision tower's tensors in the compute dtype ({} when it stays frozen)."""
        if self.cfg.vision_tower != "trainable":
            return {}
        text = self.backend.model_cfg.text
        return {n: exported[n].detach().to(text.compute_dtype)
                for n in vision_specs(self.backend.model_cfg.vision, text.hidden_size)}

    def _export(self, version: int) -> WeightBundle:
        """What a sync sends: the full text weights, or with LoRA only the adapter's PEFT tensors."""
        if not self.cfg.lora:
            return self.base_bundle(version)
        return WeightBundle.make(version, self.backend.export_weights(), kind="adapter")

    def push(self, version: int, before: Callable[[], None] = lambda: None) -> None:
        """Push the updated weights as `version` (`before()` runs on rank 0 first: the queued generations keep the
        version they started with); raise SyncFailed when the engine rejects them or they cannot take their serving
        form (engine unchanged). Collective: every rank exports, rank 0 syncs and tells the others the outcome."""
        rank0 = self.send is not None
        error = None
        try:
            bundle = self._export(version)
        except QuantError as e:  # rank 0 alone quantises: the others learn it from the broadcast
            error = (f"the trained weights cannot be synced ({e}); the rollout engine stays on version "
                     f"{self.engine.policy_version}")
        if rank0 and error is None:
            before()
            try:
                self(bundle)
            except SyncError as e:
                error = (f"weight sync to version {bundle.version} failed ({e}); the rollout engine stays "
                         f"on version {self.engine.policy_version}")
        error = self.backend.broadcast(error)
        if error is not None:
            raise SyncFailed(error)
        if rank0 and self.cfg.max_staleness:  # the versions queued or future rollouts may come from
            self.kept[version] = kept_copy(bundle.tensors)
            self.kept = {v: w for v, w in self.kept.items() if v >= version - self.cfg.max_staleness}

    def align_servers(self, checkpoint: Path, version: int) -> None:
        """Rollout servers: before the first step they serve this run's (base) weights at `version` (checked by
        checksum); servers behind it (started on the checkpoint for a resumed run, or restarted) get them by a sync
        (a LoRA run's `full`). Collective: every rank exports, rank 0 checks and syncs, and tells the others the
        outcome."""
        bundle = self.base_bundle(version)
        error = None
        if self.send is not None:
            held, expected = self.engine.version, weights_checksum(bundle.checksums)
            trains = self.cfg.vision_tower == "trainable"
            wrong = sorted(u for u, synced in self.engine.vision_synced.items() if synced != trains)
            try:
                if wrong:
                    error = (f"rollout server {wrong[0]} " + ("holds its vision tower as loaded, but this run trains "
                             "it: start the servers with `zerokl serve --sync-vision-tower`" if trains else
                             "takes vision tower syncs (--sync-vision-tower), but this run keeps the tower frozen: "
                             "start the servers without it, or set vision_tower: trainable"))
                elif held < version:
                    self.log(f"rollout servers at version {held}: syncing the run's version {version}")
                    self(bundle)
                    if self.cfg.lora:  # LoRA runs report one full-weight sync beside their adapter syncs
                        self.full = self.last
                elif held > version or any(c != expected for c in self.engine.checksums.values()):
                    error = (f"the rollout servers serve version {held} of other weights than this run's version "
                             f"{version}; start them on the run's checkpoint (`zerokl serve --checkpoint "
                             f"{checkpoint}`), or restart them to resume")
            except SyncError as e:
                error = f"the rollout servers could not take the run's weights: {e}"
        error = self.backend.broadcast(error)
        if error is not None:
            raise ConfigError(error)

    def start_lora(self, adapter: Adapter, version: int, rank: int) -> None:
        """Install the base at `version` with one full-weight sync (timed, for comparison; servers already hold it,
        `align_servers`) and the adapter (of LoRA rank `rank`) as the engine's policy adapter. Collective: every rank
        exports, rank 0 syncs."""
        from lora.adapter import save_adapter

        remote = bool(self.cfg.rollout_servers)
        base = None if remote else self.base_bundle(version)
        if self.send is None:
            return
        if base is not None:
            self(base)
            self.full = self.last
        directory = self.out / "adapter-start"
        shutil.rmtree(directory, ignore_errors=True)
        self.engine.set_policy_adapter("policy", save_adapter(adapter, directory))
        full = "" if self.full is None else f"; full-weight sync {self.full.nbytes / 1e6:.1f} MB in " \
                                            f"{self.full.seconds:.2f} s"
        self.log(f"LoRA: {len(adapter.weights)} adapted projections, rank {rank}{full}")

    def reinstall(self, version: int) -> None:
        """A resumed full-weight run: the trainer's weights into the engine as `version` (collective)."""
        bundle = self.base_bundle(version)
        if self.send is not None:
            self(bundle)
