"""Transports that carry a `WeightBundle` from the trainer to a receiver, and the sync around them.

Each implements `parity.sync.bundle.Transport`: `send(bundle) -> message` on the sending side, `receive(message) ->
bundle` on the receiving side (the same class, or `by_name(transport.name)` in another process):

- `Memory`: the message is the bundle itself (tensors by reference), for a receiver in this process. No copy.
- `SharedMemory`: the tensors' bytes back to back in one POSIX shared-memory segment (`/dev/shm`) per version, the
  message lays them out, for a receiver in another process of this host (vLLM's workers): one copy in, one out, no
  disk. `release` unlinks the segment.
- `CudaIpc`: CUDA tensors packed into one device buffer per version (a flat bundle's own buffer as it is), the
  message its CUDA IPC handle and the layout, for a receiver in another process on the same GPU (vLLM's worker
  colocated with the trainer): one copy on the device in, the receiver's views of the mapped buffer out (copied into
  its parameters device to device); nothing crosses to the host. `release` drops the sender's buffer (torch keeps
  it until the receiver's views are gone).
- `Disk`: safetensors + a JSON manifest (version, kind, checksums) written once to `ROOT/v{version}` through a
  temporary directory and an atomic rename; the message names the directory. `Disk()` (no root) only receives.
- `TorchDistributed`: broadcasts the manifest, then the tensors in name order packed into byte buckets (a flat bundle:
  its buffer as it is, in slices), from a source rank over a `torch.distributed` group (gloo on CPU, NCCL on GPU: the
  sender's tensors and the receiver's `device` are then CUDA devices); every rank gets the same bundle.

`WeightSync(transport, receiver)` runs one sync with user hooks around it.
"""

from __future__ import annotations

import json
import functools
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from parity.io.atomic import atomic_dir
from parity.sync.bundle import Message, Receiver, SyncError, Transport, WeightBundle
from parity.sync.flat import Flat, FlatChecksums, FlatLayout
from parity.sync.group import StandaloneGroup

MANIFEST = "manifest.json"
TENSORS = "weights.safetensors"


SHM_ROOT = Path("/dev/shm")


@dataclass
class Memory:
    """The bundle travels as the message: tensors (or a flat bundle's buffer) by reference, checksums as computed by
    `WeightBundle.make`."""

    name: str = "memory"

    def release(self, message: Message) -> None:
        pass

    def send(self, bundle: WeightBundle) -> Message:
        return {"version": bundle.version, "kind": bundle.kind, "bundle": bundle}

    def receive(self, message: Message) -> WeightBundle:
        bundle = message.get("bundle") if isinstance(message, dict) else None
        if not isinstance(bundle, WeightBundle):
            raise SyncError("malformed in-memory weight update: no bundle")
        return bundle


