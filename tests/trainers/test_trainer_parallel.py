"""The K3 trainer at TP = 2 with EP = 2 on two CPU ranks (each rank holds half the experts and half of every
tensor-parallel weight), and TP = 4 on four (gloo, torchrun).

Each run executes tests/dist/trainer_parallel.py, which checks on every rank: load -> export is bitwise; every
token's log-prob equals the one-process forward (torch.equal); each row-parallel GEMM multiplies only the rank's
K / TP share; packed = padded; DDP-finalised gradients and
Megatron's grad norm match the one-process gradients; one Megatron Adam step moves every parameter with a
gradient and lowers the loss; the saved checkpoint reloads bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TRAINER_PARALLEL_CHECKS, torchrun_checks

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)


ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "trainer_parallel.py"



@pytest.fixture(scope="module")
def checkpoint(k3_tiny: Path) -> Path:
    return k3_tiny


@pytest.mark.parametrize("tp,ep,nproc", [(2, 2, 2), (4, 1, 4)], ids=["tp2-ep2", "tp4"])
def test_trainer_parallel(tp: int, ep: int, nproc: int, checkpoint: Path, tmp_path: Path) -> None:
    torchrun_checks(WORKER, ["--tp", str(tp), "--ep", str(ep), "--checkpoint", str(checkpoint),
                             "--out", str(tmp_path / "exported")], TRAINER_PARALLEL_CHECKS, nproc=nproc)
