"""K3 in the real vLLM engine (CPU), parity mode: bits, not tolerances.

The session's k3-tiny checkpoint and shared engine (`k3_engine`: prefix caching on with a 16-token match unit,
max_num_seqs 16, LoRA slots that these base requests leave empty) generate a workload of 28 mixed-length prompts (4
end just before a 128-token cache block boundary, 4 share a 300-token prefix, more than two blocks), 2 samples each.
Every generated log-prob must equal the trainer's one-pass `score_sequences` on the same weights, and the same
(prompt, seed) must give the same tokens and log-probs: at other batch positions, alone, from a warm prefix cache
(hits on block boundaries and inside blocks), with one sequence at a time and 13-token prefill chunks, under forced
preemption, and over the OpenAI server (the session's `zerokl serve`). The `fast` kernels break this (negative
control).
"""

from __future__ import annotations

import argparse
import json
import re
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from parity.kernels import FAST, INVARIANT, Kernels
from parity.kernels.logprobs import Sampling
from parity.model import K3Forward, K3Weights, record_routing, score_sequences
from parity.routing import NOT_COMPUTED, per_sequence, routing_agreement
from parity.weights import text_specs
from rollout.engine import RolloutEngine, RolloutError, Sample, sample_seed
from rollout.server import serve
from parity.io.checkpoint import load_checkpoint

from helpers import K3_ENGINE_ARGS, without_chat_template

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)

TEMPERATURE = 0.9
MAX_TOKENS = 8
N = 2
BLOCK = 128  # vLLM's cache block; the shared engine's prefix_match_unit is 16



@pytest.fixture(scope="module")
def checkpoint(k3_tiny: Path) -> Path:
    return k3_tiny


@pytest.fixture(scope="module")
def weights(checkpoint: Path) -> K3Weights:
    cfg, tensors = load_checkpoint(checkpoint)
    return K3Weights.from_official(cfg.text, tensors)


def _random_prompts(n: int, seed: int, lo: int, hi: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(4, 1024, (m,), generator=g).tolist() for m in lengths]


PROMPTS = (_random_prompts(20, 1, 5, 60) + _random_prompts(4, 4, 120, 127)
           + [_random_prompts(1, 2, 300, 301)[0] + p for p in _random_prompts(4, 3, 5, 40)])
SEEDS = list(range(100, 100 + len(PROMPTS)))
BOUNDARY = range(20, 24)  # 120-126 tokens: decoding crosses the first 128-token cache block
LONG = range(24, 28)  # the prompts sharing a 300-token prefix


@pytest.fixture(scope="module")
def engine(k3_engine: RolloutEngine) -> RolloutEngine:
    return k3_engine


@pytest.fixture(scope="module")
def reference(engine: RolloutEngine) -> list[list[Sample]]:
    """reference[i][j]: sample j of PROMPTS[i] from the reference engine, whole workload in one batch."""
    return _by_prompt(engine.generate(PROMPTS, n=N, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=SEEDS))


def _by_prompt(samples: list[Sample]) -> list[list[Sample]]:
    return [samples[i : i + N] for i in range(0, len(samples), N)]


def _assert_same(got: Sample, want: Sample, what: str) -> None:
    assert got.prompt_ids == want.prompt_ids, what
    assert got.completion_ids == want.completion_ids, f"{what}: tokens {got.completion_ids} != {want.completion_ids}"
    if not torch.equal(got.logprobs, want.logprobs):
        i = int((got.logprobs != want.logprobs).nonzero()[0, 0])
        raise AssertionError(f"{what}: first mismatching token {i}, "
                             f"max |d| = {(got.logprobs - want.logprobs).abs().max().item():.3e}")


def _generate_subset(eng: RolloutEngine, idx: list[int]) -> list[list[Sample]]:
    return _by_prompt(eng.generate([PROMPTS[i] for i in idx], n=N, temperature=TEMPERATURE, max_tokens=MAX_TOKENS,
                                   seed=[SEEDS[i] for i in idx]))


def _trainer_mismatches(samples: list[Sample], weights: K3Weights, kernels: Kernels) -> tuple[int, float]:
    """(samples whose log-probs differ from one-pass trainer scoring, max |difference|)."""
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    scores = score_sequences(K3Forward(weights, kernels), seqs, TEMPERATURE)
    trainer = [ref[len(s.prompt_ids) - 1 :] for ref, s in zip(scores, samples)]
    worst = max((t - s.logprobs).abs().max().item() for t, s in zip(trainer, samples))
    return sum(not torch.equal(t, s.logprobs) for t, s in zip(trainer, samples)), worst


