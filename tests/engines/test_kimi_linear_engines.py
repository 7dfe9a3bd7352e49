"""Kimi Linear checkpoints (`model_type: kimi_linear`, `KimiLinearForCausalLM` names: no `language_model.`
prefix, decoder layers under `model.`) through both engines, bitwise like K3 (configs/kimi-linear-tiny.yaml).

Trainer: official tensors load into the Megatron model and export back bit for bit; its log-probs equal the
rollout schedule of the shared forward (torch.equal); TP = 2 with EP = 2 (torchrun, the worker of
tests/trainers/test_trainer_parallel.py). Engines: three `zerokl ppo` steps (configs/ppo-kimi-linear-tiny.yaml) keep KL
exactly 0 with every token bitwise equal, and after the weight syncs the engine's log-probs, batched and for a prompt
alone, still equal the trainer's (torch.equal). (`zerokl parity check`'s front door: tests/engines/test_parity_cli.py.)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from parity.kernels import INVARIANT
from parity.model import K3Forward, K3Weights, decode_logprobs
from parity.weights import text_specs
from rollout.engine import sample_seed
from rollout.vllm.plugin import TEXT_MODEL_TYPE, hf_overrides
from trainer.megatron.io import export_official, load_official
from trainer.logprobs import PaddedBatch, token_logprobs
from trainer.megatron.parallel import ParallelContext, destroy_parallel, init_parallel
from trainer.megatron.sharding import Split, shard, split_roles
from trainer.megatron.train import build_model
from parity.io.checkpoint import CheckpointError, load_checkpoint
from zerokl.ppo.config import load_ppo_config
from zerokl.ppo.loop import PPORun
from helpers import TRAINER_PARALLEL_CHECKS, torchrun_checks

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "kimi-linear-tiny.yaml"
A_LOG = "model.layers.0.self_attn.A_log"



@pytest.fixture(scope="module")
def ckpt(kimi_linear_tiny: Path) -> Path:
    return kimi_linear_tiny


@pytest.fixture
def par() -> Iterator[ParallelContext]:
    ctx = init_parallel()
    yield ctx
    destroy_parallel(ctx)


def test_checkpoint_is_kimi_linear_and_selects_zerokl_model(ckpt: Path) -> None:
    cfg, weights = load_checkpoint(ckpt)
    assert cfg.model_type == "kimi_linear" and cfg.raw["architectures"] == ["KimiLinearForCausalLM"]
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", A_LOG} <= weights.keys()
    assert not any(n.startswith("language_model.") for n in weights)
    overrides = hf_overrides("invariant", "kimi_linear")
    assert overrides["architectures"] == ["ZeroKLK3ForCausalLM"] and overrides["model_type"] == TEXT_MODEL_TYPE
    assert "text_config" not in overrides  # a bare kimi_linear config has no text_config to override


def test_trainer_round_trip_and_decode_bits(ckpt: Path, par: ParallelContext) -> None:
    cfg, weights = load_checkpoint(ckpt)
    assert split_roles(cfg.text).keys() == text_specs(cfg.text).keys()
    model = build_model(cfg, weights, par)
    assert model.official_parameters().keys() == text_specs(cfg.text).keys() == weights.keys()
    exported = export_official(model)
    assert exported.keys() == weights.keys()
    for name, t in weights.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    with pytest.raises(CheckpointError, match="missing, first: model.layers.3.self_attn.kv_b_proj.weight"):
        load_official(model, {n: t for n, t in weights.items() if n != "model.layers.3.self_attn.kv_b_proj.weight"})
    with pytest.raises(CheckpointError, match="unexpected text tensors, first: model.layers.1.extra.weight"):
        load_official(model, {**weights, "model.layers.1.extra.weight": torch.zeros(1)})

    fwd = K3Forward(K3Weights.from_official(cfg.text, weights), INVARIANT)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, cfg.text.vocab_size, (n,), generator=g).tolist() for n in (11, 6, 9)]
    with torch.no_grad():
        lp = token_logprobs(model, PaddedBatch.from_sequences(seqs), 0.8)
    for i, s in enumerate(seqs):
        want = decode_logprobs(fwd, s[:3], s[3:], 0.8)
        assert torch.equal(lp[i, 2: len(s) - 1], want), f"sequence {i}"


def test_a_log_splits_over_heads_on_dim_2(ckpt: Path) -> None:
    """Kimi Linear stores A_log as [1, 1, H, 1]: TP ranks take consecutive heads along dim 2."""
    cfg, weights = load_checkpoint(ckpt)
    a_log = weights[A_LOG]
    assert split_roles(cfg.text)[A_LOG] is Split.HEADS_DIM2
    parts = [shard(A_LOG, a_log, Split.HEADS_DIM2, r, 2) for r in range(2)]
    assert all(p.shape == (1, 1, 2, 1) for p in parts) and torch.equal(torch.cat(parts, dim=2), a_log)



def test_trainer_tp2_ep2(ckpt: Path, tmp_path: Path) -> None:
    torchrun_checks(REPO / "tests" / "dist" / "trainer_parallel.py",
                    ["--tp", "2", "--ep", "2", "--checkpoint", str(ckpt), "--out", str(tmp_path / "exported")],
                    TRAINER_PARALLEL_CHECKS)


def test_ppo_steps_keep_kl_exactly_zero(tmp_path: Path) -> None:
    cfg = replace(load_ppo_config(REPO / "configs" / "ppo-kimi-linear-tiny.yaml"), steps=3, wandb="disabled")
    run = PPORun(cfg, tmp_path / "ppo", log=lambda _: None)
    try:
        for step in range(3):
            result = run.run_step()
            m = result.metrics
            assert result.diagnosis is None, result.diagnosis
            assert m["kl"] == 0.0 and m["max_abs_logprob_diff"] == 0.0 and m["bitwise_equal_frac"] == 1.0 \
                and m["routing_agreement"] == 1.0, m
            assert m["step"] == step and m["policy_version"] == step
        assert run.engine.policy_version == run.version == 3
        _, init = load_checkpoint(tmp_path / "ppo" / "init-checkpoint")
        trained = run.sync.export_base()
        assert trained.keys() == init.keys() and any(not torch.equal(trained[n], t.float()) for n, t in init.items())
        prompts = [run.rollouts.encode(p) for p in ("What is 3 + 4?", "What is 1 + 8? Answer:")]
        samples = run.engine.generate(prompts, n=2, temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
        alone = run.engine.generate(prompts[1:], n=2, temperature=1.0, max_tokens=8, seed=[sample_seed(11, 1)],
                                    ignore_eos=True)
        for a, b in zip(alone, samples[2:]):  # the second prompt alone: its batch's tokens and bits
            assert a.completion_ids == b.completion_ids and torch.equal(a.logprobs, b.logprobs)
        with torch.no_grad():
            lp = token_logprobs(run.trainer.module, PaddedBatch.from_sequences(
                [s.prompt_ids + s.completion_ids for s in samples]), 1.0)
        for i, s in enumerate(samples):
            p, c = len(s.prompt_ids), len(s.completion_ids)
            assert torch.equal(lp[i, p - 1: p - 1 + c], s.logprobs), f"sample {i}"
    finally:
        run.close()
