"""The DeepSpeed trainer backend in one process (gloo world of one): the module tree, log-probs against the shared
forward and the rollout decode schedule (bits), checkpoint round trip, steps against the Megatron trainer (bits),
resume, PEFT LoRA. ZeRO-3 on two processes: tests/trainers/test_trainer_deepspeed_dist.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from lora.adapter import CONFIG_FILE, WEIGHTS_FILE, Adapter, load_adapter, load_lora, save_adapter
from lora.init import random_adapter
from lora.spec import AdapterError
from lora.targets import lora_targets
from parity.config import ModelConfig
from parity.kernels import INVARIANT
from parity.model import K3Forward, K3Weights, decode_logprobs, score_sequences
from parity.weights import text_specs
from trainer.deepspeed.engine import (DeepSpeedTrainer, build_deepspeed_trainer, destroy, destroy_dist, init_dist,
                                      train_step)
from trainer.deepspeed.io import export_official, load_official, load_state, save_official, save_state
from trainer.deepspeed.lora import attach_lora, export_adapter, save_adapter as save_trainer_adapter
from trainer.deepspeed.module import DeepSpeedK3Model, Projection
from trainer.logprobs import PackedBatch, PaddedBatch, token_logprobs
from parity.io.checkpoint import CheckpointError, load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TEMPERATURE = 0.8
LR = 3e-3
LORA_TARGETS = ["q_proj", "o_proj", "kv_b_proj", "gate_proj", "down_proj", "routed_expert_up_proj"]


@pytest.fixture(scope="module", autouse=True)
def process_group() -> Iterator[None]:
    """One gloo group for the module's trainers (each `build_deepspeed_trainer` reuses it)."""
    owns = init_dist()
    yield
    if owns:
        destroy_dist()


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
    return save_adapter(random_adapter(cfg.text, rank=4, targets=LORA_TARGETS, seed=1),
                        tmp_path_factory.mktemp("ds") / "adapter")


@pytest.fixture(scope="module")
def zero3(checkpoint: Path) -> Iterator[DeepSpeedTrainer]:
    """An untrained ZeRO-3 trainer with every parameter partitioned (persistence threshold 0)."""
    trainer = build_deepspeed_trainer(checkpoint, lr=LR, zero_stage=3, persistence_threshold=0)
    yield trainer
    destroy(trainer)


def _seqs(lens: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 1024, (n,), generator=g).tolist() for n in lens]


def _assert_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(a, b):
        i = int((a != b).nonzero()[0, 0]) if a.shape == b.shape else -1
        raise AssertionError(f"{what}: first mismatching index {i}, max |d| = {(a - b).abs().max().item():.3e}")


def _pg_loss(step: int) -> Callable[[torch.nn.Module], torch.Tensor]:
    """Step `step`'s policy-gradient-shaped loss on 4 sequences (16 routed experts, 4 per token: some experts get
    no token in some steps)."""
    g = torch.Generator().manual_seed(1000 + step)
    batch = PaddedBatch.from_sequences([torch.randint(4, 1024, (int(n),), generator=g).tolist()
                                        for n in torch.randint(3, 14, (4,), generator=g)])
    adv = torch.randn(4, generator=g)
    return lambda model: -(token_logprobs(model, batch, 1.0).sum(1) * adv).mean()


def _masters(trainer: DeepSpeedTrainer) -> dict[str, torch.Tensor]:
    return {n: t for n, t in export_official(trainer, compute_dtype=True).items() if n in trainer.module.specs}