def test_vllm_generation_equals_one_pass_forward(reference: list[list[Sample]], weights: K3Weights) -> None:
    samples = [s for group in reference for s in group]
    assert all(len(s.completion_ids) > 0 and s.logprobs.dtype == torch.float32 for s in samples)
    assert all(s.policy_version == samples[0].policy_version for s in samples)
    bad, worst = _trainer_mismatches(samples, weights, INVARIANT)
    assert bad == 0, f"{bad} of {len(samples)} samples differ from score_sequences, max |d| = {worst:.3e}"


def test_same_bits_at_any_batch_position_and_from_warm_prefix_cache(engine: RolloutEngine,
                                                                   reference: list[list[Sample]]) -> None:
    """The reference run already resumed LONG prompts from the shared prefix at a block boundary (256);
    now each LONG prompt is cached up to its last 16-token boundary, inside a block."""
    assert any(reference[i][0].cached_tokens == 2 * BLOCK for i in LONG), "no block-boundary hit in the cold run"
    perm = torch.randperm(len(PROMPTS), generator=torch.Generator().manual_seed(5)).tolist()
    shuffled = _generate_subset(engine, perm)
    for pos, i in enumerate(perm):
        for j in range(N):
            _assert_same(shuffled[pos][j], reference[i][j], f"prompt {i} at position {pos}, sample {j}")
    warm = {i: shuffled[perm.index(i)][0].cached_tokens for i in LONG}
    assert all(c >= 2 * BLOCK for c in warm.values()), f"LONG prompts missed the warm cache: {warm}"
    assert any(c % BLOCK for c in warm.values()), f"no hit inside a cache block: {warm}"


def test_same_bits_alone(engine: RolloutEngine, reference: list[list[Sample]]) -> None:
    for i in (0, 7, LONG[0]):
        alone = _generate_subset(engine, [i])[0]
        for j in range(N):
            _assert_same(alone[j], reference[i][j], f"prompt {i} alone, sample {j}")


def test_one_sequence_at_a_time_with_odd_prefill_chunks(checkpoint: Path, reference: list[list[Sample]]) -> None:
    """max_num_seqs 1 (reference: 16) and 13-token prefill chunks, prefix caching off (no state snapshots)."""
    idx = [0, LONG[1]]
    with RolloutEngine(checkpoint, max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=13,
                       enable_prefix_caching=False) as eng:
        got = _generate_subset(eng, idx)
    for g, i in zip(got, idx):
        for j in range(N):
            _assert_same(g[j], reference[i][j], f"prompt {i}, sample {j}")


def test_same_bits_under_forced_preemption(checkpoint: Path, reference: list[list[Sample]]) -> None:
    """16 cache blocks (4 per 128 tokens of a request): requests crossing a block boundary in decode
    preempt others, which are recomputed later."""
    idx = [0, 1, *BOUNDARY, LONG[3]]
    with RolloutEngine(checkpoint, max_model_len=512, max_num_seqs=16, enable_prefix_caching=True,
                       num_gpu_blocks_override=16, disable_log_stats=False) as eng:
        got = _generate_subset(eng, idx)
        preemptions = sum(m.value for m in eng.llm.get_metrics() if m.name == "vllm:num_preemptions")
    assert preemptions > 0, "the tiny KV cache did not force a preemption"
    for g, i in zip(got, idx):
        for j in range(N):
            _assert_same(g[j], reference[i][j], f"prompt {i}, sample {j}")


@pytest.fixture(scope="module")
def fast_engine(checkpoint: Path) -> Iterator[tuple[RolloutEngine, dict[str, object], dict[str, object]]]:
    """An engine on the `fast` kernels, and this process's state (`_process_state`) just before and just after it
    started: vLLM's engine core runs in this process (`rollout.engine._engine_core_in_process`)."""
    before = _process_state()
    with RolloutEngine(checkpoint, kernels="fast", **K3_ENGINE_ARGS) as eng:
        yield eng, before, _process_state()


def _process_state() -> dict[str, object]:
    """What vLLM's engine core changes in its own process when it starts."""
    import gc
    import os
    import random

    import numpy as np
    from vllm import envs

    return {"threads": torch.get_num_threads(), "env": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"),
            "envs cached": envs._is_envs_cache_enabled(), "gc frozen": gc.get_freeze_count(),
            "random": random.getstate(), "numpy": np.random.get_state()[1].tolist(),
            "torch": torch.get_rng_state().tolist()}


