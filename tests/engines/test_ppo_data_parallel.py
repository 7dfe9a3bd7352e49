"""Data parallelism that adds throughput: `zerokl ppo --backend B --nproc-per-node 2` with `data_parallel: shard`
(k3-tiny-mxfp4; Megatron's DDP, and DeepSpeed's ZeRO-3): each rank trains on its own half of every step's samples (the
metrics show both halves: their sample and token counts and their mean rewards, which differ), every sampled log-prob,
raw log-prob and expert choice of both halves is checked bit for bit (on Megatron with its distributed optimizer:
each rank keeps the Adam state of half of the parameters), and the run is deterministic: resumed from its
step-1 checkpoint on two fresh processes, step 1's metrics and the final weights are bitwise the uninterrupted run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import PPO_REFERENCE_CONFIG, ppo_config_file
from zerokl.cli import main
from zerokl.ppo.metrics import TIMING_KEYS

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # two-rank runs, an engine each: scheduled first (conftest.py)

REPO = Path(__file__).resolve().parents[2]
STEPS = 2


def _ppo(backend: str, *argv: str) -> None:
    res = subprocess.run([str(Path(sys.executable).with_name("zerokl")), "ppo", *argv, "--backend", backend,
                          "--nproc-per-node", "2"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_sharded_ranks_train_on_their_halves_and_resume_bitwise(backend: str, k3_tiny_mxfp4: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = ppo_config_file(tmp_path, PPO_REFERENCE_CONFIG, k3_tiny_mxfp4, steps=STEPS, checkpoint_every=1)
    config.write_text(config.read_text() + "data_parallel: shard\n")
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    _ppo(backend, "--config", str(config), "--out", str(run))
    metrics = _metrics(run)
    samples = [m["dp_rank0_samples"] + m["dp_rank1_samples"] for m in metrics]
    assert samples == [32] * STEPS and all(m["dp_size"] == 2 and m["dp_rank0_samples"] == 16 for m in metrics)
    for m in metrics:
        assert m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 and m["raw_bitwise_equal_frac"] == 1.0 \
            and m["routing_agreement"] == 1.0 and m["parity_checked_frac"] == 1.0, m
        assert m["dp_rank0_reward_mean"] + m["dp_rank1_reward_mean"] == pytest.approx(2 * m["reward_mean"])
    assert any(m["dp_rank0_reward_mean"] != m["dp_rank1_reward_mean"] for m in metrics)  # two different shards
    _ppo(backend, "--config", str(config), "--out", str(resumed), "--resume", str(run / "checkpoints" / "step-1"))
    again = _metrics(resumed)
    assert [m["step"] for m in again] == [1]
    assert {k: v for k, v in again[0].items() if k not in TIMING_KEYS} == \
        {k: v for k, v in metrics[1].items() if k not in TIMING_KEYS}
    want = torch.load(run / "checkpoints" / f"step-{STEPS}" / "weights.pt")
    got = torch.load(resumed / "checkpoints" / f"step-{STEPS}" / "weights.pt")
    assert got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items())
    one = tmp_path / "one-process.yaml"  # resumed on one process: refused before anything starts
    one.write_text(config.read_text().replace("data_parallel: shard\n", ""))
    capsys.readouterr()
    assert main(["ppo", "--config", str(one), "--out", str(tmp_path / "bad"), "--backend", backend,
                 "--resume", str(run / "checkpoints" / "step-1")]) == 2
    err = capsys.readouterr().err
    assert "on 2 processes" in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "bad").exists()
    if backend == "megatron":  # ZeRO-1: each rank saved (and held) the Adam moments of half of the parameters
        shards = [torch.load(run / "checkpoints" / "step-1" / f"optimizer-rank{r}.pt") for r in (0, 1)]
        held = [sum(s["exp_avg"].numel() for part in shard for s in part["state"].values()) for shard in shards]
        weights = sum(t.numel() for t in want.values())  # the frozen ones (DSA indexer, vision tower) hold no moments
        assert 0 < sum(held) <= weights and abs(held[0] - held[1]) <= 1e-3 * sum(held), (held, weights)


def test_lora_on_two_megatron_ranks_keeps_zero_kl_and_resumes_bitwise(k3_tiny_mxfp4: Path, tmp_path: Path) -> None:
    """`--lora` on two data-parallel Megatron ranks (`data_parallel: replicate`: both train on the whole batch; the
    distributed optimizer shards the adapter's Adam state): KL 0 every step, and the run resumed from its step-1
    checkpoint ends with the uninterrupted run's adapter bit for bit (the adapter's save is collective: every rank
    takes part, rank 0 writes)."""
    from safetensors.torch import load_file

    config = ppo_config_file(tmp_path, PPO_REFERENCE_CONFIG, k3_tiny_mxfp4, steps=STEPS, checkpoint_every=1)
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    _ppo("megatron", "--config", str(config), "--out", str(run), "--lora")
    assert all(m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 for m in _metrics(run))
    _ppo("megatron", "--config", str(config), "--out", str(resumed), "--lora", "--resume",
         str(run / "checkpoints" / "step-1"))
    assert {k: v for k, v in _metrics(resumed)[0].items() if k not in TIMING_KEYS} == \
        {k: v for k, v in _metrics(run)[1].items() if k not in TIMING_KEYS}
    want, got = ([load_file(p) for p in sorted((d / "checkpoints" / f"step-{STEPS}" / "adapter").glob("*.safetensors"))]
                 for d in (run, resumed))
    assert want and len(want) == len(got)
    assert all(a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a) for a, b in zip(want, got))
