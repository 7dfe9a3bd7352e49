"""The one table of K3 / Kimi Linear text weight names, shapes and storage dtypes, in the official naming.

Names are those of the official HF checkpoints as vLLM's loaders accept them. Kimi K3
(`KimiK3ForConditionalGeneration`) keeps the text model under `language_model.` (`language_model.layers.N.`
is mapped by its `hf_to_vllm_mapper`); Kimi Linear (`KimiLinearForCausalLM`, also transformers' class of
that name) keeps it at the top level (`model.layers.N.`, `model.embed_tokens`, `lm_head`). Inside a layer
both families use the same names; the stacked projections such as `in_proj_qkvgfab` and
`fused_qkv_a_g_proj` are vLLM-side fusions of the names here. Every other module (checkpoint writer,
reference model, engines) derives its names from this table.

Two forms of the same weights: `text_specs` names one tensor per weight (what the trainers hold as fp32 masters and
the forward reads); `stored_specs` is what a checkpoint stores and the rollout engine holds (an MXFP4 checkpoint's
routed experts as `weight_packed` + `weight_scale`). `serving_weights` and `master_weights` convert between them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn

from parity.config import TextConfig
from parity.quant import mxfp4

Init = Literal["linear", "embed", "norm", "bias", "a_log", "dt_bias", "conv", "res_proj"]
Packing = Literal["mxfp4_packed", "mxfp4_scale"]

TEXT_PREFIX = "language_model"  # K3's text model inside KimiK3ForConditionalGeneration


@dataclass(frozen=True)
class TextNames:
    """Where one checkpoint family keeps the text tensors outside the decoder layers, and the layers."""

    root: str  # every text tensor name starts with this ("" = the whole checkpoint is the text model)
    model: str  # module holding embed_tokens, norm and the output AttnRes scorer
    layers: str  # module holding the decoder layers

    def layer(self, layer: int) -> str:
        return f"{self.layers}.{layer}"

    @property
    def embed(self) -> str:
        return f"{self.model}.embed_tokens.weight"

    @property
    def norm(self) -> str:
        return f"{self.model}.norm.weight"

    @property
    def output_res_norm(self) -> str:
        return f"{self.model}.output_attn_res_norm.weight"

    @property
    def output_res_proj(self) -> str:
        return f"{self.model}.output_attn_res_proj.weight"

    @property
    def lm_head(self) -> str:
        return f"{self.root}lm_head.weight"


NAMES = {
    "kimi_k3": TextNames(f"{TEXT_PREFIX}.", f"{TEXT_PREFIX}.model", f"{TEXT_PREFIX}.layers"),
    "kimi_linear": TextNames("", "model", "model.layers"),
}


# Other spellings of official names that vLLM's K3 loader also reads (its `hf_to_vllm_mapper` maps the written
# form onto these module paths; torchtitan's K3 key map reads only these). zerokl writes the left-hand form, the
# names of the released K3 checkpoints, and reads both.
K3_MODEL_LAYERS = f"{TEXT_PREFIX}.model.layers."  # the other spelling of K3's decoder layers (vLLM's module path)
ALIASES = (
    (K3_MODEL_LAYERS, f"{TEXT_PREFIX}.layers."),
    ("mm_projector.linear_1.", "mm_projector.proj.0."),
    ("mm_projector.linear_2.", "mm_projector.proj.2."),
)


def official_name(name: str) -> str:
    """`name` in the spelling zerokl writes: an `ALIASES` spelling is mapped to the official one, any other name is
    returned as it is."""
    for alias, official in ALIASES:
        if name.startswith(alias):
            return official + name[len(alias):]
    return name


def text_names(c: TextConfig) -> TextNames:
    """The official text tensor names of `c`'s checkpoint family."""
    return NAMES[c.checkpoint_family]


