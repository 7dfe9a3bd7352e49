"""The DSpark draft: its official checkpoint format (as vLLM's `k3_dspark` config and `K3DSparkForCausalLM` loader
read it), `zerokl init-checkpoint` writing it, and its forward on the parity kernels against the float64 reference
and across batch layouts (bits). Rollouts with it: tests/engines/test_speculative.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from helpers import assert_bits
from parity.config import ConfigError, load_model_config, read_config
from parity.dspark import check_fits_target, dspark_specs, parse_dspark_config
from parity.dspark_model import DSparkDraft
from parity.io.checkpoint import CheckpointError, dspark_weights, load_dspark_checkpoint
from parity.kernels import INVARIANT
from parity.reference import dspark as ref
from zerokl.cli import main

ROOT = Path(__file__).resolve().parents[2]
DRAFT_CONFIG = ROOT / "configs" / "k3-tiny-dspark.yaml"
TARGET_CONFIG = ROOT / "configs" / "k3-tiny-mxfp4.yaml"


def _raw(**changes: object) -> dict:
    raw = read_config(DRAFT_CONFIG)
    raw.update(changes)
    return {k: v for k, v in raw.items() if v is not None}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dspark") / "draft"
    assert main(["init-checkpoint", "--config", str(DRAFT_CONFIG), "--out", str(out), "--seed", "3"]) == 0
    return out


def test_init_checkpoint_writes_what_vllm_loads(draft_dir: Path) -> None:
    """config.json passes vLLM's own `K3DSparkConfig` and names vLLM's architecture; every stored tensor name is one
    vLLM's loader maps onto the draft (none dropped, no `model.` prefix of its own); the tensors round-trip and
    are the seeded draw."""
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM
    from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig

    raw = json.loads((draft_dir / "config.json").read_text())
    assert raw["architectures"] == ["K3DSparkModel"] and raw["model_type"] == "k3_dspark"
    vcfg = K3DSparkConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    assert list(vcfg.target_layer_ids) == raw["target_layer_ids"] and vcfg.draft_vocab_size == raw["vocab_size"]
    cfg, weights = load_dspark_checkpoint(draft_dir)
    names = sorted(weights)
    mapped = K3DSparkForCausalLM.hf_to_vllm_mapper.apply_list(names)
    assert len(mapped) == len(names) and all(m.startswith("model.") and not m.startswith("model.model.") for m in mapped)
    assert not any(n.startswith("model.") or "embed_tokens" in n or "lm_head" in n for n in names)
    again = dspark_weights(cfg, 3)
    assert set(again) == set(weights)
    for name in weights:
        assert_bits(weights[name], again[name])
    check_fits_target(cfg, load_model_config(TARGET_CONFIG).text)


@pytest.mark.parametrize("changes, message", [
    ({"target_hidden_size": None}, "missing required key 'target_hidden_size'"),
    ({"num_target_layers": 2}, "num_target_layers must equal len(target_layer_ids) = 3"),
    ({"target_layer_ids": [4, 1]}, "ascending"),
    ({"mla_use_output_gate": True}, "mla_use_output_gate is not supported"),
    ({"sample_from_anchor": False}, "sample_from_anchor must be true"),
    ({"draft_vocab_size": 512}, "draft_vocab_size must equal vocab_size"),
    ({"dspark_noise_token_id": 5000}, "dspark_noise_token_id must be a token id below vocab_size"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'default'"),
    ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
])
def test_bad_draft_configs_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_dspark_config(_raw(**changes))


def test_draft_must_fit_its_target() -> None:
    target = load_model_config(TARGET_CONFIG).text
    for changes, message in (({"vocab_size": 2048}, "vocab_size 2048 differs"),
                             ({"target_layer_ids": [1, 4, 8]}, "name layers past the target's 8"),
                             ({"target_hidden_size": 128}, "target_hidden_size 128 differs"),
                             ({"torch_dtype": "float32"}, "torch_dtype float32 differs")):
        with pytest.raises(ConfigError, match=message):
            check_fits_target(parse_dspark_config(_raw(**changes)), target)


def test_init_checkpoint_refuses_a_bad_draft_config_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_raw(num_target_layers=5)))
    assert main(["init-checkpoint", "--config", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "num_target_layers must equal" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_dspark_checkpoint(tmp_path)


def _draft(dtype: str, seed: int = 0) -> tuple[DSparkDraft, torch.Tensor, torch.Tensor]:
    cfg = parse_dspark_config(_raw(torch_dtype=dtype))
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g).to(cfg.dtype)
    head = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * cfg.hidden_size**-0.5).to(cfg.dtype)
    return DSparkDraft(cfg, dspark_weights(cfg, seed), INVARIANT, embed, head), embed, head


def _batch(draft: DSparkDraft, lens: list[int], seed: int) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Target hidden states for len(lens) sequences (right-padded with junk), the draft's context caches, anchors."""
    c = draft.cfg
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(len(lens), max(lens), c.target_hidden_size * len(c.target_layer_ids), generator=g).to(c.dtype)
    pos = torch.arange(max(lens)).expand(len(lens), -1)
    anchors = torch.randint(0, c.vocab_size, (len(lens),), generator=g)
    return aux, draft.context_latents(aux, pos), anchors


def test_draft_forward_matches_float64_reference() -> None:
    """fp32 draft on the invariant kernels (absorbed MLA, RoPE table) vs the float64 direct form, two sequences of
    different context lengths in one batch: base logits and the Markov bias."""
    draft, embed, head = _draft("float32")
    lens, n = [5, 11], 4
    aux, cache, anchors = _batch(draft, lens, seed=1)
    hidden = draft.block_hidden(anchors, torch.tensor(lens), cache, n)
    logits = draft.base_logits(hidden)
    for b, p in enumerate(lens):
        want = ref.draft_logits(draft.cfg, draft.w, embed, head, aux[b, :p], int(anchors[b]), n)
        torch.testing.assert_close(logits[b].double(), want, rtol=2e-4, atol=2e-4)
        bias = draft.markov_bias(anchors[b : b + 1])[0]
        torch.testing.assert_close(bias.double(), ref.markov_bias(draft.cfg, draft.w, int(anchors[b])), rtol=1e-5,
                                   atol=1e-5)


def test_draft_rows_are_batch_invariant() -> None:
    """bf16: a sequence's draft logits alone equal its logits inside a batch of three (other lengths, junk past its
    own context) bit for bit."""
    draft, _, _ = _draft("bfloat16", seed=2)
    lens, n = [7, 3, 12], 3
    aux, cache, anchors = _batch(draft, lens, seed=4)
    together = draft.base_logits(draft.block_hidden(anchors, torch.tensor(lens), cache, n))
    for b, p in enumerate(lens):
        pos = torch.arange(p).view(1, p)
        alone_cache = draft.context_latents(aux[b : b + 1, :p], pos)
        alone = draft.base_logits(draft.block_hidden(anchors[b : b + 1], torch.tensor([p]), alone_cache, n))
        assert_bits(alone[0], together[b])
    assert len(dspark_specs(draft.cfg)) == len(draft.w)

