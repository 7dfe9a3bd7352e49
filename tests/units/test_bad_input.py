"""Bad input through the commands a user runs: exit code 2, one `zerokl: error:` line that names the file, the line
or key and the bad value, no traceback, and nothing written or started.

PPO configs (wrong types, non-finite or out-of-range values), `--prompts` files (empty, out-of-vocabulary, negative or
non-integer ids, unknown keys, non-JSON and non-UTF-8 lines, prompts longer than the context), `parity diff` dumps
(non-integer ids, log-probs that are strings, NaN or +inf, duplicate ids, non-UTF-8), checkpoints (a shard missing or
truncated, index and shards that disagree, NaN or inf weights), and `--resume` (a run directory resumes from its
latest complete checkpoint; a run with another model, LoRA or advantage setting is refused).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import PPOReference
from parity.io.checkpoint import INDEX_FILE, load_checkpoint
from parity.weights import is_quantized, pack_quantized
from zerokl.cli import main
from zerokl.ppo.config import load_ppo_config
from zerokl.ppo.state import resume_point

REPO = Path(__file__).resolve().parents[2]


def _user_error(argv: list[str], capsys: pytest.CaptureFixture[str], *culprits: str) -> str:
    """Run the command; it must exit 2 with one error line naming every culprit."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("zerokl: error:"), err[-2000:]
    for culprit in culprits:
        assert culprit in lines[0], (culprit, lines[0])
    return lines[0]


