"""The real vLLM engine (its CUDA build) against the real Megatron trainer, colocated on one GPU: `zerokl parity check`
bitwise and exit 0 on the Triton kernels (and exit 1 on the fast kernels), `zerokl ppo` with KL exactly 0 every step,
`zerokl serve` answering the `openai` client with the offline engine's log-probs bit for bit. Skips without CUDA; the
runs on an H100 are in bench/results/h100-vllm-cuda.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from helpers import free_port, picture, running_server

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}  # the trainer initialises CUDA in the parent first


def _zerokl(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerokl.cli", *args], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def k3_micro(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu") / "k3-micro"
    made = _zerokl("init-checkpoint", "--config", "configs/k3-micro.yaml", "--out", str(out))
    assert made.returncode == 0, made.stderr[-2000:]
    return out


def test_parity_check_through_vllm_on_the_gpu(k3_micro: Path, tmp_path: Path) -> None:
    report = tmp_path / "check.json"
    run = _zerokl("parity", "check", "--model", str(k3_micro), "--num-prompts", "4", "--max-tokens", "16",
                  "--batch-mix", "both", "--json", str(report))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["tokens"] > 0 and result["bitwise_equal"] == result["tokens"], result


def test_fast_kernels_fail_the_check_on_the_gpu(k3_micro: Path, tmp_path: Path) -> None:
    report = tmp_path / "check.json"
    run = _zerokl("parity", "check", "--model", str(k3_micro), "--num-prompts", "4", "--max-tokens", "16",
                  "--batch-mix", "random", "--kernels", "fast", "--no-diagnose", "--json", str(report))
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["tokens"] > 0 and result["bitwise_equal"] < result["tokens"], result


SERVED_PROMPTS = [[5 + i, 17, 300 + 7 * i, 42] * (i + 1) for i in range(6)]


def test_serve_on_the_gpu_answers_the_openai_client_with_the_offline_engines_logprobs(
        k3_micro: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent `openai` completions from `zerokl serve` on the GPU (batched by its scheduler), then the same prompts
    and seeds through the offline engine in one call: equal tokens and log-probs, bit for bit."""
    import openai

    from rollout.engine import RolloutEngine, sample_seed

    port = free_port()
    argv = [sys.executable, "-m", "zerokl.cli", "serve", "--checkpoint", str(k3_micro), "--port", str(port), "--",
            "--max-model-len", "512", "--gpu-memory-utilization", "0.4"]
    with running_server(argv, port, tmp_path / "server.log", start_timeout=600) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")

        def complete(i: int) -> tuple[list[int], list[float]]:
            reply = client.completions.create(model=str(k3_micro), prompt=SERVED_PROMPTS[i], max_tokens=16,
                                              temperature=1.0, logprobs=0, seed=sample_seed(100 + i, 0),
                                              extra_body={"return_tokens_as_token_ids": True})
            lp = reply.choices[0].logprobs
            return [int(t.removeprefix("token_id:")) for t in lp.tokens], lp.token_logprobs

        with ThreadPoolExecutor(len(SERVED_PROMPTS)) as pool:
            served = list(pool.map(complete, range(len(SERVED_PROMPTS))))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    engine = RolloutEngine(k3_micro, max_model_len=512, gpu_memory_utilization=0.4)
    try:
        offline = engine.generate(SERVED_PROMPTS, temperature=1.0, max_tokens=16,
                                  seed=[100 + i for i in range(len(SERVED_PROMPTS))])
    finally:
        engine.close()
    for i, ((tokens, logprobs), want) in enumerate(zip(served, offline)):
        assert tokens == want.completion_ids, f"prompt {i}: tokens differ"
        assert torch.equal(torch.tensor(logprobs, dtype=torch.float32), want.logprobs), f"prompt {i}: log-probs differ"


GRAPH_TEXT = [[4 + i, 11, 200 + 5 * i] * (1 + i % 4) for i in range(10)]


def test_decode_replayed_from_cuda_graphs_gives_the_eager_engines_bits(k3_micro: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The same requests through an engine whose decode steps replay vLLM's CUDA graphs and through an eager one
    (`enforce_eager`), image prompts among them (their decode rows come from the runner's embedding buffer): equal
    tokens, processed and raw log-probs and experts, bit for bit; the graphed engine holds graphs for its decode
    batches."""
    from rollout.engine import RolloutEngine
    from rollout.sampling import ImagePrompt
    from rollout.vllm.graphs import captured

    prompts = [*GRAPH_TEXT, ImagePrompt([40, 3, 41, 42], (picture(60, 40, 1),)),
               ImagePrompt([3, 43, 3, 44], (picture(30, 100, 2), picture(90, 90, 3)))]  # 3: k3-micro's placeholder
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    runs = {}
    for eager in (False, True):
        engine = RolloutEngine(k3_micro, max_model_len=512, max_num_seqs=16, gpu_memory_utilization=0.3,
                               enforce_eager=eager)
        try:
            assert engine.graphs is not eager
            if not eager:
                assert engine.llm.collective_rpc(captured)[0], "no decode graph was captured"
            runs[eager] = engine.generate(prompts, n=2, temperature=1.0, max_tokens=24,
                                          seed=list(range(len(prompts))), record=True)
        finally:
            engine.close()
    for i, (graphed, eager) in enumerate(zip(runs[False], runs[True])):
        assert graphed.completion_ids == eager.completion_ids, f"sample {i}: tokens differ"
        assert torch.equal(graphed.logprobs, eager.logprobs), f"sample {i}: log-probs differ"
        assert torch.equal(graphed.raw_logprobs, eager.raw_logprobs), f"sample {i}: raw log-probs differ"
        assert (graphed.routing is None) == (eager.routing is None)
        assert graphed.routing is None or torch.equal(graphed.routing, eager.routing), f"sample {i}: experts differ"


def test_ppo_through_vllm_on_the_gpu_keeps_kl_zero(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = _zerokl("ppo", "--config", "configs/ppo-tiny-mxfp4.yaml", "--steps", "3", "--out", str(out), "--wandb",
                  "disabled")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    assert all(m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 and m["raw_bitwise_equal_frac"] == 1.0
               and m["routing_agreement"] == 1.0 for m in metrics), metrics
