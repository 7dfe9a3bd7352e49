"""Layout sweep: the K3 Megatron trainer under every TP x EP x DP layout that fits, against itself and the rollout side.

Layouts: TP in {1, 2, 4, 8} x EP in {1, 2, 4, 8} x DP in {1, 2} with world size W = TP * DP <= --max-world, EP
dividing W (Megatron folds EP into the TP x DP ranks, expert TP 1: `trainer.megatron.parallel`) and sizes the config
divides (`trainer.megatron.sharding.check_divisible`), on either kernel family.

Invariants (exit 1 if one fails):
1. forward: the trainer's log-probs of a fixed global batch (seeded sequences of uneven lengths) are bitwise equal
   (`torch.equal`) under every layout, and to the one-process parity forward (`parity.model.score_sequences`);
2. zero KL: at every step of every layout the rollout side (`K3Forward` on the trainer's exported weights in the form
   a weight sync carries, `parity.weights.serving_weights`) gives every token the trainer's log-prob bit for bit; the
   sweep stops at the first step where it does not, naming the layout, the step, the tokens that differ and the
   max |diff|.
Reported: after each update, the classes of layouts with bitwise-equal weights and with bitwise-equal applied gradients
(DDP-reduced, clipped; `parity.sync.checksum.checksum` of every whole tensor), the first tensor where a class differs
from the first class, the smallest set of sizes among (tp, ep, dp) that fixes the class (the rule), for each pair
of layouts differing in one size the gradients that size left equal, and each layout's gradient drift: its step-0
gradients (same weights, same loss) against the first layout's, ||g - g0|| / ||g0|| and the worst tensor's, which
tells rounding (other reduction orders) from a wrong gradient.

Every layout optimises the same function, the mean token NLL over the global batch: DP rank r trains on its contiguous
share of the sequences (its TP peers on the same share) with loss -(its tokens' log-prob sum) * DP / (global tokens);
Megatron's DDP scales gradients by 1 / DP before summing them over DP ranks, so every token's gradient seed has the same
bits in every layout (DP = 1 or 2: exact).

Findings (k3-tiny on CPU over gloo, invariant kernels, lr 1e-3, fp32 and bf16 checkpoints, W <= 2 and, fp32, W <= 4:
11 layouts): the forward is bitwise and the KL exactly 0 at every step of every layout; but no two layouts hold equal
weights after any update, with clipping on (--clip-grad 1: the grad norm is about 45, every step clips) or off
(--clip-grad 1e9). They compute the same gradient up to rounding: the step-0 gradient drift against TP = EP = DP = 1
is at most 1.2e-6 in fp32 (worst tensor 7.5e-6; DP alone 9e-8 on one host, 1.1e-6 for its worst tensor on another)
and 2.3e-2 in bf16, where activations are rounded to bf16 between ops (worst tensor 5.9e-2, a KDA gate's dt_bias; DP
alone 5e-8). What DP does is checked in bits (`dp_split` in the report): at step 0 each DP = 2 rank's local gradients
equal one process's gradients of its sequences alone, and the reduced gradients are exactly their sum, each scaled by
1 / 2: DP only adds two partial sums where one process sums once. Each size changes the gradients, each at its own place (first backward, clipping off, seen in which
gradients a one-size neighbour keeps):
- TP: the forward never splits a reduction differently (row-parallel partials are whole segments of the invariant GEMM,
  added in its fixed pairwise order), but the backward does: the input gradient of a vocab- or column-split GEMM is a
  sum over the split dim, formed as TP partial sums and all-reduced (`copy_to` in `ParallelK3Forward`), and
  REGION_REPLICATED weights' gradients are summed over TP. lm_head's own gradient keeps its bits (rows are whole); the
  final norm and everything before it do not.
- EP: a token's k slot gradients at the routed experts' input come back from the owning ranks and are added in one
  indexed accumulation in slot order, where the one-process `experts_combine` accumulates them expert by expert through
  autograd: other additions from the last MoE layer's latent input down. The router's ids are sorted and EP owners are
  contiguous, so every EP > 1 adds them alike; between EP sizes (at a fixed W) only the expert weights' gradients
  differ, because the expert data-parallel group (W / EP ranks holding the same expert, each with part of its rows)
  changes size and DDP adds their partial sums. With one expert-DP rank the expert gradients keep the one-process
  bits (rows arrive in token order).
- DP: DDP adds the DP ranks' partial weight gradients (each a reduction over its share of the tokens), where one rank
  reduces over all tokens in one GEMM: every weight gradient that both shares feed changes, lm_head's included.
- Clipping on: Megatron's grad norm is reduced over the model-parallel ranks (another grouping of the squared sums) and
  every gradient is multiplied by clip / (norm + 1e-6); where two layouts' norms differ beyond that coefficient's
  rounding (here the TP pairs, and EP at TP = 2) no gradient keeps its bits, lm_head's included. It spreads the
  difference; it does not create the classes (they are the same with clipping off).
Negative control: --kernels fast breaks invariant 1 at DP = 2 and the KL check under EP (batch-dependent GEMMs).

Run (the driver: writes the checkpoint, then for each world size one torchrun of this file with --worker running that
size's layouts in sequence over one process group; one line per layout as it finishes, then the summary):
    python bench/layouts.py --config configs/k3-tiny.yaml --max-world 2 --steps 2 --json OUT.json
On a CUDA host each rank takes GPU LOCAL_RANK (NCCL, NVLink multicast off in the workers' environment) and the Triton
invariant kernels (--kernels invariant); --max-world defaults to the number of GPUs (2 on a CPU host). Beside --json,
OUT.logprobs.pt holds every layout's step-0 log-probs and the one-process reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")  # megatron-core on CPU

from parity.compare import SequenceLogprobs, compare  # noqa: E402
from parity.config import ModelConfig, TextConfig  # noqa: E402
from parity.io.checkpoint import init_checkpoint, load_checkpoint  # noqa: E402
from parity.kernels import get_kernels  # noqa: E402
from parity.model import K3Forward, K3Weights, score_sequences  # noqa: E402
from parity.sync.bundle import checksums as tensor_checksums  # noqa: E402
from parity.weights import master_weights, serving_weights  # noqa: E402
from sync_x2 import NO_MULTICAST  # noqa: E402
from trainer.logprobs import PaddedBatch, token_logprobs  # noqa: E402
from trainer.megatron.io import export_official  # noqa: E402
from trainer.megatron.modules import MegatronK3Model  # noqa: E402
from trainer.megatron.parallel import ParallelContext, destroy_parallel, init_parallel  # noqa: E402
from trainer.megatron.sharding import check_divisible  # noqa: E402
from trainer.megatron.train import build_model, train_step, wrap  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402

SIZES = (1, 2, 4, 8)  # TP and EP sizes tried
DP_SIZES = (1, 2)
TEMPERATURE = 0.7
SIZE_KEYS = ("tp", "ep", "dp")


@dataclass(frozen=True)
class Layout:
    tp: int
    ep: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def tag(self) -> str:
        return f"tp{self.tp}-ep{self.ep}-dp{self.dp}"

    @classmethod
    def parse(cls, tag: str) -> Layout:
        tp, ep, dp = (int(part[2:]) for part in tag.split("-"))
        return cls(tp, ep, dp)


def layouts(text: TextConfig, max_world: int) -> list[Layout]:
    """Every layout that fits `max_world` ranks and the config, by world size, then TP, then EP."""
    out = []
    for tp, ep, dp in itertools.product(SIZES, SIZES, DP_SIZES):
        if tp * dp > max_world or (tp * dp) % ep:
            continue
        try:
            check_divisible(text, tp, ep)
        except ValueError:
            continue
        out.append(Layout(tp, ep, dp))
    return sorted(out, key=lambda lay: (lay.world, lay.tp, lay.ep))


def global_batch(vocab: int, batch: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """The seeded global batch: `batch` sequences of lengths drawn in [min_len, max_len], ids in [4, vocab)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (batch,), generator=g).tolist()
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]


