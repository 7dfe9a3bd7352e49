"""Megatron's TransformerConfig extended with the K3 model: the official config and the parity kernel set.

The model is Kimi K3 or Kimi Linear (K3 with its extra blocks switched off, `parity.config.TextConfig`).
Megatron fields are filled from the K3 text config where Megatron has an equivalent (layers, widths, experts,
router top-k); they size Megatron's own objects (parallel linears, DDP, optimizer). Everything K3-specific
(KDA, MLA latents, LatentMoE, AttnRes, SiTU) is read from `k3.text` by the shared forward in `parity.model`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from parity.config import ModelConfig
from parity.kernels import KERNEL_SETS
from trainer.megatron.parallel import ParallelContext
from trainer.megatron.sharding import check_divisible


@dataclass
class K3TransformerConfig(TransformerConfig):
    """TransformerConfig plus `k3` (the official model config) and `kernels` (a `parity.kernels` kernel set name)."""

    k3: ModelConfig | None = None
    kernels: str = "invariant"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.k3 is None:
            raise ValueError("K3TransformerConfig.k3: the official model config is required")
        if self.kernels not in KERNEL_SETS:
            raise ValueError(f"K3TransformerConfig.kernels: choose one of {KERNEL_SETS}, got {self.kernels!r}")


def k3_transformer_config(model_cfg: ModelConfig, par: ParallelContext, kernels: str = "invariant",
                          params_dtype: torch.dtype = torch.float32) -> K3TransformerConfig:
    """The trainer's config for `model_cfg` at `par`'s TP/EP sizes; fp32 master parameters unless asked."""
    t = model_cfg.text
    check_divisible(t, par.tp, par.ep)
    moe = {}
    if t.num_experts is not None:
        moe = dict(
            num_moe_experts=t.num_experts,
            moe_router_topk=t.num_experts_per_token,
            moe_ffn_hidden_size=t.moe_intermediate_size,
            moe_shared_expert_intermediate_size=t.moe_intermediate_size * t.num_shared_experts or None,
            moe_router_score_function=t.router_activation,
            moe_router_topk_scaling_factor=t.routed_scaling_factor,
        )
    return K3TransformerConfig(
        num_layers=t.num_hidden_layers,
        hidden_size=t.hidden_size,
        num_attention_heads=t.num_attention_heads,
        kv_channels=t.v_head_dim,
        ffn_hidden_size=t.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=t.rms_norm_eps,
        add_bias_linear=False,
        gated_linear_unit=True,
        tensor_model_parallel_size=par.tp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=1,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=params_dtype,
        k3=model_cfg,
        kernels=kernels,
        **moe,
    )
