"""`RolloutEngine`: offline rollouts of an official K3 checkpoint through the real vLLM engine (`vllm.LLM`)
with zerokl's model class (`rollout.vllm.model`), in parity mode by default.

What a caller gets, per sample: the prompt ids, the completion ids, the log-prob of every completion
token under the distribution it was sampled from (fp32, `log_softmax(logits / T)`, truncated by top_k / top_p /
min_p when asked: vLLM's `processed_logprobs`), and the policy version (the weight version vLLM reports for the
sample's tokens).
With the `invariant` kernels these log-probs are bit-identical to `parity.model.score_sequences` on the
same weights, whatever vLLM does around them: batching, chunked prefill, prefix-cache hits, preemption.

LoRA: start with vLLM's `enable_lora=True, max_loras=N, max_lora_rank=R`; `load_adapter(name, path)` reads a
PEFT adapter into the workers (validated by `lora.adapter` there) and returns the `LoRARequest` that selects it
per prompt in `generate(lora=...)`. Base and adapter requests share batches; each keeps its bits
(`rollout.vllm.lora_table`).

Determinism: sample j of a prompt with seed s is drawn with vLLM's per-request generator seeded by
`sample_seed(s, j)`, so it depends only on (weights, prompt, s, j), not on the rest of the batch.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lora.push import VERSION_SEP
from parity.config import load_model_config
from parity.kernels import platform_device
from rollout import worker_processes
from rollout.vllm import compat, graphs, records
from rollout.sampling import (ImagePrompt, RolloutError, Sample, check_sampling, prompt_seeds, root_message,
                              sample_seed)
from rollout.vllm.plugin import WEIGHT_BACKEND, hf_overrides
from rollout.speculative import vllm_speculative_config
from parity.sync.bundle import Message, SyncError, Transport, WeightBundle, verify
from parity.sync.transports import SharedMemory

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

# Engine arguments the engine sets itself: parity depends on them.
_FIXED_ARGS = ("model", "dtype", "hf_overrides", "logprobs_mode", "compilation_config", "weight_transfer_config",
               "distributed_executor_backend")
# what reaches vLLM's worker processes (`Memory` stays in this one; `cuda_ipc` needs the sender on the engine's GPU)
WORKER_TRANSPORTS = ("shared_memory", "cuda_ipc", "disk")
_MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks


class RolloutEngine:
    """Wraps `vllm.LLM` on `checkpoint` (an official Kimi K3 or Kimi Linear checkpoint directory).

    kernels: "invariant" (parity mode), "triton" (parity mode on the Triton kernels) or "fast" (plain torch ops: the
    negative control).
    vision: serve the checkpoint's vision tower (prompts may carry images, `ImagePrompt`); default: when it has one.
    vision_synced: the tower takes weight syncs (full bundles carry its tensors: a run that trains it).
    enforce_eager: no CUDA graphs; otherwise a CUDA engine replays its decode steps from graphs where
    `rollout.vllm.graphs` allows (the same bits as eager).
    engine_args: further `vllm.LLM` arguments (max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, prefix_match_unit (prefix hits inside a cache block), num_gpu_blocks_override,
    max_model_len, ...).
    """

    def __init__(self, checkpoint: str | Path, kernels: str = "invariant", vision: bool | None = None,
                 vision_synced: bool = False, enforce_eager: bool = False, **engine_args: Any):
        fixed = sorted(set(engine_args) & set(_FIXED_ARGS))
        if fixed:
            raise RolloutError(f"RolloutEngine sets {', '.join(fixed)} itself (parity depends on them)")
        from vllm import LLM

        compat.check_version()  # an unsupported vLLM stops here, before the engine starts its processes
        worker_processes.install_on_cpu()
        self.kernels = kernels
        model_cfg = load_model_config(checkpoint)
        if vision and model_cfg.vision is None:
            raise RolloutError(f"{checkpoint} has no vision tower (no vision_config): it takes no images")
        self.vision = model_cfg.vision is not None if vision is None else vision
        if vision_synced and not self.vision:
            raise RolloutError(f"{checkpoint}: a synced vision tower needs the model served with its vision tower")
        overrides = hf_overrides(kernels, model_cfg.model_type, self.vision, vision_synced)
        self.speculative = engine_args.get("speculative_config") is not None
        if self.speculative:  # checked (`rollout.speculative`); vLLM counts drafts in its stats (`draft_counts`)
            engine_args["speculative_config"] = vllm_speculative_config(engine_args["speculative_config"],
                                                                        model_cfg.text, kernels)
            engine_args.setdefault("disable_log_stats", False)
            engine_args.setdefault("enable_prefix_caching", False)  # vLLM's default is on; drafts run without it
        self.graphs = graphs.graphed(kernels, platform_device().type, enforce_eager,
                                     bool(engine_args.get("enable_lora")), self.speculative)
        with _engine_core_in_process():
            self.llm = LLM(model=str(checkpoint), dtype=model_cfg.text.torch_dtype, hf_overrides=overrides,
                           logprobs_mode="processed_logprobs", **graphs.engine_args(self.graphs),
                           weight_transfer_config={"backend": WEIGHT_BACKEND}, distributed_executor_backend="mp",
                           **engine_args)
        self.llm.llm_engine.set_weight_version("0")
        self._lora_ids = 0
        self.text_cfg = model_cfg.text
        self.policy_adapter: LoRARequest | None = None
        self._policy_name, self._policy_spec, self._policy_shapes = "", None, {}
        self._updates = Path(tempfile.mkdtemp(prefix="zerokl-weights-"))

    def draft_counts(self) -> tuple[int, int]:
        """(draft tokens proposed, draft tokens accepted) since the engine started; (0, 0) without speculative
        decoding. From vLLM's own speculative-decoding counters."""
        if not self.speculative:
            return 0, 0
        totals = {"vllm:spec_decode_num_draft_tokens": 0, "vllm:spec_decode_num_accepted_tokens": 0}
        for metric in self.llm.get_metrics():
            if metric.name in totals:
                totals[metric.name] += int(getattr(metric, "value", 0))
        return totals["vllm:spec_decode_num_draft_tokens"], totals["vllm:spec_decode_num_accepted_tokens"]

    @property
    def policy_version(self) -> int:
        return int(self.llm.llm_engine.get_weight_version())

    def generate(self, prompts: Sequence[Sequence[int] | str | ImagePrompt], n: int = 1, temperature: float = 1.0,
                 max_tokens: int = 16, seed: int | Sequence[int] = 0, top_p: float | None = None,
                 top_k: int | None = None, min_p: float | None = None, ignore_eos: bool = False,
                 stop_token_ids: Sequence[int] = (),
                 lora: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 record: bool = False) -> list[Sample]:
        """`n` samples per prompt, prompt-major (sample j of prompt i is entry i * n + j).

        prompts: token id lists, text (tokenized by the checkpoint's tokenizer) or `ImagePrompt`s (an engine serving
        its vision tower).
        seed: one seed for the call (prompt i gets `sample_seed(seed, i)`) or one seed per prompt.
        top_p / top_k / min_p: truncation (`parity.kernels.logprobs.Sampling`); the log-probs are under the truncated
        distribution (vLLM's processed log-probs), which the trainer recomputes with `Sampling`.
        stop_token_ids: tokens that end a sample besides end-of-sequence (kept as its last token, like it).
        lora: an adapter from `load_adapter` for every prompt, or one per prompt (None: the base model).
        record: fill each sample's `raw_logprobs` and `routing` from inside the worker (`rollout.vllm.records`: raw log-probs
        by vLLM's own op; experts at each position the engine computed, `parity.routing.NOT_COMPUTED` at positions a
        prefix-cache hit served).
        """
        from vllm import SamplingParams

        seeds = prompt_seeds(prompts, seed)
        loras = self._prompt_loras(prompts, lora)
        check_sampling(n, temperature, max_tokens, top_p, top_k, min_p)
        if self.speculative and min_p is not None:
            raise RolloutError("min_p is not applied by vLLM's speculative sampling: an engine with drafts samples "
                               "without it")
        truncation = {k: v for k, v in (("top_p", top_p), ("top_k", top_k), ("min_p", min_p)) if v is not None}
        requests, params, adapters = [], [], []
        for prompt, s, adapter in zip(prompts, seeds, loras):
            request = self._request(prompt)
            for j in range(n):
                requests.append(request)
                adapters.append(adapter)
                params.append(SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0,
                                             seed=sample_seed(s, j), ignore_eos=ignore_eos,
                                             stop_token_ids=list(stop_token_ids), **truncation))
        if not record:
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=adapters)
            return [self._sample(out) for out in outputs]
        self.llm.collective_rpc(records.start)
        try:
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=adapters)
        finally:
            recorded = {records.external_id(k): v for k, v in self.llm.collective_rpc(records.take)[0].items()}
        return [self._recorded(self._sample(out), recorded.get(out.request_id, {})) for out in outputs]

    def load_adapter(self, name: str, path: str | Path) -> LoRARequest:
        """Load the PEFT adapter directory `path` into the workers under a new id; returns the request that
        selects it. Raises `RolloutError` with the workers' reason (e.g. `lora.adapter`'s validation) and
        leaves the engine's adapters as they were."""
        from vllm.lora.request import LoRARequest

        if self.llm.llm_engine.vllm_config.lora_config is None:
            raise RolloutError("this engine was started without LoRA; pass enable_lora=True, max_loras and "
                               "max_lora_rank to RolloutEngine")
        self._lora_ids += 1
        request = LoRARequest(name, self._lora_ids, str(Path(path).resolve()))
        try:
            self.llm.llm_engine.add_lora(request)
        except Exception as e:  # the worker's AdapterError arrives wrapped by vLLM's RPC
            raise RolloutError(f"adapter {name} ({path}) was not loaded: {root_message(e)}") from None
        return request

    def remove_adapter(self, request: LoRARequest) -> None:
        """Drop an adapter loaded with `load_adapter` from the workers."""
        self.llm.llm_engine.remove_lora(request.lora_int_id)

    def set_policy_adapter(self, name: str, path: str | Path) -> LoRARequest:
        """Load the adapter at `path` as the policy adapter: the one adapter bundles (`update_weights` with
        `kind="adapter"`) replace. Later bundles must carry the same tensors (names, shapes, fp32)."""
        from lora.adapter import load_adapter

        adapter = load_adapter(path, self.text_cfg)
        request = self.load_adapter(f"{name}{VERSION_SEP}{self.policy_version}", path)
        if self.policy_adapter is not None:
            self.remove_adapter(self.policy_adapter)
        self.policy_adapter, self._policy_name, self._policy_spec = request, name, adapter.spec
        self._policy_shapes = {n: (tuple(t.shape), torch.float32) for n, t in adapter.tensors().items()}
        return request

    def update_weights(self, bundle: WeightBundle, transport: Transport | None = None) -> None:
        """Install a weight bundle (`parity.sync`), all-or-nothing, sent with `transport` (default `SharedMemory`):
        see `receive`."""
        transport = transport or SharedMemory()
        message = transport.send(bundle)
        try:
            self.receive(transport, message)
        finally:
            transport.release(message)

    def receive(self, transport: Transport, message: Message) -> None:
        """The `parity.sync.bundle.Receiver` side of a weight sync. `kind="full"` (every fp32 text tensor): the
        message goes to the workers, which rebuild the bundle with the same transport, verify it and swap it into
        their parameters; then the prefix cache is dropped (its latents and states came from the old weights).
        `kind="adapter"` (the policy adapter's PEFT tensors): a new version of the policy adapter. Raises `SyncError`
        on a rejected update; the engine then keeps its previous weights, adapter and version."""
        if message["kind"] == "adapter":
            self._update_policy_adapter(transport.receive(message))
            return
        if transport.name not in WORKER_TRANSPORTS:
            raise SyncError(f"vLLM's workers receive full weights through {' or '.join(WORKER_TRANSPORTS)}, "
                            f"not {transport.name!r}")
        self.llm.collective_rpc("start_weight_update")
        try:
            self.llm.collective_rpc("update_weights",
                                    kwargs={"update_info": {"transport": transport.name, "message": message}})
        except Exception as e:  # the worker's SyncError arrives wrapped by vLLM's RPC
            raise SyncError(f"weight update {message['version']} rejected: {e}") from e
        self.llm.collective_rpc("finish_weight_update")
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.set_weight_version(str(message["version"]))

    def _update_policy_adapter(self, bundle: WeightBundle) -> None:
        """Verify the bundle against the policy adapter's tensors, write it as a PEFT directory, load it under a
        new versioned name, then drop the old version (requests name `policy_adapter`, read per call)."""
        from lora.adapter import Adapter, pair_tensors, save_adapter
        if self.policy_adapter is None:
            raise SyncError("adapter update without a policy adapter: call set_policy_adapter first")
        verify(bundle, self._policy_shapes, self.policy_version)
        directory = self._updates / f"adapter-v{bundle.version:08d}"
        try:
            save_adapter(Adapter(self._policy_spec, pair_tensors(bundle.tensors, "adapter update")), directory)
            request = self.load_adapter(f"{self._policy_name}{VERSION_SEP}{bundle.version}", directory)
        except (ValueError, RolloutError) as e:
            shutil.rmtree(directory, ignore_errors=True)
            raise SyncError(f"adapter update {bundle.version} rejected: {e}") from None
        old = self.policy_adapter
        self.policy_adapter = request
        self.remove_adapter(old)
        if Path(old.lora_path).parent == self._updates:
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.llm_engine.set_weight_version(str(bundle.version))

    def close(self) -> None:
        """Stop vLLM's worker process and the engine core, and remove staged weight updates. The core's teardown
        ends with `cleanup_dist_env_and_memory()` (`vllm/v1/engine/core.py:839`), which would destroy this process's
        torch.distributed state: the core made none here (the model and its process groups live in the worker), and
        what there is belongs to the caller (the Megatron trainer), so that call is skipped."""
        from vllm.v1.engine import core

        cleanup = core.cleanup_dist_env_and_memory
        core.cleanup_dist_env_and_memory = lambda shutdown_ray=False: None
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            core.cleanup_dist_env_and_memory = cleanup
        shutil.rmtree(self._updates, ignore_errors=True)

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- helpers --------------------------------------------------------------------------------
    def _request(self, prompt: Sequence[int] | str | ImagePrompt) -> dict[str, Any]:
        if isinstance(prompt, str):
            return {"prompt": prompt}
        if not isinstance(prompt, ImagePrompt):
            return {"prompt_token_ids": list(prompt)}
        if not self.vision:
            raise RolloutError("a prompt with images needs a K3 checkpoint with a vision tower (vision_config), served "
                               "with it (vision=True)")
        return {"prompt_token_ids": list(prompt.token_ids), "multi_modal_data": {"image": list(prompt.images)}}

    @staticmethod
    def _prompt_loras(prompts: Sequence[Sequence[int] | str],
                      lora: LoRARequest | Sequence[LoRARequest | None] | None) -> list[LoRARequest | None]:
        if lora is None or not isinstance(lora, Sequence):
            return [lora] * len(prompts)
        if len(lora) != len(prompts):
            raise RolloutError(f"got {len(lora)} adapters for {len(prompts)} prompts; give one per prompt or one")
        return list(lora)

    @staticmethod
    def _sample(out: Any) -> Sample:
        c = out.outputs[0]
        versions = {span.version for span in c.weight_versions or ()}
        if len(versions) != 1:
            raise RolloutError(f"request {out.request_id}: tokens from weight versions {sorted(versions)}")
        tokens = list(c.token_ids)
        lps = torch.tensor([step[t].logprob for step, t in zip(c.logprobs, tokens)], dtype=torch.float32)
        return Sample(list(out.prompt_token_ids), tokens, lps, int(versions.pop()), out.num_cached_tokens or 0)

    def _recorded(self, sample: Sample, recorded: dict[str, torch.Tensor]) -> Sample:
        """`sample` with the worker's records of its request: the raw log-prob of each completion token (sampled into
        positions len(prompt) ...) and, with MoE layers, the routing of each input position (all but the last token)."""
        first, n = len(sample.prompt_ids), len(sample.completion_ids)
        raw = recorded.get("raw", torch.empty(0))[first : first + n]
        if raw.shape[0] != n or bool(raw.isnan().any()):
            raise RolloutError(f"the engine recorded no raw log-prob for some completion tokens of a request "
                               f"(positions {first}..{first + n - 1})")
        routing = recorded.get("routing")
        if routing is not None:  # positions past the completion: drafts a last verify step computed and did not keep
            routing = routing[: first + n - 1]
        if self.text_cfg.num_moe_layers and (routing is None or routing.shape[0] != first + n - 1):
            raise RolloutError(f"the engine recorded routing for {0 if routing is None else routing.shape[0]} "
                               f"positions of a request with {first + n - 1} input positions")
        return replace(sample, raw_logprobs=raw, routing=routing)


