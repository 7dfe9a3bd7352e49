"""`zerokl ppo --config C [--steps N] [--out DIR] [--resume DIR] [--kernels K] [--on-mismatch M] [--wandb W]
[--nproc-per-node N [--tp T] [--ep E]] [--rollout-servers URL,... | --num-rollout-servers N]`.

Writes `OUT/metrics.jsonl` (one line per step, keys `METRIC_KEYS` plus loss/grad_norm/sync figures),
checkpoints under `OUT/checkpoints/step-N`, wandb files under `OUT/wandb` (offline unless `--wandb online`),
and `OUT/diagnosis.txt` when parity breaks. Exit code: 0 when every step had KL exactly 0, 1 when a step
broke parity (after the diagnosis), 2 for user errors (among them a reward function that raises or returns
something other than a finite number mid-run: the error names the dataset line and the step).

`--nproc-per-node N` (N > 1) starts N processes of this command (`zerokl.launch`; the run's starting checkpoint is
created first); under any torchrun-style launcher the command runs as one rank of it. They form TP x DP = N
Megatron ranks with the routed experts split over EP (`--tp`, `--ep`, config keys `tp`, `ep`; the DP gradients
averaged, Megatron's distributed optimizer sharding the fp32 masters and Adam over the DP ranks).
Each data-parallel rank trains on its own part of every minibatch (`data_parallel: shard`, the default), or on the
whole batch with `data_parallel: replicate`. Rank 0 owns the rollout engine and writes the metrics, wandb and console
output; checkpoints are written collectively.

`--rollout-servers URL,...` rolls out on running `zerokl serve` servers and syncs weights into them
(`rollout.client.remote`); `--num-rollout-servers N` starts N of them on this machine first (`rollout.client.local_servers`, logs
in `OUT/servers/`) and stops them when the run ends, by error, Ctrl-C or SIGTERM included.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from parity.config import ConfigError
from zerokl.argtypes import kernel_set, positive_int
from zerokl.ppo.config import ON_MISMATCH, WANDB_MODES, PPOConfig, load_ppo_config
from zerokl.tasks import RewardError


def _console(step: int, total: int, m: dict[str, float], seconds: float) -> str:
    width = 24
    done = int(width * step / total)
    bar = "#" * done + "." * (width - done)
    return (f"[{bar}] step {step}/{total} reward {m['reward_mean']:.3f} kl {m['kl']:.1e} "
            f"eq {m['bitwise_equal_frac']:.3f} {_routing(m)}v{int(m['policy_version'])} "
            f"rollout {m['rollout_tokens_per_s']:.0f} tok/s train {m['train_tokens_per_s']:.0f} tok/s "
            f"{_sync(m)}({seconds:.1f}s)")


def _routing(m: dict[str, float]) -> str:
    return f"route {m['routing_agreement']:.3f} " if "routing_agreement" in m else ""


def _sync(m: dict[str, float]) -> str:
    if "sync_seconds" not in m:
        return ""
    text = f"sync {m['sync_seconds'] * 1e3:.0f} ms {m['sync_bytes'] / 1e6:.2f} MB"
    if "sync_bytes_bf16" in m:
        text += f" (bf16 {m['sync_bytes_bf16'] / 1e6:.2f} MB)"
    if "full_sync_seconds" in m:
        text += f" (full weights {m['full_sync_seconds'] * 1e3:.0f} ms {m['full_sync_bytes'] / 1e6:.1f} MB)"
    return text + " "


def _old_logprob_savings(steps: list[dict[str, float]]) -> str:
    """With `old_logprobs: rollout`: the time the skipped old-log-prob passes would have cost, from the steps that
    ran it (each pays it once), against the run's total step time."""
    ran = [m for m in steps if m["old_logprob_recomputed"]]
    skipped = len(steps) - len(ran)
    total = sum(m["time_gen"] + m["time_ref"] + m["time_old_logprob"] + m["time_update"] + m["time_sync"] for m in steps)
    if not ran or not skipped:
        return f"old_logprobs: rollout: the old-log-prob pass ran on {len(ran)} of {len(steps)} steps"
    saved = sum(m["time_old_logprob"] for m in ran) / len(ran) * skipped
    return (f"old_logprobs: rollout: the old-log-prob pass ran on {len(ran)} of {len(steps)} steps ({saved / skipped:.2f} s "
            f"each); skipping it saved about {saved:.1f} s, {saved / (total + saved):.0%} of the step time recomputing "
            "every step would take")


