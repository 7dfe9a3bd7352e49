"""PPO with the rollout side and the trainer in their own processes, on their own devices: trainer ranks on GPUs
0..k-1 (a torchrun job: the Megatron trainer at `--tp` x `--ep`, data parallel over the rest), rollout ranks on GPUs
k.. (one process each). On a host without CUDA every process runs on the CPU and the groups use gloo.

The rollout side is the generation path the rollout model class runs inside vLLM (`bench/ppo_gpu.py:generate`:
`parity.model.K3Forward` on the invariant kernels, chunked prefill, MLA latents in a shuffled paged pool, decode).
Trainer rank 0 and the rollout ranks share one `parity.sync.group.StandaloneGroup` (NCCL on CUDA, gloo on CPU; the
trainer's world and Megatron's groups are its own). Per step:

1. every rollout rank generates its share of the step's prompts with the weights it holds, and broadcasts the
   tokens and each sampled token's log-prob (raw fp32 bits) to the group;
2. the trainer ranks score every sampled token (each data-parallel rank its contiguous share of the sequences); the
   step's KL(rollout || trainer) must be exactly 0, every log-prob `torch.equal`, or the run stops with a diagnosis;
3. one policy-gradient step (group-baseline advantages, mean over the step's tokens, whatever the layout);
4. the trainer's weights in their served form (`parity.weights.serving_weights`: bf16, MXFP4-packed experts where
   the checkpoint has them) go to every rollout rank as one versioned, checksummed `WeightBundle` through
   bucketed `TorchDistributed` broadcasts; each rollout rank verifies the bundle on its own device (names, shapes,
   dtypes, checksums, version) before it swaps the weights in.

The rollout side starts with no weights: version 1 is the trainer's initial weights.

    python bench/ppo_split.py --config configs/k3-1b.yaml --trainer-ranks 2 --rollout-ranks 2 --steps 20 --json OUT

Prints one line per step and a summary; exit 0 only if every step's KL is 0 and every sync verified.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from ppo_gpu import generate, prompts_for, reward  # noqa: E402

from parity.io.checkpoint import init_checkpoint, load_checkpoint  # noqa: E402
from parity.kernels import get_kernels  # noqa: E402
from parity.model import K3Forward, K3Weights  # noqa: E402
from parity.sync.bundle import TensorStore, WeightBundle  # noqa: E402
from parity.sync.group import StandaloneGroup, host_store  # noqa: E402
from parity.sync.transports import TorchDistributed  # noqa: E402
from parity.weights import serving_dtype, serving_weights, stored_specs  # noqa: E402
from trainer.logprobs import PaddedBatch, token_logprobs  # noqa: E402
from trainer.megatron.io import export_official  # noqa: E402
from trainer.megatron.parallel import destroy_parallel, init_parallel  # noqa: E402
from trainer.megatron.train import build_trainer, train_step  # noqa: E402

TRAINER = 0  # the trainer's rank 0 is rank 0 of the shared group; rollout rank i is rank i + 1


def cuda() -> bool:
    return torch.cuda.is_available()


# --- the shared group -----------------------------------------------------------------------------

def shared_group(rank: int, world: int, address: str) -> StandaloneGroup:
    host, port = address.rsplit(":", 1)
    return StandaloneGroup(host, int(port), rank, world, "nccl" if cuda() else "gloo", timeout_s=600,
                           launcher_store=True)


def link(group: StandaloneGroup, device: torch.device) -> TorchDistributed:
    return TorchDistributed(src=TRAINER, group=group, device=device)


def share_samples(group: StandaloneGroup, src: int, device: torch.device, samples: Any = None) -> dict[str, Any]:
    """Rollout rank `src`'s samples on every rank of the group: prompts and completions as an object, the sampled
    tokens' log-probs as one fp32 tensor (bits unchanged), returned on the CPU."""
    head = None
    if samples is not None:
        head = {"prompts": samples.prompts, "completions": samples.completions}
    head = group.broadcast_object(head, src, device)
    n = sum(len(c) for c in head["completions"])
    flat = torch.cat(samples.logprobs).float().to(device) if samples is not None else \
        torch.empty(n, dtype=torch.float32, device=device)
    group.broadcast(flat, src)
    head["logprobs"] = list(flat.cpu().split([len(c) for c in head["completions"]]))
    return head


# --- rollout ranks --------------------------------------------------------------------------------

