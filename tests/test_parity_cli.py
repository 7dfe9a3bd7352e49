"""`zerokl parity check` / `selftest` through the real vLLM engine and the real Megatron model, on k3-tiny-mxfp4 (bf16
compute, MXFP4 routed experts with a quantisation-aware trainer, FP8 MLA latents: the numerics K3 ships).

Check (invariant kernels): every sampled log-prob bitwise equal for batched and alone rollouts, which also
agree with each other; the HTML report renders a real plot. Fast kernels: a non-zero max |d| and exit 1, with a
diagnosis. Prefix-cache hits over the FP8 latents keep the bits. Selftest: one-ulp (of bf16) rollout-side
perturbations detected and localised (2 trials here; the README reports a 20-trial run). The command runs in-process
(`zerokl.cli.main`, what the console script calls; tests/test_cli.py runs the script itself), before the module's
shared `Checker` exists: one Megatron trainer per process at a time."""

from __future__ import annotations

import base64
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from zerokl.cli import main
from zerokl.engine_check import ENGINE_ARGS, Checker, selftest, task_prompts

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)




@pytest.fixture(scope="module")
def ckpt(k3_tiny_mxfp4: Path) -> Path:
    return k3_tiny_mxfp4


def test_cli_fast_kernels_fail_with_report(ckpt: Path, tmp_path: Path) -> None:
    rc = main(["parity", "check", "--model", str(ckpt), "--num-prompts", "6", "--max-tokens", "12", "--batch-mix", "both",
               "--kernels", "fast", "--json", str(tmp_path / "r.json"), "--report", str(tmp_path / "r.html")])
    assert rc == 1
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["max_abs_diff"] > 0 and data["bitwise_equal"] < data["tokens"]
    assert data["diagnosis"]
    page = (tmp_path / "r.html").read_text()
    assert "FAIL" in page and data["diagnosis"].split(":")[0] in page
    png = base64.b64decode(re.search(r"base64,([A-Za-z0-9+/=]+)", page).group(1))
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("L")
    assert img.size[0] > 400 and len(set(img.tobytes())) > 20


def test_cli_user_errors(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One `zerokl: error:` line, exit 2, before any engine or rank starts."""
    cases = [(["--model", str(tmp_path)], "not a checkpoint directory"),
             (["--model", str(ckpt), "--tp", "3"], "--tp 3: linear_attn_config.num_heads = 4 is not divisible"),
             (["--model", str(ckpt), "--tp", "2", "--backend", "deepspeed"], "the deepspeed backend has none")]
    for args, message in cases:
        assert main(["parity", "check", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_cli_lora_check_at_tp2_is_bitwise(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both sides with a PEFT adapter on every supported module (scale 3/8), 8 prompts x 16 tokens, the trainer at
    TP = 2 on two ranks (row-parallel layers and their LoRA A reduced over each rank's half of K only)."""
    adapter = tmp_path / "adapter"
    assert main(["lora", "init", "--model", str(ckpt), "--out", str(adapter), "--rank", "8", "--alpha", "3",
                 "--seed", "7"]) == 0
    assert main(["parity", "check", "--model", str(ckpt), "--lora", str(adapter), "--num-prompts", "8",
                 "--max-tokens", "16", "--batch-mix", "both", "--tp", "2", "--json", str(tmp_path / "r.json")]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["bitwise_equal"] == data["tokens"] > 0
    assert "scoring 16 sequences with the trainer at TP = 2" in capsys.readouterr().out  # 8 prompts, 2 mixes
    capsys.readouterr()
    assert main(["parity", "check", "--model", str(ckpt), "--lora", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "no adapter_config.json" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def checker(ckpt: Path) -> Iterator[Checker]:
    """The module's checker; its engine caches prefixes (16-token match unit), so repeated prompts resume from cached
    FP8 latents and KDA states."""
    c = Checker(ckpt, engine_args={**ENGINE_ARGS, "enable_prefix_caching": True, "prefix_match_unit": 16})
    yield c
    c.close()


def test_check_invariant_is_bitwise(checker: Checker) -> None:
    res = checker.check(task_prompts(8, 0, checker.tokenizer), mix="both", max_tokens=16, temperature=0.9)
    assert res.report.tokens == 2 * 8 * 16
    assert res.report.all_equal and res.report.max_abs_diff == 0.0 and res.report.kl_k1 == 0.0
    assert res.report.ratio_min == res.report.ratio_max == 1.0
    assert res.mix_mismatch == 0 and res.diagnosis is None


def test_fp8_latent_prefix_hits_keep_the_bits(checker: Checker) -> None:
    """Prefix-cache hits over FP8 latents and the KDA states cached with them, at a block boundary and inside a
    block: a warm run resumes from the cache and samples the cold run's tokens and log-probs bit for bit, which equal
    the one-pass forward's (the trainer's math) on the checkpoint."""
    import torch

    from parity.kernels import INVARIANT
    from parity.model import K3Forward, K3Weights, score_sequences

    g = torch.Generator().manual_seed(8)
    shared = torch.randint(4, 1000, (300,), generator=g).tolist()
    prompts = [shared + torch.randint(4, 1000, (n,), generator=g).tolist() for n in (5, 17, 40)]
    cold = checker.engine.generate(prompts, max_tokens=8, seed=4)
    warm = checker.engine.generate(prompts, max_tokens=8, seed=4)
    assert all(w.cached_tokens >= 256 for w in warm) and any(w.cached_tokens % 128 for w in warm), \
        [w.cached_tokens for w in warm]
    fwd = K3Forward(K3Weights.from_official(checker.cfg.text, checker.tensors), INVARIANT)
    for c, w in zip(cold, warm):
        assert c.completion_ids == w.completion_ids and torch.equal(c.logprobs, w.logprobs)
        ref = score_sequences(fwd, [c.prompt_ids + c.completion_ids])[0][len(c.prompt_ids) - 1 :]
        assert torch.equal(ref, c.logprobs)


def test_selftest_detects_and_localises(checker: Checker) -> None:
    trials = selftest(checker, task_prompts(8, 1, checker.tokenizer), trials=2, seed=3, max_tokens=16,
                      log=lambda _: None)
    assert len(trials) == 2 and all(t.detected for t in trials)
    assert all(t.diagnosed_block == t.expected_block for t in trials), trials
    # the engine is back on the checkpoint's weights: parity holds again
    assert checker.check(task_prompts(4, 2, checker.tokenizer), mix="random", max_tokens=8).report.all_equal
