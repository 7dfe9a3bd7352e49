"""Two ranks, one trainer and one rollout engine: weight sync over torch.distributed, then bitwise parity.

Run (two GPUs, NCCL; rank 0 = trainer on GPU 0, rank 1 = rollout engine on GPU 1):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 2 bench/sync_x2.py --config configs/k3-small.yaml --megatron --json OUT.json
On a host without CUDA the same steps run on gloo and the CPU invariant kernels (tests/test_sync_x2.py).

Steps, in order (each prints one line; rank 0 writes the report after each step):
1. bandwidth (CUDA only): device-to-device copy on each GPU (bytes read + written), a plain peer copy
   GPU0 -> GPU1 and back, NCCL send/recv and broadcast of one large buffer;
2. full sync: the trainer's fp32 master weights (drawn in bf16, the checkpoint dtype, then upcast) as a
   checksummed, versioned `WeightBundle` through `TorchDistributed` (NCCL broadcast); the engine verifies
   every tensor (names, shapes, dtypes, checksums, version) before it swaps the weights in;
3. the engine samples completions with the serving schedule (chunked prefill and decode mixed in one batch
   per step, MLA latents in a shared paged pool with shuffled blocks and NaN in unwritten slots, KDA chunk
   state); the trainer scores the same ids in one pass; every sampled token's log-prob must be bit-equal
   (`torch.equal`); the engine's pre-sync weights give the negative control;
4. adapter-only sync (LoRA, `kind="adapter"`, PEFT tensor names) and the same parity check with the adapter;
5. a bundle with one flipped bit is rejected and the engine keeps its version;
6. a bulk full sync of k3-small scaled up (`--scale`: widths and heads times the factor, bf16, random on
   device) for the transport's rate at a size where per-tensor latency does not dominate;
7. with `--megatron`: the Megatron-core trainer at TP=2, EP=2 and TP=2 x EP=2 over both ranks, loaded from the
   synced weights (and then the adapter), against the engine's TP=1 log-probs: bits compared per token (on CUDA the
   EP layouts report the trainer's refusal as their outcome: EP is not built on the Triton kernels).

Invariants checked: a receiver's weights change only through a verified bundle of a newer version; after
each sync the engine's log-prob of every sampled token equals the trainer's (`torch.equal`, compared on
rank 0 after a CPU copy, which moves bits unchanged). Model compute is in the config's dtype (parity.model).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lora.adapter import Adapter, pair_tensors
from lora.init import peft_default_adapter, random_adapter
from rollout.generate.paged_pool import PagedLatentPool
from parity.config import ModelConfig, TextConfig, load_model_config
from parity.kernels import get_kernels
from parity.caches import MLACache, new_cache
from parity.model import K3Forward, K3Weights, score_sequences
from parity.weights import text_specs
from parity.io.checkpoint import random_weights
from parity.sync.bundle import SyncError, TensorStore, WeightBundle
from parity.sync.transports import TorchDistributed

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TRAINER, ENGINE = 0, 1
LORA_RANK = 8
LAYOUTS = ((2, 1), (1, 2), (2, 2))  # Megatron (TP, EP)


# --- setup ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ranks:
    """This rank's device, and a gloo group over both ranks for host-side coordination (barriers, small
    Python objects): waiting in it runs no GPU kernel, so a waiting rank never competes with a measurement."""

    device: torch.device
    host: dist.ProcessGroup


def init_ranks() -> Ranks:
    """Two ranks from torchrun: NCCL with rank r on GPU r when CUDA is present (NVLink multicast must be
    off in the environment), else gloo on the CPU; plus the host group."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        raise SystemExit(f"run with exactly 2 ranks (torchrun --nproc-per-node 2), got {world}")
    timeout = datetime.timedelta(minutes=6)
    if not torch.cuda.is_available():
        dist.init_process_group("gloo", timeout=timeout)
        return Ranks(torch.device("cpu"), dist.new_group(backend="gloo", timeout=timeout))
    wrong = {k: os.environ.get(k) for k, v in NO_MULTICAST.items() if os.environ.get(k) != v}
    if wrong:
        raise SystemExit(f"NVLink multicast must be off: set {NO_MULTICAST} (got {wrong})")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timeout, device_id=device)
    return Ranks(device, dist.new_group(backend="gloo", timeout=timeout))


