"""The trainer seam (`trainer.backend`) without the rollout engine: the Megatron trainer with a LoRA adapter gives the
shared forward's log-prob bits and trains the adapter alone; `save_state` / `load_state` continue bit for bit, with
and without an adapter and with GAE's value head; user mistakes are ConfigErrors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from lora.adapter import load_adapter, load_lora, save_adapter
from lora.init import random_adapter
from parity.config import ConfigError, ModelConfig
from parity.kernels import INVARIANT
from parity.model import K3Forward, K3Weights, score_sequences
from parity.weights import text_specs
from trainer.backend import TrainerBackend, build_backend
from trainer.base import ADAPTER_DIR, WEIGHTS_FILE
from trainer.logprobs import PaddedBatch, token_logprobs
from parity.io.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TEMPERATURE = 0.8
LR = 3e-3


@pytest.fixture(scope="module")
def checkpoint(k3_tiny: Path) -> Path:
    return k3_tiny


@pytest.fixture(scope="module")
def official(checkpoint: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return load_checkpoint(checkpoint)


@pytest.fixture(scope="module")
def adapter_dir(official: tuple[ModelConfig, dict[str, torch.Tensor]],
                tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `zerokl lora init` adapter (B non-zero) on attention, MLP and latent-MoE projections."""
    cfg, _ = official
    adapter = random_adapter(cfg.text, rank=4, targets=["q_proj", "o_proj", "kv_b_proj", "gate_proj", "down_proj",
                                                        "routed_expert_up_proj"], seed=1)
    return save_adapter(adapter, tmp_path_factory.mktemp("seam") / "adapter")


def _pg_loss(step: int) -> Callable[[torch.nn.Module], torch.Tensor]:
    """A policy-gradient-shaped loss on 4 random sequences (step-seeded)."""
    g = torch.Generator().manual_seed(1000 + step)
    batch = PaddedBatch.from_sequences([torch.randint(4, 1024, (int(n),), generator=g).tolist()
                                        for n in torch.randint(3, 14, (4,), generator=g)])
    adv = torch.randn(4, generator=g)
    return lambda model: -(token_logprobs(model, batch, 1.0).sum(1) * adv).mean()


def _seqs() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, 1024, (n,), generator=g).tolist() for n in (9, 4, 12)]


def _run(backend: TrainerBackend, steps: range) -> tuple[list[tuple[float, float]], dict[str, torch.Tensor]]:
    """`steps` optimizer steps, each accumulating two micro-batches' gradients."""
    history = [backend.train_step(_pg_loss(step), _pg_loss(100 + step)) for step in steps]
    return history, backend.export_weights()


