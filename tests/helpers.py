"""Helpers several test modules use: bit-equality assertions that say where bits differ, a free local port, and a
vLLM server process for the test's duration."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch


def first_mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    """'equal', or the first index where the bits differ and the max |a - b| (in float64)."""
    diff = (a != b).nonzero()
    if len(diff) == 0:
        return "equal"
    idx = tuple(diff[0].tolist())
    return f"first mismatch at {idx}, max |d| = {(a.double() - b.double()).abs().max().item():.3e}"


def assert_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """`torch.equal`, failing with `first_mismatch`."""
    assert torch.equal(a, b), first_mismatch(a, b)


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
