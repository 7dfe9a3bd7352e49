"""Where the GPU path's time goes: the invariant kernel set against `fast`, in one process (issue #28's ratio goals).

`bench/ppo_gpu.py --bench` gives the rows (trainer step, prefill, decode); this script measures the same rows on the
same inputs (`ppo_gpu.benchmark`'s token ids: seed 5) and takes them apart. Parts (`--parts`, comma-separated, run
in this order for each kernel set of `--kernels`; every table is printed as soon as it is measured, and every number
is also written as a JSON line to `--json`):

- `trainer`: the trainer step as `ppo_gpu.benchmark` times it (forward + backward + Adam on `--batch` x `--len`
  tokens, median of `--reps` after a first, compiling step), then the same step split as `trainer.megatron.train.
  train_step` runs it: zero-grad / forward / `loss.backward()` / grad finalisation + optimizer step, the device
  synchronised between the pieces.
- `ops`: two more split steps with every op of the kernel set wrapped (`Probe`): each op's forward synchronised before
  and after; each op's backward timed as its own node (the op runs in an `autograd.Function` over detached copies of
  its inputs; that node's backward is one `torch.autograd.grad` over the op's own graph, synchronised before and
  after). So `backward()` splits into the ops' own backward and the rest (the model's glue: embedding, reshapes,
  fake-quantisation's straight-through gradient, ...). The wrapper adds syncs, so these steps are slower than the
  rows; compare the ops with each other, not with the row.
- `tprofile`: `torch.profiler` (CUDA activity only) over one bare `backend.train_step` on `--profile-batch` x
  `--profile-len` tokens after one warm-up step at that size: GPU time per kernel name, the `--top` largest.
- `prefill`: prefill of `--batch` prompts of `--len` tokens in 48-token chunks (`ppo_gpu.prefill`): the row (median
  of `--reps`), a kernel profile of one prefill, and the ops' synchronised forward times over one prefill.
- `decode`: the decode-step rows at batch 1 and 64, eager and CUDA-graphed (`ppo_gpu._decode_step_s`: 64-token
  prompts, median of 15 steps); kernel profiles of 4 graphed steps at batch 1 and 64 and 4 eager steps at batch 64;
  the ops' synchronised forward times over one eager step at batch 64.
- `host`: eager host overhead per op call: one prefill and one eager decode step at batch 1 and 64 with the device
  synchronised before each op call and the host clock read when the call returns (what the call costs the host:
  argument handling, launches; an op that reads a value back to the host also waits for its own kernels there).

    python bench/profile_gpu.py --parts trainer,ops --json OUT.jsonl
    python bench/profile_gpu.py --parts tprofile,prefill,decode,host

The kernel sets are the ones `get_kernels` returns (on CUDA: `invariant` = the Triton kernels with the torch
invariant backward, `parity.kernels.triton`; `fast` = cuBLAS, fla's KDA, SDPA, `torch._grouped_mm`). Without CUDA the
trainer parts run on the CPU kernel sets (a smoke test of the script: `--config configs/k3-tiny.yaml --batch 2 --len 16
--parts trainer,ops`); the generation parts need CUDA (the paged pool and the graphs are CUDA's).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ppo_gpu as P  # noqa: E402  (the benchmark's prefill / decode / timing helpers)

import parity.kernels as PK  # noqa: E402
from parity.io.checkpoint import init_checkpoint, load_checkpoint  # noqa: E402
from parity.kernels import get_kernels  # noqa: E402
from parity.model import K3Forward, K3Weights  # noqa: E402
from parity.quant.bf16 import holds_bf16_values, mark_bf16_valued  # noqa: E402
from trainer.megatron.backend import MegatronBackend  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
JSON_OUT: Path | None = None


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def emit(**record: Any) -> None:
    """One JSON line to `--json` (and nothing to stdout: the tables say it there)."""
    if JSON_OUT is not None:
        with JSON_OUT.open("a") as f:
            f.write(json.dumps(record) + "\n")


def say(text: str) -> None:
    print(text, flush=True)


# --- per-op probe ---------------------------------------------------------------------------------


class Probe:
    """What the wrapped ops record while `mode` is set: None (pass through: nothing added but a Python call),
    "synced" (forward and backward per op, synchronised) or "host" (host seconds per call, synchronised before)."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self.reset()

    def reset(self) -> None:
        self.fwd: dict[str, float] = defaultdict(float)
        self.bwd: dict[str, float] = defaultdict(float)
        self.host: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self.bcalls: Counter = Counter()