def test_module_tree_is_the_official_names(official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """Parameter paths = official names; projections are `nn.Linear`s (PEFT targets) that refuse to run; every
    parameter is gathered by some ZeRO-3 block or scope."""
    cfg, _ = official
    module = DeepSpeedK3Model(cfg.text)
    names = [n for n, _ in module.named_parameters()]
    assert sorted(names) == sorted(text_specs(cfg.text))
    assert names[:2] == ["language_model.model.embed_tokens.weight", "language_model.model.norm.weight"]
    q = module.get_submodule("language_model.layers.0.self_attn.q_proj")
    assert isinstance(q, Projection) and isinstance(q, torch.nn.Linear)
    with pytest.raises(RuntimeError, match="not called"):
        q(torch.zeros(1, cfg.text.hidden_size))
    module.bind_zero3()


def test_logprobs_equal_shared_forward_and_rollout_schedule(
        zero3: DeepSpeedTrainer, official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """ZeRO-3 (all parameters partitioned): a padded and a packed batch score every token with the bits of
    `parity.model.score_sequences` and of the rollout engine's schedule (prefill the prompt, decode one token
    per step) on the shared forward."""
    cfg, weights = official
    prompts, completions = _seqs((5, 9, 3), seed=11), _seqs((6, 2, 8), seed=12)
    seqs = [p + c for p, c in zip(prompts, completions)]
    batch = PaddedBatch.from_sequences(seqs)
    with torch.no_grad():
        lp = token_logprobs(zero3.model, batch, TEMPERATURE)
        packed = PackedBatch(torch.tensor([t for s in seqs for t in s]),
                             torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()]))
        _assert_bits(token_logprobs(zero3.model, packed, TEMPERATURE), lp[batch.mask()], "packed vs padded")
    assert all(p.data.numel() == 0 for p in zero3.module.official_parameters().values())  # partitioned at rest
    fwd = K3Forward(K3Weights.from_official(cfg.text, weights), INVARIANT)
    for i, (ref, s) in enumerate(zip(score_sequences(fwd, seqs, TEMPERATURE), seqs)):
        _assert_bits(lp[i, : len(s) - 1], ref, f"sequence {i} vs score_sequences")
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        rollout = decode_logprobs(fwd, prompt, completion, TEMPERATURE)
        start = len(prompt) - 1
        _assert_bits(lp[i, start : start + len(completion)], rollout, f"sequence {i} vs decode")


