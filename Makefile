# The two README commands. Both are idempotent: the venv is created once and re-synced when
# pyproject.toml or scripts/install.sh change.
PY      := .venv/bin/python
STAMP   := .venv/.installed
export VLLM_CACHE_ROOT ?= $(CURDIR)/.cache/vllm
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	bash scripts/install.sh
	touch $(STAMP)

# vLLM's CPU KV cache (GiB per engine): 2 for the demo's engine; the tests take 1 (tests/conftest.py), since up to six
# engines are up at once on the 24 GiB CI machine
demo: export VLLM_CPU_KVCACHE_SPACE ?= 2
demo: install
	bash scripts/demo.sh

# Two pytest workers on the 2-core CI machine: much of a test's time is single-threaded (imports, engine and
# server starts, subprocesses), so the other worker's tests fill it. Modules sharing session fixtures run on one
# worker (tests/conftest.py).
PYTEST_WORKERS ?= 2
# Each worker's torch takes an equal share of the cores (at least 1): OpenMP threads of two workers oversubscribing two
# cores spin against each other (measured: a suite of 19.4 min ran in 14.2 with one thread per worker). The parity
# kernels' bits do not depend on the thread count (tests/invariance/test_kernels.py).
test: export OMP_NUM_THREADS ?= $(shell n=$$(( $$(nproc) / $(PYTEST_WORKERS) )); echo $$(( n > 0 ? n : 1 )))

test: install
	$(PY) -m pytest -q -ra -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)