PROBE = Probe()


class _Timed(torch.autograd.Function):
    """The op on detached copies of its gradient-needing inputs, its graph kept: backward is one `autograd.grad`
    over that graph, timed. The op computes exactly what it computes unwrapped (the same kernels on the same
    values; a bf16-valued fp32 master keeps its mark, `parity.quant.bf16`)."""

    @staticmethod
    def forward(ctx: Any, name: str, op: Callable, args: tuple, kwargs: dict, box: list, *leaves: torch.Tensor):
        ctx.set_materialize_grads(False)  # an unused output (a final state) adds no backward work
        inner = []
        for t in leaves:
            d = t.detach().requires_grad_()
            if d.dtype != torch.bfloat16 and holds_bf16_values(t):
                mark_bf16_valued(d)
            inner.append(d)
        swap = {id(t): d for t, d in zip(leaves, inner)}
        new_args = tuple(swap.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args)
        with torch.enable_grad():
            result = _clocked(PROBE.fwd, name, lambda: op(*new_args, **kwargs))
        outs = list(result) if isinstance(result, tuple) else [result]
        diff = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        ctx.graph, ctx.inner, ctx.name = [outs[i] for i in diff], inner, name
        box.append(result)
        return tuple(outs[i].detach() for i in diff)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        pairs = [(o, g) for o, g in zip(ctx.graph, grads) if g is not None]
        got: tuple = (None,) * len(ctx.inner)
        if pairs:
            sync()
            t0 = time.perf_counter()
            with torch.device(ctx.inner[0].device):  # the backward thread has no device context
                got = torch.autograd.grad([o for o, _ in pairs], ctx.inner, [g for _, g in pairs], allow_unused=True)
            sync()
            PROBE.bwd[ctx.name] += time.perf_counter() - t0
            PROBE.bcalls[ctx.name] += 1
        ctx.graph = ctx.inner = None
        return (None, None, None, None, None, *got)


def _clocked(table: dict[str, float], name: str, call: Callable[[], Any], wait: bool = True) -> Any:
    """`call()` timed into `table[name]` (from a synced device; until the device is done unless `wait` is off), one call
    counted for `name`."""
    sync()
    t0 = time.perf_counter()
    result = call()
    if wait:
        sync()
    table[name] += time.perf_counter() - t0
    PROBE.calls[name] += 1
    return result


def _probed(name: str, op: Callable) -> Callable:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        mode = PROBE.mode
        if mode is None:
            return op(*args, **kwargs)
        if mode == "host":  # the host's time: no sync after the call
            return _clocked(PROBE.host, name, lambda: op(*args, **kwargs), wait=False)
        leaves = list({id(a): a for a in args if isinstance(a, torch.Tensor) and a.requires_grad}.values())
        if not (leaves and torch.is_grad_enabled()):
            return _clocked(PROBE.fwd, name, lambda: op(*args, **kwargs))
        box: list = []
        diff_outs = _Timed.apply(name, op, args, kwargs, box, *leaves)
        result = box[0]
        outs = list(result) if isinstance(result, tuple) else [result]
        it = iter(diff_outs)
        merged = [next(it) if isinstance(o, torch.Tensor) and o.requires_grad else o for o in outs]
        return tuple(merged) if isinstance(result, tuple) else merged[0]

    wrapped.__doc__, wrapped.__name__ = op.__doc__, getattr(op, "__name__", name)
    return wrapped


