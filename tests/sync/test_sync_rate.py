"""bench/sync_rate.py on three CPU ranks over gloo (what a multi-GPU host runs over NCCL): rank 0 sends k3-tiny-mxfp4's
weights in bf16 and MXFP4-packed form through bucketed `TorchDistributed` broadcasts, both rollout ranks verify every
version, and the report carries the broadcast ceiling, each sync's rates against it and the 2.8T extrapolation."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity.config import load_model_config
from parity.weights import text_specs

pytestmark = pytest.mark.slow  # starts processes: scheduled first (conftest.py)

ROOT = Path(__file__).resolve().parents[2]
REPS = 2


def test_sync_rate_on_gloo(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--standalone",
           str(ROOT / "bench" / "sync_rate.py"),
           "--config", "configs/k3-tiny-mxfp4.yaml", "--buffer-mib", "8", "--bucket-mib", "2", "--reps", str(REPS),
           "--json", str(report)]
    run = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(report.read_text())
    assert got["world_size"] == 3 and got["backend"] == "gloo" and got["broadcast"]["GBps"] > 0
    text = load_model_config(ROOT / "configs" / "k3-tiny-mxfp4.yaml").text
    params = sum(math.prod(s.shape) for s in text_specs(text).values())
    bf16, mx = got["bf16"], got["mxfp4"]
    assert bf16["bytes"] > 2 * params - 1 and mx["bytes"] < 0.7 * bf16["bytes"]  # packed experts: ~4.25 bits each
    assert mx["tensors"] > bf16["tensors"]  # each packed weight travels as codes + scales
    for row in (bf16, mx):
        assert row["verified_versions"] == REPS + 1
        assert row["transfer_over_broadcast"] == pytest.approx(row["transfer_GBps"] / got["broadcast"]["GBps"])
        full = row["k3_full"]
        assert full["parameters"] > 2.7e12
        assert full["seconds_at_end_to_end_rate"] == pytest.approx(full["bytes"] / row["end_to_end_GBps"] / 1e9)
    assert mx["k3_full"]["bytes"] < 0.3 * bf16["k3_full"]["bytes"]
