"""LoRA in the Megatron K3 trainer, one process (TP = EP = 1): log-probs equal the shared forward with
`K3Weights.lora` and the rollout decode schedule (bits); only adapter parameters train; export round trips;
merging is close but changes bits; float64 gradient check of the adapter. TP = 2 / EP = 2:
tests/trainers/test_lora_parallel.py."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.func import functional_call

from lora.adapter import Adapter, load_adapter
from lora.cli import add_parser
from lora.init import random_adapter
from lora.merge import merge_checkpoint
from parity.config import ModelConfig, load_model_config, parse_model_config
from parity.kernels import INVARIANT
from parity.model import K3Forward, K3Weights, decode_logprobs, score_sequences
from trainer.megatron.io import export_adapter, save_adapter, save_adapter_state
from trainer.logprobs import PackedBatch, PaddedBatch, token_logprobs
from trainer.megatron.parallel import ParallelContext, destroy_parallel, init_parallel
from trainer.megatron.train import Trainer, build_model, build_trainer, train_step
from parity.io.checkpoint import load_checkpoint, random_weights

ROOT = Path(__file__).resolve().parents[2]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def par() -> Iterator[ParallelContext]:
    ctx = init_parallel()
    yield ctx
    destroy_parallel(ctx)


@pytest.fixture(scope="module")
def checkpoint(k3_tiny: Path) -> Path:
    return k3_tiny


@pytest.fixture(scope="module")
def official(checkpoint: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return load_checkpoint(checkpoint)


@pytest.fixture(scope="module")
def adapter(official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> Adapter:
    """Every supported projection, r = 8, alpha = 16, non-zero B."""
    return random_adapter(official[0].text, 8, 16.0, seed=4)


def _seqs(lens: tuple[int, ...], seed: int, vocab: int = 1024) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]


def _assert_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(a, b):
        i = int((a != b).nonzero()[0, 0])
        raise AssertionError(f"{what}: first mismatching token {i}, max |d| = {(a - b).abs().max().item():.3e}")


def _shared_forward(official: tuple[ModelConfig, dict[str, torch.Tensor]], adapter: Adapter | None) -> K3Forward:
    cfg, weights = official
    w = K3Weights.from_official(cfg.text, weights)
    return K3Forward(K3Weights(cfg.text, w.tensors, adapter.lora() if adapter else {}), INVARIANT)


def test_logprobs_equal_shared_forward_and_rollout_decode_schedule(
        par: ParallelContext, official: tuple[ModelConfig, dict[str, torch.Tensor]], adapter: Adapter) -> None:
    """Megatron model with the adapter, one padded and one packed forward = `K3Forward` with `K3Weights.lora`
    scoring each sequence alone = the rollout schedule (prefill the prompt, decode one token per step)."""
    cfg, weights = official
    model = build_model(cfg, weights, par, adapter=adapter)
    prompts, completions = _seqs((5, 9, 3), seed=11), _seqs((6, 2, 8), seed=12)
    seqs = [p + c for p, c in zip(prompts, completions)]
    batch = PaddedBatch.from_sequences(seqs)
    with torch.no_grad():
        lp = token_logprobs(model, batch, TEMPERATURE)
        packed = PackedBatch(torch.tensor([t for s in seqs for t in s]),
                             torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()]))
        _assert_bits(token_logprobs(model, packed, TEMPERATURE), lp[batch.mask()], "packed vs padded")
    fwd = _shared_forward(official, adapter)
    for i, s in enumerate(seqs):
        _assert_bits(lp[i, : len(s) - 1], score_sequences(fwd, [s], TEMPERATURE)[0], f"sequence {i} vs K3Forward")
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        rollout = decode_logprobs(fwd, prompt, completion, TEMPERATURE)
        start = len(prompt) - 1
        _assert_bits(lp[i, start : start + len(completion)], rollout, f"sequence {i} vs decode")


@dataclass
class Trained:
    """A LoRA trainer after one Megatron Adam step on a fixed batch."""

    trainer: Trainer
    official_before: dict[str, torch.Tensor]
    lora_before: dict[str, torch.Tensor]
    loss: float
    loss_after: float
    batch: PaddedBatch


@pytest.fixture(scope="module")
def trained(par: ParallelContext, checkpoint: Path, adapter: Adapter) -> Trained:
    trainer = build_trainer(checkpoint, par, lr=1e-3, adapter=adapter)
    batch = PaddedBatch.from_sequences(_seqs((12, 7), seed=5))

    def nll(model: torch.nn.Module) -> torch.Tensor:
        return -token_logprobs(model, batch, 1.0).sum() / (batch.lens - 1).sum()

    module = trainer.module
    official_before = {n: p.detach().clone() for n, p in module.official_parameters().items()}
    lora_before = {n: p.detach().clone() for n, p in module.lora_parameters().items()}
    loss, _ = train_step(trainer, nll)
    with torch.no_grad():
        after = float(nll(trainer.model))
    return Trained(trainer, official_before, lora_before, loss, after, batch)


def test_only_adapter_parameters_train_and_the_loss_drops(trained: Trained) -> None:
    module, opt = trained.trainer.module, trained.trainer.optimizer
    lora = module.lora_parameters()
    assert len(lora) == 2 * len(module.lora_scales) and all(p.requires_grad for p in lora.values())
    assert not any(p.requires_grad for p in module.official_parameters().values())
    in_optimizer = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in lora.values()}  # fp32 optimizer: it steps the parameters themselves
    for name, p in module.official_parameters().items():
        assert torch.equal(p, trained.official_before[name]), f"base parameter {name} moved"
    unchanged = [n for n, p in lora.items() if torch.equal(p, trained.lora_before[n])]
    assert not unchanged, f"{len(unchanged)} adapter parameters did not move, first: {unchanged[0]}"
    assert trained.loss_after < trained.loss, f"loss {trained.loss:.5f} -> {trained.loss_after:.5f}"


def lora_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zerokl")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_export_after_training_round_trips(trained: Trained, par: ParallelContext, checkpoint: Path,
                                           official: tuple[ModelConfig, dict[str, torch.Tensor]],
                                           tmp_path: Path) -> None:
    """The trained adapter, written in PEFT format in process (`save_adapter`) and through the trainer's state
    shards + `zerokl lora export`, loads back to the trainer's tensors bit for bit; a fresh model built on the
    exported adapter gives the trained model's log-probs bit for bit."""
    module = trained.trainer.module
    cfg = official[0]
    exported = load_adapter(save_adapter(module, tmp_path / "peft"), cfg.text)
    save_adapter_state(module, tmp_path / "state")
    assert lora_main(["lora", "export", "--model", str(checkpoint), "--state", str(tmp_path / "state"),
                      "--out", str(tmp_path / "cli")]) == 0
    via_cli = load_adapter(tmp_path / "cli", cfg.text)
    live = module.lora_parameters()
    for m, (a, b) in exported.weights.items():
        assert torch.equal(a, live[f"{m}.lora_A.weight"]) and torch.equal(b, live[f"{m}.lora_B.weight"]), m
        assert torch.equal(a, via_cli.weights[m][0]) and torch.equal(b, via_cli.weights[m][1]), m
    assert exported.spec == via_cli.spec == export_adapter(module).spec
    with torch.no_grad():
        fresh = build_model(cfg, official[1], par, adapter=exported)
        _assert_bits(token_logprobs(fresh, trained.batch, TEMPERATURE),
                     token_logprobs(module, trained.batch, TEMPERATURE), "exported adapter vs trained model")