def instrument() -> None:
    """Wrap every op of the kernel sets `get_kernels` hands out (before any model is built: models keep the record
    they were given)."""

    def probed(ks: PK.Kernels) -> PK.Kernels:
        return dataclasses.replace(ks, **{f.name: _probed(f.name, getattr(ks, f.name))
                                          for f in dataclasses.fields(ks)
                                          if f.name != "name" and getattr(ks, f.name) is not None})

    for attr in ("INVARIANT", "FAST", "FAST_GROUPED"):
        setattr(PK, attr, probed(getattr(PK, attr)))
    if CUDA or os.environ.get("TRITON_INTERPRET") == "1":
        import parity.kernels.triton as PT

        PT.DEVICE_INVARIANT, PT.TRITON = probed(PT.DEVICE_INVARIANT), probed(PT.TRITON)


def probed_run(mode: str, fn: Callable[[], Any]) -> Any:
    PROBE.reset()
    PROBE.mode = mode
    try:
        return fn()
    finally:
        PROBE.mode = None


def snapshot() -> dict[str, dict[str, float]]:
    names = set(PROBE.calls) | set(PROBE.bcalls)
    return {n: dict(calls=PROBE.calls[n], fwd_s=PROBE.fwd.get(n, 0.0), bwd_calls=PROBE.bcalls[n],
                    bwd_s=PROBE.bwd.get(n, 0.0), host_s=PROBE.host.get(n, 0.0)) for n in sorted(names)}


# --- profiler ---------------------------------------------------------------------------------------


