"""K3's DSpark draft in the official format: its config (`model_type: k3_dspark`, vLLM's `K3DSparkConfig`), its
tensors, and the rotary table its attention uses.

The draft is a small dense MLA model of its own checkpoint directory. It reads the target's hidden states after the
decoder layers `target_layer_ids` (0-based, before the final norm), concatenated in ascending layer order, as
context: `context_norm(context_proj(concat))`, whose per-layer latents (`kv_a_proj_with_mqa`, `kv_a_layernorm`, RoPE
on the rope part) stand in for the target's tokens; it embeds [anchor, noise x (N - 1)] with the target's embedding,
attends to the context and to the whole block (non-causal), and predicts the next token at every block row with the
target's lm_head plus a low-rank Markov bias of the token drafted before it (`parity.dspark_model`). Tensor names carry
no `model.` prefix (vLLM's loader adds it); the embedding and lm_head are the target's, never stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from parity.config import COMPUTE_DTYPES, ConfigError, TextConfig, _get
from parity.weights import WeightSpec

MODEL_TYPE = "k3_dspark"
ARCHITECTURE = "K3DSparkModel"  # vLLM registers K3DSparkForCausalLM under this name
# vLLM's K3DSparkConfig rejects these when true; zerokl builds the plain draft only
UNSUPPORTED_FLAGS = ("mla_use_nope", "mla_use_output_gate", "mla_use_qk_norm", "dspark_bonus_anchor",
                     "enable_confidence_head", "is_causal")


@dataclass(frozen=True)
class DSparkConfig:
    """A `k3_dspark` draft config; `raw` is the official config.json as given."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    noise_token_id: int
    logit_scale: float
    torch_dtype: str
    raw: dict[str, Any]

    @property
    def dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.torch_dtype]

    @property
    def latent_width(self) -> int:
        """One cached position per layer: [latent (kv_lora_rank) ; rotated key (qk_rope_head_dim)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def _count(d: dict[str, Any], key: str, where: str, default: Any = ...) -> int:
    v = _get(d, key, where, default, kind=int)
    if isinstance(v, bool) or v < 1:
        raise ConfigError(f"{where}: {key} must be a count >= 1, got {v!r}")
    return v


def parse_dspark_config(raw: dict[str, Any], where: str = "config") -> DSparkConfig:
    """Validate a `k3_dspark` config: what vLLM's `K3DSparkConfig` checks (q_lora_rank set, no NoPE / output gate /
    qk-norm, draft vocab = vocab, `num_target_layers` = len(target_layer_ids)), the keys its model reads without a
    default (target_hidden_size, markov_rank, the noise token), and the choices zerokl runs (SiLU MLP, default RoPE,
    the anchor as the first prediction, non-causal block, no confidence head). Every key that shapes the model is
    required: vLLM would fall back to DeepSeek-V3's sizes for a missing one."""
    if raw.get("model_type") != MODEL_TYPE:
        raise ConfigError(f"{where}: model_type must be {MODEL_TYPE!r}, got {raw.get('model_type')!r}")
    for flag in UNSUPPORTED_FLAGS:
        if raw.get(flag):
            raise ConfigError(f"{where}: {flag} is not supported by the K3 DSpark draft zerokl runs")
    if raw.get("sample_from_anchor", True) is not True:
        raise ConfigError(f"{where}: sample_from_anchor must be true (the anchor predicts the first draft token)")
    if _get(raw, "hidden_act", where, "silu", kind=str) != "silu":
        raise ConfigError(f"{where}: hidden_act must be 'silu' (K3's DSpark draft MLP), got {raw.get('hidden_act')!r}")
    rope = raw.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default":
        raise ConfigError(f"{where}: rope_parameters must use rope_type 'default', got {rope!r}")
    theta = rope.get("rope_theta", raw.get("rope_theta", 50000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    vocab = _count(raw, "vocab_size", where)
    if raw.get("draft_vocab_size", vocab) != vocab:
        raise ConfigError(f"{where}: draft_vocab_size must equal vocab_size (the draft shares the target's lm_head)")
    ids = _get(raw, "target_layer_ids", where, kind=list)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ConfigError(f"{where}: target_layer_ids must be a non-empty list of layer indices >= 0, got {ids!r}")
    if len(set(ids)) != len(ids) or list(ids) != sorted(ids):
        raise ConfigError(f"{where}: target_layer_ids must be ascending without repeats (vLLM captures them in "
                          f"sorted order), got {ids!r}")
    if _get(raw, "num_target_layers", where, kind=int) != len(ids):
        raise ConfigError(f"{where}: num_target_layers must equal len(target_layer_ids) = {len(ids)}")
    if raw.get("dspark_target_layer_ids", ids) != ids:
        raise ConfigError(f"{where}: dspark_target_layer_ids, when given, must equal target_layer_ids")
    noise = _get(raw, "dspark_noise_token_id", where, kind=int)
    if isinstance(noise, bool) or not 0 <= noise < vocab:
        raise ConfigError(f"{where}: dspark_noise_token_id must be a token id below vocab_size, got {noise!r}")
    dtype = _get(raw, "torch_dtype", where, "float32", kind=str)  # absent: float32, as transformers (and TextConfig)
    if dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"{where}: torch_dtype must be one of {sorted(COMPUTE_DTYPES)}, got {dtype!r}")
    scale = _get(raw, "logit_scale", where, 1.0, kind=(int, float))
    return DSparkConfig(
        vocab_size=vocab, hidden_size=_count(raw, "hidden_size", where),
        intermediate_size=_count(raw, "intermediate_size", where),
        num_hidden_layers=_count(raw, "num_hidden_layers", where),
        num_attention_heads=_count(raw, "num_attention_heads", where),
        q_lora_rank=_count(raw, "q_lora_rank", where), kv_lora_rank=_count(raw, "kv_lora_rank", where),
        qk_nope_head_dim=_count(raw, "qk_nope_head_dim", where), qk_rope_head_dim=_count(raw, "qk_rope_head_dim", where),
        v_head_dim=_count(raw, "v_head_dim", where), rms_norm_eps=float(_get(raw, "rms_norm_eps", where, kind=(int, float))),
        rope_theta=float(theta), max_position_embeddings=_count(raw, "max_position_embeddings", where),
        target_hidden_size=_count(raw, "target_hidden_size", where), target_layer_ids=tuple(ids),
        markov_rank=_count(raw, "markov_rank", where), noise_token_id=noise, logit_scale=float(scale),
        torch_dtype=dtype, raw=raw)


def check_fits_target(draft: DSparkConfig, target: TextConfig, where: str = "DSpark draft") -> None:
    """The draft reads this target: same vocabulary and width (shared embedding and lm_head), the target's hidden
    width as context, layers it has, and its compute dtype."""
    if draft.torch_dtype != target.torch_dtype:
        raise ConfigError(f"{where}: torch_dtype {draft.torch_dtype} differs from the target's {target.torch_dtype}")
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"{where}: vocab_size {draft.vocab_size} differs from the target's {target.vocab_size}")
    if draft.hidden_size != target.hidden_size:
        raise ConfigError(f"{where}: hidden_size {draft.hidden_size} differs from the target's {target.hidden_size} "
                          "(the draft embeds with the target's embedding and predicts with its lm_head)")
    if draft.target_hidden_size != target.hidden_size:
        raise ConfigError(f"{where}: target_hidden_size {draft.target_hidden_size} differs from the target's "
                          f"hidden_size {target.hidden_size}")
    if max(draft.target_layer_ids) >= target.num_hidden_layers:
        raise ConfigError(f"{where}: target_layer_ids {list(draft.target_layer_ids)} name layers past the target's "
                          f"{target.num_hidden_layers}")


