"""The Megatron trainer on CUDA against generation through the rollout model code (bench/ppo_gpu.py, one GPU): every
sampled token's log-prob bitwise equal each step, a resumed run equal to the uninterrupted one. Skips without CUDA;
the k3-1b run and its timings are in bench/results/h200-gpu-path.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("config", ["k3-tiny", "k3-tiny-mxfp4", "k3.1-tiny"])
def test_gpu_trainer_equals_generation_and_resumes(config: str, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    run = subprocess.run([sys.executable, "bench/ppo_gpu.py", "--config", f"configs/{config}.yaml", "--steps", "4",
                          "--resume-at", "2", "--batch", "4", "--max-tokens", "8", "--json", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    verdict = json.loads(out.read_text())["verdict"]
    assert verdict["bitwise_steps"] == 4 and verdict["resume_metrics_equal"] and verdict["resume_weights_equal"]