def test_engine_start_leaves_the_callers_process_as_it_was(fast_engine) -> None:
    _, before, after = fast_engine
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}


def test_fast_kernels_break_parity(fast_engine, weights: K3Weights) -> None:
    """Negative control: the same checks on plain torch ops fail (values still agree to round-off)."""
    eng = fast_engine[0]
    idx = [0, 1, 2, 3, LONG[0], LONG[1]]
    batched = _generate_subset(eng, idx)
    alone = [_generate_subset(eng, [i])[0] for i in idx[:3]]
    samples = [s for group in batched for s in group]
    bad, worst = _trainer_mismatches(samples, weights, FAST)
    assert bad > 0 and 0 < worst < 1e-3, f"fast rollout vs fast trainer: {bad} differ, max |d| {worst:.3e}"
    differs = [not torch.equal(a[j].logprobs, b[j].logprobs) for a, b in zip(alone, batched) for j in range(N)]
    assert any(differs), "fast kernels gave batch-invariant log-probs"


def test_truncated_sampling_equals_the_trainers_processed_logprobs(engine: RolloutEngine, weights: K3Weights) -> None:
    """top_p 0.7 with top_k 5, and min_p alone: every sampled token's log-prob under the truncated distribution
    (vLLM's processed log-probs) equals the trainer's `Sampling` recompute from its own logits, bit for bit; the
    truncation acts (log-probs above the untruncated ones) and the negative control (the untruncated scoring)
    differs."""
    idx = list(range(0, 28, 7))
    for truncation in (dict(top_p=0.7, top_k=5), dict(min_p=0.2)):
        sampling = Sampling(TEMPERATURE, **truncation)
        samples = engine.generate([PROMPTS[i] for i in idx], n=N, temperature=TEMPERATURE, max_tokens=MAX_TOKENS,
                                  seed=[SEEDS[i] for i in idx], **truncation)
        seqs = [s.prompt_ids + s.completion_ids for s in samples]
        fwd = K3Forward(weights, INVARIANT)
        trainer = [lp[len(s.prompt_ids) - 1 :] for lp, s in zip(score_sequences(fwd, seqs, sampling), samples)]
        bad = [i for i, (s, t) in enumerate(zip(samples, trainer)) if not torch.equal(s.logprobs, t)]
        assert not bad, f"{truncation}: samples {bad} differ from the trainer's processed log-probs"
        full = [lp[len(s.prompt_ids) - 1 :] for lp, s in zip(score_sequences(fwd, seqs, TEMPERATURE), samples)]
        assert all(torch.isfinite(s.logprobs).all() and (s.logprobs >= f).all() for s, f in zip(samples, full))
        assert any(not torch.equal(s.logprobs, f) for s, f in zip(samples, full)), f"{truncation} truncated nothing"


def test_engine_records_equal_the_trainers(engine: RolloutEngine, weights: K3Weights) -> None:
    """What the engine records in its worker (`record=True`), sampling with top_p 0.7 and top_k 5: the raw log-prob of
    every sampled token (temperature 1, no truncation: vLLM's raw op) equals the trainer's raw recompute bit for bit
    (and differs from the processed one), and the experts chosen at every position the engine computed (prompt chunks,
    decode steps; a warm prefix-cache hit computes only the prompt's tail) are the trainer's one-pass choices:
    agreement 1.0 over every (position, MoE layer). One changed expert id lowers it (the measure is not blind)."""
    idx = [0, 5, LONG[0], LONG[1]]
    samples = engine.generate([PROMPTS[i] for i in idx], n=N, temperature=TEMPERATURE, max_tokens=MAX_TOKENS,
                              seed=[SEEDS[i] for i in idx], top_p=0.7, top_k=5, record=True)
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    fwd = K3Forward(weights, INVARIANT)
    with record_routing() as log:
        raw = score_sequences(fwd, seqs, 1.0)
    for s, r in zip(samples, raw):
        assert torch.equal(s.raw_logprobs, r[len(s.prompt_ids) - 1 :]) and not torch.equal(s.raw_logprobs, s.logprobs)
    trainer = per_sequence(log, torch.tensor([len(x) for x in seqs]))
    rollout = [s.routing for s in samples]
    assert all(r is not None and r.shape == t.shape for r, t in zip(rollout, trainer))
    agreement = routing_agreement(rollout, trainer)
    total = sum(t.shape[0] * t.shape[1] for t in trainer)
    skipped = [int((r[:, 0, 0] == NOT_COMPUTED).sum()) for r in rollout]
    assert sum(skipped) >= 2 * BLOCK and skipped == [s.cached_tokens for s in samples], skipped
    assert agreement.fraction == 1.0 and agreement.compared == total - sum(skipped) * weights.cfg.num_moe_layers
    flipped = rollout[0].clone()
    flipped[3, 0, 0] = (flipped[3, 0, 0] + 1) % weights.cfg.num_experts
    assert routing_agreement([flipped], trainer[:1]).matched == routing_agreement(rollout[:1], trainer[:1]).matched - 1


