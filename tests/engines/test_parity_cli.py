"""`zerokl parity check` / `selftest` through the real vLLM engine and the real Megatron model, on k3-tiny-mxfp4 (bf16
compute, MXFP4 routed experts with a quantisation-aware trainer, FP8 MLA latents: the numerics K3 ships).

Check (invariant kernels): every sampled log-prob bitwise equal for batched and alone rollouts, which also
agree with each other; the HTML report renders a real plot. Fast kernels: a non-zero max |d| and exit 1, with a
diagnosis. Prefix-cache hits over the FP8 latents keep the bits. Selftest: one-ulp (of bf16) rollout-side
perturbations detected and localised (2 trials here; docs/parity.md reports a 20-trial run). The command runs in-process
(`zerokl.cli.main`, what the console script calls; tests/units/test_cli.py runs the script itself), before the module's
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
from helpers import picture, without_chat_template
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
             (["--model", str(ckpt), "--tp", "3"], "--tp 3: linear_attn_config.num_heads = 4 is not divisible")]
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


# --- image prompts (the checkpoint's vision tower in both engines) ------------------------------------------------


def _image_prompts_file(root: Path) -> Path:
    """Text prompts and image prompts (one image, two images at their placeholders, an RGBA and a palette image,
    odd sizes, one larger than the tower's grid and scaled down) with paths relative to the file."""
    pics = {"a.png": picture(60, 40, 1), "b.png": picture(30, 100, 2, "RGBA"), "c.png": picture(300, 200, 3),
            "d.gif": picture(20, 21, 4, "P")}
    (root / "imgs").mkdir()
    for name, im in pics.items():
        im.save(root / "imgs" / name)
    rows = [{"prompt": "What is 12 + 30? Answer:"},
            {"prompt": "What is in the picture? Answer:", "images": ["imgs/a.png"]},
            {"prompt": "Compare <|kimi_image_placeholder|> and <|kimi_image_placeholder|>.",
             "images": ["imgs/b.png", "imgs/c.png"]},
            {"prompt_token_ids": [3, 40, 41, 42], "images": ["imgs/d.gif"]},
            {"prompt": "Reverse the string kimi. Answer:"}]
    path = root / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_image_prompts_keep_the_bits_and_the_image_is_used(checker: Checker, tmp_path: Path) -> None:
    """Image prompts mixed with text ones, batched and alone: every log-prob the trainer's (its image rows from the same
    tower, the same preprocessing); another image in the same prompt changes the log-probs; the same image in a
    second request is served from the prefix cache with the same bits."""
    import torch

    from rollout.sampling import ImagePrompt
    from zerokl.engine_check import load_prompts

    prompts = load_prompts(_image_prompts_file(tmp_path), checker.tokenizer, checker.cfg.text.vocab_size, 1000,
                           checker.path)
    assert [len(p.images) if isinstance(p, ImagePrompt) else 0 for p in prompts] == [0, 1, 2, 1, 0]
    res = checker.check(prompts, mix="both", max_tokens=8, seed=5)
    assert res.report.tokens == 2 * 5 * 8 and res.report.all_equal and res.mix_mismatch == 0, res.report
    pad = checker.cfg.raw["media_placeholder_token_id"]
    assert all(s.prompt_token_ids.count(pad) >= 1 for s in res.rollout[1:4])  # expanded by vLLM's K3 processor
    other = ImagePrompt(prompts[1].token_ids, (picture(60, 40, 9),))
    first, swapped = checker.engine.generate([prompts[1], other], max_tokens=8, seed=[11, 11])
    assert len(first.prompt_ids) == len(swapped.prompt_ids) and not torch.equal(first.logprobs, swapped.logprobs)
    again = checker.engine.generate([prompts[1]], max_tokens=8, seed=[11])[0]
    assert again.cached_tokens >= 16 and again.completion_ids == first.completion_ids
    assert torch.equal(again.logprobs, first.logprobs)
    assert torch.equal(checker.score([again], 1.0, [prompts[1]])[0], again.logprobs)


# --- chat prompts (the checkpoint's K3 chat template, with tools) -------------------------------------------------

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic",
                                         "parameters": {"type": "object", "required": ["expression"],
                                                        "properties": {"expression": {"type": "string"}}}}}
