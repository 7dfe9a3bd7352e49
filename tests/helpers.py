"""Helpers several test modules use: a free local port and a vLLM server process for the test's duration."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(argv: Sequence[str], port: int, log: Path, start_timeout: float = 240) -> Iterator[str]:
    """Start a server command (`zerokl serve` or vLLM's api_server) listening on `port`; yields its base URL once
    `/health` answers; SIGTERM (then SIGKILL) at exit. Its output goes to `log`, quoted if it dies early."""
    with log.open("w") as out:
        proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            assert proc.poll() is None, f"server exited:\n{log.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, f"server did not start in {start_timeout:.0f} s"
                time.sleep(1)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
