"""`zerokl plan`: what a K3 config costs: parameters, KV cache, KDA state and memory per GPU for a layout.

Parameter counts come from the one weight table (`parity.weights.text_specs`); nothing here re-derives a
text shape. All byte figures are plain bytes; the printed GB are 10^9 bytes (as in the published "1,680 GB").

Layout model (an average pipeline stage): non-expert weights (attention, dense MLPs, shared experts, router,
embedding, lm_head) are split over TP, routed experts over EP, and everything over PP. The MLA latent cache is
replicated on every TP rank (one latent serves all heads) and split over PP; the KDA state is split over TP
(by head) and PP.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any

from parity.config import ConfigError, ModelConfig, TextConfig, VisionConfig, load_model_config
from parity.weights import text_specs
from zerokl.argtypes import positive_int

GB = 1e9
BF16_BYTES = 2
FP32_BYTES = 4
MXFP4_BYTES_PER_PARAM = 0.5 + 1 / 32  # 4-bit value plus one E8M0 scale byte per 32 values
MEMORY_ESTIMATE_BYTES_PER_PARAM = 0.6  # the published 4-bit rule of thumb: params x 0.6 B
KDA_RECURRENT_STATE_BYTES = FP32_BYTES  # vLLM's KDA state dtype "auto" = fp32
KDA_CONV_STATE_BYTES = BF16_BYTES  # vLLM keeps the short-conv state in the model dtype
DEFAULT_CONTEXT_TOKENS = 4096  # KimiLinearConfig's max_position_embeddings default
ROUTED_EXPERT_TAG = ".block_sparse_moe.experts."
FP8_INDEX_SCALE_BLOCK = 128  # FP8 index keys: one fp32 scale per 128 values (DeepSeek V3.2 indexer cache)
NVFP4_BLOCK = 16  # NVFP4: one FP8 (E4M3) scale per 16 values
MXFP4_BLOCK = 32  # MXFP4: one E8M0 scale per 32 values


@dataclass(frozen=True)
class KvFormat:
    """How one MLA layer's per-token cache entry is stored: the latent, and the DSA index key when there is one."""

    name: str
    latent: str  # "bf16", "fp8" or "nvfp4" (512 nope entries in NVFP4, the rope entries in FP8)
    index_key: str  # "bf16", "fp8" (with an fp32 scale) or "mxfp4"
    description: str


KV_FORMATS: dict[str, KvFormat] = {
    "bf16": KvFormat("bf16", "bf16", "bf16", "bf16 latent, bf16 index key"),
    "fp8": KvFormat("fp8", "fp8", "fp8", "FP8 latent, FP8 index key + fp32 scale"),
    "nvfp4": KvFormat("nvfp4", "nvfp4", "mxfp4", "NVFP4 latent (rope part FP8), MXFP4 index key"),
}


@dataclass(frozen=True)
class KvBytes:
    """Per-token cache bytes of the MLA layers under one format, before any parallel split."""

    format: str
    latent_per_layer: int
    index_key_per_layer: int  # 0 without the DSA indexer
    mla_layers: int

    @property
    def per_layer(self) -> int:
        """Bytes one MLA layer caches per token."""
        return self.latent_per_layer + self.index_key_per_layer

    @property
    def per_token(self) -> int:
        """Bytes all MLA layers cache per token."""
        return self.per_layer * self.mla_layers


