"""torchrun worker for tests/trainers/test_trainer_parallel.py: the K3 trainer at TP/EP > 1 against the one-process
forward.

Run: torchrun --nproc_per_node 2 tests/dist/trainer_parallel.py --tp 2 --ep 1 --checkpoint DIR --out DIR
Each check prints one line; any failure raises (non-zero exit). Data: with DP > 1 (EP runs) every rank scores
its own sequences, with TP ranks sharing theirs, so EP moves real tokens between ranks.
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import parity.kernels.linear as linear_kernel
from parity.config import ModelConfig
from parity.kernels import INVARIANT
from parity.model import K3Forward, K3Weights, score_sequences
from trainer.megatron.io import (export_official, load_rank_shards, load_rank_weights, save_official,
                                 save_rank_weights)
from trainer.megatron.memory import rank_memory
from trainer.megatron.config import k3_transformer_config
from trainer.logprobs import PackedBatch, PaddedBatch, token_logprobs
from trainer.megatron.modules import MegatronK3Model
from trainer.megatron.parallel import ParallelContext, destroy_parallel, init_parallel
from trainer.megatron.sharding import Split, shard, split_roles
from trainer.megatron.train import train_step, wrap
from parity.io.checkpoint import load_checkpoint, open_checkpoint

TEMPERATURE = 0.7
CLIP_GRAD = 1.0


def sequences(dp_rank: int) -> list[list[int]]:
    """This data-parallel rank's batch: 3 sequences of uneven lengths (padding inside the batch)."""
    g = torch.Generator().manual_seed(100 + dp_rank)
    return [torch.randint(4, 1024, (n,), generator=g).tolist() for n in (13, 7 + 3 * dp_rank, 10)]


