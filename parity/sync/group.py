"""A process group between processes that share no `torch.distributed` world: a trainer and the workers of rollout
servers it does not own (each with its own default group, or none).

`StandaloneGroup` rendezvous over a `TCPStore` hosted by rank 0 (the sender) and builds a gloo group (CPU tensors) or
an NCCL group (CUDA tensors) on it, registered nowhere: it never touches the caller's default process group. Objects
travel as JSON (no pickle: a server never unpickles what a client sent).
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
"""What makes `init_process_group`'s env:// rendezvous join MASTER_ADDR:MASTER_PORT as a client on every rank (the
store hosted by the launcher, as torchrun's agent does) instead of rank 0 binding MASTER_PORT itself."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (another process may take it before it is bound: where this
    process can bind the listener itself, `host_store` leaves no such window)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def host_store(host: str = "127.0.0.1", timeout_s: float = 300.0) -> dist.TCPStore:
    """A `TCPStore` server listening on `host` at a port the system picks as it binds (`.port`): no other process can
    take the port between choosing and binding it. It serves as long as the object lives."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host:port` (what a process there must dial to reach this one)."""
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: picks the route, sends nothing
        return str(s.getsockname()[0])


@dataclass
class StandaloneGroup:
    """`world_size` ranks meeting at `host:port`; rank 0 hosts the store, or uses `store` (a `host_store` whose port
    the other ranks were given), or, with `launcher_store`, joins one that the process which started the ranks hosts.
    Construction blocks until every rank joined (or `timeout_s` passes: RuntimeError)."""

    host: str
    port: int
    rank: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 120.0
    store: dist.TCPStore | None = field(default=None, repr=False)
    launcher_store: bool = False
    _pg: Any = field(init=False, repr=False)
    _store: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")
        if self.store is not None and (self.rank != 0 or self.store.port != self.port):
            raise ValueError(f"a hosted store is rank 0's, on the group's port {self.port}")
        timeout = timedelta(seconds=self.timeout_s)
        master = self.rank == 0 and not self.launcher_store
        self._store = self.store or dist.TCPStore(self.host, self.port, self.world_size, is_master=master,
                                                  timeout=timeout)
        self.store = None
        if self.backend == "gloo":
            self._pg = dist.ProcessGroupGloo(self._store, self.rank, self.world_size, timeout)
        else:
            self._pg = dist.ProcessGroupNCCL(self._store, self.rank, self.world_size)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """In place: every rank's `tensor` becomes rank `src`'s (same shape and dtype on every rank)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._pg.broadcast([tensor], opts).wait()

    def broadcast_object(self, obj: Any, src: int, device: torch.device | str | None = None) -> Any:
        """Rank `src`'s JSON-serialisable `obj` on every rank (tuples arrive as lists)."""
        data = json.dumps(obj).encode() if self.rank == src else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        self.broadcast(size, src)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        if self.rank == src:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf, src)
        return json.loads(buf.cpu().numpy().tobytes().decode()) if self.rank != src else obj

    def close(self) -> None:
        """Drop the group and the store (rank 0's ends the rendezvous)."""
        self._pg = None
        self._store = None
