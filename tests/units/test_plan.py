"""`zerokl plan`: the published K3 / K3.1 Pro figures, the per-GPU split, and the small configs."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from parity.config import ConfigError, load_model_config
from zerokl import plan as plan_mod
from zerokl.plan import Plan, format_plan, plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def k3() -> Plan:
    return plan(load_model_config(CONFIGS / "k3-full.yaml"))


@pytest.fixture(scope="module")
def k31() -> Plan:
    return plan(load_model_config(CONFIGS / "k3.1-pro.yaml"))


@pytest.mark.parametrize("name", ["k3", "k31"])
def test_published_parameter_totals(name: str, request: pytest.FixtureRequest) -> None:
    p: Plan = request.getfixturevalue(name)
    assert p.total_params == pytest.approx(2.8e12, rel=0.02)
    assert p.active_params == pytest.approx(104e9, rel=0.02)
    assert p.memory_estimate_bytes == pytest.approx(1680e9, rel=0.03)


def test_k3_fp8_latent_cache(k3: Plan) -> None:
    fp8 = next(k for k in k3.kv if k.format == "fp8")
    assert (fp8.mla_layers, fp8.latent_per_layer, fp8.index_key_per_layer) == (24, 576, 0)
    assert fp8.per_token == 13_824
    assert k3.kv_selected == fp8


def test_k31_cache_formats(k31: Plan) -> None:
    by_format = {k.format: k for k in k31.kv}
    assert by_format["fp8"].latent_per_layer * 24 == 13_824
    assert by_format["fp8"].index_key_per_layer == 132
    assert by_format["fp8"].per_token == 16_992
    assert by_format["nvfp4"].per_layer == 420
    assert by_format["nvfp4"].per_token == 10_080


def test_kda_state(k3: Plan) -> None:
    assert k3.kda_layers == 69
    assert k3.kda_recurrent_state_bytes == 69 * 96 * 128 * 128 * 4
    assert k3.kda_conv_state_bytes == 69 * 3 * 3 * 96 * 128 * 2


def test_parallel_degrees_divide_per_gpu_memory(k3: Plan) -> None:
    cfg = load_model_config(CONFIGS / "k3-full.yaml")
    split = plan(cfg, tp=8, ep=32, pp=3)
    assert split.dense_weight_bytes == k3.dense_weight_bytes
    assert split.dense_weight_bytes_per_gpu == pytest.approx(k3.dense_weight_bytes_per_gpu / (8 * 3))
    assert split.expert_weight_bytes_per_gpu == pytest.approx(k3.expert_weight_bytes_per_gpu / (32 * 3))
    assert split.kv_bytes_per_gpu == pytest.approx(k3.kv_bytes_per_gpu / 3)
    assert split.kda_state_bytes_per_gpu == pytest.approx(k3.kda_state_bytes_per_gpu / (8 * 3))
    assert k3.expert_weight_bytes == pytest.approx(k3.routed_expert_params * (0.5 + 1 / 32))
    assert k3.memory_bytes_per_gpu == pytest.approx(
        k3.dense_weight_bytes + k3.expert_weight_bytes + k3.kv_selected.per_token * k3.context_tokens
        + k3.kda_state_bytes
    )


def test_bad_layouts_are_config_errors() -> None:
    cfg = load_model_config(CONFIGS / "k3-full.yaml")
    for kwargs in ({"tp": 5}, {"ep": 3}, {"pp": 94}, {"tp": 0}, {"kv_format": "int2"}):
        with pytest.raises(ConfigError):
            plan(cfg, **kwargs)


@pytest.mark.parametrize("name", ["k3-tiny.yaml", "k3-small.yaml"])
def test_small_configs_plan(name: str) -> None:
    p = plan(load_model_config(CONFIGS / name), tp=2, ep=4, context_tokens=128)
    assert 0 < p.active_params < p.total_params
    assert p.kv_selected.per_token > 0 and not p.has_indexer
    assert "KV cache per token" in format_plan(p, title=name)


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan_mod.add_parser(parser.add_subparsers())
    argv = ["plan", "--config", str(overrides.pop("config", CONFIGS / "k3-tiny.yaml"))]
    for key, value in overrides.items():
        argv += [f"--{key}", str(value)]
    return parser.parse_args(argv)


def test_cli_prints_plan(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(tp=2, context=64)
    assert args.func(args) == 0
    assert "tp=2" in capsys.readouterr().out


def test_cli_prints_the_trainers_memory_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """With --dp: one rank's fp32 masters, gradients and Adam moments at the layout (`trainer.megatron.memory`; the
    parallel trainer test compares them with what a rank allocates). Doubling DP halves only the moments."""
    args = _args(tp=2, ep=2, dp=1)
    assert args.func(args) == 0
    one = capsys.readouterr().out.split("trainer memory per rank: ")[1].splitlines()
    args = _args(tp=2, ep=2, dp=2)
    assert args.func(args) == 0
    two = capsys.readouterr().out.split("trainer memory per rank: ")[1].splitlines()
    counts = [[int(line.split()[1 if i < 2 else 2].replace(",", "")) for i, line in enumerate(lines[1:4])]
              for lines in (one, two)]
    assert counts[0][:2] == counts[1][:2] and counts[0][2] == 2 * counts[0][1] and counts[1][2] == counts[1][1]


@pytest.mark.parametrize("overrides", [{"config": "/nonexistent/k3.yaml"}, {"tp": 3}, {"dp": 2, "pp": 2},
                                       {"dp": 2, "ep": 3}])
def test_cli_bad_input_is_one_line_exit_2(overrides: dict[str, object], capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(**overrides)
    assert plan_mod.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerokl: error: ") and err.count("\n") == 1


def test_kimi_linear_48b_plan_uses_its_declared_context() -> None:
    """The released Kimi-Linear-48B-A3B shape: 48B total / 3B active class, 1M-token context by default."""
    p = plan(load_model_config("configs/kimi-linear-48b-a3b.yaml"))
    assert 47e9 < p.total_params < 51e9 and 2.8e9 < p.active_params < 3.8e9
    assert p.context_tokens == 1048576


def test_tied_word_embeddings_are_refused(tmp_path: Path) -> None:
    """Neither vLLM's models nor transformers' Kimi Linear tie the LM head to the embedding: a config that asks
    for it is refused by name instead of meaning another model on one side."""
    text = (CONFIGS / "k3-tiny.yaml").read_text().replace("tie_word_embeddings: false", "tie_word_embeddings: true")
    (tmp_path / "tied.yaml").write_text(text)
    with pytest.raises(ConfigError, match="tie_word_embeddings: true is not supported"):
        load_model_config(tmp_path / "tied.yaml")
