"""A full-weight sync over several `zerokl serve` servers, all or none, in two phases (`RemoteRollout.sync`).

Every server is paused (its running requests finish first). Phase one: each verifies and stages the bundle (names,
shapes, dtypes, checksums, a newer version: `rollout.vllm.weight_transfer`), over a `torch.distributed` broadcast
(`StandaloneGroup`, set up anew per sync through `/init_weight_transfer_engine`) or the bundle's transport; a refusal
drops every staged copy and every server keeps its weights. Phase two: each commits its copy, keeping the values it
replaces, and must then report the new version and the checksum of what was sent (`GET /zerokl/weights`); if a live
server fails either, every committed server rolls back to the version it held (`/zerokl/rollback_weight_update`), so no
two servers ever answer with different weights; when every one holds the new version, each drops its old values
(`/zerokl/confirm_weight_update`) and generation resumes. A server that dies at any point (it no longer answers) is
dropped, as one that dies during generation, and the sync goes on with the others; in phase one a broadcast it was
part of is staged again without it. It rejoins at the next sync once it answers again.
"""

from __future__ import annotations

import urllib.error
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from parity.sync.bundle import SyncError, Transport, WeightBundle, weights_checksum
from parity.sync.group import StandaloneGroup, address_towards, host_store
from parity.sync.transports import TorchDistributed
from rollout.client import http
from rollout.client.http import Server, ServerDown
from rollout.server.admin import ABORT_ROUTE, CONFIRM_ROUTE, ROLLBACK_ROUTE

class Client(Protocol):
    """What a sync reads and updates of its client (`rollout.client.remote.RemoteRollout`)."""

    version: int  # the version every live server holds
    checksums: dict[str, str]  # per server URL, the checksum of the weights it holds
    dropped: list[Server]
    log: Callable[[str], None]


