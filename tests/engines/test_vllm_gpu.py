"""The real vLLM engine (its CUDA build) against the real Megatron trainer, colocated on one GPU: `zerokl parity check`
bitwise and exit 0 on the Triton kernels, `zerokl ppo` with KL exactly 0 every step. Skips without CUDA; the runs on an
H100 are in bench/results/h100-vllm-cuda.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}  # the trainer initialises CUDA in the parent first


def _zerokl(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerokl.cli", *args], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def k3_micro(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu") / "k3-micro"
    made = _zerokl("init-checkpoint", "--config", "configs/k3-micro.yaml", "--out", str(out))
    assert made.returncode == 0, made.stderr[-2000:]
    return out


def test_parity_check_through_vllm_on_the_gpu(k3_micro: Path, tmp_path: Path) -> None:
    report = tmp_path / "check.json"
    run = _zerokl("parity", "check", "--model", str(k3_micro), "--num-prompts", "4", "--max-tokens", "16",
                  "--batch-mix", "both", "--json", str(report))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["tokens"] > 0 and result["bitwise_equal"] == result["tokens"], result


def test_ppo_through_vllm_on_the_gpu_keeps_kl_zero(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = _zerokl("ppo", "--config", "configs/ppo-tiny-mxfp4.yaml", "--steps", "3", "--out", str(out), "--wandb",
                  "disabled")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    assert all(m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 and m["raw_bitwise_equal_frac"] == 1.0
               and m["routing_agreement"] == 1.0 for m in metrics), metrics
