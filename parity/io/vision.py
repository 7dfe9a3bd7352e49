"""Checkpoint tensor names and shapes of K3's vision tower and projector, in the official naming.

Read from vLLM's code, not from the launch material:
- `vllm/model_executor/models/kimi_k25_vit.py`: `MoonViT3dPretrainedModel` (what `vision_tower.*` holds:
  `patch_embed.proj` conv, `patch_embed.pos_emb.weight` (height, width, hidden), per block `norm0`/`norm1`,
  `wqkv`, `wo`, `mlp.fc0`/`mlp.fc1`, then `encoder.final_layernorm`) and `KimiK25MultiModalProjector`
  (`mm_projector.*`; vLLM calls the two linears `linear_1`/`linear_2`);
- `vllm/models/kimi_k3/nvidia/model.py`: `KimiK3ForConditionalGeneration.hf_to_vllm_mapper` maps the official
  `mm_projector.proj.0` / `mm_projector.proj.2` onto those, so the checkpoint keeps the `proj.N` names; every
  `vision_tower.*` name is the same on both sides;
- `vllm/transformers_utils/configs/kimi_k3.py`: `KimiK3VisionConfig`, whose defaults apply to keys a config
  leaves out (K3: RMSNorm, no biases, `qkv_hidden_size` 1536, projector `patchmergerv2`).

Not checkpoint tensors: the temporal sin-cos table (`time_weight`, a non-persistent buffer), the 2D RoPE table,
and the pixel input normalisation (`patch_embed.input_norm` buffers, built from the processor config).
"""

from __future__ import annotations

from typing import Any

from parity.config import ConfigError, VisionConfig
from parity.weights import WeightSpec

VISION_PREFIX = "vision_tower"
PROJECTOR_PREFIX = "mm_projector"

# KimiK3VisionConfig defaults for the keys that decide names and shapes.
_DEFAULTS: dict[str, Any] = {
    "patch_size": 14,
    "init_pos_emb_height": 64,
    "init_pos_emb_width": 64,
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "vt_num_attention_heads": 12,
    "vt_num_hidden_layers": 27,
    "vt_hidden_size": 1024,
    "vt_intermediate_size": 4096,
    "merge_kernel_size": (2, 2),
    "mm_projector_type": "patchmergerv2",
    "qkv_hidden_size": 1536,
    "norm_type": "rmsnorm",
    "attn_bias": False,
    "patch_embed_proj_bias": False,
    "mlp_type": "mlp2",
    "linear_bias": False,
    "activation_func": "gelu_pytorch_tanh",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
    "pos_emb_interpolation_mode": "bilinear",
    "merge_type": "sd2_tpool",
}
# The one value each of these may take: the forward (`parity.vision`) implements exactly it.
_ONLY = {"pos_emb_type": "divided_fixed", "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh",
         "projector_hidden_act": "gelu", "merge_type": "sd2_tpool"}


def vision_settings(vision: VisionConfig) -> dict[str, Any]:
    """`vision_config` with KimiK3VisionConfig's defaults for absent (or null) keys."""
    return {**_DEFAULTS, **{k: v for k, v in vision.raw.items() if v is not None}}


def _lin(out_f: int, in_f: int) -> WeightSpec:
    return WeightSpec((out_f, in_f), False, "linear", in_f)


def _bias(n: int) -> WeightSpec:
    return WeightSpec((n,), False, "bias")


def _norm_specs(name: str, norm_type: str, n: int) -> dict[str, WeightSpec]:
    """`nn.RMSNorm` has a weight; `nn.LayerNorm` a weight and a bias."""
    specs = {f"{name}.weight": WeightSpec((n,), False, "norm")}
    if norm_type == "layernorm":
        specs[f"{name}.bias"] = _bias(n)
    elif norm_type != "rmsnorm":
        raise ConfigError(f"vision_config.norm_type must be 'rmsnorm' or 'layernorm', got {norm_type!r}")
    return specs


def _linear_specs(name: str, out_f: int, in_f: int, bias: bool) -> dict[str, WeightSpec]:
    specs = {f"{name}.weight": _lin(out_f, in_f)}
    if bias:
        specs[f"{name}.bias"] = _bias(out_f)
    return specs


