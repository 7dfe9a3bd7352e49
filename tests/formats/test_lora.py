"""LoRA adapters in PEFT format: `zerokl lora init` output read by PEFT and vLLM's parsers, load round trip,
validation errors, PEFT's scaling and targeting rules, and the shared forward with an adapter (batch and
padding invariance). Trainer-side LoRA: tests/trainers/test_lora_trainer.py."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora.adapter import CONFIG_FILE, WEIGHTS_FILE, Adapter, load_adapter, load_lora, save_adapter
from lora.cli import add_parser
from lora.init import random_adapter
from lora.spec import MAX_RANK, AdapterError, LoraSpec
from lora.state import read_state, shard_file, write_shard
from lora.targets import lora_targets, tensor_name
from parity.config import ModelConfig, load_model_config
from parity.kernels import INVARIANT
from parity.model import K3Forward, K3Weights, score_sequences
from parity.io.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
Q_PROJ = "language_model.layers.1.self_attn.q_proj"  # a KDA layer (layer 0 is dense, 1-3 KDA, 4 MLA, ...)


def lora_main(argv: list[str]) -> int:
    """`zerokl lora ...` as `zerokl.cli.main` runs a subcommand (the lead wires `lora.cli.add_parser` there)."""
    parser = argparse.ArgumentParser(prog="zerokl")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture(scope="module")
def checkpoint(k3_tiny: Path) -> Path:
    return k3_tiny


@pytest.fixture(scope="module")
def official(checkpoint: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return load_checkpoint(checkpoint)


@pytest.fixture(scope="module")
def adapter_dir(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("adapter") / "a"
    assert lora_main(["lora", "init", "--model", str(checkpoint), "--out", str(out), "--rank", "8", "--alpha", "16",
                      "--seed", "3"]) == 0
    return out


def _copy(adapter_dir: Path, dest: Path, config: dict | None = None,
          tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of the adapter directory with its config updated by `config` and tensors replaced by `tensors`."""
    dest.mkdir()
    cfg = {**json.loads((adapter_dir / CONFIG_FILE).read_text()), **(config or {})}
    (dest / CONFIG_FILE).write_text(json.dumps(cfg))
    tensors = load_file(adapter_dir / WEIGHTS_FILE) if tensors is None else tensors
    save_file({n: t.contiguous() for n, t in tensors.items()}, dest / WEIGHTS_FILE)
    return dest


def test_init_writes_a_peft_adapter(adapter_dir: Path, checkpoint: Path) -> None:
    """adapter_config.json is read by PEFT's own `PeftConfig.from_pretrained`; tensor names are PEFT's; loading
    gives back the written tensors bit for bit; B is non-zero; every supported projection is adapted."""
    from peft import PeftConfig

    peft_cfg = PeftConfig.from_pretrained(str(adapter_dir))
    assert (peft_cfg.peft_type.value, peft_cfg.r, peft_cfg.lora_alpha) == ("LORA", 8, 16)
    assert not peft_cfg.use_dora and not peft_cfg.use_rslora and "q_proj" in peft_cfg.target_modules
    raw = load_file(adapter_dir / WEIGHTS_FILE)
    assert tensor_name(Q_PROJ, "A") == f"base_model.model.{Q_PROJ}.lora_A.weight" and tensor_name(Q_PROJ, "A") in raw
    assert all(t.dtype == torch.float32 for t in raw.values())
    cfg = load_model_config(checkpoint).text
    adapter = load_adapter(adapter_dir, cfg)
    assert set(adapter.weights) == set(lora_targets(cfg))
    for module, (a, b) in adapter.weights.items():
        assert torch.equal(a, raw[tensor_name(module, "A")]) and torch.equal(b, raw[tensor_name(module, "B")])
        assert b.count_nonzero() == b.numel(), module
    lora = load_lora(adapter_dir, cfg)
    assert lora[f"{Q_PROJ}.weight"].scale == 2.0 and lora[f"{Q_PROJ}.weight"].a.shape == (8, cfg.hidden_size)