def _wandb_run(cfg: PPOConfig, out: Path):
    if cfg.wandb == "disabled":
        return None
    import wandb

    return wandb.init(project="zerokl", dir=str(out), mode=cfg.wandb, config=asdict(cfg), reinit=True)


def run(args: argparse.Namespace) -> int:
    from zerokl.ppo.setup import check_sharding, data_parallel_ranks

    servers = args.num_rollout_servers
    if args.ray is not None and servers is None and not _config_key(args.config, "num_rollout_servers"):
        servers = 1  # --ray runs the servers it starts: one unless the flag or the config says more
    cfg = load_ppo_config(args.config, steps=args.steps, kernels=args.kernels, on_mismatch=args.on_mismatch,
                          wandb=args.wandb, lora=args.lora or None, rollout_servers=args.rollout_servers,
                          num_rollout_servers=servers, tp=args.tp, ep=args.ep)
    out = Path(args.out)
    try:
        processes = int(os.environ.get("WORLD_SIZE", args.nproc_per_node))
        check_sharding(cfg, data_parallel_ranks(cfg, processes))
        _check_nproc(cfg, processes)
    except ConfigError as e:
        raise ConfigError(f"{args.config}: {str(e).removeprefix('ppo config: ')}") from None
    if args.ray is not None:
        from zerokl.ppo.on_ray import run_on_ray

        return run_on_ray(cfg, out.resolve(), args.resume, args.ray, args.nproc_per_node, train)
    if cfg.num_rollout_servers:
        return _with_servers(cfg, out, args)
    if args.nproc_per_node > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(cfg, out, args.nproc_per_node)
    return train(cfg, out, args.resume)


def _with_servers(cfg: PPOConfig, out: Path, args: argparse.Namespace) -> int:
    """Start `num_rollout_servers` servers on the run's checkpoint, train against them, stop them however the run
    ends (a SIGTERM ends the run as Ctrl-C does)."""
    from rollout.client.local_servers import local_servers
    from zerokl.ppo.setup import base_checkpoint, server_lora
    from zerokl.ppo.rollouts import engine_args_for

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    checkpoint = base_checkpoint(cfg, out)
    lora = server_lora(cfg, checkpoint, args.resume, out / "served-adapters")
    with local_servers(checkpoint, cfg.num_rollout_servers, out / "servers", cfg.kernels, engine_args_for(cfg),
                       lora=lora, vision_synced=cfg.vision_tower == "trainable") as urls:
        if args.nproc_per_node > 1 and "WORLD_SIZE" not in os.environ:
            from zerokl.launch import launch
            return launch([*sys.argv[1:], "--num-rollout-servers", "0", "--rollout-servers", ",".join(urls)],
                          args.nproc_per_node)
        return train(replace(cfg, rollout_servers=list(urls), num_rollout_servers=0), out, args.resume)


def train(cfg: PPOConfig, out: Path, resume: str | None) -> int:
    """The PPO run in this process (one rank under a launcher): the console lines, metrics, checkpoints; its exit
    code."""
    from rollout.sampling import RolloutError
    from zerokl.ppo.loop import PPORun
    from zerokl.ppo.rollouts import StaleRollout
    from zerokl.ppo.sync import SyncFailed
    from zerokl.ppo.state import CheckpointError, resume_point

    rank0 = int(os.environ.get("RANK", "0")) == 0
    log = (lambda msg: print(msg, flush=True)) if rank0 else (lambda msg: None)  # noqa: E731
    run_ = PPORun(cfg, out, resume_point(Path(resume)) if resume else None, log=log)
    wb = _wandb_run(cfg, out) if rank0 else None
    metrics_path = out / "metrics.jsonl"
    if rank0 and run_.step == 0:
        metrics_path.write_text("")
    elif rank0:  # keep the lines up to the resumed step, so the file matches an uninterrupted run
        kept = [ln for ln in metrics_path.read_text().splitlines() if json.loads(ln)["step"] < run_.step] \
            if metrics_path.exists() else []
        metrics_path.write_text("".join(ln + "\n" for ln in kept))
    broke = False
    steps: list[dict[str, float]] = []
    try:
        while run_.step < cfg.steps:
            t0 = time.perf_counter()
            try:
                result = run_.run_step()
            except (SyncFailed, StaleRollout, RolloutError) as e:
                log(f"STOPPED at step {run_.step}: {e}")
                return 1
            except RewardError as e:  # the user's reward function failed: a user error (exit 2)
                raise RewardError(f"{e}; stopping at step {run_.step}") from None
            m = result.metrics
            steps.append(m)
            if rank0:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(m) + "\n")
            if wb is not None:
                wb.log(m, step=int(m["step"]))
            log(_console(int(m["step"]) + (0 if result.diagnosis else 1), cfg.steps, m, time.perf_counter() - t0))
            if result.diagnosis:
                broke = True
                log(f"PARITY BROKEN at step {int(m['step'])}: {result.diagnosis}")
                if cfg.on_mismatch == "stop":
                    return 1
            if run_.step % cfg.checkpoint_every == 0 or run_.step == cfg.steps:
                try:
                    run_.save_state(out / "checkpoints" / f"step-{run_.step}")
                except CheckpointError as e:
                    log(f"STOPPED at step {run_.step}: {e}")
                    return 1
        log(f"done: {cfg.steps} steps, metrics in {metrics_path}")
        if cfg.old_logprobs == "rollout":
            log(_old_logprob_savings(steps))
        return 1 if broke else 0
    finally:
        if wb is not None:
            wb.finish()
        run_.close()