def _ppo_config(tmp_path: Path, checkpoint: Path, **keys: object) -> Path:
    text = (REPO / "configs/ppo-tiny.yaml").read_text().replace("model: configs/k3-tiny.yaml", f"model: {checkpoint}")
    lines = [ln for ln in text.splitlines() if ln.split(":")[0] not in keys]
    lines += [f"{k}: {v}" for k, v in keys.items()]
    path = tmp_path / "ppo.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(("keys", "says"), [
    ({"lr": "fast"}, "lr must be a finite number, got 'fast'"),
    ({"lr": "-0.003"}, "lr must be > 0, got -0.003"),
    ({"lr": ".nan"}, "lr must be a finite number, got nan"),
    ({"steps": "2.7"}, "steps must be an integer, got 2.7"),
    ({"steps": '"ten"'}, "steps must be an integer, got 'ten'"),
    ({"samples_per_prompt": "4.5"}, "samples_per_prompt must be an integer, got 4.5"),
    ({"normalize_adv_std": "3"}, "normalize_adv_std must be true or false, got 3"),
    ({"task_args": "[1, 2]"}, "task_args must be a mapping"),
    ({"kl_coef": "-1"}, "kl_coef must be >= 0, got -1"),
    ({"kl_estimator": "k2"}, "kl_estimator must be one of k1, k3, got 'k2'"),
    ({"ref_model": "configs"}, "ref_model is only read with kl_coef > 0"),
    ({"old_logprobs": "rollout"}, "with ppo_epochs x num_minibatches = 1 the update's own forward is the check"),
    ({"parity_check_every": "3"}, "parity_check_every is only read with old_logprobs: rollout"),
    ({"num_minibatches": "64"}, "num_minibatches = 64 is more than the 32 samples of a step"),
    ({"micro_batch_size": "32"}, "micro_batch_size must be >= 1 and less than the 32 samples of the smallest"),
    ({"num_minibatches": "3", "micro_batch_size": "0"}, "micro_batch_size must be >= 1 and less than the 10 samples"),
    ({"ppo_epochs": "0"}, "ppo_epochs must be >= 1, got 0"),
    ({"model": "5"}, "model must be a model config or checkpoint path"),
    ({"gamma": "0.99"}, "gamma is only read with advantage: gae"),
    ({"value_clip": "0.2"}, "value_clip is only read with advantage: gae"),
    ({"value_lr": "0.01"}, "value_lr is only read with advantage: gae"),
    ({"advantage": "gae", "value_lr": "0"}, "value_lr must be > 0, got 0"),
    ({"advantage": "gae", "gamma": "1.5"}, "gamma must be in [0, 1], got 1.5"),
    ({"advantage": "gae", "lam": "-0.1"}, "lam must be in [0, 1], got -0.1"),
    ({"advantage": "gae", "vf_coef": "0"}, "vf_coef must be > 0, got 0"),
    ({"advantage": "gae", "value_clip": "-1"}, "value_clip must be > 0, got -1"),
    ({"advantage": "gae", "lora": "true"}, "advantage 'gae' trains the value head with the trunk, which lora freezes"),
    ({"advantage": "gae", "ppo_epochs": "2", "old_logprobs": "rollout"}, "old_logprobs 'rollout' skips"),
    ({"advantage": "gae", "normalize_adv_std": "true"}, "normalize_adv_std is GRPO's"),
    ({"zero_stage": "2"}, "zero_stage: the deepspeed backend was retired: zerokl trains on Megatron-core alone"),
    ({"backend": "megatron"}, "backend: the deepspeed backend was retired"),
    ({"lora_rank": "4"}, "lora_rank is only read with lora: true"),
    ({"lora_targets": "[q_proj]"}, "lora_targets is only read with lora: true"),
    ({"lora": "true", "lora_init": "configs", "lora_alpha": "8"}, "lora_alpha is not read with lora_init"),
    ({"lora": "true", "lora_rank": "0"}, "lora_rank must be >= 1, got 0"),
    ({"max_staleness": "-1"}, "max_staleness must be >= 0, got -1"),
    ({"max_staleness": "1", "advantage": "gae"}, "max_staleness > 0 with advantage: gae is not supported"),
    ({"max_staleness": "1", "lora": "true"}, "max_staleness > 0 with lora: true is not supported"),
    ({"max_staleness": "1", "ppo_epochs": "2", "old_logprobs": "rollout"},
     "old_logprobs is not read with max_staleness"),
    ({"rollout_servers": "[localhost:8000]"}, "rollout server 'localhost:8000' is not a server URL"),
    ({"rollout_servers": "[]"}, "rollout_servers is empty"),
    ({"rollout_servers": "[http://h:1]", "num_rollout_servers": "2"}, "give rollout_servers (running servers) or"),
    ({"num_rollout_servers": "-1"}, "num_rollout_servers must be >= 0"),
    ({"sync": "torch_distributed"}, "sync torch_distributed reaches rollout servers"),
    ({"sync": "cuda_ipc", "num_rollout_servers": "1"}, "sync cuda_ipc reaches the in-process engine"),
    ({"data_parallel": "both"}, "data_parallel must be one of replicate, shard"),
    ({"tp": "0"}, "tp must be >= 1, got 0"),
    ({"ep": "1.5"}, "ep must be an integer, got 1.5"),
    ({"top_p": "1.5"}, "top_p must be in (0, 1], got 1.5"),
    ({"top_k": "0"}, "top_k must be an integer >= 1, got 0"),
    ({"top_k": "2.5"}, "top_k must be an integer"),
    ({"min_p": "-0.1"}, "min_p must be in [0, 1], got -0.1"),
    ({"top_p": "0.7", "kl_coef": "0.05"}, "kl_coef > 0 with top_k / top_p / min_p is refused"),
    ({"logprobs_mode": "raw"}, "logprobs_mode must be one of processed_logprobs, raw_logprobs, got 'raw'"),
    ({"max_turns": "3"}, "max_turns is only read with an agent task (task addition is single-turn)"),
    ({"task": "guess", "task_args": "{}", "max_turns": "0"}, "max_turns must be >= 1, got 0"),
    ({"task": "guess", "task_args": "{}", "env_timeout_s": "0"}, "env_timeout_s must be > 0, got 0"),
    ({"task": "guess", "task_args": "{}", "advantage": "gae"}, "advantage 'gae' with an agent task is not built"),
    ({"task": "env", "task_args": "{path: nowhere.py:Env}"}, "task env: path"),
    ({"task": "calculator", "task_args": "{digits: 0}"}, "task calculator: digits must be >= 1, got 0"),
    ({"vision_tower": "true"}, "vision_tower must be a string, got True"),
    ({"vision_tower": "train"}, "vision_tower must be one of frozen, trainable, got 'train'"),
    ({"vision_tower": "trainable", "lora": "true"}, "vision_tower: trainable with lora: true is not supported"),
    ({"vision_tower": "trainable", "max_staleness": "1"}, "vision_tower: trainable with max_staleness > 0 is not"),
])
def test_ppo_config_values_are_checked(keys: dict[str, str], says: str, k3_tiny: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    config = _ppo_config(tmp_path, k3_tiny, **keys)
    _user_error(["ppo", "--config", str(config), "--out", str(tmp_path / "out")], capsys, str(config), says)
    assert not (tmp_path / "out").exists()


def test_ppo_on_several_processes_with_staleness_is_refused(k3_tiny: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    config = _ppo_config(tmp_path, k3_tiny, max_staleness=1)
    _user_error(["ppo", "--config", str(config), "--out", str(tmp_path / "out"), "--nproc-per-node", "2"], capsys,
                str(config), "2 processes with max_staleness > 0 is not supported")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("argv", "says"), [
    (["--nproc-per-node", "3", "--tp", "2"], "tp: 2 does not divide the 3 processes"),
    (["--nproc-per-node", "4", "--ep", "3"], "ep: 3 does not divide the 4 processes"),
    (["--nproc-per-node", "3"], "the 32 samples of a step (prompts_per_step x samples_per_prompt) must divide into "
                                "num_minibatches = 1 x 3 equal parts"),
])
def test_ppo_layouts_that_do_not_divide_are_refused(argv: list[str], says: str, k3_tiny: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    config = _ppo_config(tmp_path, k3_tiny)
    _user_error(["ppo", "--config", str(config), "--out", str(tmp_path / "out"), *argv], capsys, str(config), says)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_ppo_cuda_ipc_sync_needs_a_gpu(k3_tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _ppo_config(tmp_path, k3_tiny, sync="cuda_ipc")
    _user_error(["ppo", "--config", str(config), "--out", str(tmp_path / "out")], capsys, str(config),
                "sync cuda_ipc needs a CUDA GPU")


def test_ppo_reference_must_be_a_checkpoint_of_the_policys_architecture(k3_tiny: Path, k3_tiny_mxfp4: Path,
                                                                        tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`ref_model` is checked before the trainer or the engine starts."""
    config = _ppo_config(tmp_path, k3_tiny, kl_coef=0.05, ref_model=tmp_path)
    _user_error(["ppo", "--config", str(config), "--out", str(tmp_path / "a")], capsys, "is not a checkpoint directory")
    config = _ppo_config(tmp_path, k3_tiny, kl_coef=0.05, ref_model=k3_tiny_mxfp4)
    _user_error(["ppo", "--config", str(config), "--out", str(tmp_path / "b")], capsys,
                f"ref_model {k3_tiny_mxfp4}: its text model config differs from the policy's")


def test_ppo_image_task_needs_a_vision_tower(kimi_linear_tiny: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    config = _ppo_config(tmp_path, kimi_linear_tiny, task="squares", task_args="{max_count: 3}")
    _user_error(["ppo", "--config", str(config), "--out", str(tmp_path / "out")], capsys, str(config),
                "task squares gives images, but model")
    config = _ppo_config(tmp_path, kimi_linear_tiny, vision_tower="trainable")
    _user_error(["ppo", "--config", str(config), "--out", str(tmp_path / "out")], capsys, str(config),
                "vision_tower: trainable, but model")
    assert not (tmp_path / "out").exists()


def test_ppo_config_reads_exponents_yaml_leaves_as_text(k3_tiny: Path, tmp_path: Path) -> None:
    """YAML 1.1 reads `3e-3` (no dot) as a string; the config reads it as the number it is."""
    assert load_ppo_config(_ppo_config(tmp_path, k3_tiny, lr="3e-3", clip="2E-1")).lr == 3e-3


@pytest.mark.parametrize(("line", "says"), [
    (b'{"prompt": ""}', "'prompt' must be non-empty text"),
    (b'{"prompt_token_ids": []}', "'prompt_token_ids' must be a non-empty list"),
    (b'{"prompt_token_ids": [5, -1]}', "prompt_token_ids[1] = -1 is not a token id"),
    (b'{"prompt_token_ids": [5, 999999]}', "prompt_token_ids[1] = 999999 is not a token id"),
    (b'{"prompt_token_ids": [5, 6.0]}', "prompt_token_ids[1] = 6.0 is not a token id"),
    (b'{"prompt_token_ids": [true]}', "prompt_token_ids[0] = True is not a token id"),
    (b'{"prompt": "hi", "images": ["a.png"]}', "a.png: no such image file"),
    (b'{"prompt": "hi", "image": ["a.png"]}', "unknown key(s) 'image'"),
    (b'{"prompt": "hi", "prompt_token_ids": [5]}', "expected one of 'prompt' or 'prompt_token_ids'"),
    (b"5", "expected an object"),
    (b'{"prompt": "caf\xe9"}', "not UTF-8"),
    (b'{"prompt": ', "not JSON"),
    (json.dumps({"prompt_token_ids": [7] * 1020}).encode(), "the prompt has 1020 tokens; at most 992 fit"),
])
def test_prompt_file_lines_are_checked_before_anything_starts(line: bytes, says: str, k3_tiny: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b'{"prompt": "What is 1 + 2?"}\n' + line + b"\n")
    out = tmp_path / "r.json"
    _user_error(["parity", "check", "--model", str(k3_tiny), "--prompts", str(prompts), "--json", str(out)], capsys,
                f"{prompts}:2", says)
    assert not out.exists()


@pytest.mark.parametrize("argv", [["--max-tokens", "0"], ["--num-prompts", "-3"], ["--temperature", "0"],
                                  ["--temperature", "nan"]])
def test_check_arguments_are_checked(argv: list[str], k3_tiny: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["parity", "check", "--model", str(k3_tiny), *argv])
    assert exit_.value.code == 2


@pytest.mark.parametrize(("line", "says"), [
    ({"id": 0, "token_ids": [1, "a"], "logprobs": [-1.0, -2.0]}, "token_ids[1] = 'a' is not a token id"),
    ({"id": 0, "token_ids": [1, 2], "logprobs": [-1.0, "-2"]}, "logprobs[1] = '-2' is not a number"),
    ({"id": 0, "token_ids": [1, 2], "logprobs": [-1.0, float("nan")]}, "logprobs[1] is nan"),
    ({"id": 0, "token_ids": [1, 2], "logprobs": [float("inf"), -1.0]}, "logprobs[0] is inf"),
    ({"id": 0, "token_ids": [1, 2], "logprobs": [-1.0]}, "2 token_ids but logprobs is a list of 1"),
    ({"id": [0], "token_ids": [1], "logprobs": [-1.0]}, "id must be a string or an integer"),
    ({"id": 1, "token_ids": [1], "logprobs": [-1.0]}, "id '1' appears twice"),
])
def test_dump_lines_are_checked(line: dict, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "a.jsonl"
    good.write_text(json.dumps({"id": 1, "token_ids": [1], "logprobs": [-1.0]}) + "\n")
    bad = tmp_path / "b.jsonl"
    bad.write_text(good.read_text() + json.dumps(line) + "\n")
    _user_error(["parity", "diff", str(good), str(bad), "--json", str(tmp_path / "r.json")], capsys, f"{bad}:2", says)
    assert not (tmp_path / "r.json").exists()


def test_dump_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "b.jsonl"
    bad.write_bytes(b'{"id": "\xff", "token_ids": [1], "logprobs": [-1.0]}\n')
    _user_error(["parity", "diff", str(bad), str(bad)], capsys, f"{bad}:1", "not UTF-8")


def _broken_copy(k3_tiny: Path, tmp_path: Path, how: str) -> tuple[Path, str]:
    """A copy of the checkpoint broken one way; returns it and what the error must name."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(k3_tiny, ckpt)
    index = json.loads((ckpt / INDEX_FILE).read_text())
    name, shard = sorted(index["weight_map"].items())[5]
    if how == "missing shard":
        (ckpt / shard).unlink()
        return ckpt, f"{ckpt / shard}: the index names this shard but it is not on disk"
    if how == "truncated shard":
        data = (ckpt / shard).read_bytes()
        (ckpt / shard).write_bytes(data[: len(data) // 2])
        return ckpt, f"{ckpt / shard}: not a readable safetensors file"
    tensors = load_file(str(ckpt / shard))
    if how == "tensor not in the index":
        tensors["language_model.layers.0.extra.weight"] = torch.zeros(2)
        save_file(tensors, str(ckpt / shard), metadata={"format": "pt"})
        return ckpt, "holds language_model.layers.0.extra.weight (and 0 more), which the index"
    if how == "index entry not in the shard":
        index["weight_map"]["language_model.layers.0.ghost.weight"] = shard
        (ckpt / INDEX_FILE).write_text(json.dumps(index))
        return ckpt, "lists language_model.layers.0.ghost.weight"
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = float("nan" if how == "nan weight" else "inf")
    save_file(tensors, str(ckpt / shard), metadata={"format": "pt"})
    return ckpt, "holds NaN or inf values"


@pytest.mark.parametrize("how", ["missing shard", "truncated shard", "tensor not in the index",
                                 "index entry not in the shard", "nan weight", "inf weight"])
def test_broken_checkpoints_are_named(how: str, k3_tiny: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, says = _broken_copy(k3_tiny, tmp_path, how)
    _user_error(["parity", "check", "--model", str(ckpt), "--json", str(tmp_path / "r.json")], capsys, says)
    assert not (tmp_path / "r.json").exists()


def test_resume_from_a_run_directory_takes_its_latest_complete_checkpoint(ppo_reference: PPOReference,
                                                                         tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(ppo_reference.out / "checkpoints", run / "checkpoints")
    assert resume_point(run) == run / "checkpoints" / "step-4"
    shutil.copytree(run / "checkpoints" / "step-4", run / "checkpoints" / "step-6.partial")  # a crash mid-save
    assert resume_point(run) == run / "checkpoints" / "step-4"
    assert resume_point(run / "checkpoints" / "step-2") == run / "checkpoints" / "step-2"


def test_export_writes_the_trained_weights_as_a_servable_checkpoint(ppo_reference: PPOReference, k3_tiny_mxfp4: Path,
                                                                    tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`zerokl export` of the reference run (one process: weights.pt) writes its latest checkpoint's weights as an
    official checkpoint: every tensor in the model's storage dtype, the text tensors the trained fp32 masters rounded
    to it, the MXFP4 experts packed from them again; a non-empty --out or a directory that is no checkpoint is named.
    (Megatron's per-rank files: tests/engines/test_ppo_data_parallel.py.)"""
    out = tmp_path / "exported"
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(ppo_reference.out), "--out", str(out)]) == 0
    masters = torch.load(ppo_reference.out / "checkpoints" / "step-4" / "weights.pt", weights_only=True)
    cfg, exported = load_checkpoint(out)
    base = load_checkpoint(k3_tiny_mxfp4)[1]
    assert exported.keys() == base.keys() and all(exported[n].dtype == t.dtype for n, t in base.items())
    assert all(torch.equal(exported[n], masters[n].to(t.dtype)) for n, t in base.items() if n in masters)
    packed = pack_quantized(cfg.text, {n: t for n, t in masters.items() if is_quantized(cfg.text, n)})
    assert packed and all(torch.equal(exported[n], t) for n, t in packed.items())
    assert any(not torch.equal(exported[n], t) for n, t in base.items())  # the trained weights, not the base
    _user_error(["export", "--checkpoint", str(ppo_reference.out), "--out", str(out)], capsys, "is not empty")
    _user_error(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "again")], capsys,
                "is not a zerokl ppo checkpoint")
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize(("key", "value"), [("lora", "true"), ("model", "configs/k3-small.yaml"), ("advantage", "gae")])
def test_resume_into_another_run_is_refused(key: str, value: str, ppo_reference: PPOReference, k3_tiny_mxfp4: Path,
                                            tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _ppo_config(tmp_path, k3_tiny_mxfp4, **{key: value})  # the reference run's checkpoint
    _user_error(["ppo", "--config", str(config), "--out", str(tmp_path / "out"), "--resume", str(ppo_reference.out)],
                capsys, str(ppo_reference.out / "checkpoints" / "step-4"), f"run with {key}:")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("key", "value", "flag", "says"), [
    ("steps", "3.5", ["--steps", "1"], "steps must be an integer, got 3.5"),
    ("kernels", "turbo", ["--kernels", "invariant"], "kernels must be one of"),
    ("on_mismatch", "ignore", ["--on-mismatch", "warn"], "on_mismatch must be one of"),
    ("wandb", "cloud", ["--wandb", "disabled"], "wandb must be one of"),
    ("tp", "0", ["--tp", "2"], "tp must be >= 1, got 0"),
])
def test_a_config_value_a_flag_overrides_is_still_checked(key: str, value: str, flag: list[str], says: str,
                                                          k3_tiny: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The file is validated whole as it stands before the flags override it: a bad value in it is refused even
    where a flag replaces it (the same file alone is refused too, by the test above)."""
    config = _ppo_config(tmp_path, k3_tiny, **{key: value})
    _user_error(["ppo", "--config", str(config), "--out", str(tmp_path / "out"), *flag], capsys, str(config), says)
    assert not (tmp_path / "out").exists()


def test_ray_without_a_cluster_is_one_line(k3_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """`--ray ADDRESS` where no Ray cluster answers: `ray.init`'s ConnectionError becomes a `zerokl: error:` line (Ray's
    own wait for an absent head takes minutes, so its answer is stood in for here)."""
    import ray

    def no_cluster(**kwargs: object) -> None:
        raise ConnectionError(f"Could not find any running Ray instance at {kwargs.get('address')}")

    monkeypatch.setattr(ray, "init", no_cluster)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    config = _ppo_config(tmp_path, k3_tiny)
    _user_error(["ppo", "--config", str(config), "--out", str(tmp_path / "out"), "--ray", "10.0.0.1:6379"], capsys,
                "--ray 10.0.0.1:6379: no Ray cluster answers", "ray start --head")
