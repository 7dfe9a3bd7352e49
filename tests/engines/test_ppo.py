"""`zerokl ppo` end to end on k3-tiny: real vLLM rollouts, real Megatron trainer.

The session's reference run (`ppo_reference`, in-process, 16 steps of configs/ppo-tiny-mxfp4.yaml: bf16, MXFP4
experts with a quantisation-aware trainer, FP8 latents) pins: KL exactly 0 and
every log-prob bitwise equal at every step, policy versions in lock-step, a rising reward. A run of the command in
its own process is killed after its step-1 checkpoint and resumed (`--resume`): its metrics and final weights equal
the reference's bit for bit. A run resumed from the reference's step-2 checkpoint gets a tensor corrupted in flight:
the sync is rejected, the engine keeps its version, and the next step equals the reference's step 2 (so is a NaN in
an MXFP4 expert's master, refused before anything is sent). With the fast
kernels (fp32 k3-tiny, where a replayed schedule differs at a named block) the first step reports non-zero KL and a
diagnosis naming the block, and the command exits 1. GAE with a value head (configs/ppo-tiny-gae.yaml) keeps every
log-prob bitwise and resumes bit for bit, head included. The resumed and fast-kernel
commands run in this process (`zerokl.cli.main`; tests/units/test_cli.py runs the console script itself).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from parity.sync.bundle import WeightBundle
from zerokl.cli import main
from zerokl.ppo.config import load_ppo_config
from zerokl.ppo.metrics import TIMING_KEYS
from zerokl.ppo.loop import PPORun
from zerokl.ppo.sync import SyncFailed
from helpers import PPO_REFERENCE_CONFIG, PPOReference, ppo_config_file

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)

EXPERT = "language_model.layers.1.block_sparse_moe.experts.3.w1.weight"
REPO = Path(__file__).resolve().parents[2]


def _without_timings(m: dict) -> dict:
    return {k: v for k, v in m.items() if k not in TIMING_KEYS}


def test_every_step_zero_kl_and_versions_in_lockstep(ppo_reference: PPOReference) -> None:
    for i, m in enumerate(ppo_reference.metrics):
        assert m["kl"] == 0.0 and m["max_abs_logprob_diff"] == 0.0 and m["bitwise_equal_frac"] == 1.0 \
            and m["routing_agreement"] == 1.0 and m["raw_bitwise_equal_frac"] == 1.0, m
        assert m["step"] == i and m["policy_version"] == i


def test_reward_rises(ppo_reference: PPOReference) -> None:
    """The reward's least-squares slope over the steps is positive and the last 8 steps' mean is above the first 8's.
    How fast it rises depends on the CPU (the run's bits do, through its SIMD paths; parity holds on each): first 8
    steps 0.07 -> last 8 0.24 on an AVX-512 EPYC, 0.064 -> 0.098 (slope 0.0041 per step, t = 2.0) on an AVX2 one."""
    rewards = [m["reward_mean"] for m in ppo_reference.metrics]
    steps = range(len(rewards))
    mean_step, mean_reward = sum(steps) / len(rewards), sum(rewards) / len(rewards)
    slope = sum((x - mean_step) * (y - mean_reward) for x, y in zip(steps, rewards))
    assert slope > 0 and sum(rewards[-8:]) > sum(rewards[:8]), rewards


def test_kill_and_resume_is_bitwise(ppo_reference: PPOReference, k3_tiny_mxfp4: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    cfg = ppo_config_file(out, PPO_REFERENCE_CONFIG, k3_tiny_mxfp4, steps=2, checkpoint_every=1)
    proc = subprocess.Popen([str(Path(sys.executable).with_name("zerokl")), "ppo", "--config", str(cfg), "--out",
                             str(out)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 400
        while not (out / "checkpoints" / "step-1").exists():
            assert proc.poll() is None or (out / "checkpoints" / "step-1").exists(), "run died before step 1"
            assert time.time() < deadline, "no step-1 checkpoint in time"
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the kill: no clean shutdown, no final checkpoint
        proc.wait()
    assert main(["ppo", "--config", str(cfg), "--out", str(out), "--resume", str(out / "checkpoints" / "step-1")]) == 0
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1]
    for got, want in zip(lines, ppo_reference.metrics[:2]):
        assert _without_timings(got) == _without_timings(want)
    final = torch.load(out / "checkpoints" / "step-2" / "weights.pt")
    ref = torch.load(ppo_reference.out / "checkpoints" / "step-2" / "weights.pt")
    assert final.keys() == ref.keys()
    assert all(torch.equal(final[n], ref[n]) for n in ref)


def test_corrupted_sync_leaves_engine_on_old_version(ppo_reference: PPOReference, k3_tiny_mxfp4: Path,
                                                     tmp_path: Path) -> None:
    cfg = replace(load_ppo_config(REPO / PPO_REFERENCE_CONFIG), model=str(k3_tiny_mxfp4), wandb="disabled")
    run = PPORun(cfg, tmp_path / "run", resume=ppo_reference.out / "checkpoints" / "step-2", log=lambda _: None)
    try:
        before = run.engine.policy_version
        transport = run.sync.send.transport

        class Corrupting:
            """The run's transport with one bit flipped in flight."""

            name = transport.name
            receive, release = transport.receive, transport.release

            def send(self, bundle: WeightBundle) -> dict:
                tensors = dict(bundle.tensors)
                name = sorted(tensors)[7]
                bad = tensors[name].clone()
                bad.view(torch.uint8)[0] ^= 1
                tensors[name] = bad
                return transport.send(WeightBundle(bundle.version, bundle.kind, tensors, bundle.checksums))

        run.sync.send.transport = Corrupting()
        try:
            with pytest.raises(SyncFailed, match="checksum mismatch.*stays on version"):
                run.sync.push(run.version + 1)
        finally:
            run.sync.send.transport = transport
        master = run.trainer.module.official_parameters()[EXPERT]  # a NaN in an MXFP4 expert's fp32 master
        saved = master.detach().clone()
        with torch.no_grad():
            master.view(-1)[5] = float("nan")
        try:
            with pytest.raises(SyncFailed, match=rf"{re.escape(EXPERT)}: holds NaN or inf.*stays on version"):
                run.sync.push(run.version + 1)
        finally:
            with torch.no_grad():
                master.copy_(saved)
        assert run.engine.policy_version == before == run.version == 2
        result = run.run_step()  # the loop goes on from the old version with parity intact
    finally:
        run.close()
    assert result.metrics["kl"] == 0.0 and result.metrics["policy_version"] == before
    assert _without_timings(result.metrics) == _without_timings(ppo_reference.metrics[2])


def test_fast_kernels_break_the_check(k3_tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = ppo_config_file(tmp_path, "configs/ppo-tiny.yaml", k3_tiny, steps=3)
    assert main(["ppo", "--config", str(cfg), "--out", str(tmp_path / "fast"), "--kernels", "fast"]) == 1
    assert "PARITY BROKEN at step 0" in capsys.readouterr().out
    m = json.loads((tmp_path / "fast" / "metrics.jsonl").read_text().splitlines()[0])
    assert m["kl"] != 0.0 or m["max_abs_logprob_diff"] > 0.0
    assert m["bitwise_equal_frac"] < 1.0
    assert "first divergence at" in (tmp_path / "fast" / "diagnosis.txt").read_text()


def test_minibatch_epochs_reference_kl_and_entropy_keep_zero_kl(k3_tiny_mxfp4: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`ppo_epochs: 2, num_minibatches: 2` (four optimizer steps per PPO step), each minibatch of 16 samples in passes
    of 6, 6 and 4 (`micro_batch_size: 6`), with a k3 KL penalty to the starting weights and an entropy bonus,
    `old_logprobs: rollout` with the full recompute every 2 steps: step 0 checks every sample before any update,
    step 1 the first minibatch's (its three passes run at the generating version), bitwise both; the later
    minibatches are off-policy (`ppo_kl` != 0, `clipfrac` reported), the policy leaves the reference (`kl_ref` > 0
    once updated), `entropy` is reported and the saved time is printed. (The shuffle is seeded by the
    step, so resume needs nothing new: `test_kill_and_resume_is_bitwise`.)"""
    cfg = ppo_config_file(tmp_path, PPO_REFERENCE_CONFIG, k3_tiny_mxfp4, steps=2)
    cfg.write_text(cfg.read_text() + "ppo_epochs: 2\nnum_minibatches: 2\nmicro_batch_size: 6\nkl_coef: 0.05\n"
                   "kl_estimator: k3\n"
                   "entropy_coef: 0.01\nold_logprobs: rollout\nparity_check_every: 2\n")
    assert main(["ppo", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 0
    metrics = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        assert m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 and m["routing_agreement"] == 1.0, m
        assert m["ppo_kl"] != 0.0 and 0.0 <= m["clipfrac"] <= 1.0, m
        assert m["kl_ref"] >= 0.0 and m["entropy"] > 0.0 and m["time_ref"] > 0.0, m
    assert metrics[1]["kl_ref"] > 0.0
    assert [m["old_logprob_recomputed"] for m in metrics] == [1.0, 0.0]
    assert metrics[0]["parity_checked_frac"] == 1.0 and metrics[1]["parity_checked_frac"] == 0.5
    assert "old_logprobs: rollout: the old-log-prob pass ran on 1 of 2 steps" in capsys.readouterr().out


def test_gae_value_head_with_truncated_sampling_keeps_zero_kl(k3_tiny: Path, tmp_path: Path) -> None:
    """configs/ppo-tiny-gae.yaml (a value head trained with the policy, 2 epochs x 2 minibatches, old values from the
    no-grad pass, entropy bonus, KL penalty) sampling with `top_k: 5, top_p: 0.7` and the loss on the raw log-probs
    (`logprobs_mode: raw_logprobs`, which makes the KL to the reference finite under truncation), on a user dataset
    scored by a user reward function (`task: jsonl`, configs/rewards/example_reward.py) for 2 steps: zero KL and every
    log-prob bitwise equal at each step, processed (the engine's = the trainer's recompute of the truncation) and raw,
    the value metrics reported, the head trained and never exported. (Its save and restore, Adam state included:
    `tests/trainers/test_trainer_backend.py::test_value_head_state_round_trip_continues_bitwise`; the loop's resume of
    the rest: `test_kill_and_resume_is_bitwise`.)"""
    cfg = replace(load_ppo_config(REPO / "configs/ppo-tiny-gae.yaml"), model=str(k3_tiny), steps=2, wandb="disabled",
                  prompts_per_step=4, top_k=5, top_p=0.7, logprobs_mode="raw_logprobs", task="jsonl",
                  task_args={"path": str(REPO / "configs/data/word-problems.jsonl"),
                             "reward": f"{REPO / 'configs/rewards/example_reward.py'}:score"})
    run = PPORun(cfg, tmp_path / "run", log=lambda _: None)
    try:
        results = [run.run_step() for _ in range(2)]
        head = run.backend.trainer.module.value_head.weight.detach().clone()
        exported = run.backend.export_official()
    finally:
        run.close()
    assert all(r.diagnosis is None for r in results), [r.diagnosis for r in results]
    for m in (r.metrics for r in results):
        assert m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 and m["routing_agreement"] == 1.0, m
        assert m["value_loss"] > 0.0 and 0.0 <= m["vf_clipfrac"] <= 1.0 and m["explained_var"] <= 1.0, m
        assert m["raw_kl"] == 0.0 and m["raw_bitwise_equal_frac"] == 1.0 and m["kl_ref"] >= 0.0, m
        assert 0.0 < m["entropy"] < math.log(5), m  # the truncated distribution's: at most 5 tokens
    assert head.abs().sum() > 0 and not any("value" in n for n in exported)