def share(obj: Any, src: int, ranks: Ranks) -> Any:
    """`obj` from rank `src` on every rank, over the host group (tensors inside must be CPU tensors)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=ranks.host)
    return box[0]


def gather(obj: Any, ranks: Ranks) -> list[Any]:
    """[rank 0's obj, rank 1's obj] on every rank, over the host group."""
    out = [None, None]
    dist.all_gather_object(out, obj, group=ranks.host)
    return out


def wait(device: torch.device) -> None:
    """Block until the device's queued work is done (no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def text_weights(cfg: ModelConfig, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Trainer-style fp32 masters of a seeded checkpoint: text tensors drawn in bf16 (fp32 specs in fp32),
    upcast exactly to fp32, on `device`."""
    names = text_specs(cfg.text)
    with torch.device("cpu"):  # the seeded CPU draw, whatever default device the caller set
        drawn = random_weights(cfg, seed)
    return {n: t.to(torch.float32).to(device) for n, t in drawn.items() if n in names}


def scaled(text: TextConfig, factor: int) -> TextConfig:
    """`text` with every width and head count times `factor` (layers, experts and head dims unchanged)."""
    assert text.q_lora_rank is not None and text.routed_expert_hidden_size is not None
    return dataclasses.replace(
        text, hidden_size=text.hidden_size * factor, intermediate_size=text.intermediate_size * factor,
        moe_intermediate_size=text.moe_intermediate_size * factor,
        routed_expert_hidden_size=text.routed_expert_hidden_size * factor, q_lora_rank=text.q_lora_rank * factor,
        kv_lora_rank=text.kv_lora_rank * factor, kda_num_heads=text.kda_num_heads * factor,
        num_attention_heads=text.num_attention_heads * factor)


def bulk_tensors(text: TextConfig, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors with `text`'s official names and shapes, bf16 (fp32 specs fp32), drawn on `device`."""
    gen = torch.Generator(device).manual_seed(seed)
    return {n: torch.randn(s.shape, generator=gen, device=device).to(torch.float32 if s.fp32 else torch.bfloat16)
            for n, s in text_specs(text).items()}


def drawn_adapter(cfg: TextConfig, seed: int | None, device: torch.device) -> Adapter:
    """A rank-`LORA_RANK` adapter on every supported projection, drawn on the CPU, moved to `device`:
    `random_adapter(seed)` (B != 0, a trained adapter's stand-in), or PEFT's B = 0 start when `seed` is None."""
    with torch.device("cpu"):
        adapter = peft_default_adapter(cfg, LORA_RANK) if seed is None else random_adapter(cfg, LORA_RANK, seed=seed)
    return Adapter(adapter.spec, {m: (a.to(device), b.to(device)) for m, (a, b) in adapter.weights.items()})


# --- step 1: bandwidth ------------------------------------------------------------------------------