def test_lora_backend_equals_the_shared_forward_and_trains_the_adapter_only(
        checkpoint: Path, adapter_dir: Path, official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """With an adapter directory: log-probs = `K3Forward` with `K3Weights.lora` from `lora.adapter.load_lora`
    (torch.equal); `export_weights` is the adapter's PEFT tensors; two steps, each accumulating two micro-batches, move
    the adapter and leave the base frozen."""
    cfg, weights = official
    seqs = _seqs()
    with_lora = K3Weights.from_official(cfg.text, weights)
    with_lora.lora = load_lora(adapter_dir, cfg.text)
    ref = score_sequences(K3Forward(with_lora, INVARIANT), seqs, TEMPERATURE)
    start = load_adapter(adapter_dir, cfg.text)
    backend = build_backend(checkpoint, lr=LR, adapter=adapter_dir)
    try:
        lp = backend.logprobs(PaddedBatch.from_sequences(seqs), TEMPERATURE)
        for i, s in enumerate(seqs):
            assert torch.equal(lp[i, : len(s) - 1], ref[i]), f"sequence {i}"
        exported = backend.export_weights()
        assert exported.keys() == start.tensors().keys()
        assert all(torch.equal(t, start.tensors()[n]) for n, t in exported.items())
        _, trained = _run(backend, range(2))
        base = backend.export_official()
    finally:
        backend.close()
    assert all(torch.equal(base[n], t.float()) for n, t in weights.items() if n in text_specs(cfg.text))
    assert trained.keys() == start.tensors().keys()
    assert not all(torch.equal(trained[n], t) for n, t in start.tensors().items())


@pytest.mark.parametrize("lora", [True, False])
def test_state_round_trip_continues_bitwise(lora: bool, checkpoint: Path, adapter_dir: Path, tmp_path: Path) -> None:
    """step 0, save_state, step 1 == a fresh backend that loads the state and runs step 1: (loss, grad norm) and the
    exported weights (or adapter) bit for bit; the state holds weights.pt, or adapter/ with LoRA."""
    adapter = adapter_dir if lora else None
    backend = build_backend(checkpoint, lr=LR, adapter=adapter)
    try:
        backend.train_step(_pg_loss(0))
        backend.save_state(tmp_path / "state")
        want = _run(backend, range(1, 2))
    finally:
        backend.close()
    assert (tmp_path / "state" / (ADAPTER_DIR if lora else WEIGHTS_FILE)).exists()
    resumed = build_backend(checkpoint, lr=LR, adapter=adapter)
    try:
        resumed.load_state(tmp_path / "state")
        history, weights = _run(resumed, range(1, 2))
        with pytest.raises(FileNotFoundError):
            resumed.load_state(tmp_path / "nothing")
    finally:
        resumed.close()
    assert history == want[0] and weights.keys() == want[1].keys()
    assert all(torch.equal(t, want[1][n]) for n, t in weights.items())


def test_value_head_state_round_trip_continues_bitwise(checkpoint: Path, tmp_path: Path) -> None:
    """With GAE's value head (`value_head_lr`: its own Adam group) and a loss that trains it: step 0, save_state,
    step 1 == a fresh backend that loads the state and runs step 1, (loss, grad norm), the exported weights and the
    head bit for bit; the head is in the state (value_head.pt), never in the export."""
    from trainer.megatron.backend import VALUE_HEAD_FILE

    def loss(step: int) -> Callable[[torch.nn.Module], torch.Tensor]:
        g = torch.Generator().manual_seed(2000 + step)
        batch = PaddedBatch.from_sequences([torch.randint(4, 1024, (9,), generator=g).tolist() for _ in range(3)])
        target = torch.rand(3, 9, generator=g)
        return lambda model: ((model(batch.input_ids, batch.lens, 1.0, values=True)[1] - target) ** 2).mean()

    def run(backend: TrainerBackend) -> tuple[tuple[float, float], dict[str, torch.Tensor], torch.Tensor]:
        step = backend.train_step(loss(1))
        return step, backend.export_weights(), backend.trainer.module.value_head.weight.detach().clone()

    backend = build_backend(checkpoint, lr=LR, value_head_lr=LR / 10)
    try:
        backend.train_step(loss(0))
        backend.save_state(tmp_path / "state")
        want = run(backend)
    finally:
        backend.close()
    assert (tmp_path / "state" / VALUE_HEAD_FILE).exists() and want[2].abs().sum() > 0
    assert not any("value_head" in n for n in want[1])
    resumed = build_backend(checkpoint, lr=LR, value_head_lr=LR / 10)
    try:
        resumed.load_state(tmp_path / "state")
        got = run(resumed)
    finally:
        resumed.close()
    assert got[0] == want[0] and torch.equal(got[2], want[2])
    assert got[1].keys() == want[1].keys() and all(torch.equal(t, want[1][n]) for n, t in got[1].items())


def test_user_mistakes_are_config_errors(checkpoint: Path, adapter_dir: Path, kimi_linear_tiny: Path) -> None:
    with pytest.raises(ConfigError, match="has no vision tower"):
        build_backend(kimi_linear_tiny, train_vision=True)
    with pytest.raises(ConfigError, match="the vision tower trains without an adapter only"):
        build_backend(checkpoint, adapter=adapter_dir, train_vision=True)


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> Iterator[None]:
    """Each backend starts and ends its own process group."""
    yield
    assert not torch.distributed.is_initialized()