def kernel_table(label: str, fn: Callable[[], Any], calls: int = 1, top: int = 15) -> dict[str, Any]:
    """torch.profiler (CUDA activity only) over `calls` calls of `fn`: GPU time per kernel name per call, the `top`
    largest as a markdown table, the rest summed in one row."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA] if CUDA else [ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        sync()
    t1 = time.perf_counter()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or 0
        if us > 0:
            rows.append((e.key, e.count / calls, us / calls / 1e3))
    t2 = time.perf_counter()
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    launches = sum(r[1] for r in rows)
    say(f"\n#### {label}: {total:.3f} ms GPU time per call in {launches:.0f} kernel launches "
        f"({len(rows)} names); profiled wall {t1 - t0:.2f} s for {calls} call(s), table {t2 - t1:.1f} s\n")
    say("| kernel | launches / call | GPU ms / call | share |\n|---|---|---|---|")
    for name, n, ms in rows[:top]:
        say(f"| `{name[:90]}` | {n:g} | {ms:.3f} | {ms / total:.1%} |")
    if len(rows) > top:
        rest = rows[top:]
        ms = sum(r[2] for r in rest)
        say(f"| ({len(rest)} other names) | {sum(r[1] for r in rest):g} | {ms:.3f} | {ms / max(total, 1e-12):.1%} |")
    out = dict(label=label, gpu_ms=total, launches=launches, wall_s=t1 - t0, calls=calls,
               top=[dict(kernel=n, launches=c, ms=m) for n, c, m in rows[:top]])
    emit(kind="kernel_table", **out)
    return out


# --- trainer ----------------------------------------------------------------------------------------


def split_step(trainer: Any, loss_fn: Callable) -> dict[str, float]:
    """`trainer.megatron.train.train_step` with one loss, the device synchronised between its pieces (seconds)."""
    from megatron.core.distributed import finalize_model_grads

    sync()
    t0 = time.perf_counter()
    trainer.model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    sync()
    t1 = time.perf_counter()
    loss = loss_fn(trainer.model)
    sync()
    t2 = time.perf_counter()
    loss.backward()
    sync()
    t3 = time.perf_counter()
    float(loss.detach())
    finalize_model_grads([trainer.model])
    ok, _, _ = trainer.optimizer.step()
    if not ok:
        raise RuntimeError("Megatron optimizer step reported failure")
    sync()
    t4 = time.perf_counter()
    return dict(zero_grad=t1 - t0, forward=t2 - t1, backward=t3 - t2, optimizer=t4 - t3, total=t4 - t0)


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def timed(fn: Callable[[], Any]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def trainer_parts(ckpt: Path, kernels: str, parts: list[str], ids: torch.Tensor, lens: torch.Tensor,
                  args: argparse.Namespace, results: dict) -> None:
    res = results.setdefault(kernels, {})
    t0 = time.perf_counter()
    backend = MegatronBackend(ckpt, lr=args.lr, clip_grad=1.0, weight_decay=0.0, kernels=kernels, adapter=None)
    say(f"\n### trainer, kernels {kernels} (backend built in {time.perf_counter() - t0:.1f} s)")

    def loss_fn(model: torch.nn.Module) -> torch.Tensor:  # ppo_gpu.benchmark's loss
        return model(ids, lens, 1.0).sum() / ids.numel()

    with torch.device(DEV):
        if "trainer" in parts or "ops" in parts:
            first = timed(lambda: backend.train_step(loss_fn))
            res["first_step_s"] = first
            say(f"first step (compiles, tunes): {first:.3f} s")
        if "trainer" in parts:
            steps = [timed(lambda: backend.train_step(loss_fn)) for _ in range(args.reps)]
            res["step_s"], res["steps_s"] = median(steps), steps
            say(f"trainer step, {args.batch} x {args.len} tokens: median {median(steps):.3f} s of "
                f"{[round(s, 3) for s in steps]}")
            emit(kind="trainer_step", kernels=kernels, batch=args.batch, len=args.len, seconds=median(steps),
                 all=steps, first=first)
            splits = [split_step(backend.trainer, loss_fn) for _ in range(args.reps)]
            res["split"] = {k: median([s[k] for s in splits]) for k in splits[0]}
            res["splits"] = splits
            say("split (median): " + ", ".join(f"{k} {v:.3f} s" for k, v in res["split"].items()))
            emit(kind="trainer_split", kernels=kernels, median=res["split"], all=splits)
        if "ops" in parts:
            per_step = []
            acc: dict[str, dict[str, float]] = {}
            for _ in range(2):
                per_step.append(probed_run("synced", lambda: split_step(backend.trainer, loss_fn)))
                for n, v in snapshot().items():
                    a = acc.setdefault(n, dict.fromkeys(v, 0.0))
                    for k, x in v.items():
                        a[k] += x / 2
            res["ops"], res["ops_steps"] = acc, per_step
            say("probed steps (synced per op): " + "; ".join(
                ", ".join(f"{k} {v:.3f}" for k, v in s.items()) for s in per_step))
            emit(kind="trainer_ops", kernels=kernels, ops=acc, steps=per_step)
        if "tprofile" in parts:
            pids = ids[: args.profile_batch, : args.profile_len].contiguous()
            plens = torch.full((pids.shape[0],), pids.shape[1])

            def small(model: torch.nn.Module) -> torch.Tensor:
                return model(pids, plens, 1.0).sum() / pids.numel()

            warm = timed(lambda: backend.train_step(small))
            again = timed(lambda: backend.train_step(small))
            say(f"\nsmall step {args.profile_batch} x {args.profile_len}: first {warm:.3f} s, again {again:.3f} s")
            res["tprofile"] = kernel_table(f"trainer step ({kernels}), {args.profile_batch} x {args.profile_len} "
                                           "tokens", lambda: backend.train_step(small), top=args.top)
            res["tprofile"]["step_s"] = again
    backend.close()
    del backend
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def trainer_tables(results: dict, kernels: list[str]) -> None:
    """The invariant / fast comparisons of what `trainer_parts` measured for both sets."""
    if len(kernels) < 2 or not all(k in results for k in kernels):
        return
    a, b = (results[k] for k in kernels)
    if "step_s" in a and "step_s" in b:
        say(f"\n| what | {kernels[0]} s | {kernels[1]} s | {kernels[0]} / {kernels[1]} |\n|---|---|---|---|")
        say(f"| trainer step (median) | {a['step_s']:.3f} | {b['step_s']:.3f} | {a['step_s'] / b['step_s']:.2f}x |")
        for k in a["split"]:
            x, y = a["split"][k], b["split"][k]
            say(f"| ... {k} | {x:.3f} | {y:.3f} | {x / y if y else float('nan'):.2f}x |")
    if "ops" in a and "ops" in b:
        say(f"\n| op | calls | {kernels[0]} fwd s | {kernels[1]} fwd s | {kernels[0]} bwd s | {kernels[1]} bwd s | "
            "bwd ratio | bwd gap s |\n|---|---|---|---|---|---|---|---|")
        names = sorted(set(a["ops"]) | set(b["ops"]),
                       key=lambda n: -(a["ops"].get(n, {}).get("bwd_s", 0) - b["ops"].get(n, {}).get("bwd_s", 0)))
        for n in names:
            x, y = a["ops"].get(n, {}), b["ops"].get(n, {})
            xb, yb = x.get("bwd_s", 0.0), y.get("bwd_s", 0.0)
            ratio = f"{xb / yb:.1f}x" if yb else "-"
            say(f"| {n} | {x.get('calls', 0):g} / {y.get('calls', 0):g} | {x.get('fwd_s', 0):.4f} | "
                f"{y.get('fwd_s', 0):.4f} | {xb:.4f} | {yb:.4f} | {ratio} | {xb - yb:.4f} |")
        for k, ops in ((kernels[0], a), (kernels[1], b)):
            steps = ops["ops_steps"]
            bwd = sum(s["backward"] for s in steps) / len(steps)
            fwd = sum(s["forward"] for s in steps) / len(steps)
            opb = sum(v["bwd_s"] for v in ops["ops"].values())
            opf = sum(v["fwd_s"] for v in ops["ops"].values())
            say(f"\n{k}: probed forward {fwd:.3f} s (ops {opf:.3f}, rest {fwd - opf:.3f}); probed backward {bwd:.3f} s "
                f"(ops' own backward {opb:.3f}, rest {bwd - opb:.3f})")


# --- generation -------------------------------------------------------------------------------------


def decode_stepper(fwd: K3Forward, cfg: Any, prompts: list[list[int]], graphed: bool, room: int) -> Callable:
    """After `prompts`' prefill (room for `room` tokens), a function running one decode step (token 5 in every row),
    eager or replayed from a CUDA graph, as `ppo_gpu._decode_step_s` runs it."""
    b = len(prompts)
    caches, _ = P.prefill(fwd, cfg, prompts, room + 1, 0)
    tok = torch.full((b, 1), 5, dtype=torch.long, device=DEV)
    ones = torch.ones(b, dtype=torch.long, device=DEV)
    graph = P.GraphedDecode(fwd, caches, b) if graphed else None
    done = [0]

    def step() -> None:
        pos = torch.tensor([[len(p) + done[0]] for p in prompts], device=DEV)
        done[0] += 1
        if done[0] > room:
            raise RuntimeError("decode_stepper: out of room")
        if graph is not None:
            graph.step(tok, pos)
        else:
            fwd.logits(fwd.hidden(tok, pos, ones, caches)[:, 0])

    return step


def op_table(label: str, per_set: dict[str, dict], key: str, unit: float, unit_name: str) -> None:
    """One markdown table of per-op numbers (`key` of `snapshot()`, per call when `unit` is 'per call') per set."""
    sets = list(per_set)
    names = sorted({n for s in per_set.values() for n in s},
                   key=lambda n: -max(s.get(n, {}).get(key, 0.0) for s in per_set.values()))
    per_call = key == "host_s"
    say(f"\n#### {label}\n")
    head = " | ".join(f"{k} calls | {k} {unit_name}" for k in sets)
    say(f"| op | {head} | {' / '.join(sets)} |\n|---|" + "---|" * (2 * len(sets) + 1))
    for n in names:
        cells, vals = [], []
        for k in sets:
            v = per_set[k].get(n)
            if v is None:
                cells.append("- | -")
                vals.append(None)
                continue
            x = v[key] / (v["calls"] if per_call and v["calls"] else 1) * unit
            cells.append(f"{v['calls']:g} | {x:.1f}" if per_call else f"{v['calls']:g} | {x:.2f}")
            vals.append(x)
        ratio = f"{vals[0] / vals[1]:.2f}x" if len(vals) == 2 and vals[0] and vals[1] else "-"
        say(f"| {n} | {' | '.join(cells)} | {ratio} |")
    for k in sets:
        tot = sum(v[key] for v in per_set[k].values()) * (unit if not per_call else 1e3)
        say(f"{k}: all ops together {tot:.2f} {'ms' if per_call else unit_name}")


def generation_parts(cfg: Any, official: dict, kernels: str, parts: list[str], prompts: list[list[int]],
                     args: argparse.Namespace, results: dict) -> None:
    res = results.setdefault(kernels, {})
    with torch.device(DEV):
        fwd = K3Forward(K3Weights.from_official(cfg.text, {n: t.to(DEV) for n, t in official.items()}),
                        get_kernels(kernels))  # the checkpoint as served: MXFP4 experts packed
        say(f"\n### generation, kernels {kernels}")
        if "prefill" in parts:
            t = P._median_s(lambda: P.prefill(fwd, cfg, prompts, 1, 0), args.reps)
            tokens = len(prompts) * len(prompts[0])
            res["prefill_s"] = t
            say(f"prefill, {len(prompts)} x {len(prompts[0])} tokens: {t:.4f} s ({tokens / t:.0f} tok/s)")
            emit(kind="prefill", kernels=kernels, seconds=t, tokens_per_s=tokens / t)
            res["prefill_profile"] = kernel_table(f"prefill ({kernels}), {len(prompts)} x {len(prompts[0])} tokens in "
                                                  f"{P.PREFILL_CHUNK}-token chunks",
                                                  lambda: P.prefill(fwd, cfg, prompts, 1, 0), top=args.top)
            total = probed_run("synced", lambda: timed(lambda: P.prefill(fwd, cfg, prompts, 1, 0)))
            res["prefill_ops"], res["prefill_synced_s"] = snapshot(), total
            emit(kind="prefill_ops", kernels=kernels, total_s=total, ops=res["prefill_ops"])
        if "decode" in parts:
            for b in (1, 64):
                dprompts = [p[:64] for p in (prompts * 64)[:b]]
                for graphed in ((False, True) if CUDA else (False,)):
                    t = P._decode_step_s(fwd, cfg, dprompts, graphed, 16) if CUDA else float("nan")
                    what = f"decode step, batch {b}, {'CUDA graph' if graphed else 'eager'}"
                    res[what] = t
                    say(f"{what}: {t:.4f} s ({b / t:.0f} tok/s)")
                    emit(kind="decode", kernels=kernels, what=what, seconds=t)
                    if graphed or b == 64:
                        step = decode_stepper(fwd, cfg, dprompts, graphed, 8)
                        step()
                        res[what + " profile"] = kernel_table(f"{what} ({kernels})", step, calls=4, top=args.top)
                    if b == 64 and not graphed:
                        step = decode_stepper(fwd, cfg, dprompts, False, 4)
                        step()
                        total = probed_run("synced", lambda: timed(step))
                        res["decode64_ops"], res["decode64_synced_s"] = snapshot(), total
                        emit(kind="decode64_ops", kernels=kernels, total_s=total, ops=res["decode64_ops"])
        if "host" in parts:
            host = {}
            P.prefill(fwd, cfg, prompts, 1, 0)
            total = probed_run("host", lambda: timed(lambda: P.prefill(fwd, cfg, prompts, 1, 0)))
            host["prefill"] = (snapshot(), total)
            for b in (1, 64):
                step = decode_stepper(fwd, cfg, [p[:64] for p in (prompts * 64)[:b]], False, 4)
                step()
                total = probed_run("host", lambda: timed(step))
                host[f"decode batch {b}"] = (snapshot(), total)
            res["host"] = host
            emit(kind="host", kernels=kernels, host={k: dict(ops=v[0], total_s=v[1]) for k, v in host.items()})
    del fwd
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def generation_tables(results: dict, kernels: list[str]) -> None:
    have = {k: results[k] for k in kernels if k in results}
    if len(have) < 1:
        return
    rows = [w for w in next(iter(have.values())) if w == "prefill_s" or w.startswith("decode step") and
            not w.endswith("profile")]
    if len(have) == 2 and rows:
        a, b = (have[k] for k in kernels)
        say(f"\n| what | {kernels[0]} s | {kernels[1]} s | {kernels[0]} / {kernels[1]} |\n|---|---|---|---|")
        for w in rows:
            if w in a and w in b:
                say(f"| {w} | {a[w]:.4f} | {b[w]:.4f} | {a[w] / b[w]:.2f}x |")
    if all("prefill_ops" in v for v in have.values()):
        op_table("prefill, per-op forward, synchronised per op (ms over one prefill)",
                 {k: v["prefill_ops"] for k, v in have.items()}, "fwd_s", 1e3, "ms")
        for k, v in have.items():
            say(f"{k}: synced prefill {v['prefill_synced_s'] * 1e3:.1f} ms")
    if all("decode64_ops" in v for v in have.values()):
        op_table("eager decode step at batch 64, per-op forward, synchronised per op (ms per step)",
                 {k: v["decode64_ops"] for k, v in have.items()}, "fwd_s", 1e3, "ms")
        for k, v in have.items():
            say(f"{k}: synced eager step {v['decode64_synced_s'] * 1e3:.1f} ms")
    if all("host" in v for v in have.values()):
        for what in next(iter(have.values()))["host"]:
            op_table(f"host time per op call, {what} (us per call; device synchronised before each call)",
                     {k: v["host"][what][0] for k, v in have.items()}, "host_s", 1e6, "us/call")
            for k, v in have.items():
                say(f"{k}: {what} with the per-call syncs: {v['host'][what][1] * 1e3:.1f} ms")


# --- main -------------------------------------------------------------------------------------------


def table_order(kernels: list[str]) -> list[str]:
    """The sets as the comparison tables list them: invariant first (the ratio is invariant / fast), whatever order
    they ran in."""
    return ["invariant", "fast"] if {"invariant", "fast"} <= set(kernels) else kernels


def main() -> int:
    global JSON_OUT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Parts: trainer, ops, tprofile, prefill, decode, host (module docstring).")
    p.add_argument("--config", default="configs/k3-1b.yaml")
    p.add_argument("--parts", default="trainer,ops", type=lambda v: v.split(","))
    p.add_argument("--kernels", default="invariant,fast", type=lambda v: v.split(","),
                   help="kernel sets, run in this order (the tables list invariant first: invariant / fast)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--len", type=int, default=256)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    p.add_argument("--profile-batch", type=int, default=2)
    p.add_argument("--profile-len", type=int, default=128)
    p.add_argument("--top", type=int, default=15, help="kernel names per profile table")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0, help="checkpoint seed (ppo_gpu's default)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"],
                   help="checkpoint and compute dtype (default: the config's)")
    p.add_argument("--json", help="append one JSON line per measurement here")
    args = p.parse_args()
    JSON_OUT = Path(args.json) if args.json else None
    unknown = set(args.parts) - {"trainer", "ops", "tprofile", "prefill", "decode", "host"}
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}")
    if CUDA:
        props = torch.cuda.get_device_properties(0)
        say(f"# {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC; {props.name}; torch {torch.__version__}")
    instrument()
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ckpt = init_checkpoint(args.config, Path(tmp) / "ckpt", seed=args.seed, dtype=args.dtype)
        cfg, official = load_checkpoint(ckpt)
        say(f"checkpoint {args.config} ({cfg.text.torch_dtype}) in {time.perf_counter() - t0:.1f} s")
        g = torch.Generator().manual_seed(5)  # ppo_gpu.benchmark's inputs: train ids first, then the prompts
        ids = torch.randint(4, cfg.text.vocab_size, (args.batch, args.len), generator=g, device="cpu")
        lens = torch.full((args.batch,), args.len)
        prompts = [torch.randint(4, cfg.text.vocab_size, (args.len,), generator=g, device="cpu").tolist()
                   for _ in range(args.batch)]
        if {"trainer", "ops", "tprofile"} & set(args.parts):
            for k in args.kernels:
                trainer_parts(ckpt, k, args.parts, ids, lens, args, results)
            trainer_tables(results, table_order(args.kernels))
        if {"prefill", "decode", "host"} & set(args.parts):
            for k in args.kernels:
                generation_parts(cfg, official, k, args.parts, prompts, args, results)
            generation_tables(results, table_order(args.kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
