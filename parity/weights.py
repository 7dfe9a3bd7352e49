"""The one table of K3 text weight names, shapes and storage dtypes, in the official checkpoint naming.

Names are those of the official Kimi K3 HF checkpoints as vLLM's `KimiK3ForConditionalGeneration`
loader accepts them (`language_model.layers.N.` is mapped by its `hf_to_vllm_mapper`; the stacked
projections such as `in_proj_qkvgfab` and `fused_qkv_a_g_proj` are vLLM-side fusions of the names here).
Every other module (checkpoint writer, reference model, engines) derives its names from this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from parity.config import ConfigError, TextConfig

Init = Literal["linear", "embed", "norm", "bias", "a_log", "dt_bias", "conv", "res_proj"]

TEXT_PREFIX = "language_model"


@dataclass(frozen=True)
class WeightSpec:
    """One checkpoint tensor: its shape, whether it is stored in fp32 (else the model dtype), how to initialise it."""

    shape: tuple[int, ...]
    fp32: bool
    init: Init
    fan_in: int = 1


def layer_prefix(layer: int) -> str:
    return f"{TEXT_PREFIX}.layers.{layer}"


def _lin(out_f: int, in_f: int) -> WeightSpec:
    return WeightSpec((out_f, in_f), False, "linear", in_f)


def _norm(n: int) -> WeightSpec:
    return WeightSpec((n,), False, "norm")


def kda_specs(c: TextConfig) -> dict[str, WeightSpec]:
    """KDA layer, K3 full-rank gate: q/k/v/g projections, f_a -> f_b gate, beta, short conv, gated norm, o_proj."""
    h, p, d, nh = c.hidden_size, c.kda_proj_size, c.kda_head_dim, c.kda_num_heads
    if not c.use_full_rank_gate:
        raise ConfigError("linear_attn_config.use_full_rank_gate: only the K3 full-rank KDA gate is supported")
    specs = {f"{n}.weight": _lin(p, h) for n in ("q_proj", "k_proj", "v_proj", "g_proj")}
    specs.update(
        {
            "f_a_proj.weight": _lin(d, h),
            "f_b_proj.weight": _lin(p, d),
            "b_proj.weight": _lin(nh, h),
            "dt_bias": WeightSpec((p,), True, "dt_bias"),
            "A_log": WeightSpec((nh,), True, "a_log"),
            "q_conv1d.weight": WeightSpec((p, 1, c.conv_kernel), True, "conv", c.conv_kernel),
            "k_conv1d.weight": WeightSpec((p, 1, c.conv_kernel), True, "conv", c.conv_kernel),
            "v_conv1d.weight": WeightSpec((p, 1, c.conv_kernel), True, "conv", c.conv_kernel),
            "o_norm.weight": _norm(d),
            "o_proj.weight": _lin(h, p),
        }
    )
    return specs


def mla_specs(c: TextConfig) -> dict[str, WeightSpec]:
    """MLA layer (NoPE): low-rank q, compressed kv latent, per-head up-projection, sigmoid output gate."""
    h, nh = c.hidden_size, c.num_attention_heads
    specs: dict[str, WeightSpec] = {}
    if c.q_lora_rank is not None:
        specs["q_a_proj.weight"] = _lin(c.q_lora_rank, h)
        specs["q_a_layernorm.weight"] = _norm(c.q_lora_rank)
        specs["q_b_proj.weight"] = _lin(nh * c.qk_head_dim, c.q_lora_rank)
    else:
        specs["q_proj.weight"] = _lin(nh * c.qk_head_dim, h)
    specs["kv_a_proj_with_mqa.weight"] = _lin(c.mla_latent_size, h)
    specs["kv_a_layernorm.weight"] = _norm(c.kv_lora_rank)
    specs["kv_b_proj.weight"] = _lin(nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    if c.mla_use_output_gate:
        specs["g_proj.weight"] = _lin(nh * c.v_head_dim, h)
    specs["o_proj.weight"] = _lin(h, nh * c.v_head_dim)
    return specs


def mlp_specs(hidden: int, inter: int) -> dict[str, WeightSpec]:
    """Gated MLP (dense layers and shared experts): gate_proj, up_proj -> act -> down_proj."""
    return {
        "gate_proj.weight": _lin(inter, hidden),
        "up_proj.weight": _lin(inter, hidden),
        "down_proj.weight": _lin(hidden, inter),
    }


def moe_specs(c: TextConfig) -> dict[str, WeightSpec]:
    """LatentMoE: fp32-scored router with correction bias, latent down/norm/up, routed experts w1/w3/w2, shared experts."""
    assert c.num_experts is not None
    h, lat, inter = c.hidden_size, c.moe_hidden_size, c.moe_intermediate_size
    specs: dict[str, WeightSpec] = {
        "gate.weight": _lin(c.num_experts, h),
        "gate.e_score_correction_bias": WeightSpec((c.num_experts,), True, "bias"),
    }
    if c.routed_expert_hidden_size is not None:
        specs["routed_expert_down_proj.weight"] = _lin(lat, h)
        if c.latent_moe_use_norm:
            specs["routed_expert_norm.weight"] = _norm(lat)
        specs["routed_expert_up_proj.weight"] = _lin(h, lat)
    for e in range(c.num_experts):
        specs[f"experts.{e}.w1.weight"] = _lin(inter, lat)
        specs[f"experts.{e}.w3.weight"] = _lin(inter, lat)
        specs[f"experts.{e}.w2.weight"] = _lin(lat, inter)
    if c.num_shared_experts:
        for k, v in mlp_specs(h, inter * c.num_shared_experts).items():
            specs[f"shared_experts.{k}"] = v
    return specs


def attn_res_specs(c: TextConfig) -> dict[str, WeightSpec]:
    """AttnRes scorer per sub-layer: RMSNorm then a hidden -> 1 projection."""
    h = c.hidden_size
    return {
        "self_attention_res_norm.weight": _norm(h),
        "self_attention_res_proj.weight": WeightSpec((1, h), False, "res_proj", h),
        "mlp_res_norm.weight": _norm(h),
        "mlp_res_proj.weight": WeightSpec((1, h), False, "res_proj", h),
    }


def layer_specs(c: TextConfig, layer: int) -> dict[str, WeightSpec]:
    """All tensors of one decoder layer, names relative to `layer_prefix(layer)`."""
    specs = {"input_layernorm.weight": _norm(c.hidden_size), "post_attention_layernorm.weight": _norm(c.hidden_size)}
    attn = kda_specs(c) if c.is_kda(layer) else mla_specs(c)
    specs.update({f"self_attn.{k}": v for k, v in attn.items()})
    if c.is_moe(layer):
        specs.update({f"block_sparse_moe.{k}": v for k, v in moe_specs(c).items()})
    else:
        specs.update({f"mlp.{k}": v for k, v in mlp_specs(c.hidden_size, c.intermediate_size).items()})
    if c.attn_res_block_size is not None:
        specs.update(attn_res_specs(c))
    return specs


def text_specs(c: TextConfig) -> dict[str, WeightSpec]:
    """Every text tensor of the checkpoint, full official names, in a stable order (layer by layer)."""
    h = c.hidden_size
    specs = {f"{TEXT_PREFIX}.model.embed_tokens.weight": WeightSpec((c.vocab_size, h), False, "embed")}
    for layer in range(c.num_hidden_layers):
        specs.update({f"{layer_prefix(layer)}.{k}": v for k, v in layer_specs(c, layer).items()})
    specs[f"{TEXT_PREFIX}.model.norm.weight"] = _norm(h)
    if c.attn_res_block_size is not None:
        specs[f"{TEXT_PREFIX}.model.output_attn_res_norm.weight"] = _norm(h)
        specs[f"{TEXT_PREFIX}.model.output_attn_res_proj.weight"] = WeightSpec((1, h), False, "res_proj", h)
    if not c.tie_word_embeddings:
        specs[f"{TEXT_PREFIX}.lm_head.weight"] = _lin(c.vocab_size, h)
    return specs