def nll(lp: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
    return -lp.sum() / (batch.lens - 1).sum()


def check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")
    if dist.get_rank() == 0:
        print(f"ok  {what}", flush=True)


def reference_grads(model_cfg: ModelConfig, weights: dict[str, torch.Tensor], dp: int) -> dict[str, torch.Tensor]:
    """fp32 gradients of the mean over DP ranks of each rank's NLL, one process, the plain parity forward
    (zeros for the selection-only router bias, which gets no gradient)."""
    ref = K3Weights.from_official(model_cfg.text, weights)
    for t in ref.tensors.values():
        t.requires_grad_(True)
    fwd = K3Forward(ref, INVARIANT)
    loss = torch.zeros(())
    for r in range(dp):
        seqs = sequences(r)
        lps = score_sequences(fwd, seqs, TEMPERATURE)
        loss = loss - sum(lp.sum() for lp in lps) / sum(len(s) - 1 for s in seqs) / dp
    loss.backward()
    return {n: torch.zeros_like(t) if t.grad is None else t.grad for n, t in ref.tensors.items()}


def multiplied(fn):  # noqa: ANN001, ANN201 - any call
    """(fn(), [(activation shape, weight) of every invariant GEMM this rank ran inside fn])."""
    seen: list[tuple[tuple[int, ...], torch.Tensor]] = []
    whole = linear_kernel.tiled_matmul

    def recording(x: torch.Tensor, w: torch.Tensor, segments: int | None = None) -> torch.Tensor:
        seen.append((tuple(x.shape), w))
        return whole(x, w, segments)

    linear_kernel.tiled_matmul = recording
    try:
        return fn(), seen
    finally:
        linear_kernel.tiled_matmul = whole


def row_parallel_shares(model: MegatronK3Model, seen: list, roles: dict, tp: int, full: dict) -> str:
    """'' when every row-parallel weight was multiplied, and only as this rank's [N, K / TP] shard with [M, K / TP]
    activations (1 / TP of its FLOPs); else what was not."""
    for name, p in model.official_parameters().items():
        if roles[name] is not Split.ROW:
            continue
        uses = [x for x, w in seen if w.data_ptr() == p.data_ptr()]
        n, k = full[name].shape
        if not uses or tuple(p.shape) != (n, k // tp) or any(x[-1] != k // tp for x in uses):
            return f"{name}: weight {tuple(p.shape)}, activations {uses} (whole [{n}, {k}])"
    return ""


def main() -> None:
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--ep", type=int, required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    par: ParallelContext = init_parallel(args.tp, args.ep)
    tag = f"TP={par.tp} EP={par.ep} DP={par.dp}"
    model_cfg, weights = load_checkpoint(args.checkpoint)
    model = MegatronK3Model(k3_transformer_config(model_cfg, par))
    reader = open_checkpoint(args.checkpoint)
    load_rank_shards(model, reader)
    held = sum(p.numel() * reader.dtype(n).itemsize for n, p in model.official_parameters().items()) + \
        sum(t.numel() * t.element_size() for t in model.passthrough.values())
    stored = sum(t.numel() * t.element_size() for t in weights.values())
    check(reader.bytes_read == held < stored,
          f"{tag}: this rank read {reader.bytes_read:,} of the checkpoint's {stored:,} bytes: its own shard only")

    exported = export_official(model)
    check(exported.keys() == weights.keys() and all(
        exported[n].dtype == weights[n].dtype and torch.equal(exported[n], weights[n]) for n in weights),
        f"{tag}: load then export returns every checkpoint tensor bit for bit")
    onto0 = export_official(model, onto_rank0=True)
    check(onto0.keys() == (exported.keys() if dist.get_rank() == 0 else set()) and all(
        onto0[n].dtype == exported[n].dtype and torch.equal(onto0[n], exported[n]) for n in onto0),
        f"{tag}: exported onto rank 0 alone, the same tensors bit for bit; nothing on the other ranks")

    seqs = sequences(par.dp_rank)
    batch = PaddedBatch.from_sequences(seqs)
    one_process = score_sequences(K3Forward(K3Weights.from_official(model_cfg.text, weights), INVARIANT), seqs,
                                  TEMPERATURE)
    trainer = wrap(model, lr=1e-3, clip_grad=CLIP_GRAD)
    lp, seen = multiplied(lambda: token_logprobs(trainer.model, batch, TEMPERATURE))
    check(all(torch.equal(lp[i, : len(s) - 1], one_process[i]) for i, s in enumerate(seqs)),
          f"{tag}: every token's log-prob equals the one-process forward (torch.equal)")
    bad = row_parallel_shares(model, seen, split_roles(model_cfg.text), par.tp, weights)
    check(not bad, f"{tag}: each row-parallel GEMM multiplies only this rank's K / TP share {bad}")
    lens = torch.tensor([len(s) for s in seqs])
    packed = PackedBatch(torch.tensor([t for s in seqs for t in s]), torch.cat([torch.zeros(1, dtype=torch.long),
                                                                             lens.cumsum(0)]))
    check(torch.equal(token_logprobs(trainer.model, packed, TEMPERATURE), lp[batch.mask()]),
          f"{tag}: packed batch equals padded batch (torch.equal)")

    ref_grads = reference_grads(model_cfg, weights, par.dp)
    before = {n: p.detach().clone() for n, p in model.official_parameters().items()}
    loss, grad_norm = train_step(trainer, lambda m: nll(token_logprobs(m, batch, TEMPERATURE), batch))
    roles = split_roles(model_cfg.text)
    clip = min(1.0, CLIP_GRAD / (grad_norm + 1.0e-6))  # Megatron's clip coefficient, applied to .grad in place
    worst = 0.0
    for name, p in model.official_parameters().items():
        want = shard(name, ref_grads[name], roles[name], par.tp_rank, par.tp) * clip
        worst = max(worst, float((p.grad - want).norm() / (want.norm() + 1e-12)))
    check(worst < 1e-4, f"{tag}: DDP-finalised, clipped gradients match the one-process ones (worst rel. {worst:.1e})")
    ref_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in ref_grads.values()))
    check(abs(grad_norm - ref_norm) < 1e-4 * ref_norm, f"{tag}: Megatron grad norm {grad_norm:.6f} = {ref_norm:.6f}")

    mem = rank_memory(model_cfg.text, par.tp, par.ep, dist.get_world_size())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    moments = sum(s[k].numel() for part in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
                  for s in part.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    check((trainable, frozen, moments) == (mem.gradients, mem.frozen, mem.adam),
          f"{tag}: this rank's parameters ({trainable:,} trained, {frozen:,} frozen) and Adam moments ({moments:,}) "
          f"are the counts `zerokl plan --dp` prints ({mem})")

    params = model.official_parameters()
    stuck = [n for n, p in params.items() if ref_grads[n].any() and torch.equal(p, before[n])]
    after = nll(token_logprobs(trainer.model, batch, TEMPERATURE), batch).detach()
    total = torch.stack([torch.as_tensor(loss), after])
    dist.all_reduce(total)
    check(not stuck and total[1] < total[0],
          f"{tag}: one Megatron Adam step moved every parameter with a gradient ({stuck[:1]} stuck), "
          f"summed loss {total[0]:.4f} -> {total[1]:.4f}")
    changed = export_official(model)
    path = save_official(model, args.out)
    if dist.get_rank() == 0:
        _, written = load_checkpoint(path)
        check(all(torch.equal(written[n], changed[n]) for n in changed), f"{tag}: saved checkpoint reloads bit for bit")

    state = Path(f"{args.out}-rank-weights")  # a state saved on several processes: each rank's part, nothing gathered
    if dist.get_rank() == 0:
        state.mkdir()
    dist.barrier()
    save_rank_weights(model, state)
    dist.barrier()
    trained = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    load_rank_weights(model, state)
    stored = sum(t.numel() for f in state.iterdir() for t in load_file(f).values())
    check(all(torch.equal(p, trained[n]) for n, p in params.items()) and
          stored == sum(t.numel() for t in changed.values()),
          f"{tag}: each rank's saved part reloads bit for bit, every tensor stored once over the ranks ({stored:,})")
    destroy_parallel(par)


if __name__ == "__main__":
    main()
