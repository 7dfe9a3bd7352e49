"""The K3 trainer at TP = 2, EP = 2 and both at once, two CPU ranks on gloo (`torchrun --nproc_per_node 2`).

Each run executes tests/dist/trainer_parallel.py, which checks on every rank: load -> export is bitwise; every
token's log-prob equals the one-process forward (torch.equal); packed = padded; DDP-finalised gradients and
Megatron's grad norm match the one-process gradients; one Megatron Adam step moves every parameter with a
gradient and lowers the loss; the saved checkpoint reloads bit for bit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist" / "trainer_parallel.py"
CHECKS = 7  # "ok" lines the worker prints on success


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(k3_tiny: Path) -> Path:
    return k3_tiny


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "ep2", "tp2-ep2"])
def test_trainer_two_ranks(tp: int, ep: int, checkpoint: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(WORKER), "--tp", str(tp), "--ep", str(ep),
           "--checkpoint", str(checkpoint), "--out", str(tmp_path / "exported")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # own process group: a timeout ends torchrun and its workers
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun TP={tp} EP={ep} timed out after 300 s:\n{out}\n{err[-6000:]}")
    ok = [line for line in out.splitlines() if line.startswith("ok  ")]
    assert proc.returncode == 0 and len(ok) == CHECKS, f"rc={proc.returncode}\n{out}\n{err[-6000:]}"
