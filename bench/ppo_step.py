"""The whole PPO step through vLLM, the invariant kernels against `--kernels fast`, in one run of this script: `zerokl
ppo` on one config twice, one process each, one after the other on the same machine (in one process the second run
met the first's GPU memory still held: out of memory on an H100), then each phase's median over the steps after the
first (which compiles and warms) and the ratio invariant / fast.

    python bench/ppo_step.py --config configs/ppo-1b.yaml --steps 6 --out /tmp/ppo-step --json OUT.json

Phases are the run's own timings (`zerokl.ppo.metrics.TIMING_KEYS`): generation, the reference and old-log-prob
passes, the update (the check's forward, backward and optimizer), export + weight sync. The fast run keeps training
through its mismatches (`--on-mismatch warn`, exit 1): its KL is not 0, which is the point of the control. On CUDA the
invariant engine replays its decode steps from CUDA graphs and the fast one runs eagerly (`rollout.vllm.graphs`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

PHASES = ("time_gen", "time_ref", "time_old_logprob", "time_update", "time_sync")
KERNEL_SETS = ("invariant", "fast")


def _run(config: str, kernels: str, steps: int, out: Path) -> list[dict]:
    """One `zerokl ppo` run in its own process (its output passed through); its metrics lines."""
    code = subprocess.run([sys.executable, "-m", "zerokl.cli", "ppo", "--config", config, "--steps", str(steps),
                           "--out", str(out), "--kernels", kernels, "--on-mismatch", "warn", "--wandb", "disabled"],
                          check=False).returncode
    if code != (1 if kernels == "fast" else 0):  # a run with a mismatch exits 1, after its last step
        raise SystemExit(f"zerokl ppo --kernels {kernels} exited {code}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _medians(metrics: list[dict]) -> dict[str, float]:
    """Each phase's median over the steps after the first, and of their sum."""
    timed = metrics[1:]
    rows = {p: statistics.median(m[p] for m in timed) for p in PHASES}
    rows["step"] = statistics.median(sum(m[p] for p in PHASES) for m in timed)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a PPO config (YAML)")
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is not timed); at least 2")
    parser.add_argument("--out", type=Path, required=True, help="a directory for the two runs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is not timed)")
    runs = {k: _run(args.config, k, args.steps, args.out / k) for k in KERNEL_SETS}
    kl = [m["kl"] for m in runs["invariant"]]
    print(f"invariant KL per step: {kl}")
    rows = {k: _medians(v) for k, v in runs.items()}
    print("\n| phase (median s) | invariant | fast | ratio |\n|---|---|---|---|")
    for phase in (*PHASES, "step"):
        inv, fast = rows["invariant"][phase], rows["fast"][phase]
        ratio = f"{inv / fast:.2f}x" if fast >= 1e-3 else "-"  # a phase the config skips takes ~0 s
        print(f"| {phase} | {inv:.3f} | {fast:.3f} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "medians": rows,
                                         "metrics": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
