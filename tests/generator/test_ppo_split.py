"""bench/ppo_split.py on CPU processes over gloo (what a multi-GPU host runs on its own GPUs over NCCL): a two-rank
Megatron trainer (EP = 2, DP = 2) and a rollout process of its own on k3-tiny-mxfp4 (bf16, MXFP4 experts, FP8
latents). Every step's sampled log-probs arrive from the rollout process and equal the trainer's bit for bit (KL 0),
each new version's served weights reach the rollout process verified; with the fast kernels in fp32 the first step
stops with a diagnosis."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity.io.checkpoint import load_checkpoint
from parity.weights import serving_dtype, stored_specs

pytestmark = pytest.mark.slow  # starts processes: scheduled first (conftest.py)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3


def _split(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "ppo_split.py"), "--batch", "4", "--max-tokens", "8",
                           "--lr", "1e-3", "--timeout", "400", *argv], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=480)


def test_split_ppo_keeps_kl_zero_and_syncs_every_version(k3_tiny_mxfp4: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    run = _split("--checkpoint", str(k3_tiny_mxfp4), "--trainer-ranks", "2", "--ep", "2", "--rollout-ranks", "1",
                 "--steps", str(STEPS), "--json", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["verdict"] == dict(steps=STEPS, kl_zero_steps=STEPS, trainer_ranks=2, tp=1, ep=2, dp=2,
                                     rollout_ranks=1, device="cpu", versions_sent=STEPS + 1)
    cfg, _ = load_checkpoint(k3_tiny_mxfp4)
    served = sum(math.prod(s.shape) * serving_dtype(cfg.text, s).itemsize for s in stored_specs(cfg.text).values())
    metrics = report["metrics"]
    assert [m["sync_version"] for m in metrics] == list(range(2, STEPS + 2))
    for m in metrics:
        assert m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 and m["max_abs_logprob_diff"] == 0.0, m
        assert m["sequences"] == 4 and m["tokens"] == 32 and m["sync_bytes"] == served
    assert len({m["loss"] for m in metrics}) == STEPS  # the policy moved: new weights, new samples each step


def test_split_ppo_stops_on_a_mismatch(tmp_path: Path) -> None:
    run = _split("--config", "configs/k3-tiny.yaml", "--dtype", "float32", "--kernels", "fast", "--steps", "2",
                 "--json", str(tmp_path / "report.json"))
    assert run.returncode == 1
    assert "step 0: trainer != rollout on" in run.stdout + run.stderr