def test_refused_requests(engine: RolloutEngine) -> None:
    with pytest.raises(RolloutError, match="top_p must be in"):
        engine.generate([PROMPTS[0]], top_p=1.5)
    with pytest.raises(RolloutError, match="top_k must be an integer >= 1"):
        engine.generate([PROMPTS[0]], top_k=0)
    with pytest.raises(RolloutError, match="min_p must be in"):
        engine.generate([PROMPTS[0]], min_p=-0.1)
    with pytest.raises(RolloutError, match="temperature must be"):
        engine.generate([PROMPTS[0]], temperature=0.0)
    with pytest.raises(RolloutError, match="one per prompt"):
        engine.generate([PROMPTS[0], PROMPTS[1]], seed=[1])
    with pytest.raises(RolloutError, match="sets dtype itself"):
        RolloutEngine("unused", dtype="bfloat16")


def test_text_prompts(engine: RolloutEngine, weights: K3Weights) -> None:
    samples = engine.generate(["What is 12 + 30? Answer:"], n=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS)
    assert samples[0].prompt_ids == samples[1].prompt_ids and len(samples[0].prompt_ids) > 3
    bad, worst = _trainer_mismatches(samples, weights, INVARIANT)
    assert bad == 0, f"max |d| = {worst:.3e}"


def test_load_weights_takes_official_names_and_refuses_leftovers(checkpoint: Path) -> None:
    """The model class outside an engine: official names in, fp32 parameters out, leftovers refused."""
    from rollout.vllm.model import ModelSetupError, ZeroKLK3ForCausalLM

    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.float32, model=str(checkpoint), hf_config=SimpleNamespace()),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        compilation_config=SimpleNamespace(static_forward_context={}), num_speculative_tokens=0,
        use_v2_model_runner=False, scheduler_config=SimpleNamespace(max_num_batched_tokens=64))
    model = ZeroKLK3ForCausalLM(vllm_config=vllm_config)
    cfg, tensors = load_checkpoint(checkpoint)
    assert model.load_weights(tensors.items()) == set(text_specs(cfg.text)) == {n for n, _ in model.named_parameters()}
    assert all(torch.equal(p, tensors[n].float()) for n, p in model.named_parameters())
    other = {n.replace("language_model.layers.", "language_model.model.layers."): t for n, t in tensors.items()}
    assert other.keys() != tensors.keys() and model.load_weights(other.items()) == set(text_specs(cfg.text))
    with pytest.raises(ModelSetupError, match="stored twice"):
        model.load_weights([*tensors.items(), *[(n, t) for n, t in other.items() if n not in tensors][:1]])
    with pytest.raises(ModelSetupError, match="not a K3 weight"):
        model.load_weights([*tensors.items(), ("language_model.extra.weight", torch.zeros(1))])
    first = next(iter(text_specs(cfg.text)))
    with pytest.raises(ModelSetupError, match=f"lacks 1 K3 weights, first: {first}"):
        model.load_weights([(n, t) for n, t in tensors.items() if n != first])


