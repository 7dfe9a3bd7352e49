"""The K3 trainer with a LoRA adapter at TP = 2 with EP = 2 (two CPU ranks on gloo, `torchrun --nproc_per_node 2`).

Runs tests/dist/lora_parallel.py, which checks on every rank: adapter load -> export is bitwise; every token's
log-prob with the adapter equals the one-process shared forward with `K3Weights.lora` (torch.equal); adapter
gradients and Megatron's grad norm match the one-process ones; an Adam step leaves the base alone and lowers the
loss; the per-TP-rank adapter state shards reassemble bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import torchrun_checks

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)


ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist" / "lora_parallel.py"
CHECKS = 6  # "ok" lines the worker prints on success



def test_lora_trainer_tp2_ep2(k3_tiny: Path, tmp_path: Path) -> None:
    checkpoint = k3_tiny
    torchrun_checks(WORKER, ["--tp", "2", "--ep", "2", "--checkpoint", str(checkpoint),
                             "--out", str(tmp_path / "state")], CHECKS)
