#!/usr/bin/env bash
# The main job on the bundled tiny config: 100 PPO steps on k3-tiny (vLLM rollouts, Megatron trainer),
# KL(rollout || trainer) checked to be exactly 0 at every step, then a summary of metrics.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/demo}
rm -rf "$OUT"
.venv/bin/zerokl ppo --config configs/ppo-tiny.yaml --out "$OUT" --wandb offline
.venv/bin/python scripts/summarize_run.py "$OUT/metrics.jsonl"
