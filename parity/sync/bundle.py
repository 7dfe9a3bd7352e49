"""A weight update in flight: a version, the tensors, and a checksum per tensor.

Invariant kept by `verify`: an update is accepted only if it carries exactly the expected tensor names,
with the expected shapes and dtypes, every checksum matches the bytes that arrived, and the version is
newer than the receiver's. Receivers verify everything before they change anything, so a partial or
corrupt update leaves them on the previous version.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from parity.sync.checksum import checksum, checksums, weights_checksum
from parity.sync.flat import Flat, FlatChecksums, FlatLayout

__all__ = ["Message", "Receiver", "SyncError", "TensorStore", "Transport", "WeightBundle", "checksum", "checksums",
           "verify", "weights_checksum"]


class SyncError(RuntimeError):
    """A rejected weight update; the message names the first offending tensor or field."""


@dataclass(frozen=True)
class WeightBundle:
    """`kind` is "full" (every model tensor) or "adapter" (LoRA tensors only). `flat`: the tensors' one buffer when
    they are views of it (`make_flat`), which a receiver of the same layout copies and verifies whole."""

    version: int
    kind: str
    tensors: Mapping[str, torch.Tensor]
    checksums: Mapping[str, str]
    flat: Flat | None = None

    @classmethod
    def make(cls, version: int, tensors: Mapping[str, torch.Tensor], kind: str = "full") -> WeightBundle:
        """The bundle of `tensors` as they are (no copy: the sender leaves them unchanged until the sync returns),
        each checksummed once, on its own device."""
        held = {n: t.detach().contiguous() for n, t in tensors.items()}
        return cls(version, kind, held, checksums(held))

    @classmethod
    def make_flat(cls, version: int, buffer: torch.Tensor, layout: FlatLayout, kind: str = "full") -> WeightBundle:
        """The bundle of the tensors `layout` places in `buffer`, checksummed in one pass over the buffer (on CUDA one
        launch; the strings only when read). The sender leaves the buffer unchanged until the sync returns."""
        flat = Flat(buffer, layout, layout.word_sums(buffer))
        return cls(version, kind, layout.views(buffer), FlatChecksums(flat), flat)

    def nbytes(self) -> int:
        if self.flat is not None:
            return self.flat.layout.tensor_bytes()
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def check_newer(bundle: WeightBundle, current_version: int) -> None:
    """Raise SyncError unless `bundle` is newer than the receiver's `current_version`."""
    if bundle.version <= current_version:
        raise SyncError(f"stale update: version {bundle.version} is not newer than the engine's {current_version}")


def verify(bundle: WeightBundle, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]], current_version: int) -> None:
    """Raise SyncError unless `bundle` is complete, intact and newer than `current_version`."""
    check_newer(bundle, current_version)
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
        if bundle.flat is None and name not in bundle.checksums:  # a flat bundle's sums cover its layout's names
            raise SyncError(f"{name}: no checksum")
    if bundle.flat is not None:  # the tensors are views of its buffer: one pass over it
        check_copy(bundle.flat, bundle.flat.buffer)
        return
    arrived = checksums(bundle.tensors)
    for name in bundle.tensors:
        if arrived[name] != bundle.checksums[name]:
            raise SyncError(f"{name}: checksum mismatch (corrupted in flight)")


Message = dict[str, Any]  # what a transport's `send` returns and its `receive` takes (picklable)


class Transport(Protocol):
    """Carries a `WeightBundle` from a sender to a receiver; both sides use the same class (`parity.sync.transports`).

    `send(bundle)` puts the bundle on the wire and returns the message the receiving side passes to
    `receive(message)`, which returns the bundle as it arrived (not yet verified). Every message carries the
    bundle's `version` and `kind`. Once the receiver is done, the sender calls `release(message)` (frees what the
    message pointed at, if anything). `name` lets a receiver in another process (a vLLM worker) rebuild the
    transport with `parity.sync.transports.by_name`."""

    name: str

    def send(self, bundle: WeightBundle) -> Message: ...

    def receive(self, message: Message) -> WeightBundle: ...

    def release(self, message: Message) -> None: ...


class Receiver(Protocol):
    """Holds weights at a version; `receive` verifies the bundle `transport.receive(message)` gives, then applies it
    all-or-nothing (raising SyncError and keeping the previous version otherwise)."""

    version: int

    def receive(self, transport: Transport, message: Message) -> None: ...


class TensorStore:
    """A receiver holding tensors in memory: `apply` verifies, then swaps the whole dict at once (copies: the
    store owns its tensors). A flat bundle whose layout holds the store's tensors is copied whole into a spare
    buffer, verified there by its word sums and swapped in; the buffer it replaces is the next flat update's spare
    (so a dict of `tensors` read before two flat updates sees the second)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], version: int = 0, kind: str = "full"):
        self.tensors = dict(tensors)
        self.version = version
        self.kind = kind
        self._layout: FlatLayout | None = None  # the flat layout `expected()` was last found to match
        self._buffers: list[torch.Tensor] = []  # [live, spare] of flat updates

    def expected(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {n: (tuple(t.shape), t.dtype) for n, t in self.tensors.items()}

    def apply(self, bundle: WeightBundle) -> None:
        if bundle.kind != self.kind:
            raise SyncError(f"update kind {bundle.kind!r} does not match the receiver's {self.kind!r}")
        if bundle.flat is not None and self._holds(bundle.flat.layout):
            self._apply_flat(bundle)
            return
        verify(bundle, self.expected(), self.version)
        self.tensors = {n: t.clone() for n, t in bundle.tensors.items()}
        self.version = bundle.version

    def _holds(self, layout: FlatLayout) -> bool:
        """Whether `layout` has exactly the store's names, shapes and dtypes (checked once per layout)."""
        if self._layout is not None and self._layout.matches(layout):
            return True
        if layout.expected() != self.expected():
            return False
        self._layout, self._buffers = layout, []
        return True

    def _apply_flat(self, bundle: WeightBundle) -> None:
        check_newer(bundle, self.version)
        flat = bundle.flat
        assert flat is not None
        device = next(iter(self.tensors.values())).device if self.tensors else flat.buffer.device
        if len(self._buffers) < 2:
            self._buffers.append(flat.layout.empty(device))
        spare = self._buffers[-1]
        spare.copy_(flat.buffer)
        check_copy(flat, spare)
        self._buffers.reverse()  # the spare is live; the old live buffer (if any) is the next spare
        self.tensors = flat.layout.views(spare)
        self.version = bundle.version

    def receive(self, transport: Transport, message: Message) -> None:
        """`apply` the bundle `transport` delivers with `message`."""
        self.apply(transport.receive(message))


def check_copy(flat: Flat, held: torch.Tensor) -> None:
    """Raise SyncError unless `held` (a receiver's copy of `flat.buffer`, or the buffer as it arrived; same layout)
    has the sender's word sums, naming the first tensor that differs. One comparison on the device, one read back."""
    arrived = flat.layout.word_sums(held)
    sent = flat.sums.to(arrived.device)
    if torch.equal(arrived, sent):
        return
    bad = int((arrived != sent).nonzero()[0])
    raise SyncError(f"{flat.layout.names[bad]}: checksum mismatch (corrupted in flight)")