def lora_engine_args(adapter_rank: int, max_loras: int = 1) -> dict[str, Any]:
    """vLLM LoRA engine arguments for adapters up to `adapter_rank` (vLLM accepts only a few max ranks)."""
    rank = next((r for r in VLLM_MAX_LORA_RANKS if r >= adapter_rank), None)
    if rank is None:
        raise RolloutError(f"adapter rank {adapter_rank} exceeds vLLM's largest max_lora_rank {VLLM_MAX_LORA_RANKS[-1]}")
    return {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": rank}


@contextmanager
def _engine_core_in_process() -> Iterator[None]:
    """Build the engine with vLLM's engine core in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and the model in
    vLLM's worker process (`distributed_executor_backend="mp"`, which OpenMP on CPU needs). Measured on a 2-core CPU:
    an engine starts and stops in 19 s instead of 28 s (one process fewer that imports vLLM). What the core does to its
    own process at start is undone for this one: the caller's environment variable, vLLM's reading of the environment
    (the core caches every variable), the garbage collector (the core freezes every object alive, which would pin them
    here), torch's thread count (the core sets 1) and the random states of `random`, numpy and torch (the core
    seeds them)."""
    import numpy as np
    from vllm import envs

    before = os.environ.get(_MULTIPROCESSING_ENV)
    threads = torch.get_num_threads()
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    os.environ[_MULTIPROCESSING_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_MULTIPROCESSING_ENV)
        else:
            os.environ[_MULTIPROCESSING_ENV] = before
        envs.disable_envs_cache()
        gc.unfreeze()
        torch.set_num_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
