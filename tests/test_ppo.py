"""`zerokl ppo` end to end on k3-tiny: real vLLM rollouts, real Megatron trainer.

One reference run (in-process, 24 steps of configs/ppo-tiny.yaml) pins: KL exactly 0 and every log-prob
bitwise equal at every step, policy versions in lock-step, a rising reward. A second run is killed after its
step-2 checkpoint and resumed in a new process: its metrics and final weights equal the reference's bit for
bit. A corrupted tensor in flight is rejected and the engine keeps its version. With the fast kernels the
first step reports non-zero KL and a diagnosis, and the command exits non-zero.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from zerokl.ppo.config import load_ppo_config
from zerokl.ppo.loop import PPORun, SyncFailed
from parity.sync.bundle import WeightBundle

STEPS = 24
TIMING_KEYS = {"rollout_tokens_per_s", "train_tokens_per_s", "sync_seconds"}
REPO = Path(__file__).resolve().parents[1]



@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PPORun, list[dict], Path]]:
    out = tmp_path_factory.mktemp("ppo-ref")
    cfg = replace(load_ppo_config(REPO / "configs/ppo-tiny.yaml"), steps=STEPS, wandb="disabled")
    run = PPORun(cfg, out, log=lambda _: None)
    metrics = []
    for _ in range(STEPS):
        result = run.run_step()
        assert result.diagnosis is None, result.diagnosis
        metrics.append(result.metrics)
        if run.step in (2, 4):
            run.save_state(out / "checkpoints" / f"step-{run.step}")
    yield run, metrics, out
    run.close()


def _config_for(out: Path, init_ckpt: Path, steps: int, **extra: object) -> Path:
    cfg = (REPO / "configs/ppo-tiny.yaml").read_text().replace("model: configs/k3-tiny.yaml", f"model: {init_ckpt}")
    cfg = cfg.replace("steps: 100", f"steps: {steps}").replace("checkpoint_every: 25", "checkpoint_every: 2")
    cfg += "".join(f"{k}: {v}\n" for k, v in extra.items())
    path = out / "ppo.yaml"
    path.write_text(cfg.replace("wandb: offline", "wandb: disabled"))
    return path


def _zerokl(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("zerokl")), *args]


def test_every_step_zero_kl_and_versions_in_lockstep(reference) -> None:
    _, metrics, _ = reference
    for i, m in enumerate(metrics):
        assert m["kl"] == 0.0 and m["max_abs_logprob_diff"] == 0.0 and m["bitwise_equal_frac"] == 1.0, m
        assert m["step"] == i and m["policy_version"] == i


def test_reward_rises(reference) -> None:
    _, metrics, _ = reference
    first = sum(m["reward_mean"] for m in metrics[:8]) / 8
    last = sum(m["reward_mean"] for m in metrics[-8:]) / 8
    assert last > first + 0.05, (first, last)


def test_kill_and_resume_is_bitwise(reference, tmp_path: Path) -> None:
    _, metrics, ref_out = reference
    out = tmp_path / "run"
    out.mkdir()
    cfg = _config_for(out, ref_out / "init-checkpoint", steps=4)
    proc = subprocess.Popen(_zerokl("ppo", "--config", str(cfg), "--out", str(out)), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 400
        while not (out / "checkpoints" / "step-2").exists():
            assert proc.poll() is None or (out / "checkpoints" / "step-2").exists(), "run died before step 2"
            assert time.time() < deadline, "no step-2 checkpoint in time"
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the kill: no clean shutdown, no final checkpoint
        proc.wait()
    resumed = subprocess.run(_zerokl("ppo", "--config", str(cfg), "--out", str(out), "--resume",
                                     str(out / "checkpoints" / "step-2")), cwd=REPO, capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    lines = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    for got, want in zip(lines, metrics[:4]):
        assert {k: v for k, v in got.items() if k not in TIMING_KEYS} == \
            {k: v for k, v in want.items() if k not in TIMING_KEYS}
    final = torch.load(out / "checkpoints" / "step-4" / "weights.pt")
    ref = torch.load(ref_out / "checkpoints" / "step-4" / "weights.pt")
    assert final.keys() == ref.keys()
    assert all(torch.equal(final[n], ref[n]) for n in ref)


def test_corrupted_sync_leaves_engine_on_old_version(reference) -> None:
    run, _, _ = reference
    before = run.engine.policy_version
    transport = run.sync.transport

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

    run.sync.transport = Corrupting()
    try:
        with pytest.raises(SyncFailed, match="checksum mismatch.*stays on version"):
            run._sync_new_version()
    finally:
        run.sync.transport = transport
    assert run.engine.policy_version == before == run.version
    result = run.run_step()  # the loop goes on from the old version with parity intact
    assert result.metrics["kl"] == 0.0 and result.metrics["policy_version"] == before


def test_fast_kernels_break_the_check(reference, tmp_path: Path) -> None:
    _, _, ref_out = reference
    cfg = _config_for(tmp_path, ref_out / "init-checkpoint", steps=3)
    res = subprocess.run(_zerokl("ppo", "--config", str(cfg), "--out", str(tmp_path / "fast"), "--kernels", "fast"),
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "PARITY BROKEN at step 0" in res.stdout
    m = json.loads((tmp_path / "fast" / "metrics.jsonl").read_text().splitlines()[0])
    assert m["kl"] != 0.0 or m["max_abs_logprob_diff"] > 0.0
    assert m["bitwise_equal_frac"] < 1.0
    assert "first divergence at" in (tmp_path / "fast" / "diagnosis.txt").read_text()