def vision_specs(vision: VisionConfig, text_hidden_size: int) -> dict[str, WeightSpec]:
    """Every `vision_tower.*` and `mm_projector.*` tensor, official names, in a stable order.

    All stored in the model dtype (vLLM casts the tower and projector to it). The projector's output width
    is the text hidden size (vLLM overrides `vision_config.text_hidden_size` with it).
    """
    cfg = vision_settings(vision)
    hidden = int(cfg["vt_hidden_size"])
    heads = int(cfg["vt_num_attention_heads"])
    qkv = int(cfg["qkv_hidden_size"])
    mlp = int(cfg["vt_intermediate_size"])
    norm_type = str(cfg["norm_type"])
    patch = cfg["patch_size"]
    ph, pw = (patch, patch) if isinstance(patch, int) else tuple(patch)
    merge = cfg["merge_kernel_size"]
    if len(merge) != 2:
        raise ConfigError(f"vision_config.merge_kernel_size must have 2 entries, got {merge!r}")
    for key, only in _ONLY.items():
        if cfg[key] != only:
            raise ConfigError(f"vision_config.{key} must be {only!r}, got {cfg[key]!r}")
    if cfg["pos_emb_interpolation_mode"] not in ("bilinear", "bicubic"):
        raise ConfigError("vision_config.pos_emb_interpolation_mode must be 'bilinear' or 'bicubic', got "
                          f"{cfg['pos_emb_interpolation_mode']!r}")
    if qkv % heads or (qkv // heads) % 4:
        raise ConfigError(
            f"vision_config.qkv_hidden_size ({qkv}) must split into vt_num_attention_heads ({heads}) heads "
            "whose size is a multiple of 4 (2D RoPE)"
        )
    mm_hidden = cfg.get("mm_hidden_size")
    if mm_hidden is not None and int(mm_hidden) != hidden:
        raise ConfigError(
            f"vision_config.mm_hidden_size ({mm_hidden}) must equal vt_hidden_size ({hidden}): "
            "vLLM's projector reads the tower width"
        )

    v = VISION_PREFIX
    specs: dict[str, WeightSpec] = {}
    specs[f"{v}.patch_embed.proj.weight"] = WeightSpec((hidden, 3, ph, pw), False, "linear", 3 * ph * pw)
    if cfg["patch_embed_proj_bias"]:
        specs[f"{v}.patch_embed.proj.bias"] = _bias(hidden)
    specs[f"{v}.patch_embed.pos_emb.weight"] = WeightSpec(
        (int(cfg["init_pos_emb_height"]), int(cfg["init_pos_emb_width"]), hidden), False, "embed"
    )
    for i in range(int(cfg["vt_num_hidden_layers"])):
        b = f"{v}.encoder.blocks.{i}"
        specs.update(_norm_specs(f"{b}.norm0", norm_type, hidden))
        specs.update(_norm_specs(f"{b}.norm1", norm_type, hidden))
        specs.update(_linear_specs(f"{b}.mlp.fc0", mlp, hidden, bool(cfg["linear_bias"])))
        specs.update(_linear_specs(f"{b}.mlp.fc1", hidden, mlp, bool(cfg["linear_bias"])))
        specs.update(_linear_specs(f"{b}.wqkv", 3 * qkv, hidden, bool(cfg["attn_bias"])))
        specs.update(_linear_specs(f"{b}.wo", hidden, qkv, bool(cfg["attn_bias"])))
    specs.update(_norm_specs(f"{v}.encoder.final_layernorm", norm_type, hidden))

    p = PROJECTOR_PREFIX
    merged = hidden * int(merge[0]) * int(merge[1])
    kind = cfg["mm_projector_type"]
    if kind == "patchmergerv2":
        specs.update(_linear_specs(f"{p}.proj.0", merged, merged, False))
        specs.update(_linear_specs(f"{p}.proj.2", text_hidden_size, merged, False))
        specs[f"{p}.post_norm.weight"] = WeightSpec((text_hidden_size,), False, "norm")
    elif kind == "patchmerger":
        specs.update(_norm_specs(f"{p}.pre_norm", "layernorm", hidden))
        specs.update(_linear_specs(f"{p}.proj.0", merged, merged, True))
        specs.update(_linear_specs(f"{p}.proj.2", text_hidden_size, merged, True))
    else:
        raise ConfigError(
            f"vision_config.mm_projector_type must be 'patchmergerv2' or 'patchmerger', got {kind!r}"
        )
    return specs