@dataclass(frozen=True)
class Plan:
    """Figures for one config and one parallel layout."""

    tp: int
    ep: int
    pp: int
    context_tokens: int
    kv_format: str
    total_params: int  # text model, every tensor of the weight table
    active_params: int  # per token: routed experts at top-k of E, everything else (embedding, lm_head) once
    routed_expert_params: int
    experts_per_token: int
    num_experts: int
    vision_params: int | None  # rough estimate, not part of total_params
    kv: tuple[KvBytes, ...]  # every format in KV_FORMATS
    has_indexer: bool
    kda_layers: int
    kda_recurrent_state_bytes: int  # per sequence, all KDA layers
    kda_conv_state_bytes: int  # per sequence, all KDA layers
    dense_weight_bytes: int  # non-expert weights, bf16 (fp32 where the weight table stores fp32)
    expert_weight_bytes: float  # routed experts in MXFP4

    @property
    def memory_estimate_bytes(self) -> float:
        """The published 4-bit rule of thumb: total params x 0.6 B."""
        return self.total_params * MEMORY_ESTIMATE_BYTES_PER_PARAM

    @property
    def kv_selected(self) -> KvBytes:
        """The per-token KV figures of the chosen format."""
        return next(k for k in self.kv if k.format == self.kv_format)

    @property
    def kda_state_bytes(self) -> int:
        """KDA recurrent plus conv state of one sequence, all KDA layers."""
        return self.kda_recurrent_state_bytes + self.kda_conv_state_bytes

    @property
    def dense_weight_bytes_per_gpu(self) -> float:
        """Non-expert weights on one GPU: split over TP and PP."""
        return self.dense_weight_bytes / (self.tp * self.pp)

    @property
    def expert_weight_bytes_per_gpu(self) -> float:
        """Routed-expert weights on one GPU: split over EP and PP."""
        return self.expert_weight_bytes / (self.ep * self.pp)

    @property
    def weight_bytes_per_gpu(self) -> float:
        """All weights on one GPU."""
        return self.dense_weight_bytes_per_gpu + self.expert_weight_bytes_per_gpu

    @property
    def kv_bytes_per_gpu(self) -> float:
        """MLA cache of one context_tokens-long sequence on one GPU: replicated over TP, split over PP."""
        return self.kv_selected.per_token * self.context_tokens / self.pp

    @property
    def kda_state_bytes_per_gpu(self) -> float:
        """KDA state of one sequence on one GPU: split over TP (heads) and PP (layers)."""
        return self.kda_state_bytes / (self.tp * self.pp)

    @property
    def memory_bytes_per_gpu(self) -> float:
        """Weights plus the cache and state of one context_tokens-long sequence, on one GPU."""
        return self.weight_bytes_per_gpu + self.kv_bytes_per_gpu + self.kda_state_bytes_per_gpu


def _latent_bytes(c: TextConfig, kind: str) -> int:
    """Bytes of one token's MLA latent (kv_lora_rank nope entries + qk_rope_head_dim entries) in one layer."""
    n = c.kv_lora_rank + c.qk_rope_head_dim
    if kind == "bf16":
        return n * BF16_BYTES
    if kind == "fp8":
        return n
    nope = c.kv_lora_rank
    return math.ceil(nope / 2) + math.ceil(nope / NVFP4_BLOCK) + c.qk_rope_head_dim


def _index_key_bytes(c: TextConfig, kind: str) -> int:
    """Bytes of one token's DSA index key in one layer; 0 when the config has no indexer."""
    d = c.index_head_dim
    if d is None:
        return 0
    if kind == "bf16":
        return d * BF16_BYTES
    if kind == "fp8":
        return d + FP32_BYTES * math.ceil(d / FP8_INDEX_SCALE_BLOCK)
    return math.ceil(d / 2) + math.ceil(d / MXFP4_BLOCK)


def kv_bytes(c: TextConfig, fmt: KvFormat) -> KvBytes:
    """Per-token MLA cache bytes of a text config under one format."""
    return KvBytes(fmt.name, _latent_bytes(c, fmt.latent), _index_key_bytes(c, fmt.index_key), len(c.full_attn_layers))


def kda_state_bytes(c: TextConfig) -> tuple[int, int]:
    """(recurrent, conv) state bytes of one sequence over all KDA layers.

    Recurrent: heads x head_dim x head_dim fp32 per layer. Conv: (kernel - 1) x 3 * proj (q, k, v) per layer.
    """
    n = len(c.kda_layers)
    recurrent = n * c.kda_num_heads * c.kda_head_dim * c.kda_head_dim * KDA_RECURRENT_STATE_BYTES
    conv = n * (c.conv_kernel - 1) * 3 * c.kda_proj_size * KDA_CONV_STATE_BYTES
    return recurrent, conv