class TwoPhaseSync:
    """One sync of `client`'s servers (see the module docstring); `drop(server, error)` takes a dead server out of
    the client's live ones."""

    def __init__(self, client: Client, drop: Callable[[Server, Exception], None]):
        self.client, self.drop = client, drop

    def run(self, servers: list[Server], bundle: WeightBundle, transport: Transport | None) -> list[Server]:
        """Install `bundle` on `servers` (paused for the sync, resumed after, whatever happens): the servers that hold
        it; SyncError when a live one refused or none is left (every server then on the version it held)."""
        try:
            servers = self._on_live(servers, "pause", lambda s: s.call("POST", "/pause?mode=wait", {}))
            servers = self._on_live(servers, "drop a stale update",  # a session a crashed trainer left open
                                    lambda s: s.call("POST", ABORT_ROUTE, {}))
            servers = self._stage(servers, bundle, transport)
            servers = self._commit(servers, bundle)
            return self._on_live(servers, "keep the update", lambda s: s.call("POST", CONFIRM_ROUTE, {}))
        finally:
            live = [s for s in servers if s not in self.client.dropped]
            if live:
                http.each(live, lambda s: s.call("POST", "/resume", {}), strict=False)

    def outcomes(self, servers: list[Server], call: Callable[[Server], Any]) -> list[tuple[Server, Exception | None]]:
        """`call` on every server at once: each server with its failure (None: it answered)."""
        with ThreadPoolExecutor(len(servers)) as pool:
            done = [(s, pool.submit(http.catching(call), s)) for s in servers]
        return [(s, f.result()[1]) for s, f in done]

    def _survivors(self, outcomes: list[tuple[Server, Exception | None]],
                   what: str) -> tuple[list[Server], list[tuple[Server, Exception]]]:
        """The servers that are still up after `outcomes` (one that failed and no longer answers is dropped), and the
        live ones that refused, with why."""
        alive, refused = [], []
        for s, e in outcomes:
            if e is None:
                alive.append(s)
            elif self._responds(s):
                alive.append(s)
                refused.append((s, e))
            else:
                self.drop(s, e)
                self.client.log(f"rollout server {s.url} died during the weight sync ({what}); the sync goes on without it")
        if not alive:
            raise SyncError(NO_SERVER)
        return alive, refused

    def _on_live(self, servers: list[Server], what: str, call: Callable[[Server], Any]) -> list[Server]:
        """`call` on every server; the ones that died are dropped, a live one's refusal is a SyncError."""
        alive, refused = self._survivors(self.outcomes(servers, call), what)
        if refused:
            s, e = refused[0]
            raise SyncError(f"rollout server {s.url} could not {what}: {_reason(e)}")
        return alive

    def _responds(self, server: Server) -> bool:
        try:
            server.weights()
            return True
        except ServerDown:
            return False
        except urllib.error.HTTPError:
            return True

    def _stage(self, servers: list[Server], bundle: WeightBundle, transport: Transport | None) -> list[Server]:
        """Phase one: every server verifies and stages `bundle` (nothing changes yet). A refusal drops every staged
        copy (SyncError); a server that died on the way is dropped and the others stage again without it (a
        broadcast it was part of fails for all of them)."""
        retried = False
        while True:
            servers = self._on_live(servers, "start the update", lambda s: s.call("POST", "/start_weight_update", {}))
            before = len(servers)
            servers, refused = self._survivors(self._send(servers, bundle, transport), "stage")
            if not refused:
                return servers
            http.each(servers, lambda s: s.call("POST", ABORT_ROUTE, {}), strict=False)
            if len(servers) == before or retried:
                s, e = refused[0]
                raise SyncError(f"weight update {bundle.version} refused by {s.url} ({_reason(e)}); every server "
                                f"keeps version {self.client.version}")
            retried = True  # a server died and took the others' broadcast with it: once more without it

    def _send(self, servers: list[Server], bundle: WeightBundle,
              transport: Transport | None) -> list[tuple[Server, Exception | None]]:
        """Each server's answer to receiving `bundle` (`/update_weights`) over `transport`."""
        if transport is None:
            return self._broadcast(servers, bundle)
        message = transport.send(bundle)
        try:
            update = {"update_info": {"transport": transport.name, "message": message}}
            return self.outcomes(servers, lambda s: s.call("POST", "/update_weights", update))
        finally:
            transport.release(message)

    def _commit(self, servers: list[Server], bundle: WeightBundle) -> list[Server]:
        """Phase two: every server commits its staged copy, keeping its previous weights, and must then report the
        new version and the checksum of what was sent; if a live server fails either, every committed one rolls
        back to the version it held (SyncError). Servers that die on the way are dropped."""
        version = {"weight_version": str(bundle.version)}
        servers, refused = self._survivors(
            self.outcomes(servers, lambda s: s.call("POST", "/finish_weight_update", version)), "commit")
        expected = weights_checksum(bundle.checksums)
        held: dict[str, dict[str, Any]] = {}  # by server URL: what it reports holding
        if not refused:
            outcomes = self.outcomes(servers, lambda s: held.__setitem__(s.url, s.weights()))
            servers, refused = self._survivors(outcomes, "report its weights")
            refused += [(s, RuntimeError(f"it reports version {held[s.url]['version']} with checksum "
                                         f"{held[s.url]['checksum']}, expected version {bundle.version} with "
                                         f"{expected}"))
                        for s in servers if s.url in held and (held[s.url]["version"], held[s.url]["checksum"])
                        != (bundle.version, expected)]
        if refused:
            http.each(servers, lambda s: s.call("POST", ROLLBACK_ROUTE, {}), strict=False)
            s, e = refused[0]
            raise SyncError(f"weight update {bundle.version} could not be committed on {s.url} ({_reason(e)}); every "
                            f"server is back on version {self.client.version}")
        for s in servers:
            self.client.checksums[s.url] = held[s.url]["checksum"]
        return servers

    def _broadcast(self, servers: list[Server], bundle: WeightBundle) -> list[tuple[Server, Exception | None]]:
        """Send `bundle` to every server's workers over one `StandaloneGroup` with this process as rank 0 (set up
        for this sync through `/init_weight_transfer_engine`); each server's answer."""
        first = urllib.parse.urlsplit(servers[0].url)
        host = address_towards(first.hostname or "127.0.0.1", first.port or 80)
        store = host_store("127.0.0.1" if host == "127.0.0.1" else "0.0.0.0")
        port = int(store.port)
        world = 1 + sum(s.workers for s in servers)
        backend = "nccl" if next(iter(bundle.tensors.values())).is_cuda else "gloo"
        offsets = [1 + sum(s.workers for s in servers[:k]) for k in range(len(servers))]
        with ThreadPoolExecutor(len(servers)) as pool:
            joined = [pool.submit(s.call, "POST", "/init_weight_transfer_engine",
                                  {"init_info": {"master_address": host, "master_port": port, "rank_offset": off,
                                                 "world_size": world, "backend": backend}})
                      for s, off in zip(servers, offsets)]
            try:
                group = StandaloneGroup(host, port, 0, world, backend, store=store)
            except RuntimeError as e:
                failed = RuntimeError(f"did not join the weight-sync group at {host}:{port} ({e})")
                return [(s, _failure(f) or failed) for s, f in zip(servers, joined)]
            try:
                if any(_failure(f) for f in joined):
                    return [(s, _failure(f)) for s, f in zip(servers, joined)]
                update = {"update_info": {"transport": TorchDistributed.name, "message": {"version": bundle.version}}}
                staged = [pool.submit(s.call, "POST", "/update_weights", update) for s in servers]
                try:
                    TorchDistributed(src=0, group=group).send(bundle)
                except RuntimeError:  # a server died mid-broadcast: the others time out and refuse
                    pass
                return [(s, _failure(f)) for s, f in zip(servers, staged)]
            finally:
                group.close()


NO_SERVER = "no rollout server answers; restart them (`zerokl serve`) and resume the run (--resume)"


def _failure(future: Any) -> Exception | None:
    """A finished call's exception, or None."""
    return future.exception()


def _reason(error: Exception) -> str:
    """What a server's failure says: its own message for an HTTP error answer."""
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code}: {http.message(error)}"
    return str(error)