def timed(fn: Callable[[], None], devices: list[torch.device], reps: int, warmup: int = 2,
          before: Callable[[], None] = lambda: None) -> float:
    """Median wall seconds of `fn`, every device synchronised before and after each call; `before` runs
    ahead of each call, outside the timed interval."""
    times = []
    for i in range(warmup + reps):
        for d in devices:
            wait(d)
        before()
        t0 = time.perf_counter()
        fn()
        for d in devices:
            wait(d)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_ceiling(device: torch.device, nbytes: int, reps: int = 20) -> float:
    """Device-to-device copy on one GPU, GB/s counting bytes read plus bytes written (METHOD.md's ceiling),
    timed with CUDA events."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    return 2 * nbytes / statistics.median(times) / 1e9


def peer_copy(src_dev: torch.device, dst_dev: torch.device, nbytes: int, reps: int = 10) -> float:
    """A plain `copy_` from one GPU to the other (NVLink where the GPUs are linked), GB/s of bytes moved."""
    src = torch.randn(nbytes // 4, device=src_dev)
    dst = torch.empty(nbytes // 4, device=dst_dev)
    return nbytes / timed(lambda: dst.copy_(src), [src_dev, dst_dev], reps) / 1e9


def nccl_rates(ranks: Ranks, nbytes: int, reps: int = 10) -> dict[str, float]:
    """NCCL send/recv and broadcast of one buffer from rank 0 to rank 1, GB/s of bytes moved, timed on each
    rank from a host barrier to the end of its side (both ranks call; rank 1's time is reported)."""
    buf = torch.randn(nbytes // 4, device=ranks.device)

    def send_recv() -> None:
        if dist.get_rank() == TRAINER:
            dist.send(buf, ENGINE)
        else:
            dist.recv(buf, TRAINER)

    def host_barrier() -> None:
        dist.barrier(group=ranks.host)

    def broadcast() -> None:
        dist.broadcast(buf, TRAINER)

    rates = {}
    for label, fn in (("nccl_send_recv_GBps", send_recv), ("nccl_broadcast_GBps", broadcast)):
        seconds = timed(fn, [ranks.device], reps, before=host_barrier)
        rates[label] = nbytes / gather(seconds, ranks)[ENGINE] / 1e9
    return rates


def bandwidth(ranks: Ranks, nbytes: int) -> dict[str, Any]:
    """Step 1 (CUDA only): each GPU's copy ceiling, the peer copies (run by rank 0 while rank 1 waits on the
    host), NCCL rates."""
    device = ranks.device
    out: dict[str, Any] = {"buffer_bytes": nbytes,
                           "d2d_copy_GBps_read_plus_write": gather(copy_ceiling(device, nbytes), ranks)}
    peers: dict[str, Any] = {}
    if dist.get_rank() == TRAINER:
        g0, g1 = torch.device("cuda", 0), torch.device("cuda", 1)
        peers = {"peer_access_0_1": torch.cuda.can_device_access_peer(0, 1),
                 "peer_copy_gpu0_to_gpu1_GBps": peer_copy(g0, g1, nbytes),
                 "peer_copy_gpu1_to_gpu0_GBps": peer_copy(g1, g0, nbytes)}
    out.update(share(peers, TRAINER, ranks))
    out.update(nccl_rates(ranks, nbytes))
    return out


# --- steps 2, 4, 5, 6: sync -------------------------------------------------------------------------

@dataclass
class SyncTiming:
    """One sync's size and seconds: `make` (clone + checksums, trainer), `transfer` (manifest + tensors
    received and on the device, engine), `verify` (checks + swap, engine)."""

    nbytes: int
    tensors: int
    make_s: float
    transfer_s: float
    verify_s: float

    def summary(self) -> dict[str, float]:
        gb = self.nbytes / 1e9
        return {**dataclasses.asdict(self), "transfer_GBps": gb / self.transfer_s,
                "end_to_end_GBps": gb / (self.make_s + self.transfer_s + self.verify_s)}


def sync(link: TorchDistributed, ranks: Ranks, make: Callable[[], WeightBundle] | None,
         store: TensorStore | None) -> SyncTiming:
    """Trainer (`make` given) builds and sends a bundle; the engine (`store` given) receives it onto its device
    and applies it (verify first: a bad bundle raises `SyncError` and leaves `store` as it was). Both call;
    the timing is shared from both sides."""
    device = ranks.device
    make_s = transfer_s = verify_s = 0.0
    bundle = None
    if make is not None:
        t0 = time.perf_counter()
        bundle = make()
        wait(device)
        make_s = time.perf_counter() - t0
    dist.barrier(group=ranks.host)
    t0 = time.perf_counter()
    if bundle is not None:
        link.send(bundle)
    else:
        assert store is not None
        bundle = link.receive()
    wait(device)
    transfer_s = time.perf_counter() - t0
    error = None
    if store is not None:
        t0 = time.perf_counter()
        try:
            store.apply(bundle)
        except SyncError as e:
            error = str(e)
        wait(device)
        verify_s = time.perf_counter() - t0
    sides = gather((make_s, transfer_s, verify_s, error), ranks)
    if sides[ENGINE][3] is not None:
        raise SyncError(sides[ENGINE][3])
    return SyncTiming(bundle.nbytes(), len(bundle.tensors), sides[TRAINER][0], sides[ENGINE][1], sides[ENGINE][2])


def flip_one_bit(bundle: WeightBundle) -> WeightBundle:
    """The same bundle, one bit of its first tensor flipped after the checksums were taken (a fault in flight)."""
    tensors = dict(bundle.tensors)
    name = sorted(tensors)[0]
    t = tensors[name].clone()
    t.view(torch.uint8).view(-1)[0] ^= 1
    tensors[name] = t
    return WeightBundle(bundle.version, bundle.kind, tensors, bundle.checksums)


# --- step 3: the serving schedule -------------------------------------------------------------------

@dataclass
class Request:
    """One generation request: its prompt, how much of it is prefilled, the sampled tokens and their
    log-probs (fp32, as the engine computed them)."""

    prompt: list[int]
    max_new: int
    prefilled: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.tokens) >= self.max_new

    def feed(self, chunk: int) -> tuple[list[int], int]:
        """This step's input ids and the position of the first: the next prefill chunk, else the last sampled
        token; a finished request re-feeds its last token (kept in the batch, its output ignored)."""
        if self.prefilled < len(self.prompt):
            part = self.prompt[self.prefilled : self.prefilled + chunk]
            return part, self.prefilled
        return [self.tokens[-1]], len(self.prompt) + len(self.tokens) - 1

    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


def serve(fwd: K3Forward, prompts: list[list[int]], max_new: int, chunk: int, temperature: float, seed: int,
          device: torch.device) -> list[Request]:
    """The engine's schedule: every step runs one batch in which each request contributes its next prefill chunk
    (`chunk` tokens, the last one shorter) or one decode token; a request whose prompt is complete samples its
    next token (seeded CPU sampler over softmax(logits / T)) and records that token's log-prob from the parity
    `token_logprobs` (vLLM's processed log-probs)."""
    reqs = [Request(p, max_new) for p in prompts]
    b, cfg = len(reqs), fwd.cfg
    longest = max(map(len, prompts))
    bound = longest + max_new + -(-longest // chunk) + 1  # a finished request keeps re-feeding one token a step
    per_request = -(-bound // 16)
    caches = [PagedLatentPool(b, c.latent.shape[-1], 16, per_request, c.latent.dtype, device) if isinstance(c, MLACache)
              else c
              for c in new_cache(cfg, b)]
    gen = torch.Generator("cpu").manual_seed(seed)
    while not all(r.finished for r in reqs):
        feeds = [r.feed(chunk) for r in reqs]
        width = max(len(ids) for ids, _ in feeds)
        ids = torch.zeros(b, width, dtype=torch.long)
        pos = torch.zeros(b, width, dtype=torch.long)
        for i, (part, start) in enumerate(feeds):
            ids[i, : len(part)] = torch.tensor(part)
            pos[i] = torch.arange(start, start + width).clamp(max=start + len(part) - 1)
        lens = torch.tensor([len(part) for part, _ in feeds])
        for r, (part, _) in zip(reqs, feeds):
            r.prefilled += len(part) if r.prefilled < len(r.prompt) else 0
        hidden = fwd.hidden(ids.to(device), pos.to(device), lens.to(device), caches)
        last = hidden[torch.arange(b, device=device), lens.to(device) - 1]
        logits = fwd.logits(last)  # [B, V]
        probs = torch.softmax(logits.cpu() / temperature, dim=-1)
        targets = torch.multinomial(probs, 1, generator=gen).view(-1)
        lps = fwd.token_logprobs(logits, targets.to(device), temperature)
        for i, r in enumerate(reqs):
            if r.prefilled == len(r.prompt) and not r.finished:
                r.tokens.append(int(targets[i]))
                r.logprobs.append(lps[i])
    return reqs


def completion_slices(lps: list[torch.Tensor], reqs: list[dict]) -> list[torch.Tensor]:
    """From per-sequence one-pass log-probs (entry t scores token t + 1), the entries of the sampled tokens."""
    return [lp[len(r["prompt"]) - 1 : len(r["prompt"]) - 1 + len(r["tokens"])] for lp, r in zip(lps, reqs)]


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, Any]:
    """Bitwise comparison per token (after a CPU copy): counts, max |diff|, and whether every sequence is
    `torch.equal`."""
    got = [g.detach().cpu() for g in got]
    want = [w.detach().cpu() for w in want]
    tokens = sum(w.numel() for w in want)
    equal = sum(int((g.view(torch.int32) == w.view(torch.int32)).sum()) for g, w in zip(got, want))
    diff = max(float((g.double() - w.double()).abs().max()) for g, w in zip(got, want))
    return {"tokens": tokens, "bitwise_equal": equal, "max_abs_diff": diff,
            "all_torch_equal": all(torch.equal(g, w) for g, w in zip(got, want))}


def rollout_round(fwd: K3Forward | None, args: argparse.Namespace, ranks: Ranks, seed: int) -> list[dict]:
    """The engine (rank 1) serves the prompts; every rank gets the requests as CPU data."""
    reqs = None
    if fwd is not None:
        g = torch.Generator("cpu").manual_seed(seed)
        prompts = [torch.randint(4, fwd.cfg.vocab_size, (n,), generator=g, device="cpu").tolist() for n in args.prompts]
        served = serve(fwd, prompts, args.max_new, args.chunk, args.temperature, seed, ranks.device)
        reqs = [{"prompt": r.prompt, "tokens": r.tokens, "logprobs": torch.stack(r.logprobs).cpu()} for r in served]
    return share(reqs, ENGINE, ranks)


def trainer_check(fwd: K3Forward, reqs: list[dict], temperature: float) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The trainer's one-pass scores of the served sequences against the engine's log-probs; returns the
    comparison and the trainer's log-probs of the sampled tokens (CPU)."""
    scored = completion_slices(score_sequences(fwd, [r["prompt"] + r["tokens"] for r in reqs], temperature), reqs)
    scored = [t.cpu() for t in scored]
    return compare([r["logprobs"] for r in reqs], scored), scored


# --- step 7: Megatron -------------------------------------------------------------------------------

def megatron_groups(tp: int, ep: int) -> Any:
    """Megatron's TP/EP groups over the running process group, as `trainer.megatron.parallel.init_parallel` builds them.
    That function builds the CPU trainer (gloo, compat patches) and refuses a CUDA host; on CUDA the same
    `initialize_model_parallel` call runs here over NCCL."""
    from megatron.core import parallel_state

    from trainer.megatron.parallel import ParallelContext, init_parallel

    if not torch.cuda.is_available():
        return init_parallel(tp, ep)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=1)
    return ParallelContext(
        tp=tp, tp_rank=parallel_state.get_tensor_model_parallel_rank(), ep=ep,
        ep_rank=parallel_state.get_expert_model_parallel_rank(), dp=parallel_state.get_data_parallel_world_size(),
        dp_rank=parallel_state.get_data_parallel_rank(), tp_group=parallel_state.get_tensor_model_parallel_group(),
        ep_group=parallel_state.get_expert_model_parallel_group(), owns_process_group=False)


def megatron_layout(cfg: ModelConfig, tp: int, ep: int, weights: dict[str, torch.Tensor], adapter: Adapter,
                    rounds: list[list[dict]], temperature: float, device: torch.device) -> dict[str, Any]:
    """The Megatron trainer at (TP, EP) over both ranks, loaded from this rank's synced fp32 weights: scores
    round 1's sequences (base) and, with the adapter attached, round 2's; each against the engine's TP=1
    log-probs. Every rank scores every sequence (with EP, expert rows still cross ranks)."""
    from megatron.core import parallel_state

    from trainer.megatron.io import load_adapter, load_official
    from trainer.megatron.config import k3_transformer_config
    from trainer.logprobs import PaddedBatch, token_logprobs
    from trainer.megatron.modules import MegatronK3Model

    par = megatron_groups(tp, ep)
    try:
        model = MegatronK3Model(k3_transformer_config(cfg, par)).to(device)
        load_official(model, weights)
        out: dict[str, Any] = {}
        for label, reqs in (("base", rounds[0]), ("adapter", rounds[1])):
            if label == "adapter":
                load_adapter(model, adapter)
            batch = PaddedBatch.from_sequences([r["prompt"] + r["tokens"] for r in reqs])
            with torch.no_grad():
                lp = token_logprobs(model, batch, temperature)
            out[label] = compare([r["logprobs"] for r in reqs], completion_slices(list(lp), reqs))
        return out
    finally:
        parallel_state.destroy_model_parallel()


# --- main -------------------------------------------------------------------------------------------

def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3-small.yaml")
    ap.add_argument("--prompts", type=int, nargs="+", default=[150, 97, 40, 70], help="prompt lengths")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--chunk", type=int, default=32, help="chunked-prefill tokens per request and step")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--scale", type=int, default=8, help="width factor of the bulk sync's model")
    ap.add_argument("--bandwidth-bytes", type=int, default=1 << 30)
    ap.add_argument("--megatron", action="store_true", help="step 7: Megatron TP=2 / EP=2 / both")
    ap.add_argument("--json", type=Path, help="the report (rank 0 rewrites it after each step)")
    ap.add_argument("--dump", type=Path, help="engine and trainer log-probs of both rounds (torch.save)")
    return ap.parse_args()


