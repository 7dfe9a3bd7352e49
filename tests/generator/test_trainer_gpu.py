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


@pytest.mark.parametrize("config", ["k3-tiny-mxfp4", "k3-1b"])
def test_gpu_trainer_step_reads_nothing_back_to_the_host(config: str, tmp_path: Path) -> None:
    """A whole trainer step (forward, backward, Megatron's gradient finalisation, the clip's norm, Adam) after a
    first step that compiles, under CUDA's sync-debug mode: any device-to-host read (`.item()`, `.tolist()`,
    `nonzero`, a blocking copy) raises. The step's loss and grad norm come back as device tensors, read after."""
    from parity.io.checkpoint import init_checkpoint
    from trainer.megatron.backend import MegatronBackend
    from trainer.megatron.train import queue_train_step

    ckpt = init_checkpoint(REPO / "configs" / f"{config}.yaml", tmp_path / "ckpt", seed=0)
    backend = MegatronBackend(ckpt, lr=1e-5, clip_grad=1.0, weight_decay=0.0, kernels="invariant", adapter=None)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, backend.model_cfg.text.vocab_size, (3, 80), generator=g).cuda()
    lens = torch.tensor([80, 65, 17]).cuda()

    def loss_fn(model: torch.nn.Module) -> torch.Tensor:
        return model(ids, lens, 1.0).sum() / ids.numel()

    try:  # no CUDA default device around the steps: the trainer runs without one (under one, Adam would make its
        # step counters CUDA tensors and read them back each step, which the PPO loop's optimizer never does)
        backend.train_step(loss_fn)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            total, norm = queue_train_step(backend.trainer, loss_fn)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert total.is_cuda and norm.is_cuda and bool(torch.isfinite(total)) and float(norm) > 0
    finally:
        backend.close()