def test_serve_command_line(tmp_path: Path, kimi_linear_tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--checkpoint", str(tmp_path), "--", "--max-model-len", "64"])
    assert args.vllm_args == ["--", "--max-model-len", "64"]
    assert args.func(args) == 2  # not a checkpoint directory: one error line, no server
    args = parser.parse_args(["serve", "--checkpoint", str(kimi_linear_tiny), "--sync-vision-tower"])
    assert args.func(args) == 2 and "--sync-vision-tower" in capsys.readouterr().err  # no tower to sync
    for flags, says in ((["--enable-auto-tool-choice"], "needs --tool-call-parser"),
                        (["--tool-call-parser", "kimi_k9"], "no such tool parser"),
                        (["--reasoning-parser", "kimi_k9"], "no such reasoning parser")):
        args = parser.parse_args(["serve", "--checkpoint", str(kimi_linear_tiny), *flags])
        assert args.func(args) == 2 and says in capsys.readouterr().err, flags
    old = without_chat_template(kimi_linear_tiny, tmp_path / "old")  # a checkpoint written before the chat format
    args = parser.parse_args(["serve", "--checkpoint", str(old), "--tool-call-parser", "kimi_k3"])
    assert args.func(args) == 2 and "has no K3 chat format" in capsys.readouterr().err
    assert serve.chat_flags(kimi_linear_tiny, True, "kimi_k3", "kimi_k3") == [
        "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3"]
    argv = serve.serve_argv(tmp_path, kernels="fast", port=1234, vllm_args=["--max-model-len", "64"])
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and argv[-2:] == ["--max-model-len", "64"]
    overrides = json.loads(argv[argv.index("--hf-overrides") + 1])
    assert overrides["zerokl_kernels"] == "fast" and "zerokl_vision_synced" not in overrides
    argv = serve.serve_argv(tmp_path, vision=True, vision_synced=True)
    assert json.loads(argv[argv.index("--hf-overrides") + 1])["zerokl_vision_synced"] is True


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_openai_server_matches_offline_engine(checkpoint: Path, reference: list[list[Sample]],
                                              k3_server: tuple[str, Path]) -> None:
    base = k3_server[0]
    jobs = [(i, j) for i in (0, 5, 9, LONG[0]) for j in range(N)]

    def complete(job: tuple[int, int]) -> dict:
        i, j = job
        return _post(f"{base}/v1/completions", {
            "model": str(checkpoint), "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE,
            "logprobs": 0, "seed": sample_seed(SEEDS[i], j), "return_tokens_as_token_ids": True})

    with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent requests: the server batches them
        replies = list(pool.map(complete, jobs))
    for (i, j), reply in zip(jobs, replies):
        lp = reply["choices"][0]["logprobs"]
        tokens = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        got = Sample(PROMPTS[i], tokens, torch.tensor(lp["token_logprobs"], dtype=torch.float32), 0, 0)
        _assert_same(got, reference[i][j], f"server, prompt {i}, sample {j}")


CALC_TOOL = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic",
                                              "parameters": {"type": "object", "required": ["expression"],
                                                             "properties": {"expression": {"type": "string"}}}}}


def test_chat_endpoint_renders_k3_chat_and_parses_reasoning_and_tool_calls(checkpoint: Path, engine: RolloutEngine,
                                                                           k3_server: tuple[str, Path]) -> None:
    """The served chat endpoint (K3's launch-recipe flags): the prompt is the checkpoint's chat template, the tokens
    and log-probs are the offline engine's for those ids, the think channel comes back as `reasoning`, and a tool call
    (forced through structured outputs: a random-weight model writes none) comes back parsed by vLLM's kimi_k3."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 2 + 3?"}]
    body = {"model": str(checkpoint), "messages": messages, "tools": [CALC_TOOL], "temperature": TEMPERATURE,
            "return_token_ids": True}
    reply = _post(f"{k3_server[0]}/v1/chat/completions",
                  {**body, "max_tokens": MAX_TOKENS, "seed": sample_seed(7, 0), "logprobs": True})
    prompt = tokenizer(tokenizer.apply_chat_template(messages, tools=[CALC_TOOL], add_generation_prompt=True,
                                                     tokenize=False), add_special_tokens=False)["input_ids"]
    assert reply["prompt_token_ids"] == prompt
    want = engine.generate([prompt], n=1, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=[7])[0]
    choice = reply["choices"][0]
    got = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]], dtype=torch.float32)
    assert choice["token_ids"] == want.completion_ids and torch.equal(got, want.logprobs)
    # thinking is on by default: the prompt opens the think channel, which the model never closes here
    assert choice["message"]["reasoning"] == tokenizer.decode(want.completion_ids) and not choice["message"]["content"]

    forced = ('Adding.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="calculator" index="1"<|sep|>'
              '<|open|>argument key="expression" type="string"<|sep|>2 + 3<|close|>argument<|sep|><|close|>call<|sep|>'
              '<|close|>tools<|sep|><|close|>message<|sep|>')
    reply = _post(f"{k3_server[0]}/v1/chat/completions",
                  {**body, "max_tokens": 256, "seed": 3, "chat_template_kwargs": {"thinking": False},
                   "structured_outputs": {"regex": re.escape(forced)}})
    message = reply["choices"][0]["message"]
    assert tokenizer.decode(reply["prompt_token_ids"]).endswith("<|open|>response<|sep|>")  # thinking off
    assert message["content"] == "Adding." and not message.get("reasoning")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] \
        == [("calculator", {"expression": "2 + 3"})]
