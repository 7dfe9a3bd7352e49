"""bench/compare_runs.py: two runs are the same when every metric but the timings and every checkpoint tensor (`.pt`
and a rank's `.safetensors`) match bit for bit; one flipped bit or one changed metric makes it exit 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]


def _run(root: Path, weights: dict[str, torch.Tensor], reward: float, seconds: float) -> Path:
    (root / "checkpoints" / "step-2").mkdir(parents=True)
    torch.save(weights, root / "checkpoints" / "step-2" / "weights.pt")
    torch.save({"state": {0: {"exp_avg": weights["w"] * 2}}}, root / "checkpoints" / "step-2" / "optimizer.pt")
    save_file({"v": -weights["w"]}, root / "checkpoints" / "step-2" / "weights-rank1.safetensors")
    rows = [{"step": 1, "kl": 0.0, "reward_mean": reward, "time_gen": seconds}]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _compare(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/compare_runs.py", str(a), str(b), "step-2"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_compare_runs_ignores_timings_and_finds_one_flipped_bit(tmp_path: Path) -> None:
    w = {"w": torch.randn(4, 3), "b": torch.randn(3).bfloat16()}
    a = _run(tmp_path / "a", w, 0.5, 1.0)
    same = _compare(a, _run(tmp_path / "b", {k: v.clone() for k, v in w.items()}, 0.5, 7.0))
    assert same.returncode == 0, same.stdout + same.stderr
    assert "4/4 tensors bitwise equal in 3 files" in same.stdout
    flipped = {k: v.clone() for k, v in w.items()}
    flipped["w"].view(torch.int32)[1, 2] ^= 1
    bit = _compare(a, _run(tmp_path / "c", flipped, 0.5, 1.0))
    assert bit.returncode == 1 and ".w" in bit.stdout
    flipped = {k: v.clone() for k, v in w.items()}
    flipped["w"].view(torch.int32)[0, 0] ^= 1 << 8  # also flips the rank file's `v` (-w, exact)
    rank = _compare(a, _run(tmp_path / "e", flipped, 0.5, 1.0))
    assert rank.returncode == 1 and "weights-rank1.safetensors: 1 tensors, 1 differ" in rank.stdout, rank.stdout
    metric = _compare(a, _run(tmp_path / "d", w, 0.25, 1.0))
    assert metric.returncode == 1 and "reward_mean" in metric.stdout