def test_merge_is_close_to_the_adapter_run_but_changes_bits(
        checkpoint: Path, official: tuple[ModelConfig, dict[str, torch.Tensor]], adapter: Adapter,
        tmp_path: Path) -> None:
    """The merged checkpoint run as a base model (no adapter) vs the base checkpoint with the adapter. fp32
    storage: only fp32 GEMM rounding differs (max |d| < 1e-4). The default bf16 storage also rounds every
    merged weight to 8 mantissa bits; this random tiny model is that sensitive to bf16 rounding of its weights
    (re-rounding the base alone moves log-probs by ~0.2 nats on average), so the check is that the merged model
    keeps most of the adapter's effect: it is much closer to the adapter run than the base model is."""
    from lora.adapter import save_adapter as write_adapter

    write_adapter(adapter, tmp_path / "adapter")
    seqs = _seqs((10, 6), seed=21)
    with_adapter = torch.cat(score_sequences(_shared_forward(official, adapter), seqs, TEMPERATURE))
    base = torch.cat(score_sequences(_shared_forward(official, None), seqs, TEMPERATURE))
    diffs = {}
    for dtype in ("float32", None):
        merged = merge_checkpoint(checkpoint, tmp_path / "adapter", tmp_path / f"merged-{dtype}", dtype)
        lp = torch.cat(score_sequences(_shared_forward(load_checkpoint(merged), None), seqs, TEMPERATURE))
        assert not torch.equal(lp, with_adapter)
        diffs[dtype] = (lp - with_adapter).abs()
    assert diffs["float32"].max() < 1e-4, diffs["float32"].max()
    effect = (base - with_adapter).abs().mean()
    assert diffs[None].mean() < 0.5 * effect, (diffs[None].mean(), effect)
    assert load_model_config(tmp_path / "merged-float32").raw["torch_dtype"] == "float32"


def test_gradcheck_float64_adapter(par: ParallelContext) -> None:
    """Autograd of the trainer's forward with respect to the adapter (A and B of every target moved along a
    fixed direction, one scalar each) vs central finite differences in float64."""
    raw = copy.deepcopy(load_model_config(ROOT / "configs" / "k3-tiny.yaml").raw)
    raw["torch_dtype"] = "float32"  # fp32 mode: the weights' own dtype (float64) is the compute dtype
    raw["text_config"].update(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                              num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                              qk_rope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_token=2,
                              moe_intermediate_size=16, routed_expert_hidden_size=24)
    raw["text_config"]["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=2,
                                                    head_dim=8)
    raw["vision_config"]["text_hidden_size"] = 32
    cfg = parse_model_config(raw)
    model = build_model(cfg, random_weights(cfg, seed=1), par, params_dtype=torch.float64,
                        adapter=random_adapter(cfg.text, 2, seed=2))
    batch = PaddedBatch.from_sequences(_seqs((6, 4), seed=3, vocab=64))
    params = {n: p.detach() for n, p in model.named_parameters()}
    lora = sorted(n for n in params if ".lora_" in n)
    g = torch.Generator().manual_seed(0)
    direction = {n: torch.randn(params[n].shape, generator=g, dtype=torch.float64) * params[n].abs().mean()
                 for n in lora}

    def loss(step_a: torch.Tensor, step_b: torch.Tensor) -> torch.Tensor:
        moved = {n: params[n] + (step_a if ".lora_A." in n else step_b) * direction[n] for n in lora}
        return functional_call(model, {**params, **moved}, (batch.input_ids, batch.lens, TEMPERATURE)).sum()

    steps = tuple(torch.zeros((), dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(loss, steps, eps=1e-6, atol=1e-6, rtol=1e-5)
