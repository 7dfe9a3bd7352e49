"""Which engines replay decode steps from vLLM's CUDA graphs (`rollout.vllm.graphs`): CUDA with the Triton kernels,
and nothing that the graphed step does not cover."""

from __future__ import annotations

import json

from rollout.vllm.graphs import COMPILATION, engine_args, graphed, server_argv


def test_only_the_triton_kernels_on_cuda_without_lora_or_drafts_are_graphed() -> None:
    assert graphed("invariant", "cuda") and graphed("triton", "cuda")
    assert not graphed("fast", "cuda") and not graphed("invariant", "cpu") and not graphed("triton", "cpu")
    for off in ({"enforce_eager": True}, {"lora": True}, {"speculative": True}):
        assert not graphed("invariant", "cuda", **off), off


def test_the_engine_and_the_server_get_the_same_mode() -> None:
    assert engine_args(False) == {"enforce_eager": True} and server_argv(False) == ["--enforce-eager"]
    assert engine_args(True) == {"enforce_eager": False, "compilation_config": COMPILATION}
    flag, value = server_argv(True)
    assert flag == "--compilation-config" and json.loads(value) == COMPILATION == {"mode": 0,
                                                                                   "cudagraph_mode": "FULL_DECODE_ONLY"}
