"""torchrun worker for tests/trainers/test_lora_parallel.py: the K3 trainer with a LoRA adapter at TP/EP = 2 against the
one-process shared forward with `K3Weights.lora`.

Run: torchrun --nproc_per_node 2 tests/dist/lora_parallel.py --tp 2 --ep 2 --checkpoint DIR --out DIR [--kernels K]
Each check prints one line; any failure raises (non-zero exit).
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from lora.adapter import Adapter
from lora.init import random_adapter
from lora.state import read_state
from parity.kernels import get_kernels
from parity.config import TextConfig
from parity.kernels.linear import LoRA, k_segments
from parity.kernels.triton import linear as triton_linear
from parity.model import K3Forward, K3Weights, score_sequences
from parity.weights import is_row_parallel, master_weights, text_specs
from trainer.megatron.io import export_adapter, save_adapter_state
from trainer.logprobs import PaddedBatch, token_logprobs
from trainer.megatron.parallel import ParallelContext, destroy_parallel, init_parallel
from trainer.megatron.sharding import lora_splits, shard, split_of
from trainer.megatron.train import build_model, train_step, wrap
from parity.io.checkpoint import load_checkpoint

TEMPERATURE = 0.7
CLIP_GRAD = 1.0


def sequences(dp_rank: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(200 + dp_rank)
    return [torch.randint(4, 1024, (n,), generator=g).tolist() for n in (11, 6 + 3 * dp_rank, 9)]


def nll(lp: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    return -lp.sum() / (batch.lens - 1).sum()


def check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")
    if dist.get_rank() == 0:
        print(f"ok  {what}", flush=True)


def same(a: Adapter, b: Adapter) -> bool:
    return a.spec == b.spec and a.weights.keys() == b.weights.keys() and all(
        torch.equal(x, y) for m in a.weights for x, y in zip(a.weights[m], b.weights[m]))


def triton_launches(fn):  # noqa: ANN001, ANN201 - any call
    """(fn(), [(M, K, N, segments, segment sums only) of every Triton GEMM launch inside fn])."""
    seen: list[tuple[int, int, int, int, bool]] = []
    launch = triton_linear._launch

    def recording(x, w, y, t_args, cfg, n_seg, seg, split, parts):  # noqa: ANN001, ANN202
        seen.append((*x.shape, w.shape[0], n_seg, parts is not None))
        return launch(x, w, y, t_args, cfg, n_seg, seg, split, parts)

    triton_linear._launch = recording
    try:
        return fn(), seen
    finally:
        triton_linear._launch = launch


def row_parallel_on_shards(launches: list, cfg: TextConfig, tp: int) -> bool:
    """Whether the launches hold a segment-sums GEMM on K / TP columns for each row-parallel weight [N, K] of the model,
    every segment-sums GEMM (the LoRA's x A^T too) reduces over some row-parallel K / TP, and none runs a row-parallel
    reduction over its whole K in its segments (what one process runs)."""
    whole = {tuple(spec.shape) for name, spec in text_specs(cfg).items() if is_row_parallel(name)}
    ks = {k for _, k in whole}
    ran = {(n, k) for _, k, n, _, parts in launches if parts}
    unsplit = [(n, k) for _, k, n, segs, parts in launches if not parts and k in ks and segs == k_segments(k) > 1]
    return bool(whole) and {(n, k // tp) for n, k in whole} <= ran and all(k * tp in ks for _, k in ran) and not unsplit


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", default="invariant")
    args = ap.parse_args()
    par: ParallelContext = init_parallel(args.tp, args.ep)
    tag = f"TP={par.tp} EP={par.ep} DP={par.dp}"
    model_cfg, weights = load_checkpoint(args.checkpoint)
    adapter = random_adapter(model_cfg.text, 4, 8.0, seed=6)
    model = build_model(model_cfg, master_weights(model_cfg.text, weights), par, args.kernels, adapter=adapter)
    check(same(export_adapter(model), adapter), f"{tag}: adapter load then export is bitwise")

    base = K3Weights.from_official(model_cfg.text, weights)
    ref_lora = {n: LoRA(lo.a.clone().requires_grad_(True), lo.b.clone().requires_grad_(True), lo.scale)
                for n, lo in adapter.lora().items()}
    ref = K3Forward(K3Weights(model_cfg.text, base.tensors, ref_lora), get_kernels(args.kernels))
    seqs = sequences(par.dp_rank)
    batch = PaddedBatch.from_sequences(seqs)
    trainer = wrap(model, lr=1e-3, clip_grad=CLIP_GRAD)
    lp, launches = triton_launches(lambda: token_logprobs(trainer.model, batch, TEMPERATURE))
    if args.kernels == "triton":
        check(row_parallel_on_shards(launches, model_cfg.text, par.tp),
              f"{tag}: every row-parallel GEMM ran on this rank's K / TP columns only (1 / TP of its FLOPs)")
    with torch.no_grad():
        one_process = score_sequences(ref, seqs, TEMPERATURE)
    check(all(torch.equal(lp[i, : len(s) - 1], one_process[i]) for i, s in enumerate(seqs)),
          f"{tag}: every token's log-prob with the adapter equals the one-process forward (torch.equal)")

    loss_ref = torch.zeros(())
    for r in range(par.dp):
        s = sequences(r)
        loss_ref = loss_ref - sum(x.sum() for x in score_sequences(ref, s, TEMPERATURE)) / sum(len(q) - 1 for q in s)
    (loss_ref / par.dp).backward()
    before = {n: p.detach().clone() for n, p in model.official_parameters().items()}
    loss, grad_norm = train_step(trainer, lambda m: nll(token_logprobs(m, batch, TEMPERATURE), batch))
    clip = min(1.0, CLIP_GRAD / (grad_norm + 1.0e-6))
    worst = 0.0
    for base_name, lo in ref_lora.items():
        target = model.lora_module(base_name)
        for split, want, p in zip(lora_splits(split_of(base_name)), (lo.a.grad, lo.b.grad),
                                  (target.lora_A.weight, target.lora_B.weight)):
            want = shard(base_name, want, split, par.tp_rank, par.tp) * clip
            worst = max(worst, float((p.grad - want).norm() / (want.norm() + 1e-12)))
    check(worst < 1e-4, f"{tag}: adapter gradients match the one-process ones (worst rel. {worst:.1e})")
    ref_norm = math.sqrt(sum(float(g.double().pow(2).sum())
                             for lo in ref_lora.values() for g in (lo.a.grad, lo.b.grad)))
    check(abs(grad_norm - ref_norm) < 1e-4 * ref_norm, f"{tag}: Megatron grad norm {grad_norm:.6f} = {ref_norm:.6f}")

    moved = [n for n, p in model.official_parameters().items() if not torch.equal(p, before[n])]
    after = nll(token_logprobs(trainer.model, batch, TEMPERATURE), batch).detach()
    total = torch.stack([torch.as_tensor(loss), after])
    dist.all_reduce(total)
    check(not moved and total[1] < total[0],
          f"{tag}: one Adam step leaves the base alone ({moved[:1]} moved), "
          f"summed loss {total[0]:.4f} -> {total[1]:.4f}")

    trained = export_adapter(model)
    save_adapter_state(model, Path(args.out))
    check(same(read_state(args.out, model_cfg.text), trained), f"{tag}: adapter state shards reassemble bit for bit")
    destroy_parallel(par)


if __name__ == "__main__":
    main()
