"""The Triton kernel set inside both engines, on CPU under Triton's interpreter: `zerokl parity check --kernels triton`
through the real vLLM engine (the rollout model class on the Triton kernels, the chunked KDA state in vLLM's state
cache, attention reading vLLM's paged latent blocks in place) and the real Megatron trainer, bit for bit; and
prefix-cache hits that resume a KDA chunk mid-way.

k3-micro (configs/k3-micro.yaml: every K3 feature, bf16, MXFP4 experts, FP8 latents) keeps the interpreter's cost
low. Triton decides interpreter vs compiler at its first import, so the checks run in a child process started with
TRITON_INTERPRET=1 (`test_triton_kernels_in_both_engines`); on a CUDA machine the same code runs compiled (the GPU
results are in bench/results/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zerokl.cli import main

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)

REPO = Path(__file__).resolve().parents[2]
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
CHILD = pytest.mark.skipif(not INTERP, reason="runs in the interpreter child process")


@pytest.mark.skipif(INTERP or torch.cuda.is_available(), reason="the interpreter run is for machines without CUDA")
def test_triton_kernels_in_both_engines() -> None:
    """Every check of this module, in a child process with TRITON_INTERPRET=1 (CPU tensors)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-k", "child",
                          "-p", "no:cacheprovider"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout, run.stdout[-3000:]


@pytest.mark.skipif(INTERP or torch.cuda.is_available(), reason="a machine that can run the Triton kernels")
def test_triton_refused_where_it_cannot_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["parity", "check", "--model", str(tmp_path), "--kernels", "triton"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "TRITON_INTERPRET=1" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from parity.io.checkpoint import init_checkpoint

    return init_checkpoint(REPO / "configs" / "k3-micro.yaml", tmp_path_factory.mktemp("k3-micro") / "k3-micro", seed=0)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@CHILD
def test_child_engine_and_trainer_bitwise_with_prefix_hits(micro: Path) -> None:
    """The checker `zerokl parity check --kernels triton` runs, on one engine that caches prefixes: prompts ending
    before and at the 64-token KDA chunk (decode crossing the boundary, starting on it) and two sharing a 100-token
    prefix, in a batch and then alone (the alone runs hit the batch's cache): every log-prob bitwise equal to the
    trainer's. Then prefix-cache hits inside a cache block and inside a KDA chunk (the warm run reads the cached FP8
    latents in place and restores the chunked KDA state from vLLM's state cache) sample the alone runs' tokens and
    log-probs bit for bit, which are the trainer's; and the trainer at TP = 2 (`--tp 2`'s scorer: two ranks, each
    forming its half of a row-parallel GEMM's fixed K segments, `trainer.megatron.row_segments`) scores them with the
    same bits."""
    from trainer.logprobs import PaddedBatch
    from zerokl.engine_check import ENGINE_ARGS, Checker, TensorParallelScorer

    shared = _ids(100, 1)
    prompts = [_ids(62, 62), _ids(64, 64)] + [shared + _ids(n, 10 + n) for n in (3, 21)]
    checker = Checker(micro, kernels="triton",
                      engine_args={**ENGINE_ARGS, "enable_prefix_caching": True, "prefix_match_unit": 16})
    try:
        res = checker.check(prompts, mix="both", max_tokens=4, seed=0)
        assert res.report.tokens == 2 * 4 * 4 and res.report.all_equal and res.mix_mismatch == 0, res.report
        alone = {s.id: s for s in res.rollout if s.id.startswith("alone-")}
        warm = checker.engine.generate(prompts[2:], max_tokens=4, seed=[2, 3])  # the alone runs' seeds (seed 0)
        assert all(w.cached_tokens >= 80 and w.cached_tokens % 64 for w in warm), [w.cached_tokens for w in warm]
        batch = PaddedBatch.from_sequences([w.prompt_ids + w.completion_ids for w in warm])
        scored = checker.backend.logprobs(batch, 1.0)  # every position: the TP ranks' rows are compared whole below
        for i, w in enumerate(warm):
            lp = scored[i, len(w.prompt_ids) - 1: len(w.prompt_ids) - 1 + len(w.completion_ids)]
            assert w.completion_ids == alone[f"alone-{i + 2}"].token_ids
            assert torch.equal(w.logprobs, alone[f"alone-{i + 2}"].logprobs) and torch.equal(w.logprobs, lp)
        assert torch.equal(TensorParallelScorer(micro, 2, "triton", None).logprobs(batch, 1.0), scored)
    finally:
        checker.close()
