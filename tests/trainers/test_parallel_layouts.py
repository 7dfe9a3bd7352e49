"""bench/layouts.py on k3-tiny over gloo, worlds of 1 and 2 CPU ranks, 2 steps, clipping off: every layout's forward
log-probs are bitwise equal (to each other and to the one-process parity forward, re-checked here from the saved
tensors), the zero-KL check passes at every step of every layout, and the weights follow the rule the module docstring
states: no two layouts hold equal weights (or applied equal gradients) after any update, because TP (the input
gradient of a vocab- or column-split GEMM is an all-reduced sum of TP partials), EP (a token's k slot gradients come
back from the expert ranks and are added in another order) and DP (DDP adds the ranks' partial weight gradients) each
change gradient bits, each at its own place on the way back from the loss.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)

ROOT = Path(__file__).resolve().parents[2]
LM_HEAD = "language_model.lm_head.weight"
FINAL_NORM = "language_model.model.norm.weight"
EXPECTED = {"tp1-ep1-dp1", "tp2-ep1-dp1", "tp1-ep1-dp2", "tp1-ep2-dp2", "tp2-ep2-dp1"}  # (tp, ep, dp) for world <= 2


@pytest.fixture(scope="module")
def report(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The sweep's JSON report (the driver exited 0: every forward bitwise, every KL check passed)."""
    out = tmp_path_factory.mktemp("layouts") / "layouts.json"
    cmd = [sys.executable, str(ROOT / "bench" / "layouts.py"), "--checkpoint", str(k3_tiny), "--max-world", "2",
           "--steps", "2", "--clip-grad", "1e9", "--timeout", "240", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:  # the driver stops torchrun and its workers on an interrupt
        os.kill(proc.pid, signal.SIGINT)
        log, _ = proc.communicate(timeout=120)
        pytest.fail(f"bench/layouts.py timed out:\n{log[-6000:]}")
    assert proc.returncode == 0 and out.exists(), log[-6000:]
    return json.loads(out.read_text())


def test_every_layout_forward_is_bitwise(report: dict) -> None:
    assert {r["layout"] for r in report["layouts"]} == EXPECTED
    saved = torch.load(report["logprobs_file"])
    reference = saved["reference"]
    assert len(reference) == report["args"]["batch"]
    for tag in EXPECTED:
        assert len(saved[tag]) == len(reference) and all(torch.equal(a, b) for a, b in zip(saved[tag], reference)), tag
    for a, b in combinations(sorted(EXPECTED), 2):
        assert all(torch.equal(x, y) for x, y in zip(saved[a], saved[b])), (a, b)


def test_kl_is_zero_at_every_step(report: dict) -> None:
    for r in report["layouts"]:
        assert r["failure"] is None and len(r["kl"]) == 2, r
        assert all(k["tokens"] > 0 and k["bitwise_equal"] == k["tokens"] and k["kl_k1"] == 0.0 for k in r["kl"]), r


def test_no_two_layouts_share_weights(report: dict) -> None:
    """The rule: the classes of equal weights (and of equal gradients) are single layouts at every step."""
    assert len(report["steps"]) == 2
    for step in report["steps"]:
        for what in ("weight", "gradient"):
            assert sorted(len(c["layouts"]) for c in step[f"{what}_classes"]) == [1] * len(EXPECTED), step
            assert step[f"{what}_rule"] == ["tp", "ep", "dp"]


def test_where_each_size_changes_the_gradients(report: dict) -> None:
    """Step 0 (same weights everywhere), neighbours differing in one size: DP changes the lm_head gradient (DDP sums
    partial weight gradients); TP keeps it but not the final norm's (lm_head's input gradient is summed over vocab
    shards); EP keeps both (the change starts inside the routed experts' backward)."""
    pairs = report["steps"][0]["neighbours"]
    assert sorted(p["size"] for p in pairs) == ["dp", "ep", "ep", "tp"]
    for p in pairs:
        equal = set(p["equal_gradients"])
        assert p["gradients_differing"] > 0
        if p["size"] == "dp":
            assert LM_HEAD not in equal, p
        elif p["size"] == "tp":
            assert LM_HEAD in equal and FINAL_NORM not in equal, p
        else:
            assert {LM_HEAD, FINAL_NORM} <= equal, p


# Telling rounding from a wrong gradient, from the arithmetic (fp32, unit roundoff u = 2^-24): layouts compute the
# same sums of the same fp32 terms in other orders, and reordering an n-term sum moves it by at most 2 gamma_n kappa
# relative (gamma_n = n u / (1 - n u), kappa = sum |terms| / |sum|: about 2 n u at kappa = 1), while a lost or doubled
# term (one of the n tokens' contribution) moves it by about 1 / n. The threshold is the geometric middle of the two,
# sqrt(2 n u / n) = sqrt(2 u), whatever n is: a rounding difference passes unless kappa exceeds 1 / (n sqrt(2 u))
# (about 70 at the sweep's ~40 tokens; the worst tensor's drift is about 1.5 x 2 n u), a wrong gradient fails unless it
# misses less than sqrt(2 u) of a tensor. No number here comes from one host's rounding.
ROUNDING_OR_WRONG = math.sqrt(2.0 * 2.0**-24)


def test_every_layout_computes_the_same_gradient_up_to_rounding(report: dict) -> None:
    """Step 0 (same weights, same loss): each layout's gradients against the first layout's, overall and for the
    worst tensor, below ROUNDING_OR_WRONG (a lost or doubled reduction moves a tensor by O(1 / n) or more)."""
    drift = {r["layout"]: r["gradient_drift"] for r in report["layouts"]}
    assert drift.keys() == EXPECTED and all(d["against"] == "tp1-ep1-dp1" for d in drift.values())
    assert drift["tp1-ep1-dp1"]["relative"] == 0.0
    for tag, d in drift.items():
        assert d["relative"] < ROUNDING_OR_WRONG and d["worst_relative"] < ROUNDING_OR_WRONG, (tag, d)


def test_data_parallel_only_adds_the_ranks_gradients(report: dict) -> None:
    """DP = 2 in bits, at step 0: each rank's local gradients equal one process's gradients of that rank's sequences
    alone (same loss scale), and the reduced gradients are exactly their sum, each scaled by 1 / 2: DP changes a
    gradient only by adding two partial sums where one process sums once (the drift above), on any host."""
    split = report["dp_split"]
    assert split["tensors"] > 0 and split["shares_differ"], split
    assert split["shares_equal_one_process"] and split["reduced_is_scaled_sum"], split
