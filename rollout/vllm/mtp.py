"""K3's MTP draft layers as vLLM's `kimi_k3_mtp` draft model, on the parity kernels.

vLLM's speculative config maps a kimi_k3 checkpoint with `--speculative-config '{"method": "mtp", ...}'` onto the
architecture `KimiK3MTPModel` and drives it with its MTP proposer (`vllm/v1/spec_decode/llm_base_proposer.py`): a
first pass over the step's tokens with the target's hidden states, then one pass per further draft token.
`KimiK3MTPModel` (registered by `rollout.vllm.plugin`) builds `ZeroKLK3MTP` when the target is zerokl's K3 and vLLM's own
`KimiK3MTP` otherwise, so a vLLM serving its own K3 classes is untouched.

`ZeroKLK3MTP` holds the checkpoint's MTP tensors (`parity.weights.mtp_specs`) under their official names, keeps its
latents in vLLM's paged cache (one `LatentCacheLayer` per draft layer, in the target's latent cache group) and
computes with `parity.model.K3Forward.mtp_hidden` on the target's kernel set, reading the target's embedding and
lm_head (bound by `zerokl_share_target`, which `rollout.vllm.compat` calls where vLLM's proposer would share them).
The draft never touches what the target computes: it only proposes tokens, which the target verifies.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from parity.kernels import get_kernels
from parity.model import K3Forward, K3Weights
from parity.quant import fp8
from parity.io.checkpoint import all_specs
from parity.weights import mtp_layers, mtp_specs, parameter_tree, serving_dtype, stored_mtp_specs, text_names
from rollout.vllm.caches import LatentCacheLayer, StepGroup, on_device_of
from rollout.vllm.plugin import serves_zerokl
from rollout.vllm.model import ModelSetupError, _kernels_name, checkpoint_config, compute_tensors, load_official
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context


class ZeroKLK3MTP(nn.Module):
    """The MTP draft of zerokl's K3 target: `forward` returns (normalised hidden for the draft logits, hidden for the
    next draft step), as vLLM's `KimiK3MTP` does."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_cfg = checkpoint_config(vllm_config)
        cfg = model_cfg.text
        if not cfg.num_nextn_predict_layers:
            raise ModelSetupError("the checkpoint has no MTP draft layers (num_nextn_predict_layers is 0)")
        self.cfg = cfg
        self.kernels = get_kernels(_kernels_name(vllm_config))
        stored = stored_mtp_specs(cfg)
        self.skipped_names = frozenset(all_specs(model_cfg)) - frozenset(stored)  # the target's tensors
        root = parameter_tree({name: (spec.shape, serving_dtype(cfg, spec)) for name, spec in stored.items()})
        for name, child in root.named_children():
            self.add_module(name, child)
        latent_dtype = fp8.STORAGE_DTYPE if cfg.latent_cache else cfg.compute_dtype
        self.cache_layers = nn.ModuleList(
            LatentCacheLayer(cfg, latent_dtype, f"{prefix}mtp_cache_layers.{layer}", vllm_config)
            for layer in mtp_layers(cfg))
        self.fwd: K3Forward | None = None  # bound to the target's embedding and lm_head by `zerokl_share_target`

    def zerokl_share_target(self, target: nn.Module) -> None:
        """Compute with the target's embedding and lm_head tensors (the same objects: a weight sync into the target
        reaches the draft too) and this draft's own MTP tensors."""
        tensors = compute_tensors(self.cfg, dict(self.named_parameters()), mtp_specs(self.cfg))
        names = text_names(self.cfg)
        shared = dict(target.named_parameters())
        tensors[names.embed], tensors[names.lm_head] = shared[names.embed], shared[names.lm_head]
        self.fwd = K3Forward(K3Weights(self.cfg, tensors), self.kernels)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.fwd is not None
        return self.fwd.embed(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                intermediate_tensors: object = None, inputs_embeds: torch.Tensor | None = None,
                spec_step_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat tokens [N] with the hidden states [N, D] that predicted them -> ([N, D], [N, D]) in the compute dtype
        (zeros on padding and in vLLM's dummy runs). Draft step `spec_step_idx` uses layer `spec_step_idx % n`."""
        with on_device_of(input_ids):  # the step's index and scratch tensors live where its tokens do
            return self._forward(input_ids, positions, hidden_states, inputs_embeds, spec_step_idx)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                 inputs_embeds: torch.Tensor | None, spec_step_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.cfg.hidden_size
        normed = torch.zeros(input_ids.shape[0], d, dtype=self.cfg.compute_dtype)
        out = torch.zeros_like(normed)
        metadata = get_forward_context().attn_metadata
        if metadata is None:
            return normed, out
        if inputs_embeds is not None:
            raise ModelSetupError("zerokl's K3 MTP draft takes token ids; prompt embeddings are not supported")
        assert self.fwd is not None, "zerokl_share_target was not called"
        k = spec_step_idx % self.cfg.num_nextn_predict_layers
        layer = self.cache_layers[k]
        meta = metadata[layer.prefix]
        for group in StepGroup.split(meta.layout):
            a, b = self.fwd.mtp_hidden(k, group.gather(input_ids), group.gather(positions), group.gather(hidden_states),
                                       group.lens, layer.view(meta, group))
            rows = group.token_index[group.valid]
            normed[rows], out[rows] = a[group.valid], b[group.valid]
        return normed, out

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        """Draft logits [M, V] from `forward`'s normalised hidden states (the target's lm_head)."""
        assert self.fwd is not None
        return self.fwd.mtp_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's MTP tensors into the parameters (`rollout.vllm.model.load_official`); every other tensor
        is the target's."""
        return load_official(dict(self.named_parameters()), weights, self.skipped_names, "K3 MTP draft")


class KimiK3MTPModel(nn.Module):
    """What vLLM builds for the architecture `KimiK3MTPModel`: `ZeroKLK3MTP` when the target is zerokl's K3, vLLM's
    own `KimiK3MTP` otherwise."""

    def __new__(cls, *, vllm_config: VllmConfig, prefix: str = "") -> Any:  # type: ignore[misc]
        if serves_zerokl(vllm_config.model_config.hf_config):
            return ZeroKLK3MTP(vllm_config=vllm_config, prefix=prefix)
        from vllm.models.kimi_k3 import KimiK3MTP

        return KimiK3MTP(vllm_config=vllm_config, prefix=prefix)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):  # the signature vLLM's loader inspects
        raise AssertionError("unreachable: __new__ returns another class's instance")
