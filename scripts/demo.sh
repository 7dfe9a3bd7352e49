#!/usr/bin/env bash
# The main job on the bundled tiny config, end to end as far as the project goes today:
# build an official-format checkpoint, print the K3 plan, and show the parity contract on the
# shared K3 forward (invariant kernels bit-identical across schedules, fast kernels not).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/demo}
rm -rf "$OUT" && mkdir -p "$OUT"
.venv/bin/zerokl init-checkpoint --config configs/k3-tiny.yaml --out "$OUT/k3-tiny" --seed 0
.venv/bin/zerokl plan --config configs/k3-full.yaml --tp 8 --ep 64
.venv/bin/python scripts/parity_demo.py "$OUT/k3-tiny"