def test_a_config_written_by_peft_is_read(adapter_dir: Path, checkpoint: Path, tmp_path: Path) -> None:
    """PEFT's own `LoraConfig.save_pretrained` output (every default key of peft 0.21.2) is accepted."""
    from peft import LoraConfig

    cfg = load_model_config(checkpoint).text
    ours = json.loads((adapter_dir / CONFIG_FILE).read_text())
    peft_dir = tmp_path / "peft"
    LoraConfig(r=8, lora_alpha=16, target_modules=ours["target_modules"], lora_dropout=0.05,
               task_type="CAUSAL_LM").save_pretrained(str(peft_dir))
    (peft_dir / WEIGHTS_FILE).write_bytes((adapter_dir / WEIGHTS_FILE).read_bytes())
    spec = load_adapter(peft_dir, cfg).spec
    assert (spec.r, spec.lora_alpha, set(spec.target_modules)) == (8, 16, set(ours["target_modules"]))
    assert load_lora(peft_dir, cfg)[f"{Q_PROJ}.weight"].scale == 2.0


def test_init_is_seeded_and_targets_are_chosen(checkpoint: Path) -> None:
    cfg = load_model_config(checkpoint).text
    one, two = random_adapter(cfg, 4, seed=5, targets=["o_proj"]), random_adapter(cfg, 4, seed=5, targets=["o_proj"])
    assert set(one.weights) == {m for m in lora_targets(cfg) if m.endswith(".o_proj")}
    assert all(torch.equal(one.weights[m][1], two.weights[m][1]) for m in one.weights)
    with pytest.raises(AdapterError, match="'w1' is not a LoRA target of this model"):
        random_adapter(cfg, 4, targets=["w1"])