@dataclass
class SharedMemory:
    """One shared-memory segment per version holding every tensor's bytes (CUDA tensors are copied to it once)."""

    name: str = "shared_memory"

    def send(self, bundle: WeightBundle) -> Message:
        if not SHM_ROOT.is_dir():
            raise SyncError(f"no {SHM_ROOT} on this host: use the disk transport")
        layout, offset = [], 0
        for n, t in sorted(bundle.tensors.items()):
            layout.append((n, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
            offset += t.numel() * t.element_size()
        path = SHM_ROOT / f"zerokl-{os.getpid()}-{uuid.uuid4().hex[:12]}-v{bundle.version}"
        segment = torch.from_file(str(path), shared=True, size=max(offset, 1), dtype=torch.uint8)
        for n, _, _, start in layout:
            t = bundle.tensors[n].detach().contiguous()
            nbytes = t.numel() * t.element_size()
            if nbytes:
                segment[start : start + nbytes].copy_(t.view(-1).view(torch.uint8))
        return {"version": bundle.version, "kind": bundle.kind, "segment": str(path), "layout": layout,
                "checksums": dict(bundle.checksums)}

    def receive(self, message: Message) -> WeightBundle:
        path = Path(message["segment"])
        if path.parent != SHM_ROOT or not path.is_file():
            raise SyncError(f"{path}: no such shared-memory segment (released, or not a weight update)")
        segment = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)
        tensors = {}
        for n, dtype, shape, start in message["layout"]:
            dt = getattr(torch, dtype)
            nbytes = math.prod(shape) * dt.itemsize
            tensors[n] = segment[start : start + nbytes].clone().view(dt).view(shape)  # unaligned: copy, then view
        return WeightBundle(int(message["version"]), str(message["kind"]), tensors, dict(message["checksums"]))

    def release(self, message: Message) -> None:
        Path(message["segment"]).unlink(missing_ok=True)


@dataclass
class CudaIpc:
    """Every tensor of a version back to back (`ALIGN`ed) in one CUDA buffer on the tensors' device (the bundle's few
    CPU tensors copied onto it), shared by its IPC handle (`torch.multiprocessing.reductions.reduce_tensor`)."""

    name: str = "cuda_ipc"
    held: dict[str, torch.Tensor] = field(default_factory=dict)  # the buffers sent and not yet released, by message id

    def send(self, bundle: WeightBundle) -> Message:
        """A flat bundle's own buffer is shared as it is (no packing copy; the sender keeps it unchanged until the
        sync returns)."""
        if bundle.flat is not None and bundle.flat.buffer.is_cuda:  # already one buffer: shared as it is
            return self._share(bundle, bundle.flat.buffer, list(zip(
                bundle.flat.layout.names, (str(d).removeprefix("torch.") for d in bundle.flat.layout.dtypes),
                bundle.flat.layout.shapes, bundle.flat.layout.offsets)))
        items = sorted(bundle.tensors.items())
        devices = {t.device for _, t in items if t.device.type == "cuda"}
        if len(devices) != 1:
            raise SyncError(f"the cuda_ipc transport carries the tensors of one CUDA device (CPU tensors are copied "
                            f"onto it), got {sorted({str(t.device) for _, t in items})}: use shared_memory")
        layout, offset = [], 0
        for n, t in items:
            layout.append((n, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
            offset = -(-(offset + _nbytes(t)) // ALIGN) * ALIGN
        buffer = _pack([t for _, t in items], [start for *_, start in layout], max(offset, ALIGN),
                       next(iter(devices)))
        return self._share(bundle, buffer, layout)

    def _share(self, bundle: WeightBundle, buffer: torch.Tensor, layout: list) -> Message:
        """The message sharing `buffer` (held until `release`) laid out by `layout` (name, dtype, shape, offset)."""
        from torch.multiprocessing.reductions import reduce_tensor

        key = uuid.uuid4().hex
        self.held[key] = buffer
        return {"version": bundle.version, "kind": bundle.kind, "id": key, "handle": reduce_tensor(buffer),
                "layout": layout, "checksums": dict(bundle.checksums)}

    def receive(self, message: Message) -> WeightBundle:
        try:
            rebuild, args = message["handle"]
            buffer = rebuild(*args)
        except Exception as e:  # a stale or foreign handle: CUDA's error, as a sync error
            raise SyncError(f"CUDA IPC weight update {message.get('version')}: the buffer cannot be opened "
                            f"({type(e).__name__}: {e})") from None
        tensors = {n: _view(buffer, start, shape, getattr(torch, dtype))
                   for n, dtype, shape, start in message["layout"]}
        return WeightBundle(int(message["version"]), str(message["kind"]), tensors, dict(message["checksums"]))

    def release(self, message: Message) -> None:
        self.held.pop(message["id"], None)


@dataclass
class Disk:
    """Writes each version to its own directory under `root`; the `keep` most recent versions stay on disk."""

    root: Path | None = None
    keep: int = 2
    name: str = "disk"

    def path(self, version: int) -> Path:
        if self.root is None:
            raise SyncError("Disk() without a root only receives; give it a root directory to send")
        return Path(self.root) / f"v{version:08d}"

    def send(self, bundle: WeightBundle) -> Message:
        final = self.path(bundle.version)
        if final.exists():
            raise SyncError(f"{final} already exists: versions must increase")
        with atomic_dir(final) as tmp:
            save_file(dict(bundle.tensors), str(tmp / TENSORS))
            (tmp / MANIFEST).write_text(json.dumps({"version": bundle.version, "kind": bundle.kind,
                                                    "checksums": dict(bundle.checksums)}))
        for old in sorted(Path(self.root).glob("v????????"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return {"version": bundle.version, "kind": bundle.kind, "path": str(final)}

    def release(self, message: Message) -> None:
        pass  # the newest `keep` versions stay on disk

    def receive(self, message: Message) -> WeightBundle:
        path = Path(message["path"])
        if not (path / MANIFEST).is_file():
            raise SyncError(f"{path}: no {MANIFEST} (incomplete or not a weight update)")
        manifest = json.loads((path / MANIFEST).read_text())
        return WeightBundle(int(manifest["version"]), manifest["kind"], load_file(str(path / TENSORS)),
                            manifest["checksums"])


ALIGN = 16  # bytes: where each tensor starts in a bucket (any dtype's view of it is aligned)


def buckets(meta: list[tuple[str, list[int], str]], bucket_bytes: int) -> list[list[tuple[str, int]]]:
    """Consecutive runs of `meta`'s tensors (name order), each with its tensors' byte offsets, filled up to
    `bucket_bytes` (a larger tensor is a bucket of its own). A function of the manifest alone, so the sender and every
    receiver cut the same buckets."""
    out: list[list[tuple[str, int]]] = []
    used = bucket_bytes
    for name, shape, dtype in meta:
        nbytes = math.prod(shape) * getattr(torch, dtype.removeprefix("torch.")).itemsize
        start = -(-used // ALIGN) * ALIGN
        if not out or start + nbytes > bucket_bytes:
            out.append([])
            start = 0
        out[-1].append((name, start))
        used = start + nbytes
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pack(tensors: list[torch.Tensor], starts: list[int], nbytes: int, device: torch.device) -> torch.Tensor:
    """One uint8 buffer of `nbytes` on `device` holding each tensor's bytes from its start (batched launches:
    `torch._foreach_copy_` into the tensors' views of the buffer)."""
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    kept = [(start, t) for start, t in zip(starts, tensors) if t.numel()]
    if kept:
        torch._foreach_copy_([_view(flat, start, t.shape, t.dtype) for start, t in kept], [t.detach() for _, t in kept])
    return flat


def _view(flat: torch.Tensor, start: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `shape` and `dtype` whose bytes start at `start` of a packed uint8 buffer (a view, no copy)."""
    return flat[start : start + math.prod(shape) * dtype.itemsize].view(dtype).view(tuple(shape))


@dataclass
class TorchDistributed:
    """Broadcast from `src` to every rank of `group`; receiving ranks call `receive()` and get the tensors on
    `device` (default: the CPU). `group`: a group of this process's `torch.distributed` world (None: the default
    group), or a `StandaloneGroup` (a trainer and rollout servers that share no world).

    On the wire: the manifest (an object), then the tensors in name order packed into flat byte buckets of up to
    `bucket_bytes` (`buckets`), one broadcast per bucket; a receiver's tensors are views of its bucket buffers. A
    bucket of one tensor is broadcast from (and into) the tensor itself, without the packing copy. A flat bundle
    travels as its buffer, in slices of `bucket_bytes`, with its layout's specs and the sender's word sums in the
    manifest: the receiver gets a flat bundle of the same layout, which `verify` checks with one pass over the
    buffer."""

    src: int = 0
    group: dist.ProcessGroup | StandaloneGroup | None = None
    device: torch.device | str | None = None
    bucket_bytes: int = 1 << 28
    name: str = "torch_distributed"

    def _broadcast(self, t: torch.Tensor) -> None:
        if isinstance(self.group, StandaloneGroup):
            self.group.broadcast(t, self.src)
        else:
            dist.broadcast(t, src=self.src, group=self.group)

    def _broadcast_object(self, obj: dict | None) -> dict:
        if isinstance(self.group, StandaloneGroup):
            return self.group.broadcast_object(obj, self.src, self.device)
        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        assert box[0] is not None
        return box[0]

    def send(self, bundle: WeightBundle) -> Message:
        if bundle.flat is not None:
            return self._send_flat(bundle, bundle.flat)
        manifest = {"version": bundle.version, "kind": bundle.kind, "checksums": dict(bundle.checksums),
                    "bucket_bytes": self.bucket_bytes,
                    "meta": [(n, list(t.shape), str(t.dtype)) for n, t in sorted(bundle.tensors.items())]}
        self._broadcast_object(manifest)
        for bucket in buckets(manifest["meta"], self.bucket_bytes):
            tensors = [bundle.tensors[n].contiguous() for n, _ in bucket]
            if len(tensors) == 1:
                self._broadcast(tensors[0])
                continue
            self._broadcast(_pack(tensors, [start for _, start in bucket], bucket[-1][1] + _nbytes(tensors[-1]),
                                  tensors[0].device))
        return {"version": bundle.version, "kind": bundle.kind}

    def _send_flat(self, bundle: WeightBundle, flat: Flat) -> Message:
        layout = flat.layout
        self._broadcast_object({"version": bundle.version, "kind": bundle.kind, "bucket_bytes": self.bucket_bytes,
                                "flat": [(n, list(s), str(d)) for n, s, d in
                                         zip(layout.names, layout.shapes, layout.dtypes)],
                                "sums": flat.sums.tolist()})
        for start in range(0, layout.total, self.bucket_bytes):
            self._broadcast(flat.buffer[start : start + self.bucket_bytes])
        return {"version": bundle.version, "kind": bundle.kind}

    def receive(self, message: Message | None = None) -> WeightBundle:
        manifest = self._broadcast_object(None)
        if "flat" in manifest:
            return self._receive_flat(manifest)
        meta = {name: (shape, getattr(torch, dtype.removeprefix("torch."))) for name, shape, dtype in manifest["meta"]}
        tensors = {}
        for bucket in buckets(manifest["meta"], int(manifest["bucket_bytes"])):
            if len(bucket) == 1:
                shape, dtype = meta[bucket[0][0]]
                tensors[bucket[0][0]] = t = torch.empty(shape, dtype=dtype, device=self.device)
                self._broadcast(t)
                continue
            last_shape, last_dtype = meta[bucket[-1][0]]
            flat = torch.empty(bucket[-1][1] + math.prod(last_shape) * last_dtype.itemsize, dtype=torch.uint8,
                               device=self.device)
            self._broadcast(flat)
            for name, start in bucket:
                tensors[name] = _view(flat, start, *meta[name])
        return WeightBundle(manifest["version"], manifest["kind"], tensors, manifest["checksums"])

    def _receive_flat(self, manifest: dict) -> WeightBundle:
        layout = _layout(tuple((n, tuple(s), d) for n, s, d in manifest["flat"]))
        buffer = torch.empty(layout.total, dtype=torch.uint8, device=self.device)
        step = int(manifest["bucket_bytes"])
        for start in range(0, layout.total, step):
            self._broadcast(buffer[start : start + step])
        flat = Flat(buffer, layout, torch.tensor(manifest["sums"], dtype=torch.int64, device=buffer.device))
        return WeightBundle(manifest["version"], manifest["kind"], layout.views(buffer), FlatChecksums(flat), flat)

    def release(self, message: Message) -> None:
        pass


@functools.lru_cache(maxsize=2)
def _layout(specs: tuple[tuple[str, tuple[int, ...], str], ...]) -> FlatLayout:
    """The flat layout of a manifest's specs, the same object for the same specs (a receiver of one sync after
    another keeps its views and checksum tables)."""
    return FlatLayout.of((n, s, getattr(torch, d.removeprefix("torch."))) for n, s, d in specs)


RECEIVING = {"memory": Memory, "shared_memory": SharedMemory, "cuda_ipc": CudaIpc, "disk": Disk}


def by_name(name: str) -> Transport:
    """The receiving side of the transport called `name` (a process that gets a message over RPC rebuilds it)."""
    if name not in RECEIVING:
        raise SyncError(f"unknown weight transport {name!r}; known: {', '.join(RECEIVING)}")
    return RECEIVING[name]()


@dataclass
class SyncResult:
    version: int
    kind: str
    nbytes: int
    seconds: float
    error: str | None = None


@dataclass
class WeightSync:
    """One sync: `transport.send(bundle)`, `receiver.receive(transport, message)`, `transport.release(message)`, with
    user hooks around it.
    Failures are reported, not raised, unless `strict` (the receiver then still holds its previous version)."""

    transport: Transport
    receiver: Receiver
    before_sync: list[Callable[[WeightBundle], None]] = field(default_factory=list)
    after_sync: list[Callable[[WeightBundle, SyncResult], None]] = field(default_factory=list)
    strict: bool = True

    def __call__(self, bundle: WeightBundle) -> SyncResult:
        for hook in self.before_sync:
            hook(bundle)
        t0 = time.perf_counter()
        error = None
        try:
            message = self.transport.send(bundle)
            try:
                self.receiver.receive(self.transport, message)
            finally:
                self.transport.release(message)
        except SyncError as e:
            if self.strict:
                raise
            error = str(e)
        result = SyncResult(bundle.version, bundle.kind, bundle.nbytes(), time.perf_counter() - t0, error)
        for after in self.after_sync:
            after(bundle, result)
        return result
