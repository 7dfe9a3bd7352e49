"""bench/sync_x2.py on two CPU ranks over gloo (what the two-GPU run does over NCCL), k3-tiny.

Checks what the harness reports and re-checks its bits here: after the full sync and after the adapter-only
sync, every sampled token's log-prob from the engine's serving schedule (chunked prefill + decode, paged MLA
cache) equals the trainer's one-pass log-prob (`torch.equal`); the engine's pre-sync weights do not; a bundle
with a flipped bit is rejected; Megatron at TP=2, EP=2 and TP=2 x EP=2 equals the engine's TP=1 bits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch


pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def test_sync_x2_harness_on_gloo(tmp_path: Path) -> None:
    report, dump = tmp_path / "report.json", tmp_path / "logprobs.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           str(ROOT / "bench" / "sync_x2.py"), "--config", "configs/k3-tiny.yaml",
           "--prompts", "20", "13", "--max-new", "6", "--chunk", "8", "--scale", "2", "--megatron",
           "--json", str(report), "--dump", str(dump)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # own process group: a timeout ends torchrun and its workers
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"sync_x2 timed out:\n{out}\n{err[-6000:]}")
    assert proc.returncode == 0, f"{out}\n{err[-6000:]}"
    got = json.loads(report.read_text())

    for key in ("parity_full", "parity_adapter"):
        assert got[key]["all_torch_equal"] and got[key]["bitwise_equal"] == got[key]["tokens"] == 12, got[key]
    assert got["parity_full"]["control_engine_pre_sync_weights"]["bitwise_equal"] < 12
    assert "checksum mismatch" in got["corrupt_bundle"]["rejected"]
    assert got["corrupt_bundle"]["engine_adapter_version_after"] == 2
    assert got["full_sync"]["version"] == 1 and got["adapter_sync"]["version"] == 2 and got["bulk_sync"]["nbytes"] > 0
    for tp, ep in ((2, 1), (1, 2), (2, 2)):
        layout = got[f"megatron_tp{tp}_ep{ep}"]
        for rank in ("rank0", "rank1"):
            assert all(layout[rank][part]["all_torch_equal"] for part in ("base", "adapter")), layout

    saved = torch.load(dump)
    for rnd, trainer in zip(saved["rounds"], saved["trainer"]):
        assert [len(r["tokens"]) for r in rnd] == [6, 6]
        for req, lp in zip(rnd, trainer):
            assert torch.equal(req["logprobs"], lp)