def _launch(cfg: PPOConfig, out: Path, nproc: int) -> int:
    """This command on `nproc` processes, after creating the run's starting checkpoint once."""
    from zerokl.launch import launch
    from zerokl.ppo.setup import base_checkpoint

    base_checkpoint(cfg, out)
    return launch(sys.argv[1:], nproc)


def _config_key(path: str, key: str) -> object:
    """`key`'s value in the YAML config at `path` (None when absent or unreadable: loading it says why)."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None
    return raw.get(key) if isinstance(raw, dict) else None


def _check_nproc(cfg: PPOConfig, nproc: int) -> None:
    if nproc > 1 and cfg.max_staleness:
        raise ConfigError(f"ppo config: {nproc} processes with max_staleness > 0 is not supported (rank 0 alone keeps "
                          "the earlier versions the check runs on); set max_staleness: 0 or run one process")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ppo", help="PPO with the zero-KL check every step (vLLM rollouts, Megatron trainer)")
    p.add_argument("--config", required=True, help="PPO run config (YAML), e.g. configs/ppo-tiny.yaml")
    p.add_argument("--steps", type=int, help="override the config's number of steps")
    p.add_argument("--out", default="out/ppo", help="run directory (metrics.jsonl, checkpoints, wandb)")
    p.add_argument("--resume", help="an earlier run's directory (its latest complete checkpoint) or one of its "
                                    "checkpoints (OUT/checkpoints/step-N)")
    p.add_argument("--kernels", type=kernel_set, help="invariant, triton (CUDA, or TRITON_INTERPRET=1 on CPU), or "
                   "fast = plain torch ops on both sides (the non-invariant baseline: expect the zero-KL check to fail)")
    p.add_argument("--on-mismatch", choices=ON_MISMATCH, help="warn: keep training and record the drift")
    p.add_argument("--lora", action="store_true", help="train only a LoRA adapter (config keys lora_rank, "
                   "lora_alpha, lora_targets, lora_init) and sync only the adapter into the rollout engine")
    p.add_argument("--wandb", choices=WANDB_MODES, help="wandb mode (default offline)")
    p.add_argument("--nproc-per-node", type=positive_int, default=1, help="processes (TP x DP of them, experts split "
                   "over EP; each data-parallel rank trains on its own part of every minibatch, or on the whole batch with data_parallel: replicate); N > 1 starts N "
                   "copies of this command")
    p.add_argument("--tp", type=positive_int, help="tensor-parallel ranks (config key tp, default 1)")
    p.add_argument("--ep", type=positive_int, help="expert-parallel ranks (config key ep, default 1)")
    p.add_argument("--rollout-servers", type=_urls, metavar="URL[,URL...]", help="roll out on these running `zerokl "
                   "serve` servers (same checkpoint) over HTTP and sync weights into them (config key "
                   "rollout_servers)")
    p.add_argument("--num-rollout-servers", type=int, metavar="N", help="start N `zerokl serve` servers on this "
                   "machine for the run and stop them at its end (config key num_rollout_servers)")
    p.add_argument("--ray", metavar="auto|ADDRESS", help="run on a Ray cluster: the rollout servers "
                   "(--num-rollout-servers, default 1) and the trainer ranks (--nproc-per-node) as Ray actors in one "
                   "placement group (zerokl.ppo.on_ray; pip install zerokl[ray])")
    p.set_defaults(func=run)


def _urls(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]

