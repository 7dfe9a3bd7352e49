"""Transports that carry a `WeightBundle` from the trainer to a receiver, and the hooks around a sync.

- `InProcess`: hands the bundle to a receiver object in the same process.
- `Disk`: safetensors + a JSON manifest (version, kind, checksums) written to `DIR/v{version}` through a
  temporary directory and an atomic rename; `Disk.read` returns the bundle a receiver verifies.
- `TorchDistributed`: broadcasts the manifest, then each tensor in name order, from a source rank over a
  `torch.distributed` group (gloo on CPU, NCCL on GPU: the sender's tensors and the receiver's `device`
  are then CUDA devices); every rank gets the same bundle.
Users plug their own transport by implementing `Transport.send`.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from parity.sync.bundle import SyncError, WeightBundle

MANIFEST = "manifest.json"
TENSORS = "weights.safetensors"


class Receiver(Protocol):
    """Something that holds weights at a version and applies verified bundles all-or-nothing."""

    version: int

    def apply(self, bundle: WeightBundle) -> None: ...


class Transport(Protocol):
    def send(self, bundle: WeightBundle) -> None: ...


@dataclass
class InProcess:
    receiver: Receiver

    def send(self, bundle: WeightBundle) -> None:
        self.receiver.apply(bundle)


@dataclass
class Disk:
    """Writes each version to its own directory; `keep` most recent versions stay on disk."""

    root: Path
    keep: int = 2

    def path(self, version: int) -> Path:
        return Path(self.root) / f"v{version:08d}"

    def send(self, bundle: WeightBundle) -> None:
        final = self.path(bundle.version)
        tmp = final.with_name(final.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(dict(bundle.tensors), str(tmp / TENSORS))
        (tmp / MANIFEST).write_text(json.dumps({"version": bundle.version, "kind": bundle.kind,
                                                "checksums": dict(bundle.checksums)}))
        if final.exists():
            raise SyncError(f"{final} already exists: versions must increase")
        tmp.rename(final)
        for old in sorted(Path(self.root).glob("v????????"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def read(path: str | Path) -> WeightBundle:
        path = Path(path)
        if not (path / MANIFEST).is_file():
            raise SyncError(f"{path}: no {MANIFEST} (incomplete or not a weight update)")
        manifest = json.loads((path / MANIFEST).read_text())
        return WeightBundle(int(manifest["version"]), manifest["kind"], load_file(str(path / TENSORS)),
                            manifest["checksums"])


@dataclass
class TorchDistributed:
    """Broadcast from `src` to every rank of `group`; receivers call `receive()` on their side."""

    src: int = 0
    group: dist.ProcessGroup | None = None

    def send(self, bundle: WeightBundle) -> None:
        manifest = [{"version": bundle.version, "kind": bundle.kind, "checksums": dict(bundle.checksums),
                     "meta": [(n, tuple(t.shape), str(t.dtype)) for n, t in sorted(bundle.tensors.items())]}]
        dist.broadcast_object_list(manifest, src=self.src, group=self.group)
        for name, _, _ in manifest[0]["meta"]:
            dist.broadcast(bundle.tensors[name].contiguous(), src=self.src, group=self.group)

    def receive(self, device: torch.device | str | None = None) -> WeightBundle:
        """The bundle `send` broadcast, its tensors allocated on `device` (default: the CPU); not yet verified."""
        box: list[dict | None] = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        manifest = box[0]
        assert manifest is not None
        tensors = {}
        for name, shape, dtype in manifest["meta"]:
            t = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
            dist.broadcast(t, src=self.src, group=self.group)
            tensors[name] = t
        return WeightBundle(manifest["version"], manifest["kind"], tensors, manifest["checksums"])


@dataclass
class SyncResult:
    version: int
    kind: str
    nbytes: int
    seconds: float
    error: str | None = None


@dataclass
class WeightSync:
    """Run a sync through `transport` with user hooks around it; failures are reported, not raised,
    unless `strict` (the receiver then still holds its previous version)."""

    transport: Transport
    before_sync: list[Callable[[WeightBundle], None]] = field(default_factory=list)
    after_sync: list[Callable[[WeightBundle, SyncResult], None]] = field(default_factory=list)
    strict: bool = True

    def __call__(self, bundle: WeightBundle) -> SyncResult:
        for hook in self.before_sync:
            hook(bundle)
        t0 = time.perf_counter()
        error = None
        try:
            self.transport.send(bundle)
        except SyncError as e:
            if self.strict:
                raise
            error = str(e)
        result = SyncResult(bundle.version, bundle.kind, bundle.nbytes(), time.perf_counter() - t0, error)
        for after in self.after_sync:
            after(bundle, result)
        return result
