"""torchrun worker for tests/trainers/test_trainer_deepspeed_dist.py: the DeepSpeed trainer at ZeRO-3 on one or two CPU
ranks.

Run: torchrun --nproc_per_node 2 tests/dist/deepspeed_zero.py --checkpoint DIR --adapter DIR --out FILE
Every parameter is partitioned (persistence threshold 0). Every rank scores and trains on the same batches
(replicated data), so the data-parallel average of the gradients is the one-process gradient bit for bit. Each
rank checks its log-probs against the one-process shared forward (`torch.equal`) and that an official export
lands on rank 0 only; rank 0 records the log-probs, (loss, grad norm) of every step, the fp32 master weights and
the trained adapter, written to FILE, which the test compares with a one-rank run of `run` in its own process.
Then one more step on rank-specific batches (each rank routes tokens to different experts) must complete with one
reduced gradient. One "ok" line per check.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lora.adapter import load_lora
from parity.kernels import INVARIANT
from parity.model import K3Forward, K3Weights, score_sequences
from trainer.deepspeed.engine import build_deepspeed_trainer, destroy, destroy_dist, init_dist, train_step
from trainer.deepspeed.io import export_official
from trainer.deepspeed.lora import export_adapter
from trainer.logprobs import PaddedBatch, token_logprobs
from parity.io.checkpoint import load_checkpoint

STEPS = 2
TEMPERATURE = 0.7


def batch(step: int) -> tuple[PaddedBatch, torch.Tensor]:
    """Step `step`'s sequences (uneven lengths) and per-sequence advantages, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    seqs = [torch.randint(4, 1024, (n,), generator=g).tolist() for n in (11, 5, 8)]
    return PaddedBatch.from_sequences(seqs), torch.randn(3, generator=g)


def pg_loss(b: PaddedBatch, adv: torch.Tensor) -> Any:
    """A policy-gradient-shaped loss: -mean over sequences of advantage * sum of token log-probs."""
    return lambda model: -(token_logprobs(model, b, 1.0).sum(1) * adv).mean()


def check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")
    if dist.get_rank() == 0:
        print(f"ok  {what}", flush=True)


def run(checkpoint: Path, adapter: Path | None) -> dict[str, Any]:
    """Build a ZeRO-3 trainer (with the adapter when given), check its log-probs against the shared forward and its
    export placement, train `STEPS` steps, then one step on rank-specific data; returns what rank 0 saves (on other
    ranks the masters are {} and the adapter None)."""
    cfg, weights = load_checkpoint(checkpoint)
    trainer = build_deepspeed_trainer(checkpoint, lr=3e-3, zero_stage=3, lora=adapter, persistence_threshold=0)
    what = "base" if adapter is None else "LoRA"
    b, _ = batch(0)
    with torch.no_grad():
        lp = token_logprobs(trainer.model, b, TEMPERATURE)
    ref_weights = K3Weights.from_official(cfg.text, weights)
    if adapter is not None:
        ref_weights.lora = load_lora(adapter, cfg.text)
    seqs = [row[:n].tolist() for row, n in zip(b.input_ids, b.lens)]
    ref = score_sequences(K3Forward(ref_weights, INVARIANT), seqs, TEMPERATURE)
    check(all(torch.equal(lp[i, : len(s) - 1], ref[i]) for i, s in enumerate(seqs)),
          f"{what}: ZeRO-3 log-probs = one-process shared forward (torch.equal)")
    history = [train_step(trainer, pg_loss(*batch(step))) for step in range(STEPS)]
    masters = export_official(trainer, compute_dtype=True)
    check((dist.get_rank() == 0) == bool(masters), f"{what}: export_official gathers onto rank 0 only")
    out: dict[str, Any] = {"logprobs": lp, "history": history, "masters": masters}
    if adapter is not None:
        trained = export_adapter(trainer)
        out["adapter"] = None if trained is None else trained.tensors()
    _, norm = train_step(trainer, pg_loss(*batch(100 + dist.get_rank())))  # rank-specific data and routing
    norms: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(norms, norm)
    check(len(set(norms)) == 1, f"{what}: a step on rank-specific batches reduces one gradient (same norm everywhere)")
    destroy(trainer)
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--adapter", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    init_dist()  # one process group for both trainers
    results = {"base": run(args.checkpoint, None), "lora": run(args.checkpoint, args.adapter)}
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    destroy_dist()  # the process group's threads end before the interpreter does (else, at times: std::terminate)


if __name__ == "__main__":
    main()