@dataclass(frozen=True)
class ParamCounts:
    """Parameter and storage totals of the text weight table."""

    total: int
    routed_experts: int
    dense_bytes: int  # every non-routed tensor at bf16, or fp32 where the table says so


def count_params(c: TextConfig) -> ParamCounts:
    """Sum the weight table: all parameters, the routed-expert ones, and the storage of the rest."""
    total = routed = dense_bytes = 0
    for name, spec in text_specs(c).items():
        n = math.prod(spec.shape)
        total += n
        if ROUTED_EXPERT_TAG in name:
            routed += n
        else:
            dense_bytes += n * (FP32_BYTES if spec.fp32 else BF16_BYTES)
    return ParamCounts(total, routed, dense_bytes)


def active_params(c: TextConfig, counts: ParamCounts) -> int:
    """Parameters one token touches: top-k of E routed experts, every other tensor once."""
    if not c.num_experts:
        return counts.total
    routed_active = counts.routed_experts * c.num_experts_per_token // c.num_experts
    return counts.total - counts.routed_experts + routed_active


def _vision_int(v: VisionConfig, key: str, default: int) -> int:
    """One integer field of the vision config, with vLLM's KimiK3VisionConfig default."""
    value = v.raw.get(key, default)
    if not isinstance(value, int):
        raise ConfigError(f"vision_config: key '{key}' must be an int, got {value!r}")
    return value


def vision_params(v: VisionConfig, text_hidden: int) -> int:
    """Rough MoonViT parameter count (norms and biases left out).

    Per layer 4*h*q attention (q = qkv width) + 2*h*i MLP; patch embedding 3*p^2*h; learned 2-D position
    embedding H*W*h; projector over the merged k_h*k_w patches: (k*m)^2 + (k*m)*text_hidden (m = mm_hidden_size).
    """
    h = _vision_int(v, "vt_hidden_size", 1024)
    q = _vision_int(v, "qkv_hidden_size", h)
    i = _vision_int(v, "vt_intermediate_size", 4096)
    layers = _vision_int(v, "vt_num_hidden_layers", 27)
    p = _vision_int(v, "patch_size", 14)
    pos = _vision_int(v, "init_pos_emb_height", 64) * _vision_int(v, "init_pos_emb_width", 64)
    merge = v.raw.get("merge_kernel_size", [2, 2])
    if not (isinstance(merge, list) and all(isinstance(k, int) for k in merge)):
        raise ConfigError(f"vision_config: key 'merge_kernel_size' must be a list of ints, got {merge!r}")
    merged = _vision_int(v, "mm_hidden_size", h) * math.prod(merge)
    return layers * (4 * h * q + 2 * h * i) + 3 * p * p * h + pos * h + merged * merged + merged * text_hidden


def default_context_tokens(m: ModelConfig) -> int:
    """The longest context the config declares: `model_max_length` (Kimi Linear's released configs) or
    `max_position_embeddings` (text part), whichever is larger; else KimiLinearConfig's default."""
    text_raw: dict[str, Any] = m.raw["text_config"] if m.model_type == "kimi_k3" else m.raw
    values = []
    for key in ("model_max_length", "max_position_embeddings"):
        value = text_raw.get(key, m.raw.get(key))
        if value is None:
            continue
        if not isinstance(value, int):
            raise ConfigError(f"text_config: key '{key}' must be an int, got {value!r}")
        values.append(value)
    return max(values, default=DEFAULT_CONTEXT_TOKENS)


