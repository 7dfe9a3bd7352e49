"""The DeepSpeed trainer backend through the commands (k3-tiny-mxfp4: bf16, MXFP4 experts, FP8 latents; real vLLM
engine).

`zerokl parity check --backend deepspeed` (ZeRO-3, one process) with a LoRA adapter (`--lora`: the rollout engine's
LoRA against PEFT's on the DeepSpeed trainer): every sampled token's log-prob bitwise equal, batched and alone.
`zerokl ppo --backend deepspeed --nproc-per-node 2` (ZeRO-3, every parameter partitioned over the two ranks) against
`zerokl ppo` on the Megatron backend from the same seed (the session's `ppo_reference` run), `STEPS` steps: KL exactly
0 at every step on both, the same rollouts (rewards, PPO loss and grad norm of every step, which are functions of
every sampled token and log-prob, are equal) and bitwise equal fp32 weights at the final checkpoint. The same
comparison over 20 steps was run by hand (trainer/deepspeed/README.md). User mistakes exit 2 before anything starts.
One-process commands run in-process (`zerokl.cli.main`); the two-rank run goes through the launcher.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora.adapter import save_adapter
from lora.init import random_adapter
from parity.io.checkpoint import load_checkpoint
from zerokl.cli import main
from zerokl.ppo.metrics import TIMING_KEYS
from helpers import PPO_REFERENCE_CHECKPOINTS, PPO_REFERENCE_CONFIG, PPOReference, ppo_config_file

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)

REPO = Path(__file__).resolve().parents[2]
STEPS = 2  # the final checkpoint compared; the 20-step comparison is in trainer/deepspeed/README.md
CHECKPOINT_EVERY = 2


@pytest.fixture(scope="module")
def ckpt(k3_tiny_mxfp4: Path) -> Path:
    """The reference run's checkpoint: bf16, MXFP4 experts (fake-quantised by the DeepSpeed trainer too), FP8 latents."""
    return k3_tiny_mxfp4


@pytest.fixture(scope="module")
def config(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference run's config on `ckpt`, STEPS steps, a checkpoint every CHECKPOINT_EVERY steps, no wandb; every
    rank trains on the whole batch (`data_parallel: replicate`), as the one-process reference run does."""
    config = ppo_config_file(tmp_path_factory.mktemp("ds-cmd"), PPO_REFERENCE_CONFIG, ckpt, STEPS, CHECKPOINT_EVERY)
    config.write_text(config.read_text() + "data_parallel: replicate\n")
    return config


@pytest.fixture(scope="module")
def runs(config: Path, ppo_reference: PPOReference,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict], Path]]:
    """The same run on the Megatron backend (the reference run, one process) and on DeepSpeed ZeRO-3 over two
    processes (the launcher)."""
    assert all(step in PPO_REFERENCE_CHECKPOINTS for step in range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY))
    out = tmp_path_factory.mktemp("ds-runs") / "deepspeed"
    argv = ["ppo", "--config", str(config), "--out", str(out), "--backend", "deepspeed", "--zero-stage", "3",
            "--nproc-per-node", "2"]
    res = subprocess.run([str(Path(sys.executable).with_name("zerokl")), *argv], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    deepspeed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"megatron": (ppo_reference.metrics[:STEPS], ppo_reference.out), "deepspeed": (deepspeed, out)}


def test_parity_check_deepspeed_lora_is_bitwise(ckpt: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """An adapter on every supported projection (r 8, scale 3/8, B non-zero). (The base model's tokens through the
    DeepSpeed trainer: every step of `test_two_rank_zero3_ppo_equals_megatron` checks them bit for bit.)"""
    adapter = random_adapter(load_checkpoint(ckpt)[0].text, rank=8, alpha=3, seed=7)
    rc = main(["parity", "check", "--model", str(ckpt), "--backend", "deepspeed", "--num-prompts", "8",
               "--max-tokens", "16", "--batch-mix", "both", "--json", str(tmp_path / "r.json"),
               "--lora", str(save_adapter(adapter, tmp_path / "adapter"))])
    assert rc == 0
    assert "trainer deepspeed ZeRO-3" in capsys.readouterr().out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["tokens"] == data["bitwise_equal"] == 2 * 8 * 16
    assert data["max_abs_diff"] == 0.0 and data["kl_k1"] == 0.0 and data["ratio_min"] == data["ratio_max"] == 1.0


def test_two_rank_zero3_ppo_equals_megatron(runs: dict[str, tuple[list[dict], Path]]) -> None:
    (megatron, mg_out), (deepspeed, ds_out) = runs["megatron"], runs["deepspeed"]
    assert len(megatron) == len(deepspeed) == STEPS
    for i, (a, b) in enumerate(zip(megatron, deepspeed)):
        for m in (a, b):
            assert m["kl"] == 0.0 and m["max_abs_logprob_diff"] == 0.0 and m["bitwise_equal_frac"] == 1.0 \
                and m["routing_agreement"] == 1.0, m
            assert m["step"] == i and m["policy_version"] == i
        assert {k: v for k, v in a.items() if k not in TIMING_KEYS} == \
            {k: v for k, v in b.items() if k not in TIMING_KEYS}, i
    assert (ds_out / "checkpoints" / f"step-{STEPS}" / "state").is_dir()  # DeepSpeed's own resumable state
    for step in range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY):
        want = torch.load(mg_out / "checkpoints" / f"step-{step}" / "weights.pt")
        got = torch.load(ds_out / "checkpoints" / f"step-{step}" / "weights.pt")
        assert got.keys() == want.keys()
        differ = [n for n, t in want.items() if not torch.equal(got[n], t)]
        assert not differ, f"step {step}: {len(differ)} of {len(want)} tensors differ, first {differ[0]}"


def test_user_mistakes_exit_2_before_starting(config: Path, runs: dict[str, tuple[list[dict], Path]],
                                             tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A DeepSpeed checkpoint resumed by another backend or process count."""
    cases = [(["--resume", str(runs["deepspeed"][1] / "checkpoints" / "step-2")], "resume with the same backend"),
             (["--backend", "deepspeed", "--resume", str(runs["deepspeed"][1] / "checkpoints" / "step-2")],
              "2 processes")]
    for args, message in cases:
        capsys.readouterr()
        assert main(["ppo", "--config", str(config), "--out", str(tmp_path / "bad"), *args]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err[-2000:]
        assert not (tmp_path / "bad").exists()