def rollout_main(args: argparse.Namespace) -> None:
    """One rollout rank: receive version 1, then per step generate, share, receive the next version."""
    device = torch.device("cuda", 0) if cuda() else torch.device("cpu")  # its own GPU (CUDA_VISIBLE_DEVICES)
    cfg, _ = load_checkpoint(args.checkpoint)
    text = cfg.text
    group = shared_group(args.rollout_rank + 1, args.rollout_ranks + 1, args.address)
    expected = {n: (tuple(s.shape), serving_dtype(text, s)) for n, s in stored_specs(text).items()}
    store = TensorStore({n: torch.empty(shape, dtype=dt, device="meta") for n, (shape, dt) in expected.items()})
    kernels = get_kernels(args.kernels)
    store.apply(link(group, device).receive())
    for step in range(args.steps):
        with torch.device(device):
            fwd = K3Forward(K3Weights.from_official(text, store.tensors), kernels)
        mine = prompts_for(step, args.batch, text.vocab_size, args.seed)[args.rollout_rank::args.rollout_ranks]
        samples = generate(fwd, cfg, mine, args.max_tokens, args.temperature,
                           args.seed * 100_003 + step * 101 + args.rollout_rank, device)
        for r in range(args.rollout_ranks):
            share_samples(group, r + 1, device, samples if r == args.rollout_rank else None)
        verdict = group.broadcast_object(None, TRAINER, device)
        if verdict["stop"]:
            return
        store.apply(link(group, device).receive())
    group.close()


# --- trainer ranks --------------------------------------------------------------------------------

def my_share(n: int, dp: int, dp_rank: int) -> range:
    """The contiguous sequences data-parallel rank `dp_rank` trains on (shares differ in size by at most one)."""
    return range(dp_rank * n // dp, (dp_rank + 1) * n // dp)


def completion_logprobs(model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]],
                        temperature: float) -> list[torch.Tensor]:
    """The trainer's log-prob of each completion token (one padded forward over prompt + completion)."""
    batch = PaddedBatch.from_sequences([p + c for p, c in zip(prompts, completions)])
    lp = token_logprobs(model, batch, temperature)
    return [lp[r, len(p) - 1 : len(p) - 1 + len(c)] for r, (p, c) in enumerate(zip(prompts, completions))]


def trainer_main(args: argparse.Namespace) -> None:
    """One trainer rank (torchrun): build the Megatron trainer, send version 1, then per step gather the samples,
    check them, train, send the next version. Rank 0 prints and writes the metrics."""
    par = init_parallel(args.tp, args.ep)
    trainer = build_trainer(args.checkpoint, par, lr=args.lr, clip_grad=1.0, kernels=args.kernels)
    text = trainer.module.config.k3.text
    rank = dist.get_rank()
    group = shared_group(TRAINER, args.rollout_ranks + 1, args.address) if rank == 0 else None

    def send(version: int) -> tuple[float, int]:
        wait(par.device)
        t0 = time.perf_counter()
        served = serving_weights(text, export_official(trainer.module, compute_dtype=True))  # collective
        if group is None:
            return 0.0, 0
        bundle = WeightBundle.make(version, served)
        link(group, par.device).send(bundle)
        wait(par.device)
        return time.perf_counter() - t0, bundle.nbytes()

    send(1)
    metrics = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        box: list[Any] = [None]
        if group is not None:
            shares = [share_samples(group, r + 1, par.device) for r in range(args.rollout_ranks)]
            box[0] = {k: [x for s in shares for x in s[k]] for k in ("prompts", "completions", "logprobs")}
        dist.broadcast_object_list(box, src=0)
        samples = box[0]
        n = len(samples["prompts"])
        mine = my_share(n, par.dp, par.dp_rank)
        prompts = [samples["prompts"][i] for i in mine]
        completions = [samples["completions"][i] for i in mine]
        rollout_lp = [samples["logprobs"][i] for i in mine]
        with torch.no_grad():
            got = [x.cpu() for x in completion_logprobs(trainer.model, prompts, completions, args.temperature)]
        mine_check = (sum(int(torch.equal(a, b)) for a, b in zip(got, rollout_lp)),
                      max((float((a - b).abs().max()) for a, b in zip(got, rollout_lp)), default=0.0),
                      float(sum((b.double() - a.double()).sum() for a, b in zip(got, rollout_lp))))
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (par.tp_rank, mine_check))
        checked = [c for tp_rank, c in every if tp_rank == 0]  # TP peers score the same share
        equal, max_diff = sum(c[0] for c in checked), max(c[1] for c in checked)
        tokens = sum(map(len, samples["completions"]))
        kl = sum(c[2] for c in checked) / tokens
        stop = equal != n
        if group is not None:
            group.broadcast_object({"stop": stop}, TRAINER, par.device)
        if stop:
            raise SystemExit(f"step {step}: trainer != rollout on {n - equal}/{n} sequences, max |d logprob| "
                             f"{max_diff:.3e}, KL {kl:.3e} (TP = {par.tp}, EP = {par.ep}, DP = {par.dp})")
        rewards = torch.tensor([reward(c, text.vocab_size) for c in samples["completions"]])
        adv = (rewards - rewards.mean()).to(par.device)

        def loss_fn(model: torch.nn.Module) -> torch.Tensor:
            lp = completion_logprobs(model, prompts, completions, args.temperature)
            # Megatron's DDP averages gradients over DP ranks: times dp, this is the step's mean over all tokens
            return -sum((adv[i] * x).sum() for i, x in zip(mine, lp)) * par.dp / tokens

        loss, grad_norm = train_step(trainer, loss_fn)
        sync_s, sync_bytes = send(step + 2)
        m = dict(step=step, kl=kl, bitwise_equal_frac=equal / n, max_abs_logprob_diff=max_diff, sequences=n,
                 tokens=tokens, reward_mean=float(rewards.mean()), loss=loss, grad_norm=grad_norm,
                 sync_version=step + 2, sync_bytes=sync_bytes, sync_s=sync_s, step_s=time.perf_counter() - t0)
        metrics.append(m)
        if rank == 0:
            print(json.dumps(m), flush=True)
    if rank == 0:
        verdict = dict(steps=args.steps, kl_zero_steps=sum(m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0
                                                            for m in metrics),
                       trainer_ranks=dist.get_world_size(), tp=par.tp, ep=par.ep, dp=par.dp,
                       rollout_ranks=args.rollout_ranks, device=str(par.device), versions_sent=args.steps + 1)
        print(json.dumps(verdict), flush=True)
        Path(args.json).write_text(json.dumps(dict(verdict=verdict, metrics=metrics), indent=1))
        group.close()
    destroy_parallel(par)


def wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- driver ---------------------------------------------------------------------------------------

def role_argv(args: argparse.Namespace, role: str, checkpoint: Path, address: str, out: Path) -> list[str]:
    argv = [__file__, "--role", role, "--checkpoint", str(checkpoint), "--address", address, "--json", str(out)]
    for key in ("tp", "ep", "rollout_ranks", "steps", "batch", "max_tokens", "temperature", "lr", "seed", "kernels"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return argv


def driver(args: argparse.Namespace) -> int:
    """Start the trainer job and the rollout processes, wait for all, report."""
    k, r = args.trainer_ranks, args.rollout_ranks
    if cuda() and torch.cuda.device_count() < k + r:
        raise SystemExit(f"{k} trainer + {r} rollout ranks need {k + r} GPUs; this host has {torch.cuda.device_count()}")
    if k % args.tp or k % args.ep:
        raise SystemExit(f"--trainer-ranks {k} must be divisible by --tp {args.tp} and --ep {args.ep}")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(args.checkpoint) if args.checkpoint else \
            init_checkpoint(args.config, Path(tmp) / "ckpt", seed=args.seed, dtype=args.dtype)
        out = Path(args.json) if args.json else Path(tmp) / "report.json"
        store = host_store()  # the shared group's rendezvous, hosted here until every rank is done
        address = f"127.0.0.1:{store.port}"
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONWARNINGS": "ignore"}

        def devices(ids: range) -> dict[str, str]:
            return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, ids))} if cuda() else {}

        procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(k),
                                   "--standalone",
                                   *role_argv(args, "trainer", checkpoint, address, out)],
                                  env={**env, **devices(range(k))}, start_new_session=True)]
        procs += [subprocess.Popen([sys.executable, *role_argv(args, "rollout", checkpoint, address, out),
                                    "--rollout-rank", str(i)], env={**env, **devices(range(k + i, k + i + 1))},
                                   start_new_session=True) for i in range(r)]
        deadline = time.monotonic() + args.timeout
        codes = []
        try:
            for p in procs:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(f"timed out after {args.timeout} s")
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
        if any(c != 0 for c in codes):
            print(f"failed: exit codes {codes} (trainer job first, then the rollout ranks)", file=sys.stderr)
            return 1
        report = json.loads(out.read_text())
    v = report["verdict"]
    return 0 if v["kl_zero_steps"] == v["steps"] else 1


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3-1b.yaml", help="a fresh checkpoint of this config (seed --seed)")
    ap.add_argument("--checkpoint", help="use this checkpoint instead of --config")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="checkpoint and compute dtype (default: the "
                    "config's)")
    ap.add_argument("--trainer-ranks", type=int, default=1, help="trainer processes (GPUs 0..k-1)")
    ap.add_argument("--rollout-ranks", type=int, default=1, help="rollout processes (GPUs k..)")
    ap.add_argument("--tp", type=int, default=1, help="the trainer's tensor-parallel size")
    ap.add_argument("--ep", type=int, default=1, help="the trainer's expert-parallel size")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step, over all rollout ranks")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", default="invariant")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
    ap.add_argument("--json", help="write the metrics and the verdict here")
    ap.add_argument("--role", choices=["driver", "trainer", "rollout"], default="driver", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--rollout-rank", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.batch < args.rollout_ranks:
        ap.error(f"--batch {args.batch} gives a rollout rank no prompt (--rollout-ranks {args.rollout_ranks})")
    return args


def main() -> int:
    args = parse()
    if args.role == "rollout":
        rollout_main(args)
        return 0
    if args.role == "trainer":
        trainer_main(args)
        return 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
