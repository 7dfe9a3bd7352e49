"""Which zerokl engines vLLM runs with CUDA graphs: decode steps on CUDA, in vLLM's FULL_DECODE_ONLY mode.

A step of single-token decodes runs as one dense group (`rollout.vllm.caches.StepGroup.uniform`) with every index on
the device and nothing read back to the host, over metadata that are views of the model runner's persistent buffers
(`rollout.vllm.backends`), so vLLM's FULL_DECODE_ONLY capture holds the whole forward (no torch.compile: compilation
mode NONE) and a replay launches the eager step's kernels on the same inputs: the same bits (a GPU test compares an
eager engine with a graphed one token for token, image prompts among them). Prefill and mixed steps run eagerly; a
model with a vision tower takes its decode rows as `inputs_embeds` from the runner's persistent buffer, filled by
`embed_input_ids` before the step (outside the graph), so image prompts decode from graphs too. Graphed: the Triton
kernels (`invariant` on CUDA, `triton`), whose whole decode step is captured in the rollout model's own graph test.
Eager throughout: the `fast` kernels (fla's and torch's ops, not checked for capture), every CPU engine (vLLM's CPU
runner has no graphs), LoRA (a step's adapter groups are chosen on the host), speculative decoding (not yet run on the
GPU path), and `enforce_eager`.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from parity.kernels import runs_triton

COMPILATION = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}  # mode 0: vLLM's CompilationMode.NONE


def graphed(kernels: str, device: str, enforce_eager: bool = False, lora: bool = False,
            speculative: bool = False) -> bool:
    """Whether an engine of kernel set `kernels` on `device` ("cuda" or "cpu") with these settings replays its decode
    steps from graphs."""
    return device == "cuda" and runs_triton(kernels, torch.device(device)) and not (
        enforce_eager or lora or speculative)


def engine_args(graphs: bool) -> dict[str, Any]:
    """`vllm.LLM` arguments: decode graphs, or eager."""
    return {"enforce_eager": False, "compilation_config": dict(COMPILATION)} if graphs else {"enforce_eager": True}


def server_argv(graphs: bool) -> list[str]:
    """The API server's flags for the same."""
    return ["--compilation-config", json.dumps(COMPILATION)] if graphs else ["--enforce-eager"]


def captured(worker: Any) -> list[int]:
    """In a worker (`LLM.collective_rpc`): the token counts of the decode batches its model holds CUDA graphs for."""
    entries = getattr(worker.model_runner.model, "concrete_cudagraph_entries", {})
    return sorted(d.num_tokens for d, e in entries.items() if e.cudagraph is not None)
