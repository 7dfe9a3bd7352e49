"""`zerokl ppo` with `max_staleness` (one-step-off rollouts) on k3-tiny: real vLLM rollouts generated one version
ahead in the background, checked bitwise against the kept generating version, and a bitwise resume (its own module so
the test schedules apart from tests/engines/test_ppo.py's runs)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from helpers import assert_resumes_bitwise
from zerokl.ppo.config import load_ppo_config
from zerokl.ppo.loop import PPORun

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)

REPO = Path(__file__).resolve().parents[2]


def test_one_step_off_rollouts_keep_zero_kl_and_resume_bitwise(k3_tiny: Path, tmp_path: Path) -> None:
    """configs/ppo-tiny-async.yaml (`max_staleness: 1`): step t trains on samples that version t - 1 generated in the
    background while step t - 1 trained. Every step's sampled log-probs equal the generating version's bit for bit
    (step 0 on the trainer's own forward, later steps on the kept weights: `staleness` 1), and the updates are
    off-policy from the first (`ppo_kl` != 0). A run resumed from the step-2 checkpoint (the rollout generated ahead and
    the kept version restored from it) reproduces step 2 and the final weights bit for bit. The task has images
    (`squares`): their rows come from the engine's vision tower in rollouts and the trainer's in every check and
    update, the kept version's included, and the rollout queued ahead keeps its pictures across the resume."""
    cfg = replace(load_ppo_config(REPO / "configs/ppo-tiny-async.yaml"), model=str(k3_tiny), steps=3,
                  prompts_per_step=2, wandb="disabled", task="squares", task_args={"max_count": 4})
    run = PPORun(cfg, tmp_path / "run", log=lambda _: None)
    try:
        results = []
        for step in range(3):
            results.append(run.run_step())
            assert results[-1].diagnosis is None, results[-1].diagnosis
            if step == 1:
                run.save_state(tmp_path / "step-2")
        final = run.backend.export_official()
    finally:
        run.close()
    for r, staleness in zip(results, (0, 1, 1)):
        m = r.metrics
        assert m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 \
            and m["routing_agreement"] == 1.0 and m["staleness"] == staleness, m
    assert all(r.metrics["ppo_kl"] != 0.0 for r in results[1:])
    assert_resumes_bitwise(cfg, tmp_path / "resumed", tmp_path / "step-2", results[2].metrics, final)
