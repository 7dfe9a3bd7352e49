"""zerokl's K3 as a vLLM model class: vLLM schedules, caches and samples; `parity.model` computes.

`ZeroKLK3ForCausalLM` serves the official `KimiK3ForConditionalGeneration` checkpoints (text tower) and
`KimiLinearForCausalLM` checkpoints, each under its family's tensor names (`parity.weights.text_names`).
It holds the official tensors as plain parameters under their official names, in their serving dtype
(`parity.weights.serving_dtype`: the checkpoint's compute dtype, fp32 for fp32-stored tensors; no vLLM linear
layers, so nothing is prepacked or emptied on CPU), and runs every op of the forward through
`parity.model.K3Forward` on the chosen parity kernel backend, so a token's hidden state has the bits
the trainer's `parity.model.score_sequences` gives it. MLA latents live in vLLM's paged KV cache and KDA
states in vLLM's hybrid state cache (`rollout.vllm.caches`), so vLLM's memory accounting, preemption and
prefix caching apply to them.

The kernel set is a config key (`zerokl_kernels` in `hf_overrides`, see `rollout.vllm.plugin`), so it
reaches every vLLM process the same way the checkpoint does.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from parity.config import ModelConfig, TextConfig, load_model_config
from parity.kernels import get_kernels, platform_device, runs_triton
from parity.caches import KDACache
from parity.model import K3Forward, K3Weights, record_routing
from parity.quant import fp8
from parity.routing import NOT_COMPUTED
from parity.quant.mxfp4 import MXFP4Weight
from parity.weights import (is_quantized, official_name, packed_names, parameter_tree, serving_dtype, stored_specs,
                            text_specs)
from rollout import speculative
from rollout.vllm import compat
from lora.targets import suffixes
from rollout.vllm.caches import (KDAStateLayer, LatentCacheLayer, StepGroup, kda_state_dtypes, kda_state_shapes,
                                 on_device_of)
from rollout.vllm.lora_table import AdapterTable
from rollout.vllm.plugin import KERNELS_KEY
from rollout.vllm.records import WorkerRecords
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_utils import MambaCopySpec, MambaStateCopyFunc
from vllm.model_executor.models.interfaces import (HasInnerState, IsHybrid, SupportsEagle3, SupportsLoRA,
                                                   SupportsMambaPrefixCaching)
from parity.io.checkpoint import all_specs


class ModelSetupError(ValueError):
    """vLLM was started with settings this model cannot keep parity under; the message says which."""


def checkpoint_config(vllm_config: VllmConfig) -> ModelConfig:
    """The official config of the served checkpoint, read from its directory (not vLLM's overridden copy):
    Kimi K3 or Kimi Linear (`load_model_config` refuses any other model_type, naming it)."""
    path = Path(vllm_config.model_config.model)
    if not (path / "config.json").is_file():
        raise ModelSetupError(f"zerokl serves local checkpoint directories; {path} has no config.json")
    return load_model_config(path)


def _kernels_name(vllm_config: VllmConfig) -> str:
    return getattr(vllm_config.model_config.hf_config, KERNELS_KEY, "invariant")


def _copy_whole_state(state: torch.Tensor, block_ids: list[int], cur_block_idx: int,
                      num_accepted_tokens: int) -> MambaCopySpec:
    """Prefix-caching copy of one state slot (no speculative decoding: the slot is the whole state)."""
    src = state[block_ids[cur_block_idx]]
    return MambaCopySpec(start_addr=src.data_ptr(), num_elements=src.numel())


def load_official(params: dict[str, nn.Parameter], weights: Iterable[tuple[str, torch.Tensor]],
                  skipped: frozenset[str], what: str) -> set[str]:
    """Copy each checkpoint tensor (either spelling, `parity.weights.official_name`) into its parameter, in the
    parameter's serving dtype (the cast of `K3Weights.from_official`), except the `skipped` names; fail
    (ModelSetupError) on any other name, a tensor stored twice, a misshapen one, or a parameter the checkpoint lacks.
    Returns the names loaded."""
    loaded: set[str] = set()
    for stored, tensor in weights:
        name = official_name(stored)
        if name in loaded:
            raise ModelSetupError(f"checkpoint tensor {name} is stored twice (once as {stored})")
        if name in skipped:
            continue
        if name not in params:
            raise ModelSetupError(f"checkpoint tensor {name} is not a {what} weight of this config")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ModelSetupError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                                  f"config says {tuple(params[name].shape)}")
        params[name].data.copy_(tensor.to(params[name].dtype))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ModelSetupError(f"checkpoint lacks {len(missing)} {what} weights, first: {missing[0]}")
    return loaded


def compute_tensors(cfg: TextConfig, params: dict[str, nn.Parameter],
                    names: Iterable[str]) -> dict[str, torch.Tensor | MXFP4Weight]:
    """What `K3Forward` reads for the weights `names` (`text_specs` / `mtp_specs` names): the parameters themselves,
    MXFP4 experts as packed views of their two parameters (dequantised inside the linear kernel; a weight sync rewrites
    the parameters in place)."""
    tensors: dict[str, torch.Tensor | MXFP4Weight] = {}
    for name in names:
        if is_quantized(cfg, name):
            packed, scale = packed_names(name)
            tensors[name] = MXFP4Weight(params[packed], params[scale])
        else:
            tensors[name] = params[name]
    return tensors


def check_speculative(vllm_config: VllmConfig, cfg: TextConfig) -> None:
    """Refuse a speculative config this model cannot keep parity under (ModelSetupError naming the setting): a method
    other than `speculative.METHODS`, MTP on a checkpoint without MTP layers, the Triton kernels (their chunked KDA state
    has no per-token trail) or prefix caching (vLLM's align mode keeps per-draft state blocks; this model keeps the
    pairs in the request's one slot)."""
    if not vllm_config.num_speculative_tokens:
        return
    spec = vllm_config.speculative_config
    if spec.method not in speculative.METHODS:
        raise ModelSetupError(f"speculative method {spec.method!r} is not supported by zerokl's K3; use one of "
                              f"{', '.join(speculative.METHODS)}")
    if spec.method == "mtp" and not cfg.num_nextn_predict_layers:
        raise ModelSetupError("speculative method 'mtp' needs MTP draft layers: the checkpoint's "
                              "num_nextn_predict_layers is 0")
    if runs_triton(_kernels_name(vllm_config), platform_device()):
        raise ModelSetupError("speculative decoding runs on the CPU's invariant or the fast kernels, not the Triton "
                              "kernels")
    if vllm_config.cache_config.enable_prefix_caching:
        raise ModelSetupError("speculative decoding with prefix caching is not supported by zerokl's K3: start "
                              "without --enable-prefix-caching")


class ZeroKLK3ForCausalLM(nn.Module, IsHybrid, HasInnerState, SupportsMambaPrefixCaching, SupportsLoRA,
                          SupportsEagle3):
    """K3 text model on the parity kernels, with vLLM-managed MLA latent and KDA state caches, and vLLM LoRA
    computed by the parity kernels (`rollout.vllm.lora_table`); with a DSpark draft it also returns the streams after the
    draft's target layers (vLLM's EAGLE-3 interface, `set_aux_hidden_state_layers`)."""

    embedding_modules: ClassVar[dict[str, str]] = {}
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_cfg = checkpoint_config(vllm_config)
        cfg = model_cfg.text
        if vllm_config.model_config.dtype != cfg.compute_dtype:
            raise ModelSetupError(
                f"zerokl's K3 computes in the checkpoint's torch_dtype; start vLLM with dtype='{cfg.torch_dtype}' "
                f"(got {vllm_config.model_config.dtype})")
        check_speculative(vllm_config, cfg)
        if vllm_config.use_v2_model_runner:
            raise ModelSetupError("zerokl's K3 runs on vLLM's V1 model runner, which rollout.vllm.plugin selects for it: "
                                  "the plugin's edit of VllmConfig did not apply in this process")
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size > 1:
            raise ModelSetupError("zerokl's K3 rollout model runs unsharded: use tensor/pipeline parallel size 1")
        compat.apply()
        self.cfg = cfg
        self.kernels = get_kernels(_kernels_name(vllm_config))
        stored = stored_specs(cfg)
        self.text_names = frozenset(stored)
        self.skipped_names = frozenset(all_specs(model_cfg)) - self.text_names
        root = parameter_tree({name: (spec.shape, serving_dtype(cfg, spec)) for name, spec in stored.items()})
        for name, child in root.named_children():
            self.add_module(name, child)
        self.verify_rows = vllm_config.num_speculative_tokens + 1  # longest row of a decode (verify) step
        self.aux_layers: tuple[int, ...] = ()  # 0-based layers whose output streams `forward` also returns
        spec = getattr(vllm_config, "speculative_config", None)
        self.draft_layers: tuple[int, ...] = ()  # a DSpark draft's target_layer_ids (0-based)
        if spec is not None and spec.method == "dspark":
            self.draft_layers = tuple(spec.draft_model_config.hf_config.target_layer_ids)
        self.fwd = K3Forward(K3Weights(cfg, self._compute_tensors()), self.kernels)
        self.adapters = AdapterTable(self.fwd, self.kernels)
        self.zerokl_lora_suffixes = suffixes(cfg)  # what vLLM's adapter loader accepts (rollout.vllm.compat)
        self.lora_manager: Any = None  # vLLM's LoRAModelManager sets itself here when LoRA is enabled
        self.records: WorkerRecords | None = None  # set while the engine records (`rollout.vllm.records`)
        self.record_hooks: tuple[Any, ...] = ()
        # the experts each flat token of the last step chose [tokens, MoE layers, top_k], on the engine's device
        # (vLLM builds the model there), which the records read after the step (a graphed step runs no Python)
        self.register_buffer("routing_rows", torch.full(
            (vllm_config.scheduler_config.max_num_batched_tokens, cfg.num_moe_layers, cfg.num_experts_per_token or 0),
            NOT_COMPUTED, dtype=torch.int32), persistent=False)
        self.cache_layers = nn.ModuleList(
            KDAStateLayer(cfg, self.kernels.name, f"{prefix}cache_layers.{i}", vllm_config) if cfg.is_kda(i)
            else LatentCacheLayer(cfg, fp8.STORAGE_DTYPE if cfg.latent_cache else cfg.compute_dtype,
                                  f"{prefix}cache_layers.{i}", vllm_config)
            for i in range(cfg.num_hidden_layers)
        )

    def _compute_tensors(self) -> dict[str, torch.Tensor | MXFP4Weight]:
        return compute_tensors(self.cfg, dict(self.named_parameters()), text_specs(self.cfg))

    # --- vLLM model interface -------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.fwd.embed(input_ids)

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        """vLLM's aux layer k is the stream after 0-based layer k - 1 (k = 0, the embedding, is not served)."""
        if not layers or min(layers) < 1 or max(layers) > self.cfg.num_hidden_layers:
            raise ModelSetupError(f"draft target layers {layers} (vLLM's numbering, 1-based) are not layers 1.."
                                  f"{self.cfg.num_hidden_layers} of this checkpoint")
        self.aux_layers = tuple(sorted({k - 1 for k in layers}))

    def get_eagle3_default_aux_hidden_state_layers(self) -> tuple[int, ...]:
        """The DSpark draft's target layers in vLLM's numbering (its V1 runner reads only EAGLE-3 / DFlash keys)."""
        if not self.draft_layers:
            raise ModelSetupError("a draft reading target hidden states must name its target_layer_ids")
        return tuple(i + 1 for i in self.draft_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: object = None,
                inputs_embeds: torch.Tensor | None = None,
                **kwargs: object) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Flat step tokens [N] -> hidden states before the final norm [N, D] in the compute dtype (zeros on padding);
        with `aux_layers`, also the streams after those layers, [N, D] each. `inputs_embeds` [N, D]: the step's input
        rows, image rows merged in (the multimodal subclass, `rollout.vllm.vision`, which also receives the ids)."""
        if inputs_embeds is not None and not getattr(self, "supports_multimodal", False):
            raise ModelSetupError("zerokl's K3 takes token ids; prompt embeddings are not supported")
        with on_device_of(input_ids):  # the step's index and scratch tensors live where its tokens do
            return self._forward(input_ids, positions, inputs_embeds)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 inputs_embeds: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        out = torch.zeros(input_ids.shape[0], self.cfg.hidden_size, dtype=self.cfg.compute_dtype)
        aux = {layer: torch.zeros_like(out) for layer in self.aux_layers}
        result = (out, list(aux.values())) if aux else out
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # vLLM's dummy/profile runs: no caches bound, nothing to compute
            return result
        layout = metadata[self.cache_layers[0].prefix].layout
        if layout.uniform_decode and self.lora_manager is None:  # no read back to the host: a CUDA graph can hold it
            self._run(self.fwd, StepGroup.uniform(layout), input_ids, positions, metadata, out, inputs_embeds, aux)
            return result
        for group in StepGroup.split(layout, self.verify_rows):
            ids = self.adapters.row_ids(self.lora_manager, group.token_index[:, 0])
            for lora_id in ids.unique().tolist():
                self._run(self.adapters.forward(lora_id), group.subset(ids == lora_id), input_ids, positions, metadata,
                          out, inputs_embeds, aux)
        return result

    def _run(self, fwd: K3Forward, group: StepGroup, input_ids: torch.Tensor, positions: torch.Tensor,
             metadata: dict[str, Any], out: torch.Tensor, inputs_embeds: torch.Tensor | None = None,
             aux: dict[int, torch.Tensor] | None = None) -> None:
        """One group's rows through `fwd`, reading and writing their caches; fills their rows of `out` (and of each
        `aux` layer's stream) and, on a MoE model, of `routing_rows`."""
        layers = list(self.cache_layers)
        caches = [layer.read(metadata[layer.prefix], group) if isinstance(layer, KDAStateLayer)
                  else layer.view(metadata[layer.prefix], group) for layer in layers]
        embeds = None if inputs_embeds is None else group.gather(inputs_embeds)
        streams: dict[int, torch.Tensor] = dict.fromkeys(aux or ())
        with record_routing() if self.cfg.num_moe_layers else nullcontext() as routing:
            hidden = fwd.hidden(group.gather(input_ids), group.gather(positions), group.lens, caches, embeds=embeds,
                                streams=streams)
        for layer, cache in zip(layers, caches):
            if isinstance(cache, KDACache):
                layer.write(metadata[layer.prefix], group, cache)
        if group.dense:  # row b is flat token b: no boolean mask, whose indices would be read back to the host
            rows, pick = slice(len(group.rows)), (lambda t: t[:, 0])
        else:
            rows, pick = group.token_index[group.valid], (lambda t: t[group.valid])
        out[rows] = pick(hidden)
        for layer, stream in streams.items():
            aux[layer][rows] = pick(stream).to(out.dtype)
        if routing is not None:
            self.routing_rows[rows] = pick(torch.stack(routing, dim=2).int())  # [B, T, L, k] -> the rows' tokens

    def zerokl_load_adapter(self, lora_request: Any) -> None:
        """Called by vLLM's worker adapter loader before its own (`rollout.vllm.compat`): read and validate
        the adapter with zerokl's reader; an `AdapterError` here fails the load with its message."""
        registered = set(self.lora_manager.list_adapters()) if self.lora_manager is not None else set()
        self.adapters.load(lora_request.lora_int_id, lora_request.lora_path, registered)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head on the parity kernels: [M, D] -> [M, V] in the compute dtype (vLLM's sampler
        upcasts to fp32, as `parity.kernels.logprobs` does)."""
        return self.fwd.logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's text tensors into the parameters (`load_official`), the vision tower and MTP layers
        skipped."""
        params = {name: p for name, p in self.named_parameters() if name in self.text_names}
        return load_official(params, weights, self.skipped_names, "K3")

    # --- hybrid state cache (vLLM's MambaSpec plumbing) ----------------------------------------
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        return kda_state_shapes(checkpoint_config(vllm_config).text, _kernels_name(vllm_config),
                                vllm_config.num_speculative_tokens + 1)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return kda_state_dtypes(checkpoint_config(vllm_config).text)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[MambaStateCopyFunc, MambaStateCopyFunc]:
        return (_copy_whole_state, _copy_whole_state)
