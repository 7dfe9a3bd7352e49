"""A weight update in flight: a version, the tensors, and a checksum per tensor.

Invariant kept by `verify`: an update is accepted only if it carries exactly the expected tensor names,
with the expected shapes and dtypes, every checksum matches the bytes that arrived, and the version is
newer than the receiver's. Receivers verify everything before they change anything, so a partial or
corrupt update leaves them on the previous version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch


class SyncError(RuntimeError):
    """A rejected weight update; the message names the first offending tensor or field."""


def checksum(t: torch.Tensor) -> str:
    """blake2b-128 of the tensor's bytes (contiguous, as stored), with its dtype and shape.

    Device-independent: a CUDA tensor is hashed from a CPU copy of its bytes, so the same values give the
    same checksum on the trainer's GPU, the engine's GPU and the CPU."""
    data = t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}:{tuple(t.shape)}:".encode())
    h.update(data)
    return h.hexdigest()


@dataclass(frozen=True)
class WeightBundle:
    """`kind` is "full" (every model tensor) or "adapter" (LoRA tensors only)."""

    version: int
    kind: str
    tensors: Mapping[str, torch.Tensor]
    checksums: Mapping[str, str]

    @classmethod
    def make(cls, version: int, tensors: Mapping[str, torch.Tensor], kind: str = "full") -> WeightBundle:
        frozen = {n: t.detach().contiguous().clone() for n, t in tensors.items()}
        return cls(version, kind, frozen, {n: checksum(t) for n, t in frozen.items()})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def verify(bundle: WeightBundle, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]], current_version: int) -> None:
    """Raise SyncError unless `bundle` is complete, intact and newer than `current_version`."""
    if bundle.version <= current_version:
        raise SyncError(f"stale update: version {bundle.version} is not newer than the engine's {current_version}")
    missing = sorted(set(expected) - set(bundle.tensors))
    extra = sorted(set(bundle.tensors) - set(expected))
    if missing:
        raise SyncError(f"partial update: {len(missing)} tensors missing, first {missing[0]}")
    if extra:
        raise SyncError(f"unexpected tensors in update, first {extra[0]}")
    for name, t in bundle.tensors.items():
        shape, dtype = expected[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise SyncError(f"{name}: got {tuple(t.shape)} {t.dtype}, expected {tuple(shape)} {dtype}")
        if name not in bundle.checksums:
            raise SyncError(f"{name}: no checksum")
        if checksum(t) != bundle.checksums[name]:
            raise SyncError(f"{name}: checksum mismatch (corrupted in flight)")


class TensorStore:
    """A receiver holding tensors in memory: `apply` verifies, then swaps the whole dict at once."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], version: int = 0, kind: str = "full"):
        self.tensors = dict(tensors)
        self.version = version
        self.kind = kind

    def expected(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {n: (tuple(t.shape), t.dtype) for n, t in self.tensors.items()}

    def apply(self, bundle: WeightBundle) -> None:
        if bundle.kind != self.kind:
            raise SyncError(f"update kind {bundle.kind!r} does not match the receiver's {self.kind!r}")
        verify(bundle, self.expected(), self.version)
        self.tensors = {n: t.clone() for n, t in bundle.tensors.items()}
        self.version = bundle.version