@dataclass(frozen=True)
class WeightSpec:
    """One checkpoint tensor: its shape, whether it is stored in fp32 (else the model dtype), how to initialise it, and
    for a stored MXFP4 tensor which half it is (uint8 codes or scales)."""

    shape: tuple[int, ...]
    fp32: bool
    init: Init
    fan_in: int = 1
    packing: Packing | None = None


def layer_prefix(layer: int, checkpoint_family: str = "kimi_k3") -> str:
    """Name prefix of decoder layer `layer` (0-based) in a checkpoint of that family."""
    return NAMES[checkpoint_family].layer(layer)


def _lin(out_f: int, in_f: int) -> WeightSpec:
    return WeightSpec((out_f, in_f), False, "linear", in_f)


def _norm(n: int) -> WeightSpec:
    return WeightSpec((n,), False, "norm")


def kda_specs(c: TextConfig) -> dict[str, WeightSpec]:
    """KDA layer: q/k/v projections, output gate, f_a -> f_b decay gate, beta, short conv, gated norm, o_proj.

    The output gate is full-rank `g_proj` with K3's `use_full_rank_gate`, else Kimi Linear's low-rank
    `g_a_proj` (hidden -> head_dim) then `g_b_proj` (head_dim -> heads * head_dim). `A_log` is [H] in K3
    checkpoints and [1, 1, H, 1] in Kimi Linear's (vLLM loads both; transformers' module is 4-D).
    """
    h, p, d, nh = c.hidden_size, c.kda_proj_size, c.kda_head_dim, c.kda_num_heads
    specs = {f"{n}.weight": _lin(p, h) for n in ("q_proj", "k_proj", "v_proj")}
    if c.use_full_rank_gate:
        specs["g_proj.weight"] = _lin(p, h)
    else:
        specs.update({"g_a_proj.weight": _lin(d, h), "g_b_proj.weight": _lin(p, d)})
    a_log_shape = (1, 1, nh, 1) if c.checkpoint_family == "kimi_linear" else (nh,)
    specs.update(
        {
            "f_a_proj.weight": _lin(d, h),
            "f_b_proj.weight": _lin(p, d),
            "b_proj.weight": _lin(nh, h),
            "dt_bias": WeightSpec((p,), True, "dt_bias"),
            "A_log": WeightSpec(a_log_shape, True, "a_log"),
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
    if c.index_topk is not None:
        specs.update({f"indexer.{k}": v for k, v in indexer_specs(c).items()})
    return specs


def is_indexer(name: str) -> bool:
    """An official name of a DSA indexer tensor. The trainers hold them frozen: the loss reaches the indexer only
    through the discrete top-k, which has no gradient."""
    return ".self_attn.indexer." in name


def indexer_specs(c: TextConfig) -> dict[str, WeightSpec]:
    """The DSA lightning indexer of an MLA layer (K3.1 Pro; DeepSeek-V3.2's names, as vLLM's sparse-MLA code reads
    them): per-head index queries from the low-rank query, one index key per token (LayerNorm'd), per-head weights."""
    assert c.index_n_heads is not None and c.index_head_dim is not None and c.q_lora_rank is not None
    h, nh, d = c.hidden_size, c.index_n_heads, c.index_head_dim
    return {"wq_b.weight": _lin(nh * d, c.q_lora_rank), "wk.weight": _lin(d, h), "k_norm.weight": _norm(d),
            "k_norm.bias": WeightSpec((d,), False, "bias"), "weights_proj.weight": _lin(nh, h)}


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
    """All tensors of one decoder layer, names relative to `text_names(c).layer(layer)`."""
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
    h, names = c.hidden_size, text_names(c)
    specs = {names.embed: WeightSpec((c.vocab_size, h), False, "embed")}
    for layer in range(c.num_hidden_layers):
        specs.update({f"{names.layer(layer)}.{k}": v for k, v in layer_specs(c, layer).items()})
    specs[names.norm] = _norm(h)
    if c.attn_res_block_size is not None:
        specs[names.output_res_norm] = _norm(h)
        specs[names.output_res_proj] = WeightSpec((1, h), False, "res_proj", h)
    specs[names.lm_head] = _lin(c.vocab_size, h)
    return specs


_ROUTED_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")

# Names relative to a decoder layer of the projections whose reduction (input) dim tensor parallelism splits
# (Megatron's row-parallel layers: the output projections of attention and of the gated MLPs). Their GEMMs add fixed
# K segments (`parity.kernels.linear.k_segments`), so a TP rank can compute its share of the sum with the
# one-process bits; every other GEMM is one segment.
ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight", "block_sparse_moe.shared_experts.down_proj.weight")


def is_quantized(c: TextConfig, name: str) -> bool:
    """Whether text tensor `name` (a `text_specs` name) is stored packed: the routed experts' w1/w3/w2 of an MXFP4
    checkpoint (K3 ships only those in MXFP4; every other linear stays in the model dtype)."""
    return c.expert_format == "mxfp4" and _ROUTED_EXPERT.search(name) is not None


def is_row_parallel(name: str) -> bool:
    """Whether text tensor `name` (a `text_specs` name of either family) is one of the `ROW_PARALLEL` projections."""
    return any(name.endswith(f".{rel}") and ".layers." in name for rel in ROW_PARALLEL)


def packed_names(name: str) -> tuple[str, str]:
    """(`...weight_packed`, `...weight_scale`): the stored names of quantised weight `...weight`."""
    base = name.removesuffix("weight")
    return f"{base}weight_packed", f"{base}weight_scale"


def mtp_specs(c: TextConfig) -> dict[str, WeightSpec]:
    """The multi-token-prediction draft layers (`num_nextn_predict_layers`, none by default), full official names: layer
    `num_hidden_layers + k` holds `enorm`, `hnorm`, `eh_proj` [D, 2D] (the embedding of the next token and the
    target's hidden state, each normalised, concatenated, projected), `shared_head.norm` and a decoder block (MLA,
    and MoE or MLP as the config places layer L + k) without Attention Residuals. Embedding and lm_head are the
    target's (vLLM's `kimi_k3_mtp` shares them)."""
    h, names = c.hidden_size, text_names(c)
    specs: dict[str, WeightSpec] = {}
    for layer in mtp_layers(c):
        p = names.layer(layer)
        specs.update({f"{p}.enorm.weight": _norm(h), f"{p}.hnorm.weight": _norm(h),
                      f"{p}.eh_proj.weight": _lin(h, 2 * h), f"{p}.shared_head.norm.weight": _norm(h)})
        block = layer_specs(replace(c, attn_res_block_size=None), layer)
        specs.update({f"{p}.{k}": v for k, v in block.items()})
    return specs


def mtp_layers(c: TextConfig) -> range:
    """Indices of the MTP draft layers: after the decoder layers."""
    return range(c.num_hidden_layers, c.num_hidden_layers + c.num_nextn_predict_layers)


def is_mtp(c: TextConfig, name: str) -> bool:
    """Whether `name` (official spelling) is a tensor of an MTP draft layer."""
    match = re.match(rf"{re.escape(text_names(c).layers)}\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= c.num_hidden_layers


def written_name(c: TextConfig, name: str) -> str:
    """The name a checkpoint stores tensor `name` under: its official name, except that K3's MTP layers are spelled
    `language_model.model.layers.N.` (what vLLM's `kimi_k3_mtp` loader reads; it does not map the other spelling).
    Reading maps it back (`official_name`)."""
    if c.checkpoint_family == "kimi_k3" and is_mtp(c, name):
        return K3_MODEL_LAYERS + name.removeprefix(f"{text_names(c).layers}.")
    return name


def stored_specs(c: TextConfig) -> dict[str, WeightSpec]:
    """The text tensors as a checkpoint stores them (and the rollout engine holds them): `text_specs`, with each
    quantised weight [N, K] replaced by its uint8 codes [N, K/2] and E8M0 scales [N, K/32]."""
    return _packed_specs(c, text_specs(c))


def _packed_specs(c: TextConfig, specs: Mapping[str, WeightSpec]) -> dict[str, WeightSpec]:
    """`specs` with each quantised weight replaced by its two stored halves."""
    out: dict[str, WeightSpec] = {}
    for name, spec in specs.items():
        if is_quantized(c, name):
            n, k = spec.shape
            packed, scale = packed_names(name)
            out[packed] = replace(spec, shape=(n, k // 2), packing="mxfp4_packed")
            out[scale] = replace(spec, shape=(n, k // mxfp4.GROUP), packing="mxfp4_scale")
        else:
            out[name] = spec
    return out


def stored_mtp_specs(c: TextConfig) -> dict[str, WeightSpec]:
    """`mtp_specs` as a checkpoint stores them (MXFP4 routed experts packed, like the decoder layers')."""
    return _packed_specs(c, mtp_specs(c))


def serving_dtype(c: TextConfig, spec: WeightSpec) -> torch.dtype:
    """The dtype a stored tensor has in a checkpoint and in the rollout engine: uint8 for MXFP4 halves, fp32 for
    fp32-stored tensors, else the compute dtype."""
    if spec.packing is not None:
        return torch.uint8
    return torch.float32 if spec.fp32 else c.compute_dtype


def serving_weights(c: TextConfig, masters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The text tensors of `masters` (one tensor per `text_specs` name: fp32 masters, or a checkpoint's values) in
    their stored form (`stored_specs`): quantised weights through `parity.quant.mxfp4.quantize`, the rest cast to
    their `serving_dtype` (round to nearest even). These are exactly the operands `parity.model.K3Forward.weight`
    gives the trainer's forward (fake quantisation, the same rounding), so a weight sync carries the bits both sides
    compute with. Fails naming the first missing tensor; `QuantError` on a NaN or inf weight that would be quantised."""
    out = {}
    for name, spec in text_specs(c).items():
        if name not in masters:
            raise KeyError(f"weights lack {name}")
        out[name] = masters[name].detach() if is_quantized(c, name) else masters[name].detach().to(serving_dtype(c, spec))
    return pack_quantized(c, out)


def pack_quantized(c: TextConfig, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` with every quantised weight held unpacked (a `text_specs` name) replaced by its packed halves
    (`parity.quant.mxfp4.quantize_many`: the bytes of `quantize`, batched, one host read for the value checks), in
    place in the order; everything else as given."""
    quantized = mxfp4.quantize_many({n: t for n, t in weights.items() if is_quantized(c, n)})
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name in quantized:
            packed, scale = packed_names(name)
            out[packed], out[scale] = quantized[name].packed, quantized[name].scale
        else:
            out[name] = t
    return out


def master_weights(c: TextConfig, stored: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse view: one tensor per `text_specs` name, quantised weights dequantised to fp32 (exact; quantising
    them again gives the stored bytes back), every other tensor of `stored` (text or not) passed through."""
    if c.expert_format is None:
        return dict(stored)
    out = dict(stored)
    for name in text_specs(c):
        if is_quantized(c, name):
            packed, scale = packed_names(name)
            out[name] = mxfp4.dequantize(out.pop(packed), out.pop(scale), torch.float32)
    return out


def bf16_bytes(c: TextConfig) -> int:
    """What the text weights would take with every model-dtype tensor in bf16 (fp32-stored ones in fp32): the
    baseline a quantised sync is compared with."""
    return sum(math.prod(s.shape) * (4 if s.fp32 else 2) for s in text_specs(c).values())


def parameter_tree(specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], requires_grad: bool = False) -> nn.Module:
    """Modules nested along the dotted official names, each leaf an (uninitialised) parameter of the given shape and
    dtype, so that `named_parameters()` yields exactly the official names."""
    root = nn.Module()
    for name, (shape, dtype) in specs.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, nn.Module())
            mod = mod._modules[part]
        mod.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=requires_grad))
    return root