class Report:
    """Rank 0's results, printed one line per step and written to `--json` after each."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def add(self, key: str, value: Any) -> None:
        if dist.get_rank() != TRAINER:
            return
        self.data[key] = value
        print(f"[{key}] {json.dumps(value, default=str)}", flush=True)
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=1, default=str))


def main() -> None:
    args = parse()
    ranks = init_ranks()
    device = ranks.device
    rank = dist.get_rank()
    report = Report(args.json)
    cfg = load_model_config(args.config)
    kernels = get_kernels("invariant")
    link = TorchDistributed(src=TRAINER, device=device)
    report.add("setup", {"device": str(device), "backend": dist.get_backend(), "torch": torch.__version__,
                         "config": args.config, "gpus": [torch.cuda.get_device_name(i) for i in
                                                         range(torch.cuda.device_count())],
                         "env": {k: os.environ.get(k) for k in NO_MULTICAST}, "args": vars(args)})
    with torch.device(device):
        if device.type == "cuda":
            report.add("bandwidth", bandwidth(ranks, args.bandwidth_bytes))

        # step 2: full sync, trainer v1 masters -> engine at v0
        trainer_w = text_weights(cfg, 1, device) if rank == TRAINER else None
        store = TensorStore(text_weights(cfg, 0, device)) if rank == ENGINE else None
        before = dict(store.tensors) if store is not None else None
        make = (lambda: WeightBundle.make(1, trainer_w)) if trainer_w is not None else None
        timing = sync(link, ranks, make, store)
        report.add("full_sync", {**timing.summary(), "version": 1})

        # step 3: serve with the synced weights, score on the trainer
        engine_fwd = K3Forward(K3Weights.from_official(cfg.text, store.tensors), kernels) if store is not None else None
        trainer_fwd = None if trainer_w is None else K3Forward(K3Weights.from_official(cfg.text, trainer_w), kernels)
        t0 = time.perf_counter()
        round1 = rollout_round(engine_fwd, args, ranks, seed=11)
        serve_s = time.perf_counter() - t0
        stale = None
        if rank == ENGINE:
            stale_fwd = K3Forward(K3Weights.from_official(cfg.text, before), kernels)
            seqs = [r["prompt"] + r["tokens"] for r in round1]
            stale = [t.cpu() for t in completion_slices(score_sequences(stale_fwd, seqs, args.temperature), round1)]
        stale = share(stale, ENGINE, ranks)
        trainer_lps = []
        if trainer_fwd is not None:
            result, scored = trainer_check(trainer_fwd, round1, args.temperature)
            trainer_lps.append(scored)
            control = compare(stale, [r["logprobs"] for r in round1])
            report.add("parity_full", {**result, "serve_s": serve_s, "control_engine_pre_sync_weights": control})

        # step 4: adapter-only sync (the engine starts from PEFT's B = 0 adapter, installed with version 1);
        # afterwards `adapter` is the trainer's own on rank 0 and the received one on rank 1
        adapter = drawn_adapter(cfg.text, 2 if rank == TRAINER else None, device)
        lora_store = TensorStore(adapter.tensors(), version=1, kind="adapter") if rank == ENGINE else None
        make = (lambda: WeightBundle.make(2, adapter.tensors(), kind="adapter")) if rank == TRAINER else None
        timing = sync(link, ranks, make, lora_store)
        report.add("adapter_sync", {**timing.summary(), "version": 2})
        if engine_fwd is not None and lora_store is not None:
            adapter = Adapter(adapter.spec, pair_tensors(lora_store.tensors, "adapter sync"))
            engine_fwd.w.lora = adapter.lora()
        if trainer_fwd is not None:
            trainer_fwd.w.lora = adapter.lora()
        t0 = time.perf_counter()
        round2 = rollout_round(engine_fwd, args, ranks, seed=12)
        serve_s = time.perf_counter() - t0
        if trainer_fwd is not None:
            result, scored = trainer_check(trainer_fwd, round2, args.temperature)
            trainer_lps.append(scored)
            report.add("parity_adapter", {**result, "serve_s": serve_s})

        # step 5: a flipped bit in flight is rejected, the engine stays at version 2
        make = None if rank != TRAINER else (
            lambda: flip_one_bit(WeightBundle.make(3, adapter.tensors(), kind="adapter")))
        try:
            sync(link, ranks, make, lora_store)
            rejected = None
        except SyncError as e:
            rejected = str(e)
        version = share(lora_store.version if lora_store else None, ENGINE, ranks)
        report.add("corrupt_bundle", {"rejected": rejected, "engine_adapter_version_after": version})

        # step 6: bulk full sync at scale
        big = scaled(cfg.text, args.scale)
        bulk = bulk_tensors(big, device, seed=5) if rank == TRAINER else None
        bulk_store = None
        if rank == ENGINE:
            bulk_store = TensorStore({n: torch.zeros(s.shape, dtype=torch.float32 if s.fp32 else torch.bfloat16)
                                      for n, s in text_specs(big).items()})
        make = (lambda: WeightBundle.make(1, bulk)) if bulk is not None else None
        timing = sync(link, ranks, make, bulk_store)
        report.add("bulk_sync", {**timing.summary(), "scale": args.scale, "hidden_size": big.hidden_size,
                                 "dtype": "bf16 (fp32 specs fp32)"})
        del bulk, bulk_store

        if args.dump is not None and rank == TRAINER:
            torch.save({"rounds": [round1, round2], "trainer": trainer_lps}, args.dump)

        # step 7: Megatron TP / EP against the engine's TP = 1 log-probs
        if args.megatron:
            weights = trainer_w if rank == TRAINER else store.tensors
            for tp, ep in LAYOUTS:
                t0 = time.perf_counter()
                try:
                    result = megatron_layout(cfg, tp, ep, weights, adapter, [round1, round2], args.temperature, device)
                except Exception as e:  # reported as this layout's outcome; the same failure on both ranks moves on
                    result = {"error": f"{type(e).__name__}: {e}"}
                results = gather(result, ranks)
                report.add(f"megatron_tp{tp}_ep{ep}", {"rank0": results[0], "rank1": results[1],
                                                       "seconds": time.perf_counter() - t0})
    dist.barrier(group=ranks.host)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