CHAT_LINES = [
    {"messages": [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 17 * 23?"}],
     "tools": [CALC]},
    {"prompt": "What is 12 + 30? Answer:"},
    {"messages": [{"role": "user", "content": "Add 2 and 3."},
                  {"role": "assistant", "content": "", "reasoning_content": "the tool adds",
                   "tool_calls": [{"id": "a", "type": "function",
                                   "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}]},
                  {"role": "tool", "name": "calculator", "tool_call_id": "a", "content": "5"}], "tools": [CALC]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "you"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is in"},
                                               {"type": "image_url", "image_url": {"url": "imgs/chat.png"}},
                                               {"type": "text", "text": "and how many squares?"}]}]},
]


def test_chat_prompts_with_tools_keep_the_bits(checker: Checker, tmp_path: Path) -> None:
    """Chat lines (a tool declared, a tool call and its result in the history, an image part) mixed with a text line,
    batched and alone: each is the generation prompt of the checkpoint's chat template (the image at the placeholder
    it puts), and every log-prob is the trainer's."""
    from transformers import AutoTokenizer

    from parity.io.chat_format import CHAT_TOKENS
    from rollout.sampling import ImagePrompt
    from zerokl.engine_check import load_prompts

    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in CHAT_LINES) + "\n")
    (tmp_path / "imgs").mkdir()
    picture(50, 30, 7).save(tmp_path / "imgs" / "chat.png")
    prompts = load_prompts(path, checker.tokenizer, checker.cfg.text.vocab_size, 1000, checker.path)
    assert [len(p.images) if isinstance(p, ImagePrompt) else 0 for p in prompts] == [0, 0, 0, 0, 1]
    tokenizer = AutoTokenizer.from_pretrained(checker.path)
    for row, prompt in zip(CHAT_LINES, prompts):
        ids = prompt.token_ids if isinstance(prompt, ImagePrompt) else prompt
        if "messages" in row:
            text = tokenizer.apply_chat_template(row["messages"], tools=row.get("tools"), add_generation_prompt=True,
                                                 tokenize=False)
            assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
            assert set(tokenizer.convert_tokens_to_ids(CHAT_TOKENS)) <= set(ids)
    res = checker.check(prompts, mix="both", max_tokens=8, seed=6)
    assert res.report.tokens == 2 * len(CHAT_LINES) * 8 and res.report.all_equal and res.mix_mismatch == 0, res.report


def test_cli_prompt_line_errors(ckpt: Path, kimi_linear_tiny: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """Each bad image or chat prompt line: one `zerokl: error:` line naming the file and line, exit 2, before any
    engine starts."""
    import numpy as np
    from PIL import Image

    picture(40, 40, 1).save(tmp_path / "ok.png")
    Image.fromarray(np.zeros((20, 20), dtype=np.uint16)).save(tmp_path / "deep.png")  # mode I;16
    (tmp_path / "junk.png").write_text("not an image")
    cases = [({"prompt": "hi", "images": ["nope.png"]}, "no such image file", ckpt),
             ({"prompt": "hi", "images": ["junk.png"]}, "not a readable image", ckpt),
             ({"prompt": "hi", "images": ["deep.png"]}, "is not an 8-bit image mode", ckpt),
             ({"prompt": "a <|kimi_image_placeholder|> b", "images": ["ok.png", "ok.png"]},
              "holds 1 <|kimi_image_placeholder|> tokens for 2 images", ckpt),
             ({"prompt": "hi", "images": ["ok.png"] * 3}, "with its 3 images the prompt has", ckpt),
             ({"prompt": "hi", "images": "ok.png"}, "'images' must be a non-empty list", ckpt),
             ({"prompt": "hi", "images": ["ok.png"]}, "the checkpoint has no vision tower", kimi_linear_tiny),
             ({"messages": []}, "'messages' must be a non-empty list", ckpt),
             ({"messages": [{"role": "bot", "content": "x"}]}, "expected an object with 'role' one of", ckpt),
             ({"messages": [{"role": "user", "content": 5}]}, "messages[0]: 'content' must be text", ckpt),
             ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "on assistant messages only", ckpt),
             ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]:", ckpt),
             ({"messages": [{"role": "user", "content": "x"}], "images": ["ok.png"]}, "unknown key(s) 'images'", ckpt),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "nope.png"}}]}]},
              "no such image file", ckpt),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ok.png"}}]}]},
              "the checkpoint has no vision tower", kimi_linear_tiny),
             ({"messages": [{"role": "user", "content": "x" * 200}]}, "the chat renders to", ckpt),
             ({"messages": [{"role": "user", "content": "x"}]}, "has no K3 chat format", without_chat_template(ckpt, tmp_path / "old"))]
    for row, message, model in cases:
        (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
        rc = main(["parity", "check", "--model", str(model), "--prompts", str(tmp_path / "p.jsonl"),
                   "--max-tokens", "990"])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and f"{tmp_path / 'p.jsonl'}:1" in err and "Traceback" not in err, err
