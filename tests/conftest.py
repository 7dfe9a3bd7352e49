"""Shared test setup: vLLM's CPU settings and offline hub access for the whole session, and what several modules share
because it is costly to make: the seed-0 checkpoints, one vLLM engine and one `zerokl serve` server on k3-tiny, and
one finished PPO run."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import (K3_ENGINE_ARGS, K3_LORA_ARGS, PPO_REFERENCE_CHECKPOINTS, PPO_REFERENCE_CONFIG, PPO_REFERENCE_STEPS,
                     PPOReference, free_port, running_server)

REPO = Path(__file__).resolve().parents[1]


def _float32_copy(config: Path, out: Path) -> Path:
    """The config's seed-0 checkpoint (bf16) with every bf16 tensor upcast (exactly) and `torch_dtype: float32`."""
    import torch

    from parity.config import parse_model_config
    from parity.io.checkpoint import init_checkpoint, load_checkpoint, save_checkpoint

    cfg, weights = load_checkpoint(init_checkpoint(config, out.with_name(out.name + "-bf16"), seed=0))
    fp32 = {n: t.float() if t.dtype == torch.bfloat16 else t for n, t in weights.items()}
    return save_checkpoint(parse_model_config({**cfg.raw, "torch_dtype": "float32"}), fp32, out)


@pytest.fixture(scope="session")
def k3_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The k3-tiny checkpoint, seed 0, its bf16 weights re-stored in fp32 (`torch_dtype: float32`), so it computes in
    fp32: the suite's fp32 coverage (`k3_tiny_mxfp4` is the bf16 / MXFP4 / FP8 one). Built once per test session;
    tests read it and never write into it (they copy what they change)."""
    return _float32_copy(REPO / "configs" / "k3-tiny.yaml", tmp_path_factory.mktemp("k3-tiny") / "k3-tiny")


@pytest.fixture(scope="session")
def kimi_linear_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kimi-linear-tiny checkpoint, seed 0, re-stored in fp32 like `k3_tiny`, once per session (read only)."""
    return _float32_copy(REPO / "configs" / "kimi-linear-tiny.yaml",
                         tmp_path_factory.mktemp("kimi-linear-tiny") / "kimi-linear-tiny")


