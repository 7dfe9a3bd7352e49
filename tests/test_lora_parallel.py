"""The K3 trainer with a LoRA adapter at TP = 2 with EP = 2 (two CPU ranks on gloo, `torchrun --nproc_per_node 2`).

Runs tests/dist/lora_parallel.py, which checks on every rank: adapter load -> export is bitwise; every token's
log-prob with the adapter equals the one-process shared forward with `K3Weights.lora` (torch.equal); adapter
gradients and Megatron's grad norm match the one-process ones; an Adam step leaves the base alone and lowers the
loss; the per-TP-rank adapter state shards reassemble bit for bit.
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
WORKER = ROOT / "tests" / "dist" / "lora_parallel.py"
CHECKS = 6  # "ok" lines the worker prints on success


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lora_trainer_tp2_ep2(k3_tiny: Path, tmp_path: Path) -> None:
    checkpoint = k3_tiny
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(WORKER), "--tp", "2", "--ep", "2",
           "--checkpoint", str(checkpoint), "--out", str(tmp_path / "state")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # own process group: a timeout ends torchrun and its workers
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun timed out after 300 s:\n{out}\n{err[-6000:]}")
    ok = [line for line in out.splitlines() if line.startswith("ok  ")]
    assert proc.returncode == 0 and len(ok) == CHECKS, f"rc={proc.returncode}\n{out}\n{err[-6000:]}"