def test_vllm_parses_the_tensor_names_onto_official_modules(adapter_dir: Path) -> None:
    """vLLM's LoRA loader (`parse_fine_tuned_lora_name`) maps every tensor to the official module path (what
    zerokl's vLLM K3 model keeps), and its `PEFTHelper` reads the config with the same scaling."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    for name in load_file(adapter_dir / WEIGHTS_FILE):
        module, is_a = parse_fine_tuned_lora_name(name)
        assert name == tensor_name(module, "A" if is_a else "B")
    helper = PEFTHelper.from_local_dir(str(adapter_dir), max_position_embeddings=None)
    helper.validate_legal(LoRAConfig(max_lora_rank=8))
    assert helper.vllm_lora_scaling_factor == 2.0


def test_peft_scaling_and_targeting_rules() -> None:
    spec = LoraSpec(r=16, lora_alpha=8.0, target_modules=("q_proj", "o_proj"), use_rslora=True,
                    exclude_modules=("layers.4.self_attn.o_proj",), layers_to_transform=(1, 4),
                    rank_pattern={"o_proj": 4}, alpha_pattern={r"layers\.4\..*": 2.0})
    assert spec.scale(Q_PROJ) == 8.0 / math.sqrt(16)
    assert spec.rank("language_model.layers.1.self_attn.o_proj") == 4
    assert spec.scale("language_model.layers.4.self_attn.q_proj") == 2.0 / 4.0
    assert spec.targets(Q_PROJ) and not spec.targets("language_model.layers.2.self_attn.q_proj")
    assert not spec.targets("language_model.layers.4.self_attn.o_proj")  # excluded
    assert not spec.targets("language_model.layers.1.self_attn.q_a_proj")
    regex = LoraSpec(r=2, lora_alpha=2, target_modules=r".*\.mlp\.(gate|up)_proj")
    assert regex.targets("language_model.layers.0.mlp.up_proj") and not regex.targets("x.layers.0.mlp.down_proj")


def _fails(adapter_dir: Path, checkpoint: Path, tmp_path: Path, match: str, config: dict | None = None,
           edit: dict[str, torch.Tensor | None] | None = None) -> None:
    """Loading a copy of `adapter_dir` with `config` keys changed and tensors edited (None deletes) fails with
    a one-line `AdapterError` matching `match`."""
    tensors = load_file(adapter_dir / WEIGHTS_FILE)
    for name, t in (edit or {}).items():
        if t is None:
            del tensors[name]
        else:
            tensors[name] = t
    bad = _copy(adapter_dir, tmp_path / "bad", config, tensors)
    with pytest.raises(AdapterError, match=match) as err:
        load_adapter(bad, load_model_config(checkpoint).text)
    assert "\n" not in str(err.value)


A, B = tensor_name(Q_PROJ, "A"), tensor_name(Q_PROJ, "B")
EXPERT = "language_model.layers.2.block_sparse_moe.experts.0.w1"


@pytest.mark.parametrize(("case", "match"), [
    ("wrong_shape", r"lora_B.weight has shape \(128, 4\), expected \(128, 8\)"),
    ("unknown_target", "unknown target module 'language_model.layers.1.self_attn.zz_proj'"),
    ("expert_target", "unsupported target module .*experts.0.w1.*routed experts take no LoRA"),
    ("not_selected", "which target_modules .* does not select"),
    ("missing_b", r"q_proj.lora_B.weight is missing"),
    ("nan", "non-finite values"),
    ("int_dtype", "has dtype torch.int32"),
    ("bad_name", "unexpected tensor 'model.q_proj.weight'"),
    ("rank_too_large", rf"r = {MAX_RANK + 1} must be an integer in \[1, {MAX_RANK}\]"),
    ("dora", "use_dora = True: DoRA"),
    ("pissa", "init_lora_weights = 'pissa' modifies the base weights"),
    ("bias", "bias = 'all'"),
    ("all_linear", "'all-linear' is not supported"),
    ("router_selected", "target_modules selects .*block_sparse_moe.gate.*router"),
    ("not_lora", "peft_type is 'IA3'"),
])
def test_validation_rejects_with_clear_errors(case: str, match: str, adapter_dir: Path, checkpoint: Path,
                                             tmp_path: Path) -> None:
    a, b = load_file(adapter_dir / WEIGHTS_FILE)[A], load_file(adapter_dir / WEIGHTS_FILE)[B]
    cases: dict[str, dict] = {
        "wrong_shape": {"edit": {B: b[:, :4]}},
        "unknown_target": {"edit": {A.replace("q_proj", "zz_proj"): a, B.replace("q_proj", "zz_proj"): b}},
        "expert_target": {"edit": {tensor_name(EXPERT, "A"): torch.zeros(8, 128),
                                   tensor_name(EXPERT, "B"): torch.zeros(64, 8)}},
        "not_selected": {"config": {"target_modules": ["o_proj"]}},
        "missing_b": {"edit": {B: None}},
        "nan": {"edit": {B: b.index_put((torch.tensor([0]), torch.tensor([0])), torch.tensor(float("nan")))}},
        "int_dtype": {"edit": {A: a.to(torch.int32)}},
        "bad_name": {"edit": {"model.q_proj.weight": a}},
        "rank_too_large": {"config": {"r": MAX_RANK + 1}},
        "dora": {"config": {"use_dora": True}},
        "pissa": {"config": {"init_lora_weights": "pissa"}},
        "bias": {"config": {"bias": "all"}},
        "all_linear": {"config": {"target_modules": "all-linear"}},
        "router_selected": {"config": {"target_modules": r".*\.(gate|(q|k|v|g|f_a|f_b|b|o|q_a|q_b|kv_b)_proj|"
                                                          r"kv_a_proj_with_mqa|(gate|up|down)_proj|"
                                                          r"routed_expert_(down|up)_proj)"}},
        "not_lora": {"config": {"peft_type": "IA3"}},
    }
    _fails(adapter_dir, checkpoint, tmp_path, match, **cases[case])


def test_pickle_files_and_missing_files_are_refused(adapter_dir: Path, checkpoint: Path, tmp_path: Path) -> None:
    cfg = load_model_config(checkpoint).text
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / CONFIG_FILE).write_text((adapter_dir / CONFIG_FILE).read_text())
    torch.save(load_file(adapter_dir / WEIGHTS_FILE), pickled / "adapter_model.bin")
    with pytest.raises(AdapterError, match="adapter_model.bin is a pickle; zerokl reads only adapter_model.safet"):
        load_adapter(pickled, cfg)
    with pytest.raises(AdapterError, match="not a PEFT adapter directory"):
        load_adapter(tmp_path / "nowhere", cfg)


def test_bf16_adapter_is_upcast_exactly(adapter_dir: Path, checkpoint: Path, tmp_path: Path) -> None:
    cfg = load_model_config(checkpoint).text
    half = {n: t.to(torch.bfloat16) for n, t in load_file(adapter_dir / WEIGHTS_FILE).items()}
    loaded = load_adapter(_copy(adapter_dir, tmp_path / "bf16", tensors=half), cfg)
    assert torch.equal(loaded.weights[Q_PROJ][0], half[A].float())


def test_cli_errors_are_value_errors_on_one_line(checkpoint: Path, tmp_path: Path) -> None:
    for argv, match in [
        (["--rank", "0"], r"r = 0 must be an integer in \[1, 512\]"),
        (["--rank", "4", "--targets", "lm_head"], "'lm_head' is not a LoRA target"),
    ]:
        with pytest.raises(ValueError, match=match):
            lora_main(["lora", "init", "--model", str(checkpoint), "--out", str(tmp_path / "o"), *argv])
    assert not (tmp_path / "o").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("mine")
    with pytest.raises(AdapterError, match="exists and is not an empty directory"):
        lora_main(["lora", "init", "--model", str(checkpoint), "--out", str(tmp_path / "full"), "--rank", "2"])


def test_save_load_round_trip_is_bitwise(official: tuple[ModelConfig, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    cfg = official[0].text
    adapter = random_adapter(cfg, 4, 8.0, ["kv_b_proj", "down_proj"], seed=9, use_rslora=True)
    back = load_adapter(save_adapter(adapter, tmp_path / "a"), cfg)
    assert back.spec == adapter.spec and back.weights.keys() == adapter.weights.keys()
    assert all(torch.equal(x, y) for m in adapter.weights for x, y in zip(adapter.weights[m], back.weights[m]))


def test_state_shards_reassemble_and_missing_shards_are_named(
        official: tuple[ModelConfig, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    """Two TP shards (B split along dim 0) reassemble to the adapter bit for bit; a missing shard is named."""
    cfg = official[0].text
    adapter = random_adapter(cfg, 4, targets=["q_proj", "o_proj"], seed=2)
    tensors = adapter.tensors()
    split = {n: 0 for n in tensors if ".q_proj.lora_B." in n}
    for rank in range(2):
        part = {n: t.chunk(2, dim=0)[rank] if n in split else t for n, t in tensors.items()}
        write_shard(tmp_path, adapter.spec, part, split, rank, 2)
    back = read_state(tmp_path, cfg)
    assert back.spec == adapter.spec
    assert all(torch.equal(x, y) for m in adapter.weights for x, y in zip(adapter.weights[m], back.weights[m]))
    (tmp_path / shard_file(1, 2)).unlink()
    with pytest.raises(AdapterError, match="expected the 2 shards"):
        read_state(tmp_path, cfg)


def test_forward_with_adapter_is_batch_invariant_and_changes_logprobs(
        official: tuple[ModelConfig, dict[str, torch.Tensor]], adapter_dir: Path) -> None:
    """The shared forward with `K3Weights.lora`: a sequence scored alone equals it scored in a padded batch, bit
    for bit, and differs from the base model (decode schedule: tests/trainers/test_lora_trainer.py)."""
    cfg, weights = official
    base = K3Weights.from_official(cfg.text, weights)
    fwd = K3Forward(K3Weights(cfg.text, base.tensors, load_lora(adapter_dir, cfg.text)), INVARIANT)
    seqs = [[5, 9, 300, 17, 4, 88, 1000, 6, 7], [40, 41, 42, 43], [8, 200, 3, 5, 5, 6]]
    alone = score_sequences(fwd, seqs[:1])[0]
    assert torch.equal(score_sequences(fwd, seqs)[0], alone)
    plain = score_sequences(K3Forward(base, INVARIANT), seqs[:1])[0]
    assert (plain - alone).abs().max() > 1e-2


def test_lora_keys_are_official_weight_names(official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """`Adapter.lora()` is keyed like `K3Weights.tensors`: official checkpoint weight names (KDA and MLA g_proj)."""
    cfg, weights = official
    adapter: Adapter = random_adapter(cfg.text, 2, targets=["g_proj"])
    assert set(adapter.lora()) == {n for n in weights if n.endswith(".self_attn.g_proj.weight")}