def check_layout(c: TextConfig, tp: int, ep: int, pp: int, context_tokens: int) -> None:
    """Reject layouts the engines cannot shard: degrees < 1, TP not dividing the heads, EP not dividing E."""
    for key, value in (("tp", tp), ("ep", ep), ("pp", pp)):
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if context_tokens < 0:
        raise ConfigError(f"context must be >= 0 tokens, got {context_tokens}")
    if pp > c.num_hidden_layers:
        raise ConfigError(f"pp={pp} exceeds the {c.num_hidden_layers} layers")
    if c.kda_layers and c.kda_num_heads % tp:
        raise ConfigError(f"tp={tp} does not divide the {c.kda_num_heads} KDA heads")
    if c.full_attn_layers and c.num_attention_heads % tp:
        raise ConfigError(f"tp={tp} does not divide the {c.num_attention_heads} MLA heads")
    if c.num_experts and c.num_experts % ep:
        raise ConfigError(f"ep={ep} does not divide the {c.num_experts} routed experts")


def plan(
    model_config: ModelConfig,
    tp: int = 1,
    ep: int = 1,
    pp: int = 1,
    kv_format: str = "fp8",
    context_tokens: int | None = None,
) -> Plan:
    """All plan figures for a config and layout; context_tokens defaults to the config's max_position_embeddings."""
    c = model_config.text
    if kv_format not in KV_FORMATS:
        raise ConfigError(f"kv format must be one of {sorted(KV_FORMATS)}, got {kv_format!r}")
    context = default_context_tokens(model_config) if context_tokens is None else context_tokens
    check_layout(c, tp, ep, pp, context)
    counts = count_params(c)
    recurrent, conv = kda_state_bytes(c)
    vision = model_config.vision
    return Plan(
        tp=tp,
        ep=ep,
        pp=pp,
        context_tokens=context,
        kv_format=kv_format,
        total_params=counts.total,
        active_params=active_params(c, counts),
        routed_expert_params=counts.routed_experts,
        experts_per_token=c.num_experts_per_token if c.num_experts else 0,
        num_experts=c.num_experts or 0,
        vision_params=None if vision is None else vision_params(vision, c.hidden_size),
        kv=tuple(kv_bytes(c, f) for f in KV_FORMATS.values()),
        has_indexer=c.index_head_dim is not None,
        kda_layers=len(c.kda_layers),
        kda_recurrent_state_bytes=recurrent,
        kda_conv_state_bytes=conv,
        dense_weight_bytes=counts.dense_bytes,
        expert_weight_bytes=counts.routed_experts * MXFP4_BYTES_PER_PARAM,
    )


