"""The trainer-backend seam (`trainer.backend`) without the rollout engine: Megatron and DeepSpeed ZeRO-3 with a LoRA
adapter give the shared forward's log-prob bits and train the adapter to the same bits; `save_state` / `load_state`
continue bit for bit; user mistakes are ConfigErrors; the ZeRO-3 linear keeps no gathered weight alive between
forward and backward and has autograd's bits. PPO and `zerokl parity check` through the seam:
tests/engines/test_ppo_deepspeed.py."""

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


def test_zero3_forward_saves_parameters_not_gathered_weights(checkpoint: Path) -> None:
    """A ZeRO-3 forward (every parameter partitioned) saves the projection weights themselves for the backward
    (`parity.kernels.linear.gemm`): no saved tensor holds a gathered 2-D weight's storage (with autograd through plain
    torch ops, 459 gathered storages, 22.4 of the model's 23.5 MB, stayed alive until the backward)."""
    backend = build_backend("deepspeed", checkpoint, lr=LR, zero_stage=3)
    params = list(backend.trainer.module.parameters())
    weight_bytes = {p.ds_numel * p.element_size() for p in params if len(p.ds_shape) == 2}
    held: dict[int, tuple[int, ...]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.nbytes() in weight_bytes and not any(t is p for p in params):
            held.update({storage.data_ptr(): tuple(p.ds_shape) for p in params
                         if p.data.numel() and p.data.untyped_storage().data_ptr() == storage.data_ptr()})
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp = token_logprobs(backend.model, PaddedBatch.from_sequences(_seqs()), TEMPERATURE)
        backend.model.backward(-lp.sum())
    finally:
        backend.close()
    assert held and all(len(shape) == 2 and shape[0] == 1 for shape in held.values()), held  # AttnRes scorers [1, D]


def test_lora_backends_equal_the_shared_forward_and_each_other(
        checkpoint: Path, adapter_dir: Path, official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """With the same adapter (a directory for Megatron, an `Adapter` for DeepSpeed ZeRO-3): log-probs = `K3Forward`
    with `K3Weights.lora` from `lora.adapter.load_lora` on both (torch.equal); `export_weights` is the adapter's PEFT
    tensors; two steps, each accumulating two micro-batches, give the same (loss, grad norm) and adapter tensors bit for
    bit; the base stays frozen."""
    cfg, weights = official
    seqs = _seqs()
    with_lora = K3Weights.from_official(cfg.text, weights)
    with_lora.lora = load_lora(adapter_dir, cfg.text)
    ref = score_sequences(K3Forward(with_lora, INVARIANT), seqs, TEMPERATURE)
    start = load_adapter(adapter_dir, cfg.text)
    results = {}
    for name, adapter in (("megatron", adapter_dir), ("deepspeed", start)):
        backend = build_backend(name, checkpoint, lr=LR, adapter=adapter, zero_stage=3)
        try:
            lp = backend.logprobs(PaddedBatch.from_sequences(seqs), TEMPERATURE)
            for i, s in enumerate(seqs):
                assert torch.equal(lp[i, : len(s) - 1], ref[i]), f"{name}: sequence {i}"
            exported = backend.export_weights()
            assert exported.keys() == start.tensors().keys()
            assert all(torch.equal(t, start.tensors()[n]) for n, t in exported.items())
            results[name] = _run(backend, range(2))
            base = backend.export_official()
        finally:
            backend.close()
        assert all(torch.equal(base[n], t.float()) for n, t in weights.items() if n in text_specs(cfg.text))
    (history, trained), (ds_history, ds_trained) = results["megatron"], results["deepspeed"]
    assert ds_history == history
    assert trained.keys() == ds_trained.keys()
    assert all(torch.equal(ds_trained[n], t) for n, t in trained.items())
    assert not all(torch.equal(trained[n], t) for n, t in start.tensors().items())


@pytest.mark.parametrize("name,zero_stage,lora", [("megatron", 3, True), ("deepspeed", 2, False),
                                                  ("deepspeed", 3, True)])
def test_state_round_trip_continues_bitwise(name: str, zero_stage: int, lora: bool, checkpoint: Path,
                                            adapter_dir: Path, tmp_path: Path) -> None:
    """step 0, save_state, step 1 == a fresh backend that loads the state and runs step 1: (loss, grad norm) and the
    exported weights (or adapter) bit for bit; the state holds weights.pt, or adapter/ with LoRA."""
    adapter = adapter_dir if lora else None
    backend = build_backend(name, checkpoint, lr=LR, adapter=adapter, zero_stage=zero_stage)
    try:
        backend.train_step(_pg_loss(0))
        backend.save_state(tmp_path / "state")
        want = _run(backend, range(1, 2))
    finally:
        backend.close()
    assert (tmp_path / "state" / (ADAPTER_DIR if lora else WEIGHTS_FILE)).exists()
    resumed = build_backend(name, checkpoint, lr=LR, adapter=adapter, zero_stage=zero_stage)
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

    backend = build_backend("megatron", checkpoint, lr=LR, value_head_lr=LR / 10)
    try:
        backend.train_step(loss(0))
        backend.save_state(tmp_path / "state")
        want = run(backend)
    finally:
        backend.close()
    assert (tmp_path / "state" / VALUE_HEAD_FILE).exists() and want[2].abs().sum() > 0
    assert not any("value_head" in n for n in want[1])
    resumed = build_backend("megatron", checkpoint, lr=LR, value_head_lr=LR / 10)
    try:
        resumed.load_state(tmp_path / "state")
        got = run(resumed)
    finally:
        resumed.close()
    assert got[0] == want[0] and torch.equal(got[2], want[2])
    assert got[1].keys() == want[1].keys() and all(torch.equal(t, want[1][n]) for n, t in got[1].items())


def test_user_mistakes_are_config_errors(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="backend must be one of megatron, deepspeed"):
        build_backend("fsdp", checkpoint)
    with pytest.raises(ConfigError, match="zero_stage must be one of 2, 3"):
        build_backend("deepspeed", checkpoint, zero_stage=1)


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> Iterator[None]:
    """Each backend starts and ends its own process group."""
    yield
    assert not torch.distributed.is_initialized()