@pytest.fixture(scope="session")
def k3_tiny_mxfp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/k3-tiny-mxfp4.yaml, seed 0: bf16 compute, MXFP4 routed experts, FP8 MLA latents (read only)."""
    from parity.io.checkpoint import init_checkpoint

    return init_checkpoint(REPO / "configs" / "k3-tiny-mxfp4.yaml",
                           tmp_path_factory.mktemp("k3-tiny-mxfp4") / "k3-tiny-mxfp4", seed=0)


@pytest.fixture(scope="session")
def ppo_reference(k3_tiny_mxfp4: Path, tmp_path_factory: pytest.TempPathFactory) -> PPOReference:
    """PPO_REFERENCE_CONFIG (configs/ppo-tiny-mxfp4.yaml) on `k3_tiny_mxfp4`, the checkpoint its model and seed give
    (K3's own numerics: bf16, MXFP4 experts, FP8 latents): PPO_REFERENCE_STEPS steps in this process with checkpoints
    after PPO_REFERENCE_CHECKPOINTS, every step's parity holding; the run is closed before the tests that read it
    start (one Megatron trainer per process at a time)."""
    from zerokl.ppo.config import load_ppo_config
    from zerokl.ppo.loop import PPORun

    out = tmp_path_factory.mktemp("ppo-reference")
    cfg = replace(load_ppo_config(REPO / PPO_REFERENCE_CONFIG), model=str(k3_tiny_mxfp4), steps=PPO_REFERENCE_STEPS,
                  wandb="disabled")
    run = PPORun(cfg, out, log=lambda _: None)
    metrics = []
    try:
        for _ in range(PPO_REFERENCE_STEPS):
            result = run.run_step()
            assert result.diagnosis is None, result.diagnosis
            metrics.append(result.metrics)
            if run.step in PPO_REFERENCE_CHECKPOINTS:
                run.save_state(out / "checkpoints" / f"step-{run.step}")
    finally:
        run.close()
    return PPOReference(metrics, out)


@pytest.fixture(scope="session")
def k3_engine(k3_tiny: Path) -> Iterator[object]:
    """One `RolloutEngine` on `k3_tiny` (K3_ENGINE_ARGS and K3_LORA_ARGS) for the rollout modules. A test that changes
    its base weights installs the checkpoint's again (as a newer version) before it ends, so base requests always run
    on the checkpoint's weights; the policy version only grows."""
    from rollout.engine import RolloutEngine

    with RolloutEngine(k3_tiny, **K3_ENGINE_ARGS, **K3_LORA_ARGS) as engine:
        yield engine


@pytest.fixture(scope="session")
def k3_server(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """`zerokl serve` on `k3_tiny` with the shared engine's settings, K3's launch-recipe chat flags (tool-call and
    reasoning parsers) and an adapter directory (--lora-root): (its base URL, the directory, empty at start; tests add
    the adapters they serve)."""
    root = tmp_path_factory.mktemp("served-adapters")
    port = free_port()
    argv = [sys.executable, "-m", "zerokl.cli", "serve", "--checkpoint", str(k3_tiny), "--port", str(port),
            "--lora-root", str(root), "--max-loras", str(K3_LORA_ARGS["max_loras"]),
            "--max-lora-rank", str(K3_LORA_ARGS["max_lora_rank"]),
            "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3", "--",
            "--max-model-len", str(K3_ENGINE_ARGS["max_model_len"]),
            "--max-num-seqs", str(K3_ENGINE_ARGS["max_num_seqs"]), "--enable-prefix-caching"]
    with running_server(argv, port, tmp_path_factory.mktemp("server") / "server.log") as base:
        yield base, root


# The session fixtures worth sharing between modules, by the group of modules that must run in one process to share
# them: under `pytest -n N --dist loadgroup` (make test) each group, and each other module, runs whole on one worker.
SHARED_FIXTURE_GROUPS = {"k3_engine": "k3-engine", "k3_server": "k3-engine", "ppo_reference": "ppo-reference"}


def _group(item: pytest.Item) -> str:
    """The xdist group of a test: the shared-fixture group of the fixtures it uses, else its module."""
    uses = {SHARED_FIXTURE_GROUPS[f] for f in getattr(item, "fixturenames", ()) if f in SHARED_FIXTURE_GROUPS}
    if len(uses) > 1:
        raise pytest.UsageError(f"{item.nodeid} uses fixtures of groups {sorted(uses)}: give them one group in "
                                "SHARED_FIXTURE_GROUPS")
    return uses.pop() if uses else item.module.__name__


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark the test with its xdist group as it is collected: xdist's workers read the marks into the test ids the
    controller schedules by before any `pytest_collection_modifyitems` of ours runs."""
    item.add_marker(pytest.mark.xdist_group(_group(item)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the groups holding a `heavy` test first (several engine processes at once, while no session engine is up
    yet: with the session fixtures' engines alive too they can pass the host's memory), then those holding a `slow`
    test (the two workers then end together, the fast modules filling in around them), each group's tests in their
    collected order. `make test` keeps this order (`--no-loadscope-reorder`). Groups of a tier go in the order their
    files' names sort (the tests' order before they moved into folders by what they compare, tests/README.md), so a
    module's folder does not change the schedule."""
    items.sort(key=lambda item: item.path.name)  # stable: each file's tests stay in their collected order
    groups = {item.nodeid: _group(item) for item in items}
    heavy = {groups[item.nodeid] for item in items if item.get_closest_marker("heavy")}
    slow = {groups[item.nodeid] for item in items if item.get_closest_marker("slow")}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(groups[item.nodeid], index)
    items.sort(key=lambda item: (groups[item.nodeid] not in heavy, groups[item.nodeid] not in slow,
                                 first[groups[item.nodeid]]))


@pytest.fixture(scope="session", autouse=True)
def vllm_env() -> Iterator[None]:
    """vLLM-CPU needs a KV-cache size (1 GiB unless the caller sets one); compile caches stay in the repo; under
    pytest-xdist each worker's engines run on a core of their own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        mp.setenv("VLLM_CACHE_ROOT", str(REPO / ".cache" / "vllm"))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ... under pytest -n N
        if worker is not None:  # one core per worker for vLLM's model process (its default binds core 0 in each)
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", str(int(worker.removeprefix("gw")) % (os.cpu_count() or 1)))
        yield


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny float64 ops (threads only add overhead there); restored after it. A
    module asks for it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