def _params(n: int) -> str:
    """A parameter count with its T/B/M scale."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:.3f}{unit} ({n:,})"
    return f"{n:,}"


def _bytes(b: float) -> str:
    """Bytes in decimal GB, MB or kB, whichever keeps the figure >= 1."""
    for scale, unit in ((GB, "GB"), (1e6, "MB"), (1e3, "kB")):
        if b >= scale:
            return f"{b / scale:,.2f} {unit}"
    return f"{b:,.0f} B"


def format_plan(p: Plan, title: str = "plan") -> str:
    """The plan as a human-readable report."""
    lines = [
        f"{title}: tp={p.tp} ep={p.ep} pp={p.pp}, context {p.context_tokens:,} tokens, KV format {p.kv_format}",
        "parameters (text)",
        f"  total                 {_params(p.total_params)}",
        f"  active per token      {_params(p.active_params)}"
        f"  [routed experts {p.experts_per_token} of {p.num_experts}; embedding and lm_head once each]",
        f"  routed experts        {_params(p.routed_expert_params)}",
        f"  4-bit estimate        {_bytes(p.memory_estimate_bytes)}  (params x {MEMORY_ESTIMATE_BYTES_PER_PARAM} B)",
    ]
    if p.vision_params is not None:
        lines.append(f"  vision tower (rough)  {_params(p.vision_params)}  (not in total)")
    mla = p.kv[0].mla_layers
    index = "DSA index key" if p.has_indexer else "index key (no DSA indexer)"
    lines.append(f"KV cache per token, {mla} MLA layers: latent + {index}, per layer")
    for k in p.kv:
        mark = "*" if k.format == p.kv_format else " "
        desc = KV_FORMATS[k.format].description
        lines.append(
            f" {mark}{k.format:<6} {k.latent_per_layer:>5} + {k.index_key_per_layer:>3} = {k.per_layer:>5} B/layer"
            f"  -> {k.per_token:>7,} B/token   {desc}"
        )
    lines += [
        f"KDA state per sequence, {p.kda_layers} layers: recurrent {p.kda_recurrent_state_bytes:,} B"
        f" + conv {p.kda_conv_state_bytes:,} B = {_bytes(p.kda_state_bytes)}",
        "memory per GPU",
        f"  non-expert weights (bf16) / (tp*pp)    {_bytes(p.dense_weight_bytes_per_gpu)}",
        f"  routed experts (MXFP4) / (ep*pp)       {_bytes(p.expert_weight_bytes_per_gpu)}",
        f"  MLA cache, one sequence / pp           {_bytes(p.kv_bytes_per_gpu)}",
        f"  KDA state, one sequence / (tp*pp)      {_bytes(p.kda_state_bytes_per_gpu)}",
        f"  total                                  {_bytes(p.memory_bytes_per_gpu)}",
    ]
    return "\n".join(lines)


def _non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `plan` on the `zerokl` subcommand parser."""
    p = subparsers.add_parser("plan", help="parameter counts, KV cache and per-GPU memory of a K3 config")
    p.add_argument("--config", required=True, help="model config (YAML/JSON, official HF format)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree")
    p.add_argument("--ep", type=positive_int, default=1, help="expert-parallel degree")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel degree")
    p.add_argument(
        "--context",
        type=_non_negative_int,
        default=None,
        help="tokens of one sequence (default: the config's max_position_embeddings)",
    )
    p.add_argument("--kv-format", choices=sorted(KV_FORMATS), default="fp8", help="MLA cache format")
    p.add_argument("--dp", type=positive_int, help="also the trainer's memory per rank at tp x ep over tp x dp ranks "
                   "(fp32 masters, gradients and Adam moments, the moments split over DP: `zerokl ppo --nproc-per-node "
                   "tp*dp --tp --ep`)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the plan for args.config; a bad config or layout prints one line and returns 2."""
    try:
        model_config = load_model_config(args.config)
        result = plan(
            model_config, tp=args.tp, ep=args.ep, pp=args.pp, kv_format=args.kv_format, context_tokens=args.context
        )
        training = None if args.dp is None else training_memory(model_config, args.tp, args.ep, args.pp, args.dp)
    except ConfigError as e:
        print(f"zerokl: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(result, title=str(args.config)))
    if training is not None:
        print(format_training(training, args.tp, args.ep, args.dp))
    return 0


def training_memory(model_config: ModelConfig, tp: int, ep: int, pp: int, dp: int) -> Any:
    """The Megatron trainer's resident state per rank (`trainer.megatron.memory.RankMemory`) at tp x ep over tp x dp
    ranks; ConfigError for a layout it cannot run."""
    from trainer.megatron.memory import rank_memory

    if pp > 1:
        raise ConfigError(f"--dp: the trainer has no pipeline parallelism (pp = {pp}); drop --pp")
    try:
        return rank_memory(model_config.text, tp, ep, tp * dp)
    except ValueError as e:
        raise ConfigError(f"--dp: {e}") from None


def format_training(m: Any, tp: int, ep: int, dp: int) -> str:
    """The trainer's per-rank memory as report lines."""
    return "\n".join([
        f"trainer memory per rank: tp={tp} ep={ep} dp={dp} ({tp * dp} ranks; expert-DP {m.expert_dp}), fp32",
        f"  parameters        {m.parameters:>16,}  {_bytes(4 * m.parameters)}  ({m.frozen:,} frozen)",
        f"  gradients         {m.gradients:>16,}  {_bytes(4 * m.gradients)}",
        f"  Adam moments      {m.adam:>16,}  {_bytes(4 * m.adam)}  (dense / {m.dp}, experts / {m.expert_dp})",
        f"  total                               {_bytes(m.bytes)}  (activations not counted)",
    ])
