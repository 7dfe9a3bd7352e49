# Source on a CUDA machine with Python 3.12 and torch but no network, from the repository root:
#     source scripts/gpu_env.sh
# It takes vLLM 0.32.0's CUDA build from .vllm-cuda/ (the offline bundle: its env.sh unpacks it and sets vLLM's
# variables) and installs the wheels in .whl/ (fla-core, compressed-tensors, megatron-core, einops, loguru, zerokl's
# own wheel, whose entry point registers the vLLM plugin, and for `zerokl serve` the five packages vLLM's API server
# imports that the bundle lacks: prometheus-fastapi-instrumentator, model-hosting-container-standards, jmespath,
# supervisor, python-multipart) into /tmp/zerokl-site, then puts this source tree
# first on PYTHONPATH, so `python3 -m zerokl.cli ...` runs the checkout. With network, `pip install -e ".[cuda,test]"`
# is the whole install instead.
source .vllm-cuda/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/zerokl-site .whl/*.whl \
    || echo "gpu_env.sh: installing the wheels in .whl/ failed" >&2
export PYTHONPATH="$PWD:/tmp/zerokl-site${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false VLLM_CACHE_ROOT=/tmp/zerokl-cache/vllm
