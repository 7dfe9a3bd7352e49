"""The GPU path end to end on one GPU: the Megatron trainer on CUDA against generation through the rollout model code.

vLLM cannot run on this machine, so generation runs the code the rollout model class runs inside vLLM
(`parity.model.K3Forward` on the same kernels, MLA latents in a shuffled paged pool read in place by the paged
attention kernel (`rollout.generate.paged_pool`), the chunked KDA state) with vLLM's schedule: chunked prefill of a batch of
prompts of different lengths, then batched decode, seeded Gumbel-max sampling at a temperature. The trainer is
`trainer.megatron` (Megatron DDP + Adam, fp32 masters) on the same GPU, forward on the Triton kernels, backward
through the torch invariant kernels' `autograd.Function`s (`parity.kernels.triton.autograd`).

Per step: generate -> the trainer's log-probs of every sampled token must equal generation's bit for bit (KL = 0; the
run stops otherwise) -> a group-baseline policy-gradient step -> sync into the generator (`zerokl ppo`'s in-process
path: `parity.sync.serving.ServingBuffer` writes the serving form, MXFP4 experts packed and bf16 elsewhere, into one
flat buffer; a `TensorStore` copies, verifies and swaps it in). A second trainer resumes from the step-`--resume-at` state (weights,
optimizer, sampling seeds) and must end with the same weights and metrics bit for bit.

    python bench/ppo_gpu.py --config configs/k3-1b.yaml --steps 20 --resume-at 10 --json OUT.json

Prints one line per step and a summary; exit 0 only if every step is bitwise and the resume reproduces the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.config import ModelConfig  # noqa: E402
from parity.io.checkpoint import init_checkpoint, load_checkpoint  # noqa: E402
from parity.kernels import get_kernels  # noqa: E402
from parity.caches import MLACache, new_cache  # noqa: E402
from parity.model import K3Forward, K3Weights  # noqa: E402
from parity.sync.bundle import TensorStore  # noqa: E402
from parity.sync.serving import ServingBuffer  # noqa: E402
from parity.sync.transports import Memory, WeightSync  # noqa: E402
from rollout.generate.decode_graph import GraphedDecode  # noqa: E402
from rollout.generate.paged_pool import PagedLatentPool  # noqa: E402
from trainer.logprobs import PaddedBatch, token_logprobs  # noqa: E402
from trainer.megatron.backend import MegatronBackend  # noqa: E402

BLOCK = 16  # paged latent block size
PREFILL_CHUNK = 48  # chunked prefill: not a multiple of the KDA chunk (64), so chunks end mid-chunk


@dataclass
class Samples:
    prompts: list[list[int]]
    completions: list[list[int]]
    logprobs: list[torch.Tensor]  # fp32 [max_tokens] per sequence, as generation computed them


def prefill(fwd: K3Forward, cfg: ModelConfig, prompts: list[list[int]], max_tokens: int,
            seed: int, device: torch.device | str = "cuda") -> tuple[list, torch.Tensor]:
    """Chunked prefill of all prompts together (rows with fewer tokens left carry fewer, or none) into new caches on
    `device` (MLA latents in a shuffled paged pool with room for `max_tokens` more) -> (caches, logits of each
    prompt's last token [B, V])."""
    text = cfg.text
    b = len(prompts)
    longest = max(map(len, prompts)) + max_tokens
    caches = [PagedLatentPool.for_config(text, b, BLOCK, -(-longest // BLOCK) + 1, device,
                                         torch.Generator().manual_seed(seed))
              if isinstance(c, MLACache) else c for c in new_cache(text, b)]
    done = [0] * b
    last_hidden = [None] * b
    while any(d < len(p) for d, p in zip(done, prompts)):
        lens = [min(PREFILL_CHUNK, len(p) - d) for d, p in zip(done, prompts)]
        ids = torch.zeros(b, max(lens), dtype=torch.long)
        pos = torch.zeros(b, max(lens), dtype=torch.long)
        for r, (p, d, n) in enumerate(zip(prompts, done, lens)):
            ids[r, :n] = torch.tensor(p[d : d + n])
            pos[r] = torch.arange(d, d + max(lens)).clamp(max=max(d + n - 1, 0))
        hidden = fwd.hidden(ids.to(device), pos.to(device), torch.tensor(lens).to(device), caches)
        for r, n in enumerate(lens):
            if n:
                last_hidden[r] = hidden[r, n - 1]
            done[r] += n
    return caches, fwd.logits(torch.stack(last_hidden))


def generate(fwd: K3Forward, cfg: ModelConfig, prompts: list[list[int]], max_tokens: int, temperature: float,
             seed: int, device: torch.device | str = "cuda") -> Samples:
    """`prefill`, then batched decode on `device`, each step on CUDA one replay of a CUDA graph
    (`rollout.generate.decode_graph`), elsewhere one eager step; token i is sampled for every row at once by Gumbel-max, the
    noise drawn from a generator on `device` seeded by (seed, i)."""
    b = len(prompts)
    device = torch.device(device)
    caches, logits = prefill(fwd, cfg, prompts, max_tokens, seed, device)
    graph = GraphedDecode(fwd, caches, b) if max_tokens > 1 and device.type == "cuda" else None
    ones = torch.ones(b, dtype=torch.long, device=device)
    completions: list[list[int]] = [[] for _ in range(b)]
    logprobs: list[list[torch.Tensor]] = [[] for _ in range(b)]
    for i in range(max_tokens):
        gumbel = -torch.empty(logits.shape, device=device).exponential_(
            generator=torch.Generator(device).manual_seed(seed * 1_000_003 + i)).log()
        tok = (logits.float() / temperature + gumbel).argmax(-1)
        lp = fwd.token_logprobs(logits, tok, temperature)
        for r in range(b):
            completions[r].append(int(tok[r]))
            logprobs[r].append(lp[r])
        if i + 1 < max_tokens:
            pos = torch.tensor([[len(p) + i] for p in prompts], device=device)
            logits = graph.step(tok.view(b, 1), pos) if graph is not None else \
                fwd.logits(fwd.hidden(tok.view(b, 1), pos, ones, caches)[:, 0])
    return Samples(prompts, completions, [torch.stack(x) for x in logprobs])


def trainer_logprobs(backend: MegatronBackend, s: Samples, temperature: float, grad: bool) -> list[torch.Tensor]:
    """The trainer's log-probs of each sequence's completion tokens (one padded forward over prompt + completion)."""
    batch = PaddedBatch.from_sequences([p + c for p, c in zip(s.prompts, s.completions)])
    with torch.set_grad_enabled(grad):
        lp = token_logprobs(backend.trainer.model, batch, temperature)
    return [lp[r, len(p) - 1 : len(p) - 1 + len(c)] for r, (p, c) in enumerate(zip(s.prompts, s.completions))]


def reward(completion: list[int], vocab: int) -> float:
    """A signal a random model can learn: the fraction of sampled ids in the lower half of the vocabulary."""
    return sum(t < vocab // 2 for t in completion) / len(completion)


@dataclass
class Run:
    metrics: list[dict[str, float]]
    weights: dict[str, torch.Tensor]


def prompts_for(step: int, n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed * 7919 + step)
    lens = torch.randint(20, 140, (n,), generator=g, device="cpu").tolist()
    return [torch.randint(4, vocab, (m,), generator=g, device="cpu").tolist() for m in lens]


def run(backend: MegatronBackend, cfg: ModelConfig, first: int, last: int, args: argparse.Namespace,
        save_at: int | None = None, state_dir: Path | None = None) -> Run:
    kernels = get_kernels(args.kernels)
    metrics = []
    serving = ServingBuffer(cfg.text)
    store: TensorStore | None = None
    for step in range(first, last):
        with torch.device("cuda"):
            t0 = time.perf_counter()
            bundle = serving.bundle(step + 1, backend.export_official())
            if store is None:
                store = TensorStore({n: torch.empty_like(t) for n, t in bundle.tensors.items()}, version=step)
            WeightSync(Memory(), store)(bundle)
            fwd = K3Forward(K3Weights.from_official(cfg.text, store.tensors), kernels)
            torch.cuda.synchronize()
            t_sync = time.perf_counter() - t0
            t0 = time.perf_counter()
            s = generate(fwd, cfg, prompts_for(step, args.batch, cfg.text.vocab_size, args.seed), args.max_tokens,
                         args.temperature, args.seed * 100_003 + step)
            torch.cuda.synchronize()
            t_gen = time.perf_counter() - t0
            t0 = time.perf_counter()
            old = trainer_logprobs(backend, s, args.temperature, grad=False)
            equal = sum(int(torch.equal(a, b)) for a, b in zip(old, s.logprobs))
            max_diff = max(float((a - b).abs().max()) for a, b in zip(old, s.logprobs))
            kl = float(sum((b - a).sum() for a, b in zip(old, s.logprobs))) / sum(map(len, old))
            t_check = time.perf_counter() - t0
            if equal != len(old):
                raise SystemExit(f"step {step}: trainer != generation on {len(old) - equal}/{len(old)} sequences, "
                                 f"max |d logprob| {max_diff:.3e}")
            rewards = torch.tensor([reward(c, cfg.text.vocab_size) for c in s.completions], device="cuda")
            adv = rewards - rewards.mean()

            def loss_fn(model: torch.nn.Module) -> torch.Tensor:
                lp = trainer_logprobs(backend, s, args.temperature, grad=True)
                return -sum((a * x).sum() for a, x in zip(adv, lp)) / sum(map(len, lp))

            t0 = time.perf_counter()
            loss, grad_norm = backend.train_step(loss_fn)
            torch.cuda.synchronize()
            t_train = time.perf_counter() - t0
        m = dict(step=step, kl=kl, bitwise_equal_frac=equal / len(old), max_abs_logprob_diff=max_diff,
                 reward_mean=float(rewards.mean()), loss=loss, grad_norm=grad_norm,
                 gen_tokens_per_s=args.batch * args.max_tokens / t_gen, sync_s=t_sync, gen_s=t_gen, check_s=t_check,
                 train_step_s=t_train)
        print(json.dumps(m), flush=True)
        metrics.append(m)
        if save_at is not None and step + 1 == save_at:
            backend.save_state(state_dir)
    return Run(metrics, {n: t.detach().clone() for n, t in backend.export_official().items()})


def _median_s(fn, reps: int) -> float:
    """Median wall time of `fn` (CUDA synchronised) after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def benchmark(ckpt: Path, cfg: ModelConfig, args: argparse.Namespace) -> list[dict[str, object]]:
    """Invariant (Triton) vs fast (cuBLAS, fla's KDA, SDPA, `torch._grouped_mm`) in one run, each row printed as it
    is measured: the trainer's forward + backward step, prefill tokens/s, and the decode step at batch 1 and 64
    (eager, and replayed from a CUDA graph)."""
    rows: list[dict[str, object]] = []
    g = torch.Generator().manual_seed(5)
    train_ids = torch.randint(4, cfg.text.vocab_size, (args.bench_batch, args.bench_len), generator=g, device="cpu")
    train_lens = torch.full((args.bench_batch,), args.bench_len)
    prompts = [torch.randint(4, cfg.text.vocab_size, (args.bench_len,), generator=g, device="cpu").tolist()
               for _ in range(args.bench_batch)]
    _, official = load_checkpoint(ckpt)

    def row(kernels: str, what: str, seconds: float, tokens: int | None = None) -> None:
        r: dict[str, object] = dict(kernels=kernels, what=what, seconds=seconds)
        if tokens:
            r["tokens_per_s"] = tokens / seconds
        inv = next((x for x in rows if x["what"] == what and x["kernels"] == "invariant"), None)
        if kernels == "fast" and inv is not None:
            r["invariant_over_fast"] = inv["seconds"] / seconds
        rows.append(r)
        print(json.dumps(r), flush=True)

    for kernels in ("invariant", "fast"):
        if "trainer" in args.bench_what:
            backend = MegatronBackend(ckpt, lr=args.lr, clip_grad=1.0, weight_decay=0.0, kernels=kernels, adapter=None)
            with torch.device("cuda"):
                step = _median_s(lambda: backend.train_step(
                    lambda model: model(train_ids, train_lens, 1.0).sum() / train_ids.numel()), args.bench_reps)
            backend.close()
            row(kernels, f"trainer step, {args.bench_batch} x {args.bench_len} tokens", step)
        with torch.device("cuda"):
            fwd = K3Forward(K3Weights.from_official(cfg.text, {n: t.cuda() for n, t in official.items()}),
                            get_kernels(kernels))  # the checkpoint as served: MXFP4 experts packed
            if "prefill" in args.bench_what:
                pre = _median_s(lambda: prefill(fwd, cfg, prompts, 1, 0), args.bench_reps)
                row(kernels, f"prefill, {args.bench_batch} x {args.bench_len} tokens", pre,
                    args.bench_batch * args.bench_len)
            if "decode" in args.bench_what:
                for b in (1, 64):
                    for graphed in (False, True):
                        row(kernels, f"decode step, batch {b}, {'CUDA graph' if graphed else 'eager'}",
                            _decode_step_s(fwd, cfg, [p[:64] for p in (prompts * 64)[:b]], graphed, 16), b)
        del fwd
        torch.cuda.empty_cache()
    return rows


def _decode_step_s(fwd: K3Forward, cfg: ModelConfig, prompts: list[list[int]], graphed: bool, n: int) -> float:
    """Median seconds of one batched decode step after `prompts`' prefill (n steps timed, token ids fixed)."""
    b = len(prompts)
    caches, _ = prefill(fwd, cfg, prompts, n + 1, 0)
    tok = torch.full((b, 1), 5, dtype=torch.long, device="cuda")
    ones = torch.ones(b, dtype=torch.long, device="cuda")
    graph = GraphedDecode(fwd, caches, b) if graphed else None
    times = []
    for i in range(n):
        pos = torch.tensor([[len(p) + i] for p in prompts], device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if graph is not None:
            graph.step(tok, pos)
        else:
            fwd.logits(fwd.hidden(tok, pos, ones, caches)[:, 0])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[(n - 1) // 2]  # the first eager step compiles


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/k3-1b.yaml")
    p.add_argument("--kernels", default="invariant", help="on CUDA: the Triton kernels")
    p.add_argument("--steps", type=int, default=20, help="0: no PPO run (only --bench)")
    p.add_argument("--resume-at", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench", action="store_true", help="then time invariant vs fast (trainer step, prefill, decode)")
    p.add_argument("--bench-batch", type=int, default=8)
    p.add_argument("--bench-len", type=int, default=512)
    p.add_argument("--bench-reps", type=int, default=3, help="timed repetitions after one warm-up (median)")
    p.add_argument("--bench-what", default="trainer,prefill,decode", type=lambda v: v.split(","),
                   help="comma-separated: trainer, prefill, decode")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="checkpoint and compute dtype (default: the "
                   "config's)")
    p.add_argument("--json", help="write metrics, the verdict and the timings here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(args.config, Path(tmp) / "ckpt", seed=args.seed, dtype=args.dtype)
        cfg, _ = load_checkpoint(ckpt)
        verdict: dict[str, object] = {}
        metrics: list[dict[str, float]] = []
        if args.steps:
            verdict, metrics = _ppo_and_resume(ckpt, cfg, Path(tmp) / "state", args)
        timings = benchmark(ckpt, cfg, args) if args.bench else []
    if args.json:
        Path(args.json).write_text(json.dumps(dict(verdict=verdict, metrics=metrics, timings=timings), indent=1))
    return 0 if not verdict or (verdict["resume_metrics_equal"] and verdict["resume_weights_equal"]) else 1


def _ppo_and_resume(ckpt: Path, cfg: ModelConfig, state: Path,
                    args: argparse.Namespace) -> tuple[dict[str, object], list[dict[str, float]]]:
    """`--steps` steps, the state saved after `--resume-at`; a fresh trainer resumes from it to `--steps`."""
    backend = MegatronBackend(ckpt, lr=args.lr, clip_grad=1.0, weight_decay=0.0, kernels=args.kernels, adapter=None)
    full = run(backend, cfg, 0, args.steps, args, save_at=args.resume_at, state_dir=state)
    backend.close()
    print(f"resuming from the step-{args.resume_at} state", flush=True)
    backend = MegatronBackend(ckpt, lr=args.lr, clip_grad=1.0, weight_decay=0.0, kernels=args.kernels, adapter=None)
    backend.load_state(state)
    resumed = run(backend, cfg, args.resume_at, args.steps, args)
    backend.close()

    def kept(ms: list[dict[str, float]]) -> list[dict[str, float]]:  # timings differ between runs
        return [{k: v for k, v in m.items() if not k.endswith(("_per_s", "_s"))} for m in ms]

    same_metrics = kept(resumed.metrics) == kept(full.metrics[args.resume_at:])
    same_weights = full.weights.keys() == resumed.weights.keys() and all(
        torch.equal(full.weights[n], resumed.weights[n]) for n in full.weights)
    verdict = dict(steps=args.steps, bitwise_steps=sum(m["bitwise_equal_frac"] == 1.0 for m in full.metrics),
                   resume_metrics_equal=same_metrics, resume_weights_equal=same_weights, tensors=len(full.weights))
    print(json.dumps(verdict), flush=True)
    return verdict, full.metrics


if __name__ == "__main__":
    sys.exit(main())