def test_export_round_trips_the_checkpoint(zero3: DeepSpeedTrainer, checkpoint: Path, tmp_path: Path,
                                          official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """ZeRO-3 partitions gathered one at a time give back every checkpoint tensor (dtype and bits); the saved
    directory reloads bit for bit; loading fails naming a missing or unexpected tensor."""
    cfg, weights = official
    exported = export_official(zero3)
    assert exported.keys() == weights.keys()
    for name, t in weights.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    _, saved = load_checkpoint(save_official(zero3, tmp_path / "saved"))
    assert all(torch.equal(saved[n], t) for n, t in weights.items())
    module = DeepSpeedK3Model(cfg.text)
    missing = {n: t for n, t in weights.items() if n != "language_model.layers.3.self_attn.kv_b_proj.weight"}
    with pytest.raises(CheckpointError, match="kv_b_proj"):
        load_official(module, missing)
    with pytest.raises(CheckpointError, match="unexpected"):
        load_official(module, {**weights, "language_model.layers.3.self_attn.extra.weight": torch.zeros(1)})


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_steps_equal_the_megatron_trainer_bitwise(zero_stage: int, checkpoint: Path) -> None:
    """Three clipped Adam steps (grad norms >> 1, weight decay on; the third accumulates two micro-batches) from the
    same checkpoint and batches: every loss, grad norm and fp32 master weight equals the Megatron trainer's bit for
    bit; the first step lowers the loss of its batch."""
    from trainer.megatron.parallel import destroy_parallel, init_parallel
    from trainer.megatron.train import build_trainer
    from trainer.megatron.train import train_step as megatron_step

    par = init_parallel()
    megatron = build_trainer(checkpoint, par, lr=LR, weight_decay=0.01)
    want = [megatron_step(megatron, *map(_pg_loss, micro)) for micro in ((0,), (1,), (2, 3))]
    want_masters = {n: p.detach().clone() for n, p in megatron.module.official_parameters().items()}
    destroy_parallel(par)
    trainer = build_deepspeed_trainer(checkpoint, lr=LR, zero_stage=zero_stage, weight_decay=0.01,
                                      persistence_threshold=0)
    got = [train_step(trainer, *map(_pg_loss, micro)) for micro in ((0,), (1,), (2, 3))]
    masters = _masters(trainer)
    with torch.no_grad():
        first_after = float(_pg_loss(0)(trainer.model))
    destroy(trainer)
    assert got == want and min(norm for _, norm in got) > 1.0
    for name, t in want_masters.items():
        _assert_bits(masters[name].flatten(), t.flatten(), name)
    assert first_after < got[0][0]


def test_lora_steps_equal_the_megatron_lora_trainer_bitwise(
        checkpoint: Path, adapter_dir: Path, official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """The same adapter trained 3 steps by PEFT on ZeRO-3 and by the Megatron trainer's LoRA: same losses, grad
    norms and adapter tensors, bit for bit."""
    from trainer.megatron.io import export_adapter as megatron_adapter
    from trainer.megatron.parallel import destroy_parallel, init_parallel
    from trainer.megatron.train import build_trainer
    from trainer.megatron.train import train_step as megatron_step

    cfg, _ = official
    par = init_parallel()
    megatron = build_trainer(checkpoint, par, lr=LR, adapter=load_adapter(adapter_dir, cfg.text))
    want = [megatron_step(megatron, _pg_loss(step)) for step in range(3)]
    want_adapter = megatron_adapter(megatron.module)
    destroy_parallel(par)
    trainer = build_deepspeed_trainer(checkpoint, lr=LR, zero_stage=3, lora=adapter_dir, persistence_threshold=0)
    got = [train_step(trainer, _pg_loss(step)) for step in range(3)]
    adapter = export_adapter(trainer)
    destroy(trainer)
    assert got == want and adapter is not None and adapter.weights.keys() == want_adapter.weights.keys()
    for m, (a, b) in want_adapter.weights.items():
        _assert_bits(adapter.weights[m][0], a, f"{m}.lora_A")
        _assert_bits(adapter.weights[m][1], b, f"{m}.lora_B")


def test_resume_continues_bitwise(checkpoint: Path, tmp_path: Path) -> None:
    """step 0, save_state, step 1 == a fresh trainer that loads the state and runs step 1 (weights and step)."""
    trainer = build_deepspeed_trainer(checkpoint, lr=LR, zero_stage=3, persistence_threshold=0)
    train_step(trainer, _pg_loss(0))
    save_state(trainer, tmp_path / "state")
    want = train_step(trainer, _pg_loss(1))
    want_masters = _masters(trainer)
    destroy(trainer)
    resumed = build_deepspeed_trainer(checkpoint, lr=LR, zero_stage=3, persistence_threshold=0)
    load_state(resumed, tmp_path / "state")
    assert train_step(resumed, _pg_loss(1)) == want
    got = _masters(resumed)
    destroy(resumed)
    for name, t in want_masters.items():
        _assert_bits(got[name].flatten(), t.flatten(), name)
    with pytest.raises(FileNotFoundError):
        load_state(resumed, tmp_path / "nothing")


def test_lora_adapter_trains_alone_with_shared_forward_bits(
        checkpoint: Path, adapter_dir: Path, tmp_path: Path,
        official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """PEFT on the ZeRO-3 module from a `zerokl lora` adapter: only lora_A/lora_B train; log-probs equal the shared
    forward with `K3Weights.lora` (and differ from the base model's); a step moves the adapter, not the base
    weights; `save_pretrained` writes the PEFT files that `lora.adapter` reads back bit for bit."""
    cfg, weights = official
    trainer = build_deepspeed_trainer(checkpoint, lr=LR, zero_stage=3, lora=adapter_dir, persistence_threshold=0)
    assert trainer.peft is not None
    trainable = [n for n, p in trainer.peft.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(load_adapter(adapter_dir, cfg.text).weights)
    seqs = _seqs((9, 4, 12), seed=3)
    with torch.no_grad():
        lp = token_logprobs(trainer.model, PaddedBatch.from_sequences(seqs), TEMPERATURE)
    with_lora = K3Weights.from_official(cfg.text, weights)
    with_lora.lora = load_lora(adapter_dir, cfg.text)
    ref = score_sequences(K3Forward(with_lora, INVARIANT), seqs, TEMPERATURE)
    base = score_sequences(K3Forward(K3Weights.from_official(cfg.text, weights), INVARIANT), seqs, TEMPERATURE)
    for i, s in enumerate(seqs):
        _assert_bits(lp[i, : len(s) - 1], ref[i], f"sequence {i} with the adapter")
        assert not torch.equal(ref[i], base[i])
    train_step(trainer, _pg_loss(0))
    exported = export_official(trainer)
    assert all(torch.equal(exported[n], t) for n, t in weights.items())  # base frozen
    trained = export_adapter(trainer)
    assert isinstance(trained, Adapter)
    before = load_adapter(adapter_dir, cfg.text)
    assert all(not torch.equal(trained.weights[m][1], before.weights[m][1]) for m in before.weights)
    out = save_trainer_adapter(trainer, tmp_path / "trained")
    destroy(trainer)
    assert (out / CONFIG_FILE).is_file() and (out / WEIGHTS_FILE).is_file()
    back = load_adapter(out, cfg.text)
    assert back.weights.keys() == trained.weights.keys()
    assert all(back.spec.scale(m) == before.spec.scale(m) for m in back.weights)
    for m, (a, b) in trained.weights.items():
        _assert_bits(back.weights[m][0], a, f"{m}.lora_A")
        _assert_bits(back.weights[m][1], b, f"{m}.lora_B")


def test_lora_config_starts_as_the_base_model(checkpoint: Path,
                                              official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """A fresh `LoraConfig` adapter (ZeRO-2): PEFT's B = 0, so the log-probs are the base model's bits; the same
    `seed` gives the same A."""
    cfg, weights = official
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"])
    trainer = build_deepspeed_trainer(checkpoint, lr=LR, zero_stage=2, lora=config, seed=7)
    seqs = _seqs((7, 10), seed=4)
    with torch.no_grad():
        lp = token_logprobs(trainer.model, PaddedBatch.from_sequences(seqs), TEMPERATURE)
    base = score_sequences(K3Forward(K3Weights.from_official(cfg.text, weights), INVARIANT), seqs, TEMPERATURE)
    for i, s in enumerate(seqs):
        _assert_bits(lp[i, : len(s) - 1], base[i], f"sequence {i}")
    a = export_adapter(trainer)
    destroy(trainer)
    assert a is not None and set(a.weights) == {m for m in lora_targets(cfg.text) if a.spec.targets(m)}
    again = DeepSpeedK3Model(cfg.text)
    attach_lora(again, config, seed=7)
    layer = dict(again.lora_layers())["language_model.layers.0.self_attn.q_proj"]
    _assert_bits(layer.lora_A["default"].weight.detach(), a.weights["language_model.layers.0.self_attn.q_proj"][0],
                 "lora_A under the same seed")


@pytest.mark.parametrize("options,match", [({"target_modules": ["w1"]}, "routed experts"),
                                           ({"target_modules": ["lm_head"]}, "lm_head"),
                                           ({"target_modules": ["q_proj"], "use_dora": True}, "DoRA")])
def test_lora_refuses_what_the_parity_forward_cannot_compute(
        options: dict, match: str, official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """Targets `lora.targets` excludes and options `lora.spec` refuses raise `AdapterError` naming them."""
    cfg, _ = official
    with pytest.raises(AdapterError, match=match):
        attach_lora(DeepSpeedK3Model(cfg.text), LoraConfig(r=4, lora_alpha=4, **options))
