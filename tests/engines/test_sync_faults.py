"""Weight sync over two real `zerokl serve` servers with faults injected (`rollout.client.two_phase`): one server
killed (kill -9 of its process group) at each phase of a sync (pause, stage, update, finish, the verifying report
after it), and a live server refusing its commit. After each: the sync either installs the new version on every server
still up (the dead one dropped) or leaves every server on the version it held, bit for bit; every sample the client
then gets carries the version it expects; a killed server restarted on its port rejoins at the next sync. (A server
killed during generation: tests/engines/test_ray.py; a run over servers resumed bit for bit:
tests/engines/test_rollout_servers.py.)"""

from __future__ import annotations

import email.message
import os
import signal
import subprocess
import time
import urllib.error
from pathlib import Path

import pytest
import torch

from helpers import K3_ENGINE_ARGS
from parity.config import load_model_config
from parity.io.checkpoint import load_checkpoint
from parity.sync.bundle import SyncError, WeightBundle, weights_checksum
from parity.weights import master_weights, serving_weights
from rollout.client import http
from rollout.client.local_servers import LocalServers, engine_flags
from rollout.client.remote import RemoteRollout
from rollout.server.admin import WEIGHTS_ROUTE
from rollout.server.serve import serve_argv, serve_env

pytestmark = pytest.mark.slow  # starts servers: scheduled first (conftest.py)

ENGINE_ARGS = {k: v for k, v in K3_ENGINE_ARGS.items() if k != "enable_lora"}
PHASES = {  # the request to the victim at which it dies: (method, path); the report is the one after its commit
    "pause": ("POST", "/pause?mode=wait"),
    "stage": ("POST", "/start_weight_update"),
    "update": ("POST", "/update_weights"),  # over the broadcast: the survivor stages again without it
    "finish": ("POST", "/finish_weight_update"),
    "verify": ("GET", WEIGHTS_ROUTE),
}


def _weights(checkpoint: Path, version: int) -> dict[str, torch.Tensor]:
    """The checkpoint's serving weights, one tensor changed per version (so every version has its own checksum)."""
    cfg, stored = load_checkpoint(checkpoint)
    weights = serving_weights(cfg.text, master_weights(cfg.text, stored))
    name = "language_model.model.norm.weight"
    weights[name] = (weights[name].float() * (1 + version / 64)).to(weights[name].dtype)
    return weights


class Victim:
    """Server B of the pair: dies (kill -9 of its process group) when the client sends it `PHASES[phase]`."""

    def __init__(self, servers: LocalServers, index: int, monkeypatch: pytest.MonkeyPatch):
        self.servers, self.index, self.phase = servers, index, None
        self.committed = False
        call = http.Server.call
        victim = self

        def call_and_maybe_die(server: http.Server, method: str, path: str, *args: object, **kw: object) -> object:
            if server.url == servers.urls[victim.index] and victim.phase is not None:
                if path == "/finish_weight_update":
                    victim.committed = True
                if (method, path) == PHASES[victim.phase] and (victim.phase != "verify" or victim.committed):
                    victim.kill()
            return call(server, method, path, *args, **kw)

        monkeypatch.setattr(http.Server, "call", call_and_maybe_die)

    @property
    def url(self) -> str:
        return self.servers.urls[self.index]

    def kill(self) -> None:
        proc = self.servers.procs[self.index]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self.phase = None

    def restart(self, checkpoint: Path, log: Path) -> None:
        """The server again, on its port, from the checkpoint (version 0)."""
        cfg = load_model_config(checkpoint)
        port = int(self.url.rsplit(":", 1)[1])
        argv = serve_argv(checkpoint, "invariant", "127.0.0.1", port, engine_flags(ENGINE_ARGS), cfg.model_type,
                          cfg.text.torch_dtype)
        with log.open("w") as out:
            self.servers.procs[self.index] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                              env={**os.environ, **serve_env()},
                                                              start_new_session=True)
        deadline = time.monotonic() + 300
        while not _healthy(self.url):
            assert self.servers.procs[self.index].poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1.0)


def _healthy(url: str) -> bool:
    try:
        http.Server(url, timeout_s=5).call("GET", "/health")
        return True
    except (http.ServerDown, urllib.error.HTTPError):
        return False


def _samples_carry(remote: RemoteRollout, version: int) -> None:
    samples = remote.generate([[5, 17, 29], [7, 11]], n=2, max_tokens=4, seed=3)
    assert [s.policy_version for s in samples] == [version] * 4


def test_a_server_killed_at_each_phase_of_a_sync_is_dropped_and_a_refused_commit_rolls_back(
        k3_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    servers = LocalServers(k3_tiny, 2, tmp_path / "logs", "invariant", ENGINE_ARGS, log=lambda _: None)
    try:
        remote = RemoteRollout(list(servers.urls), load_model_config(k3_tiny).text, log=lambda _: None)
        victim = Victim(servers, 1, monkeypatch)
        a = http.Server(servers.urls[0])
        held = weights_checksum(WeightBundle.make(0, _weights(k3_tiny, 0)).checksums)

        # a live server refuses its commit: the one that committed rolls back, bit for bit
        real_call = http.Server.call

        def refuse_commit(server: http.Server, method: str, path: str, *args: object, **kw: object) -> object:
            if server.url == victim.url and path == "/finish_weight_update":
                raise urllib.error.HTTPError(server.url + path, 400, "refused", email.message.Message(), None)
            return real_call(server, method, path, *args, **kw)

        monkeypatch.setattr(http.Server, "call", refuse_commit)
        with pytest.raises(SyncError, match=r"could not be committed on .* every server is back on version 0"):
            remote.sync(WeightBundle.make(1, _weights(k3_tiny, 1)))
        monkeypatch.setattr(http.Server, "call", real_call)
        victim = Victim(servers, 1, monkeypatch)
        assert remote.version == 0 and a.weights()["version"] == 0 and a.weights()["checksum"] == held
        _samples_carry(remote, 0)

        version = 0
        for k, phase in enumerate(PHASES):
            version += 1
            bundle = WeightBundle.make(version, _weights(k3_tiny, version))
            victim.phase, victim.committed = phase, False
            remote.sync(bundle)  # goes on without the dead server
            assert victim.phase is None, f"the victim was not killed at {phase}"  # it took part: it had rejoined
            expected = weights_checksum(bundle.checksums)
            assert remote.version == version and [s.url for s in remote.servers] == [a.url], phase
            assert a.weights() == {"version": version, "checksum": expected, "vision_synced": False}, phase
            _samples_carry(remote, version)
            if k + 1 < len(PHASES):  # back on its port from the checkpoint: it rejoins at the next sync
                victim.restart(k3_tiny, tmp_path / f"restart-{phase}.log")
    finally:
        servers.stop()