# --- worker (one rank of one world size) --------------------------------------------------------------------------

@dataclass
class Share:
    """One rank's view of a step: its DP rank, the global index of its first sequence, the trainer's and the rollout
    side's log-probs of its sequences (CPU), its loss."""

    dp_rank: int
    first: int
    trainer: list[torch.Tensor]
    rollout: list[torch.Tensor]
    loss: float


def rollout_logprobs(cfg: ModelConfig, weights: dict[str, torch.Tensor], seqs: list[list[int]], kernels: str,
                     device: torch.device) -> list[torch.Tensor]:
    """The parity forward's log-probs of `seqs` on `weights` (official names), on `device`, as CPU tensors."""
    with torch.device(device):
        fwd = K3Forward(K3Weights.from_official(cfg.text, weights), get_kernels(kernels))
        return [lp.cpu() for lp in score_sequences(fwd, seqs, TEMPERATURE)]


def run_layout(layout: Layout, cfg: ModelConfig, stored: dict[str, torch.Tensor], seqs: list[list[int]],
               args: argparse.Namespace) -> dict[str, Any]:
    """`args.steps` training steps at `layout` (collective: every rank calls); the result (on every rank): step-0
    log-probs of the global batch, per step the zero-KL check, loss, grad norm and (rank 0) the checksums of the
    weights after the update and of the gradients it applied; stops after a step whose KL check fails (`failure`)."""
    t0 = time.perf_counter()
    par: ParallelContext = init_parallel(layout.tp, layout.ep)
    try:
        if (par.tp, par.ep, par.dp) != (layout.tp, layout.ep, layout.dp):
            raise RuntimeError(f"{layout.tag}: Megatron built TP={par.tp} EP={par.ep} DP={par.dp}")
        per = len(seqs) // par.dp
        first = par.dp_rank * per
        mine = seqs[first : first + per]
        batch = PaddedBatch.from_sequences(mine)
        tokens = sum(len(s) - 1 for s in seqs)
        module = build_model(cfg, master_weights(cfg.text, stored), par, args.kernels)
        trainer = wrap(module, args.lr, args.clip_grad)
        weights = export_official(module, compute_dtype=True)
        result: dict[str, Any] = {**asdict(layout), "device": str(par.device), "steps": [], "failure": None}
        for step in range(args.steps):
            rollout = rollout_logprobs(cfg, serving_weights(cfg.text, weights), mine, args.kernels, par.device)
            trained: list[torch.Tensor] = []

            def loss_fn(model: torch.nn.Module) -> torch.Tensor:
                lp = token_logprobs(model, batch, TEMPERATURE)
                trained.append(lp.detach())
                return -lp.sum() * (par.dp / tokens)

            if step == 0 and layout.tp == layout.ep == 1 and layout.dp <= 2:  # DP = 2 against its shares alone
                if layout.dp == 1:
                    result["dp_split"] = {"shares": [
                        local_gradients(trainer, module, lambda m, p=part: share_loss(m, p, 2, tokens))
                        for part in (seqs[: len(seqs) // 2], seqs[len(seqs) // 2 :])]}
                    loss, grad_norm = train_step(trainer, loss_fn)
                else:
                    loss, grad_norm, result["dp_split"] = reduced_step(trainer, module, loss_fn, par.dp)
            else:
                loss, grad_norm = train_step(trainer, loss_fn)
            share = Share(par.dp_rank, first, [row[: len(s) - 1].cpu() for row, s in zip(trained[0], mine)], rollout,
                          loss)
            shares: list[Share] = [None] * dist.get_world_size()  # type: ignore[list-item]
            dist.all_gather_object(shares, share)
            kl = kl_check(shares, seqs)
            grads = export_official(Gradients(module), compute_dtype=True)  # type: ignore[arg-type]
            weights = export_official(module, compute_dtype=True)
            result["steps"].append({
                "step": step, "loss": sum(s.loss for s in _one_per_dp_rank(shares)) / par.dp, "grad_norm": grad_norm,
                "clipped": args.clip_grad / (grad_norm + 1.0e-6) < 1.0,  # Megatron's test (optimizer/clip_grads.py)
                "kl": kl, **({"weights": tensor_checksums(weights), "gradients": tensor_checksums(grads)}
                             if dist.get_rank() == 0 else {})})
            if step == 0:
                result["logprobs"] = [lp for s in _one_per_dp_rank(shares) for lp in s.trainer]
                if dist.get_rank() == 0:
                    result["gradient_drift"] = gradient_drift(grads, args.out / "step0-gradients.pt", layout.tag)
            if kl["bitwise_equal"] != kl["tokens"]:
                result["failure"] = (f"{layout.tag} step {step}: {kl['tokens'] - kl['bitwise_equal']} of "
                                     f"{kl['tokens']} token log-probs differ between trainer and rollout side, "
                                     f"max |diff| {kl['max_abs_diff']:.3e}, KL k1 {kl['kl_k1']:.3e}")
                break
        result["seconds"] = time.perf_counter() - t0
        return result
    finally:
        destroy_parallel(par)


def share_loss(model: torch.nn.Module, seqs: list[list[int]], dp: int, tokens: int) -> torch.Tensor:
    """A DP rank's loss on its sequences `seqs`: -(their token log-prob sum) * dp / (global tokens)."""
    return -token_logprobs(model, PaddedBatch.from_sequences(seqs), TEMPERATURE).sum() * (dp / tokens)


def _local(module: MegatronK3Model) -> dict[str, torch.Tensor]:
    """Each official parameter's gradient in the DDP buffer (`main_grad`), copied."""
    return {n: p.main_grad.detach().clone() for n, p in module.official_parameters().items()}


def local_gradients(trainer: Any, module: MegatronK3Model, loss_fn: Callable[[Any], torch.Tensor]) -> dict[str, str]:
    """The checksums of this process's gradients of `loss_fn` at the current weights (one backward into an emptied
    DDP buffer, no reduction, no update); the buffer is emptied again after."""
    trainer.model.zero_grad_buffer()
    loss_fn(trainer.model).backward()
    out = tensor_checksums(_local(module))
    trainer.model.zero_grad_buffer()
    return out


def reduced_step(trainer: Any, module: MegatronK3Model, loss_fn: Callable[[Any], torch.Tensor],
                 dp: int) -> tuple[float, float, dict[str, Any]]:
    """`train_step` with one loss, its DP reduction checked in bits (collective): each rank's local gradients (their
    checksums, by DP rank) and whether the reduced gradients equal, bit for bit, the ranks' local ones each scaled by
    1 / dp (Megatron's pre-scaling, exact for dp a power of two) and added in fp32 (two ranks: one addition, in either
    order the same bits)."""
    trainer.model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    loss = loss_fn(trainer.model)
    loss.backward()
    mine = _local(module)
    every: list[dict[str, torch.Tensor]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(every, {n: t.cpu() for n, t in mine.items()})
    finalize_model_grads([trainer.model])
    reduced = {n: p.main_grad.detach().cpu() for n, p in module.official_parameters().items()}
    expected = {n: every[0][n] * (1.0 / dp) + every[1][n] * (1.0 / dp) for n in reduced}
    ok, grad_norm, _ = trainer.optimizer.step()
    if not ok:
        raise RuntimeError("Megatron optimizer step reported failure")
    return float(loss.detach()), float(grad_norm), {
        "shares": [tensor_checksums(g) for g in every[:dp]],
        "reduced_is_scaled_sum": all(torch.equal(reduced[n], expected[n]) for n in reduced)}


class Gradients:
    """A trained `MegatronK3Model` seen through its parameters' gradients as the optimizer used them (DDP-reduced,
    clipped; zeros where none) for `export_official`, which then gathers whole gradients onto every rank."""

    def __init__(self, module: MegatronK3Model):
        self.module = module
        self.config = module.config
        self.passthrough: dict[str, torch.Tensor] = {}

    def official_parameters(self) -> dict[str, torch.Tensor]:
        return {n: torch.zeros_like(p) if p.grad is None else p.grad
                for n, p in self.module.official_parameters().items()}

    def vision_parameters(self) -> dict[str, torch.Tensor]:
        return {}


def gradient_drift(grads: dict[str, torch.Tensor], first_file: Path, tag: str) -> dict[str, Any]:
    """This layout's step-0 gradients against the first layout's (which saves them to `first_file`): the same weights
    and the same loss, so only the rounding of other reduction orders separates them. Returns the relative difference
    ||g - g0|| / ||g0|| over all tensors and the tensor where it is largest (float64 sums)."""
    mine = {n: t.detach().cpu() for n, t in grads.items()}
    if not first_file.exists():
        torch.save({"layout": tag, "gradients": mine}, first_file)
        return {"against": tag, "relative": 0.0, "worst_tensor": None, "worst_relative": 0.0}
    first = torch.load(first_file, weights_only=True)
    diff2 = norm2 = 0.0
    worst, worst_rel = None, 0.0
    for n, g0 in first["gradients"].items():
        d2 = float((mine[n].double() - g0.double()).pow(2).sum())
        n2 = float(g0.double().pow(2).sum())
        diff2, norm2 = diff2 + d2, norm2 + n2
        rel = math.sqrt(d2 / n2) if n2 else (math.inf if d2 else 0.0)
        if rel > worst_rel:
            worst, worst_rel = n, rel
    return {"against": first["layout"], "relative": math.sqrt(diff2 / norm2), "worst_tensor": worst,
            "worst_relative": worst_rel}


def _one_per_dp_rank(shares: list[Share]) -> list[Share]:
    """The first rank's share of each DP rank, in DP order (TP peers hold the same sequences)."""
    seen: dict[int, Share] = {}
    for s in shares:
        seen.setdefault(s.dp_rank, s)
    return [seen[r] for r in sorted(seen)]


def kl_check(shares: list[Share], seqs: list[list[int]]) -> dict[str, Any]:
    """Trainer vs rollout log-probs of every rank's sequences (`parity.compare.compare`; TP peers' copies counted too):
    tokens, bitwise-equal tokens, max |diff|, KL estimate k1."""
    rollout, trainer = [], []
    for rank, s in enumerate(shares):
        for i, (a, b) in enumerate(zip(s.rollout, s.trainer)):
            ids = seqs[s.first + i][1:]
            rollout.append(SequenceLogprobs(f"{rank}:{i}", ids, a))
            trainer.append(SequenceLogprobs(f"{rank}:{i}", ids, b))
    rep = compare(rollout, trainer)
    return {"tokens": rep.tokens, "bitwise_equal": rep.bitwise_equal, "max_abs_diff": rep.max_abs_diff,
            "kl_k1": rep.kl_k1}


def worker(args: argparse.Namespace) -> int:
    """Run `args.layouts` in sequence over one process group; rank 0 saves each result as OUT/<tag>.pt (the one-process
    reference log-probs with it). Exits 1 after a failed KL check."""
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")  # kept up across layouts
    cfg, stored = load_checkpoint(args.checkpoint)
    seqs = global_batch(cfg.text.vocab_size, args.batch, args.min_len, args.max_len, args.seed)
    reference = None
    failed = False
    for tag in args.layouts:
        result = run_layout(Layout.parse(tag), cfg, stored, seqs, args)
        if dist.get_rank() == 0:
            if reference is None:
                device = torch.device(result["device"])
                reference = rollout_logprobs(cfg, {n: t.to(device) for n, t in stored.items()}, seqs, args.kernels,
                                             device)
            tmp = args.out / f"{tag}.pt.tmp"
            torch.save({**result, "reference": reference}, tmp)
            tmp.replace(args.out / f"{tag}.pt")
        if result["failure"]:
            failed = True
            break
    dist.destroy_process_group()
    return 1 if failed else 0


# --- driver -------------------------------------------------------------------------------------------------------

def launch(world: int, group: list[Layout], ckpt: Path, out: Path, args: argparse.Namespace,
           on_result: Callable[[dict[str, Any]], None]) -> int:
    """One torchrun of `world` ranks running `group`; `on_result(result)` for each layout file as it appears. Returns
    torchrun's exit status (its log's tail printed unless a layout reported the failure); on timeout (status -9) or
    an interrupt torchrun is stopped with its workers."""
    forwarded = [f"--{k.replace('_', '-')}={getattr(args, k)}"
                 for k in ("steps", "batch", "min_len", "max_len", "seed", "lr", "clip_grad", "kernels")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           __file__, "--worker", "--checkpoint", str(ckpt), "--out", str(out), *forwarded,
           "--layouts", *(lay.tag for lay in group)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(NO_MULTICAST if torch.cuda.is_available() else {})}
    log = out / f"world{world}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    pending = list(group)
    reported = False
    deadline = time.monotonic() + args.timeout
    try:
        while True:
            rc = proc.poll()
            for lay in [lay for lay in pending if (out / f"{lay.tag}.pt").exists()]:
                pending.remove(lay)
                result = torch.load(out / f"{lay.tag}.pt", weights_only=True)
                reported |= result["failure"] is not None
                on_result(result)
            if rc is not None:
                break
            if time.monotonic() > deadline:
                print(f"world {world}: timed out after {args.timeout:.0f} s", flush=True)
                rc = -9
                break
            time.sleep(0.5)
    finally:  # timeout or interrupt: torchrun stops its workers (their own sessions) on SIGTERM
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0 and not reported:
        print(f"world {world} exited {rc}; log tail:\n{log.read_text()[-4000:]}", flush=True)
    return rc


def bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def classes_of(results: list[dict[str, Any]], step: int, what: str) -> list[list[dict[str, Any]]]:
    """The layouts that reached `step`, grouped by bitwise-equal `what` ("weights" after the update, or the
    "gradients" it applied): every tensor's checksum equal."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        if len(r["steps"]) > step:
            groups.setdefault(tuple(sorted(r["steps"][step][what].items())), []).append(r)
    return list(groups.values())


def rule(classes: list[list[dict[str, Any]]]) -> list[str] | None:
    """The smallest set of SIZE_KEYS whose values determine the class (layouts agree on them <=> same class), or None
    when no set does."""
    for n in range(len(SIZE_KEYS) + 1):
        for keys in itertools.combinations(SIZE_KEYS, n):
            values = [{tuple(r[k] for k in keys) for r in c} for c in classes]
            if all(len(v) == 1 for v in values) and len({v.pop() for v in values}) == len(classes):
                return list(keys)
    return None


def _tag(r: dict[str, Any]) -> str:
    return Layout(r["tp"], r["ep"], r["dp"]).tag


def _differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    return [n for n in a if a[n] != b[n]]


def describe(classes: list[list[dict[str, Any]]], step: int, what: str) -> list[dict[str, Any]]:
    """Each class's layouts, and how many tensors differ from the first class's, the first in export order."""
    ref = classes[0][0]["steps"][step][what]
    out = []
    for c in classes:
        differ = _differing(c[0]["steps"][step][what], ref)
        out.append({"layouts": [_tag(r) for r in c], "tensors_differing_from_first_class": len(differ),
                    "first_differing_tensor": differ[0] if differ else None})
    return out


def neighbours(reached: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """Each pair of layouts that differ in one size only, at `step`: how many weights and gradients differ, the last
    differing gradient in export order (nearest the loss: lm_head is last), and the gradients still equal among those
    not equal in every layout (expert indices folded): how far back from the loss that size leaves the bits alone."""
    grads = [r["steps"][step]["gradients"] for r in reached]
    varying = [n for n in grads[0] if len({g[n] for g in grads}) > 1]
    out = []
    for a, b in itertools.combinations(reached, 2):
        changed = [k for k in SIZE_KEYS if a[k] != b[k]]
        if len(changed) != 1:
            continue
        ga, gb = a["steps"][step]["gradients"], b["steps"][step]["gradients"]
        differ = _differing(ga, gb)
        equal = [re.sub(r"\.experts\.\d+\.", ".experts.*.", n) for n in varying if ga[n] == gb[n]]
        out.append({"layouts": [_tag(a), _tag(b)], "size": changed[0],
                    "weights_differing": len(_differing(a["steps"][step]["weights"], b["steps"][step]["weights"])),
                    "gradients_differing": len(differ), "last_differing_gradient": differ[-1] if differ else None,
                    "equal_gradients": list(dict.fromkeys(equal))})
    return out


def summary(results: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Forward and KL verdicts per layout; per step the classes of equal weights and of equal gradients (with the
    first tensor where each class differs from the first class), their rules and the one-size neighbours."""
    first = results[0]["logprobs"]
    rows = [{"layout": _tag(r), "world": r["tp"] * r["dp"], "device": r["device"],
             "forward_equals_one_process": bits_equal(r["logprobs"], r["reference"]),
             "forward_equals_first_layout": bits_equal(r["logprobs"], first),
             "kl_zero_steps": sum(s["kl"]["bitwise_equal"] == s["kl"]["tokens"] for s in r["steps"]),
             "kl": [s["kl"] for s in r["steps"]], "losses": [s["loss"] for s in r["steps"]],
             "grad_norms": [s["grad_norm"] for s in r["steps"]], "clipped": [s["clipped"] for s in r["steps"]],
             "gradient_drift": r["gradient_drift"], "failure": r["failure"], "seconds": r["seconds"]}
            for r in results]
    per_step = []
    for step in range(steps):
        weights = classes_of(results, step, "weights")
        if not weights:
            break
        gradients = classes_of(results, step, "gradients")
        per_step.append({"step": step,
                         "weight_classes": describe(weights, step, "weights"), "weight_rule": rule(weights),
                         "gradient_classes": describe(gradients, step, "gradients"), "gradient_rule": rule(gradients),
                         "neighbours": neighbours([r for c in weights for r in c], step)})
    return {"layouts": rows, "steps": per_step, "dp_split": dp_split(results)}


def dp_split(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What DP = 2 does to the step-0 gradients, in bits (None unless both tp1-ep1-dp1 and tp1-ep1-dp2 ran): each DP
    rank's local gradients equal one process's gradients of that rank's sequences alone, and the reduced ones are
    their scaled sum."""
    by_tag = {_tag(r): r.get("dp_split") for r in results}
    one, two = by_tag.get("tp1-ep1-dp1"), by_tag.get("tp1-ep1-dp2")
    if one is None or two is None:
        return None
    return {"tensors": len(two["shares"][0]), "shares_differ": two["shares"][0] != two["shares"][1],
            "shares_equal_one_process": one["shares"] == two["shares"],
            "reduced_is_scaled_sum": two["reduced_is_scaled_sum"]}


def driver(args: argparse.Namespace) -> int:
    """Write (or take) the checkpoint, run every world size's layouts, print and write the report; 0 iff every forward
    is bitwise and every KL check passed."""
    if (args.config is None) == (args.checkpoint is None):
        raise SystemExit("give --config (a checkpoint is written) or --checkpoint")
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    if args.batch % max(DP_SIZES):
        raise SystemExit(f"--batch must be divisible by every DP size {DP_SIZES}")
    max_world = args.max_world or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or init_checkpoint(args.config, Path(tmp) / "ckpt", seed=args.seed, dtype=args.dtype)
        cfg, _ = load_checkpoint(ckpt)
        todo = layouts(cfg.text, max_world)
        print(f"{len(todo)} layouts on up to {max_world} ranks: {' '.join(lay.tag for lay in todo)}", flush=True)
        results: list[dict[str, Any]] = []

        def on_result(r: dict[str, Any]) -> None:
            results.append(r)
            ok = bits_equal(r["logprobs"], r["reference"])
            steps = " ".join(f"[{s['step']}] kl_equal {s['kl']['bitwise_equal']}/{s['kl']['tokens']} "
                             f"norm {s['grad_norm']:.6g}{' clipped' if s['clipped'] else ''}" for s in r["steps"])
            drift = r["gradient_drift"]
            print(f"{_tag(r):14} forward {'bitwise' if ok else 'DIFFERS'} | {steps} | step-0 gradients vs "
                  f"{drift['against']}: {drift['relative']:.1e} (worst {drift['worst_tensor']} "
                  f"{drift['worst_relative']:.1e}) | {r['seconds']:.1f} s", flush=True)
            if r["failure"]:
                print(f"STOP: {r['failure']}", flush=True)

        rc = 0
        for world in sorted({lay.world for lay in todo}):
            group = [lay for lay in todo if lay.world == world]
            rc = launch(world, group, Path(ckpt), Path(tmp), args, on_result)
            if rc != 0:
                break
    report = summary(results, args.steps) if results else {"layouts": [], "steps": []}
    report.update(config=args.config, checkpoint=args.checkpoint, args=vars(args), worker_exit=rc,
                  layouts_planned=[lay.tag for lay in todo])
    print_summary(report)
    if args.json:
        logprobs_file = args.json.with_suffix(".logprobs.pt")
        torch.save({"reference": results[0]["reference"] if results else None,
                    **{_tag(r): r["logprobs"] for r in results}}, logprobs_file)
        report["logprobs_file"] = str(logprobs_file)
        args.json.write_text(json.dumps(report, indent=1, default=str))
    rows = report["layouts"]
    ok = (rc == 0 and len(rows) == len(todo)
          and all(r["forward_equals_one_process"] and r["forward_equals_first_layout"] for r in rows)
          and all(r["kl_zero_steps"] == args.steps for r in rows))
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


def print_summary(report: dict[str, Any]) -> None:
    print(f"\n{'layout':14} {'W':>2} {'fwd=1proc':>9} {'fwd=first':>9} {'KL=0 steps':>10} {'grad drift':>10}  "
          "grad norms", flush=True)
    for r in report["layouts"]:
        norms = " ".join(f"{n:.6g}{'*' if c else ''}" for n, c in zip(r["grad_norms"], r["clipped"]))
        print(f"{r['layout']:14} {r['world']:>2} {str(r['forward_equals_one_process']):>9} "
              f"{str(r['forward_equals_first_layout']):>9} {r['kl_zero_steps']:>10} "
              f"{r['gradient_drift']['relative']:>10.1e}  {norms}")
    print("(grad drift: ||g - g0|| / ||g0|| of the step-0 gradients against the first layout's)")
    print("(* = clipped)")
    if report.get("dp_split"):
        split = report["dp_split"]
        print(f"DP = 2, step 0: each rank's local gradients equal one process's on its sequences alone: "
              f"{split['shares_equal_one_process']}; the reduced gradients are their scaled sum, bit for bit: "
              f"{split['reduced_is_scaled_sum']}")
    for s in report["steps"]:
        for what in ("weight", "gradient"):
            keys = s[f"{what}_rule"]
            print(f"{what}s of step {s['step']}: {len(s[f'{what}_classes'])} class(es), equal <=> "
                  f"{'same ' + ', '.join(keys) if keys else 'always' if keys == [] else 'no rule in tp, ep, dp'}")
            for c in s[f"{what}_classes"]:
                where = (f": {c['tensors_differing_from_first_class']} tensors differ from the first class, first "
                         f"{c['first_differing_tensor']}" if c["first_differing_tensor"] else "")
                print(f"  {' '.join(c['layouts'])}{where}")
        for n in s["neighbours"]:
            equal = n["equal_gradients"]
            print(f"  {n['size']} only, {' vs '.join(n['layouts'])}: {n['weights_differing']} weights and "
                  f"{n['gradients_differing']} gradients differ, the last {n['last_differing_gradient']}; gradients "
                  f"still equal: {', '.join(equal[:3]) or '-'}{f' (+{len(equal) - 3})' if len(equal) > 3 else ''}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="model config: a seeded checkpoint is written from it")
    ap.add_argument("--checkpoint", type=Path, help="an official checkpoint directory (instead of --config)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="with --config: the checkpoint's dtype "
                    "(default: the config's)")
    ap.add_argument("--seed", type=int, default=0, help="checkpoint and batch seed")
    ap.add_argument("--max-world", type=int, help="most ranks (default: the CUDA devices, or 2 on CPU)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="sequences in the global batch (even)")
    ap.add_argument("--min-len", type=int, default=6)
    ap.add_argument("--max-len", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip-grad", type=float, default=1.0, help="Megatron's grad-norm clip (large: no clipping)")
    ap.add_argument("--kernels", default="invariant")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per world size's torchrun")
    ap.add_argument("--json", type=Path, help="the report; OUT.logprobs.pt beside it holds the step-0 log-probs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layouts", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
