"""`LocalServers` when the free port it chose is taken before its server binds it (another process on the machine
picked the same port meanwhile): the server starts again on another port, a bounded number of times."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from parity.sync.group import free_port
from rollout.client import local_servers
from rollout.sampling import RolloutError

ROOT = Path(__file__).resolve().parents[2]

# A stand-in for `zerokl serve`: answers /health on its port, or fails to bind it as vLLM's server does.
FAKE_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another process of this machine listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def _fake(monkeypatch: pytest.MonkeyPatch, ports: list[int]) -> None:
    """Servers are FAKE_SERVER; the free ports handed out are `ports`, then really free ones."""
    monkeypatch.setattr(local_servers, "free_port", lambda host: ports.pop(0) if ports else free_port(host))
    monkeypatch.setattr(local_servers, "serve_argv",
                        lambda checkpoint, kernels, host, port, *rest: [sys.executable, "-c", FAKE_SERVER, str(port)])


def test_a_server_whose_port_was_taken_starts_on_another(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          taken: int) -> None:
    _fake(monkeypatch, [taken])
    said: list[str] = []
    servers = local_servers.LocalServers(ROOT / "configs" / "k3-tiny.yaml", 2, tmp_path, log=said.append)
    procs = list(servers.procs)
    try:
        assert len(servers.urls) == 2 and f"http://127.0.0.1:{taken}" not in servers.urls
        assert all(local_servers._healthy(url) for url in servers.urls)
        assert any(f"rollout server 0: http://127.0.0.1:{taken} was taken meanwhile" in line for line in said), said
    finally:
        servers.stop()
    assert len(procs) == 2 and all(p.poll() is not None for p in procs)


def test_a_port_taken_every_time_is_an_error_not_a_loop(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          taken: int) -> None:
    _fake(monkeypatch, [taken] * local_servers.PORT_TRIES)
    with pytest.raises(RolloutError, match="(?s)rollout server 0 exited with code 1 while starting.*Address already "
                       "in use"):
        local_servers.LocalServers(ROOT / "configs" / "k3-tiny.yaml", 1, tmp_path, log=lambda line: None)