def layer(i: int) -> str:
    return f"layers.{i}"


def dspark_specs(cfg: DSparkConfig) -> dict[str, WeightSpec]:
    """Every stored tensor of the draft, by its checkpoint name (no `model.` prefix), with shape and init kind."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    lin = lambda o, i: WeightSpec((o, i), False, "linear", i)  # noqa: E731
    norm = lambda n: WeightSpec((n,), False, "norm")  # noqa: E731
    ctx_in = cfg.target_hidden_size * len(cfg.target_layer_ids)
    out = {"context_proj.weight": lin(d, ctx_in), "context_norm.weight": norm(d)}
    for i in range(cfg.num_hidden_layers):
        p = layer(i)
        out.update({
            f"{p}.input_layernorm.weight": norm(d),
            f"{p}.post_attention_layernorm.weight": norm(d),
            f"{p}.self_attn.q_a_proj.weight": lin(cfg.q_lora_rank, d),
            f"{p}.self_attn.q_a_layernorm.weight": norm(cfg.q_lora_rank),
            f"{p}.self_attn.q_b_proj.weight": lin(h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), cfg.q_lora_rank),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": lin(cfg.latent_width, d),
            f"{p}.self_attn.kv_a_layernorm.weight": norm(cfg.kv_lora_rank),
            f"{p}.self_attn.kv_b_proj.weight": lin(h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            f"{p}.self_attn.o_proj.weight": lin(d, h * cfg.v_head_dim),
            f"{p}.mlp.gate_proj.weight": lin(cfg.intermediate_size, d),
            f"{p}.mlp.up_proj.weight": lin(cfg.intermediate_size, d),
            f"{p}.mlp.down_proj.weight": lin(d, cfg.intermediate_size),
        })
    out.update({"final_norm.weight": norm(d),
                "markov_head.markov_w1.weight": WeightSpec((cfg.vocab_size, cfg.markov_rank), False, "embed"),
                "markov_head.markov_w2.weight": lin(cfg.vocab_size, cfg.markov_rank)})
    return out


def rope_table(cfg: DSparkConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin): [max_position_embeddings, qk_rope_head_dim / 2] fp32, angle p * theta^(-2i / R) computed as vLLM
    builds its cache (fp32 inverse frequencies times fp32 positions). One fixed table: a position's values never
    depend on which other positions a batch holds."""
    r = cfg.qk_rope_head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    ang = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), inv)
    return ang.cos(), ang.sin()


def rotate(x: torch.Tensor, pos: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """GPT-J (interleaved) rotary embedding of x: [B, T, R] or [B, T, H, R] at positions pos: [B, T]: pairs
    (x[2i], x[2i+1]) rotate by the table's angle i, in fp32 with separate multiplies and adds, rounded once to x's
    dtype."""
    cos, sin = (t.to(x.device)[pos] for t in table)  # [..., R / 2]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xf = x.float()
    a, b = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)

