"""Typed view of an official Kimi K3 / Kimi Linear HF config.

The config files stay in the official format (`config.json` with `model_type: kimi_k3` and a
`text_config`, or a bare `kimi_linear` config); this module validates them once into frozen
dataclasses so every other module reads named, checked fields. Errors name the bad key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class ConfigError(ValueError):
    """A model config that cannot describe a K3 / Kimi Linear model; the message names the key."""


@dataclass(frozen=True)
class TextConfig:
    """The text model of K3 (KimiLinearConfig fields vLLM reads), layer indices 0-based.

    Kimi Linear is this model with K3's switches off: no `attn_res_block_size` (plain residual stream),
    `hidden_act` silu (no SiTU), no `routed_expert_hidden_size` (plain MoE), no `use_full_rank_gate`
    (low-rank KDA output gate), and in its released config no MLA output gate and no q-LoRA."""

    checkpoint_family: str  # "kimi_k3" or "kimi_linear": which official tensor names (parity.weights.TextNames)
    torch_dtype: str  # the checkpoint's `torch_dtype`, which is the compute dtype: "bfloat16" or "float32"
    expert_format: str | None  # "mxfp4": routed experts stored packed (quantization_config); None: model dtype
    latent_cache: str | None  # "fp8_e4m3": MLA latents cached in FP8 (quantization_config.kv_cache_scheme); None: dtype
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str  # "situ" or "silu"
    situ_beta: float | None  # activation_situ_beta (gate soft-clip), K3: 4
    situ_linear_beta: float | None  # activation_situ_linear_beta (up soft-clip), K3: 25
    # KDA (linear attention) layers
    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel: int
    use_full_rank_gate: bool  # KDA output gate: full-rank g_proj (K3) or low-rank g_a_proj -> g_b_proj (Kimi Linear)
    gate_lower_bound: float | None
    # MLA (full attention) layers
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mla_use_output_gate: bool
    # MoE
    num_experts: int | None
    num_experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int | None  # LatentMoE latent width; None = plain MoE
    latent_moe_use_norm: bool
    routed_scaling_factor: float
    moe_renormalize: bool
    router_activation: str  # "sigmoid" or "softmax"
    first_k_dense_replace: int
    moe_layer_freq: int
    # Attention Residuals
    attn_res_block_size: int | None
    # DSA indexer (K3.1 Pro); None when absent
    index_n_heads: int | None
    index_head_dim: int | None
    index_topk: int | None
    # Multi-token prediction: draft layers stored after the decoder layers (`num_nextn_predict_layers`), 0 = none
    num_nextn_predict_layers: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int

    def is_kda(self, layer: int) -> bool:
        return layer in self.kda_layers

    def is_moe(self, layer: int) -> bool:
        return (
            self.num_experts is not None
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.num_hidden_layers))

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of weights and activations in the forward (fp32 kept at the cast points in parity/README.md)."""
        return COMPUTE_DTYPES[self.torch_dtype]

    @property
    def kda_proj_size(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def mla_latent_size(self) -> int:
        """Per-token cached latent of one MLA layer: compressed kv plus the (unrotated) key part."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_hidden_size(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def num_attn_res_blocks(self) -> int:
        if self.attn_res_block_size is None:
            return 0
        return -(-self.num_hidden_layers // self.attn_res_block_size)


@dataclass(frozen=True)
class VisionConfig:
    """K3's native vision tower (MoonViT-style encoder, 2x2 merger, projector to text hidden)."""

    raw: dict[str, Any]

    @property
    def hidden_size(self) -> int:
        return int(self.raw.get("vt_hidden_size", 1024))


@dataclass(frozen=True)
class ModelConfig:
    """A whole checkpoint config: the official dict (kept verbatim for writing) and its typed text part."""

    model_type: str  # "kimi_k3" or "kimi_linear"
    text: TextConfig
    vision: VisionConfig | None
    raw: dict[str, Any]


def _get(d: dict[str, Any], key: str, where: str, default: Any = ..., kind: type | tuple = object) -> Any:
    if key not in d or d[key] is None:
        if default is ...:
            raise ConfigError(f"{where}: missing required key '{key}'")
        return default
    value = d[key]
    if kind is not object and not isinstance(value, kind):
        raise ConfigError(f"{where}: key '{key}' must be {kind}, got {value!r}")
    return value


MXFP4_FORMAT = "mxfp4-pack-quantized"  # compressed-tensors' format name, the one vLLM's K3 loader reads


def parse_quantization(q: Any) -> tuple[str | None, str | None]:
    """(expert_format, latent_cache) from a config's `quantization_config` (absent: neither). K3's released form:
    compressed-tensors, format `mxfp4-pack-quantized` (routed experts); an 8-bit float per-tensor `kv_cache_scheme`
    asks for FP8 e4m3 MLA latents."""
    if q is None:
        return None, None
    where = "config.quantization_config"
    if not isinstance(q, dict):
        raise ConfigError(f"{where} must be a mapping, got {q!r}")
    if q.get("quant_method") != "compressed-tensors" or q.get("format") != MXFP4_FORMAT:
        raise ConfigError(f"{where}: zerokl reads quant_method 'compressed-tensors' with format '{MXFP4_FORMAT}' "
                          f"(MXFP4 routed experts, as K3 ships), got {q.get('quant_method')!r} / {q.get('format')!r}")
    kv = q.get("kv_cache_scheme")
    if kv is None:
        return "mxfp4", None
    if not isinstance(kv, dict) or kv.get("num_bits") != 8 or kv.get("type") != "float" or kv.get("strategy") != "tensor":
        raise ConfigError(f"{where}.kv_cache_scheme: only FP8 (num_bits 8, type float, strategy tensor) MLA latents are "
                          f"supported, got {kv!r}")
    return "mxfp4", "fp8_e4m3"


def parse_text_config(d: dict[str, Any], checkpoint_family: str, where: str = "text_config",
                      torch_dtype: Any = None, quantization: Any = None) -> TextConfig:
    """Validate a KimiLinearConfig-style dict; layer lists in the file are 1-based, as vLLM reads them.

    `checkpoint_family` is the checkpoint's top-level model_type ("kimi_k3" or "kimi_linear"): the text
    dict itself says `kimi_linear` in both, but the two families name their tensors differently.
    `torch_dtype` is the checkpoint's (top-level) dtype; absent means float32, as in transformers.
    `quantization` is its `quantization_config` (`parse_quantization`)."""
    dtype = "float32" if torch_dtype is None else torch_dtype
    if dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"config: torch_dtype must be one of {sorted(COMPUTE_DTYPES)} (zerokl computes in the "
                          f"checkpoint's dtype), got {torch_dtype!r}")
    lac = _get(d, "linear_attn_config", where, kind=dict)
    n_layers = _get(d, "num_hidden_layers", where, kind=int)
    kda_1 = _get(lac, "kda_layers", f"{where}.linear_attn_config", kind=list)
    full_1 = _get(lac, "full_attn_layers", f"{where}.linear_attn_config", kind=list)
    if sorted(kda_1 + full_1) != list(range(1, n_layers + 1)):
        raise ConfigError(
            f"{where}.linear_attn_config: kda_layers and full_attn_layers must partition 1..{n_layers} "
            f"(1-based), got kda={kda_1} full={full_1}"
        )
    act = _get(d, "hidden_act", where, kind=str)
    if act not in ("situ", "silu"):
        raise ConfigError(f"{where}: hidden_act must be 'situ' or 'silu', got {act!r}")
    router = _get(d, "moe_router_activation_func", where, "sigmoid", kind=str)
    if router not in ("sigmoid", "softmax"):
        raise ConfigError(f"{where}: moe_router_activation_func must be 'sigmoid' or 'softmax', got {router!r}")
    lower = lac.get("gate_lower_bound")
    if lower is not None and not (-5.0 <= float(lower) < 0.0):
        raise ConfigError(f"{where}.linear_attn_config: gate_lower_bound must be in [-5, 0), got {lower}")
    if _get(d, "mla_use_nope", where, False) is not True and full_1:
        raise ConfigError(f"{where}: mla_use_nope must be true (K3 MLA is NoPE-only)")
    if int(_get(d, "num_expert_group", where, 1)) != 1 or int(_get(d, "topk_group", where, 1)) != 1:
        raise ConfigError(f"{where}: only num_expert_group = topk_group = 1 is supported (K3 routes in one group)")
    if _get(d, "tie_word_embeddings", where, False, kind=bool):
        raise ConfigError(f"{where}: tie_word_embeddings: true is not supported: vLLM's K3 and Kimi Linear models and "
                          f"transformers' Kimi Linear always build their own lm_head (set it to false)")
    index = {k: d.get(k) for k in ("index_n_heads", "index_head_dim", "index_topk")}
    if any(v is not None for v in index.values()):
        bad = {k: v for k, v in index.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad:
            raise ConfigError(f"{where}: the DSA indexer needs index_n_heads, index_head_dim and index_topk, each an "
                              f"integer >= 1, got {bad}")
        if d.get("q_lora_rank") is None:
            raise ConfigError(f"{where}: the DSA indexer reads the low-rank query (q_lora_rank), which this config lacks")
    num_experts = d.get("num_experts")
    expert_format, latent_cache = parse_quantization(quantization)
    if expert_format == "mxfp4":
        widths = {"moe_intermediate_size": d.get("moe_intermediate_size"),
                  "routed_expert_hidden_size (or hidden_size)": d.get("routed_expert_hidden_size") or d.get("hidden_size")}
        bad = {k: v for k, v in widths.items() if not isinstance(v, int) or v % 32}
        if num_experts is None or bad:
            raise ConfigError(f"{where}: MXFP4 experts need num_experts and expert input widths that are multiples of 32 "
                              f"(one scale per 32 values), got {bad or 'no num_experts'}")
    mtp = _get(d, "num_nextn_predict_layers", where, 0, kind=int)
    if isinstance(mtp, bool) or mtp < 0:
        raise ConfigError(f"{where}: num_nextn_predict_layers must be a count >= 0, got {mtp!r}")
    return TextConfig(
        checkpoint_family=checkpoint_family,
        torch_dtype=dtype,
        expert_format=expert_format,
        latent_cache=latent_cache,
        vocab_size=_get(d, "vocab_size", where, kind=int),
        hidden_size=_get(d, "hidden_size", where, kind=int),
        num_hidden_layers=n_layers,
        intermediate_size=_get(d, "intermediate_size", where, kind=int),
        rms_norm_eps=float(_get(d, "rms_norm_eps", where, 1e-6)),
        hidden_act=act,
        situ_beta=d.get("activation_situ_beta"),
        situ_linear_beta=d.get("activation_situ_linear_beta"),
        kda_layers=tuple(i - 1 for i in kda_1),
        full_attn_layers=tuple(i - 1 for i in full_1),
        kda_num_heads=_get(lac, "num_heads", f"{where}.linear_attn_config", kind=int),
        kda_head_dim=_get(lac, "head_dim", f"{where}.linear_attn_config", kind=int),
        conv_kernel=_get(lac, "short_conv_kernel_size", f"{where}.linear_attn_config", kind=int),
        use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
        gate_lower_bound=None if lower is None else float(lower),
        num_attention_heads=_get(d, "num_attention_heads", where, kind=int),
        q_lora_rank=d.get("q_lora_rank"),
        kv_lora_rank=_get(d, "kv_lora_rank", where, kind=int),
        qk_nope_head_dim=_get(d, "qk_nope_head_dim", where, kind=int),
        qk_rope_head_dim=_get(d, "qk_rope_head_dim", where, kind=int),
        v_head_dim=_get(d, "v_head_dim", where, kind=int),
        mla_use_output_gate=bool(d.get("mla_use_output_gate", False)),
        num_experts=num_experts,
        num_experts_per_token=int(d.get("num_experts_per_token") or 0),
        num_shared_experts=int(d.get("num_shared_experts") or 0),
        moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
        routed_expert_hidden_size=d.get("routed_expert_hidden_size"),
        latent_moe_use_norm=bool(d.get("latent_moe_use_norm", False)),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        moe_renormalize=bool(d.get("moe_renormalize", True)),
        router_activation=router,
        first_k_dense_replace=int(d.get("first_k_dense_replace", 0)),
        moe_layer_freq=int(d.get("moe_layer_freq", 1)),
        attn_res_block_size=d.get("attn_res_block_size"),
        index_n_heads=d.get("index_n_heads"),
        index_head_dim=d.get("index_head_dim"),
        index_topk=d.get("index_topk"),
        num_nextn_predict_layers=mtp,
        bos_token_id=int(d.get("bos_token_id", 1)),
        eos_token_id=int(d.get("eos_token_id", 2)),
        pad_token_id=int(d.get("pad_token_id", 0)),
    )


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    """Accept `kimi_k3` (text_config + vision_config) or a bare `kimi_linear` config."""
    model_type = raw.get("model_type")
    if model_type == "kimi_k3":
        text = parse_text_config(_get(raw, "text_config", "config", kind=dict), "kimi_k3",
                                 torch_dtype=raw.get("torch_dtype"), quantization=raw.get("quantization_config"))
        vision = raw.get("vision_config")
        return ModelConfig("kimi_k3", text, VisionConfig(vision) if vision else None, raw)
    if model_type == "kimi_linear":
        text = parse_text_config(raw, "kimi_linear", "config", torch_dtype=raw.get("torch_dtype"),
                                 quantization=raw.get("quantization_config"))
        return ModelConfig("kimi_linear", text, None, raw)
    raise ConfigError(f"config: model_type must be 'kimi_k3' or 'kimi_linear', got {model_type!r}")


def load_model_config(path: str | Path) -> ModelConfig:
    """Read a YAML/JSON config file, or a checkpoint directory's config.json."""
    return parse_model_config(read_config(path))


def read_config(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML/JSON config file, or in a checkpoint directory's config.json."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ConfigError(f"config file not found: {p}")
    text = p.read_text()
    try:
        raw = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level")
    return raw
