"""Training past one rank: `zerokl ppo --nproc-per-node 4` on k3-tiny-mxfp4 at each kind of layout - TP 2 x EP 2, TP 2
alone (with LoRA) and EP 2 alone (the dense layers over DP 4) - each with KL 0 every step and resumed bit for bit.

At TP 2 x EP 2 x DP 2 (each TP pair holds half of every dense layer's heads and columns, each EP pair half of the
routed experts, Megatron's distributed optimizer over the DP pair) the two data-parallel ranks each train on their own
half of every step's samples (`data_parallel: shard`, the default), on image prompts, with GAE's value head and the
vision tower, both replicated on every rank, training with them. The metrics show both halves (their sample and token
counts and their mean rewards, which differ); every sampled log-prob, raw log-prob and expert choice of both halves is
checked bit for bit against the one-process rollout engine; and the run is deterministic: resumed from its step-1
checkpoint on fresh processes, step 1's metrics and the final weights are bitwise the uninterrupted run's. The
Megatron ranks save their own parts of the weights, every tensor once, and `zerokl export` gathers them into a
servable official checkpoint.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import PPO_REFERENCE_CONFIG, ppo_config_file
from parity.config import load_model_config
from parity.io.checkpoint import load_checkpoint
from parity.io.vision import vision_specs
from trainer.base import WEIGHTS_FILE
from trainer.megatron.backend import VALUE_HEAD_FILE
from trainer.megatron.memory import rank_memory
from trainer.megatron.sharding import split_roles
from zerokl.cli import main
from zerokl.ppo.metrics import TIMING_KEYS

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # two-rank runs, an engine each: scheduled first (conftest.py)

REPO = Path(__file__).resolve().parents[2]
STEPS = 2


LAYOUT = ("--nproc-per-node", "4", "--tp", "2", "--ep", "2")
TP_ONLY = ("--nproc-per-node", "4", "--tp", "2")  # TP 2 x DP 2, every expert on every rank
EP_ONLY = ("--nproc-per-node", "4", "--ep", "2")  # TP 1: DP 4 for the dense layers, the experts split over EP 2
MINIBATCHES = 2  # the old-log-prob pass runs, each DP rank scoring its block
# what the run trains at TP x EP besides the text model: GAE's value head (the old pass gathers its values too) and
# the vision tower, on image prompts
MODEL_PARALLEL_KEYS = {"advantage": "gae", "task": "squares", "task_args": "{max_count: 4}",
                       "vision_tower": "trainable"}


def _ppo(*argv: str, layout: tuple[str, ...] = LAYOUT) -> str:
    res = subprocess.run([str(Path(sys.executable).with_name("zerokl")), "ppo", *argv, *layout],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _saved_weights(state: Path) -> dict:
    """A saved state's weights by (rank, name), from the Megatron ranks' own files."""
    assert not (state / WEIGHTS_FILE).exists()  # several ranks: each writes its own part, no whole copy
    return {(int(f.name.split("rank")[1].split(".")[0]), name): t for f in state.glob("weights-rank*.safetensors")
            for name, t in load_file(f).items()}


def _export(run: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, torch.Tensor]:
    """`zerokl export` of the run's latest checkpoint into `out`, read back (`load_checkpoint` checks it whole)."""
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    return load_checkpoint(out)[1]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sharded_ranks_train_on_their_halves_and_resume_bitwise(k3_tiny_mxfp4: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = ppo_config_file(tmp_path, PPO_REFERENCE_CONFIG, k3_tiny_mxfp4, steps=STEPS, checkpoint_every=1,
                             num_minibatches=MINIBATCHES, **MODEL_PARALLEL_KEYS)
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    out = _ppo("--config", str(config), "--out", str(run))
    assert "4 processes, TP 2 x DP 2, experts over EP 2; each DP rank trains on its own part" in out, out[-2000:]
    metrics = _metrics(run)
    first_update = 32 // MINIBATCHES  # the samples of the step's first update, half on each DP rank
    samples = [m["dp_rank0_samples"] + m["dp_rank1_samples"] for m in metrics]
    assert samples == [first_update] * STEPS and all(m["dp_size"] == 2 for m in metrics)
    assert all(m["dp_rank0_samples"] == first_update // 2 for m in metrics)
    for m in metrics:
        assert m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 and m["raw_bitwise_equal_frac"] == 1.0 \
            and m["routing_agreement"] == 1.0 and m["parity_checked_frac"] == 1.0, m
    assert any(m["dp_rank0_reward_mean"] != m["dp_rank1_reward_mean"] for m in metrics)  # two different shards
    _ppo("--config", str(config), "--out", str(resumed), "--resume", str(run / "checkpoints" / "step-1"))
    again = _metrics(resumed)
    assert [m["step"] for m in again] == [1]
    assert {k: v for k, v in again[0].items() if k not in TIMING_KEYS} == \
        {k: v for k, v in metrics[1].items() if k not in TIMING_KEYS}
    want, got = (_saved_weights(d / "checkpoints" / f"step-{STEPS}") for d in (run, resumed))
    assert got.keys() == want.keys() and all(torch.equal(got[k], t) for k, t in want.items())
    # the value head (zero at start) and the tower trained; both resumed bit for bit
    held = Counter(name for _, name in want)  # each rank wrote its part, every tensor once (TP slices once each)
    roles = split_roles(load_model_config(k3_tiny_mxfp4).text)
    assert all(held[n] == (2 if roles[n].tp_dim is not None else 1) for n in roles) and all(
        c == 1 for n, c in held.items() if n not in roles), held
    slices: dict[str, list[torch.Tensor]] = {}
    for (_, name), t in sorted(want.items()):  # the writers of a TP-split tensor: ranks 0, 1 (TP 0, 1 of DP 0)
        slices.setdefault(name, []).append(t)
    want = {n: torch.cat(ts, roles[n].tp_dim) if len(ts) > 1 else ts[0] for n, ts in slices.items()}
    exported = _export(run, tmp_path / "exported", capsys)  # the ranks' files gathered into a servable checkpoint
    base = load_checkpoint(k3_tiny_mxfp4)[1]
    assert exported.keys() == base.keys() and all(
        exported[n].dtype == t.dtype and exported[n].shape == t.shape for n, t in base.items())
    assert all(torch.equal(exported[n], t.to(base[n].dtype)) for n, t in want.items() if n in base)
    assert all(m["value_loss"] > 0 for m in metrics)
    heads = [torch.load(d / "checkpoints" / f"step-{STEPS}" / VALUE_HEAD_FILE) for d in (run, resumed)]
    assert heads[0].abs().sum() > 0 and torch.equal(*heads)
    tower = [n for n in base if n.startswith(("vision_tower.", "mm_projector."))]
    assert tower and all(not torch.equal(exported[n], base[n]) for n in tower)
    capsys.readouterr()  # resumed on one process: refused before anything starts
    assert main(["ppo", "--config", str(config), "--out", str(tmp_path / "bad"),
                 "--resume", str(run / "checkpoints" / "step-1")]) == 2
    err = capsys.readouterr().err
    assert "at tp: 2" in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "bad").exists()
    # ZeRO-1: each rank holds the Adam moments `rank_memory` counts (about 1/DP)
    cfg = load_model_config(k3_tiny_mxfp4)
    tower = sum(math.prod(s.shape) for s in vision_specs(cfg.vision, cfg.text.hidden_size).values())
    mem = rank_memory(cfg.text, tp=2, ep=2, world=4, replicated=tower + cfg.text.hidden_size + 1)  # + value head
    shards = [torch.load(run / "checkpoints" / "step-1" / f"optimizer-rank{r}.pt") for r in range(4)]
    held = [sum(s[k].numel() for part in shard for s in part["state"].values() for k in ("exp_avg", "exp_avg_sq"))
            for shard in shards]
    padding = 2 * len(shards[0]) * math.lcm(mem.dp, 128)  # 2 moments x a bucket per group, padded to lcm(DP, 128)
    assert mem.dp == mem.expert_dp == 2 and all(abs(h - mem.adam) <= padding for h in held), (held, mem.adam)


def test_lora_at_tp2_dp2_keeps_zero_kl_and_resumes_bitwise(k3_tiny_mxfp4: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`--lora` on four Megatron ranks at TP 2 x DP 2 (`data_parallel: replicate`: both DP ranks train on the
    whole batch; each TP rank holds its shard of the adapter; the distributed optimizer shards its Adam state over
    DP): KL 0 every step, and the run resumed from its step-1 checkpoint (the adapter copied back into each rank's TP
    shard) ends with the uninterrupted run's adapter bit for bit (the adapter's save is collective: every rank takes
    part, rank 0 writes). (LoRA at TP 2 x EP 2: tests/trainers/test_lora_parallel.py, on both kernel sets.)"""
    from safetensors.torch import load_file

    config = ppo_config_file(tmp_path, PPO_REFERENCE_CONFIG, k3_tiny_mxfp4, steps=STEPS, checkpoint_every=1)
    config.write_text(config.read_text() + "data_parallel: replicate\n")
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    out = _ppo("--config", str(config), "--out", str(run), "--lora", layout=TP_ONLY)
    assert "4 processes, TP 2 x DP 2, experts over EP 1; each DP rank trains on the whole batch" in out, out[-2000:]
    assert all(m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 for m in _metrics(run))
    _ppo("--config", str(config), "--out", str(resumed), "--lora", "--resume", str(run / "checkpoints" / "step-1"),
         layout=TP_ONLY)
    assert {k: v for k, v in _metrics(resumed)[0].items() if k not in TIMING_KEYS} == \
        {k: v for k, v in _metrics(run)[1].items() if k not in TIMING_KEYS}
    want, got = ([load_file(p) for p in sorted((d / "checkpoints" / f"step-{STEPS}" / "adapter").glob("*.safetensors"))]
                 for d in (run, resumed))
    capsys.readouterr()  # a LoRA run's checkpoint is its adapter: `zerokl export` says which commands take it
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "exported")]) == 2
    err = capsys.readouterr().err
    assert "LoRA run's checkpoint" in err and "zerokl lora merge" in err and "Traceback" not in err, err
    assert not (tmp_path / "exported").exists()
    assert want and len(want) == len(got)
    assert all(a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a) for a, b in zip(want, got))


def test_experts_over_ep2_with_dense_dp4_keep_zero_kl_and_resume_bitwise(k3_tiny_mxfp4: Path, tmp_path: Path) -> None:
    """Four Megatron ranks at EP 2 (TP 1): every rank holds the dense layers and trains on its own quarter of each
    step's samples (DP 4), each EP pair splits the routed experts (expert DP 2): KL 0 and every log-prob and expert
    choice bitwise every step; resumed from its step-1 checkpoint, step 1's metrics and every rank's saved weights
    are the uninterrupted run's bit for bit."""
    config = ppo_config_file(tmp_path, PPO_REFERENCE_CONFIG, k3_tiny_mxfp4, steps=STEPS, checkpoint_every=1)
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    out = _ppo("--config", str(config), "--out", str(run), layout=EP_ONLY)
    assert "4 processes, TP 1 x DP 4, experts over EP 2; each DP rank trains on its own part" in out, out[-2000:]
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == list(range(STEPS)) and all(m["dp_size"] == 4 for m in metrics)
    assert all(sum(m[f"dp_rank{r}_samples"] for r in range(4)) == 32 and m["dp_rank3_samples"] == 8 for m in metrics)
    for m in metrics:
        assert m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 and m["raw_bitwise_equal_frac"] == 1.0 \
            and m["routing_agreement"] == 1.0 and m["parity_checked_frac"] == 1.0, m
    _ppo("--config", str(config), "--out", str(resumed), "--resume", str(run / "checkpoints" / "step-1"),
         layout=EP_ONLY)
    again = _metrics(resumed)
    assert [m["step"] for m in again] == [1]
    assert {k: v for k, v in again[0].items() if k not in TIMING_KEYS} == \
        {k: v for k, v in metrics[1].items() if k not in TIMING_KEYS}
    want, got = (_saved_weights(d / "checkpoints" / f"step-{STEPS}") for d in (run, resumed))
    assert want and got.keys() == want.keys() and all(torch.equal(got[k], t) for k, t in want.items())
