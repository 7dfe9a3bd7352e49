"""How each official K3 / Kimi Linear text tensor is laid out over tensor- and expert-parallel ranks: the one
sharding table.

Every name of `parity.weights.text_specs` (either checkpoint family's names, `parity.weights.NAMES`) gets a
`Split`; `split_roles` fails on a name it cannot place, so a new weight cannot silently be replicated. TP
splits are contiguous along the split dim, rank 0 first; along a head-indexed dim that gives each rank whole,
consecutive heads. Experts are split by EP into contiguous ranges.

A *TP region* is a block whose inside runs per head or per MLP column: the KDA and MLA blocks and every gated
MLP (dense, or shared experts). Its input's gradient is summed over TP at the region boundary.
"""

from __future__ import annotations

import functools
import re
from enum import Enum

import torch

from parity.config import TextConfig
from parity.kernels.linear import k_segments
from parity.weights import NAMES, ROW_PARALLEL, text_specs


class Split(Enum):
    """Placement of one tensor (TP unless stated) and how the forward uses it."""

    REPLICATED = "replicated"  # whole on every rank, used on replicated activations
    REGION_REPLICATED = "region_replicated"  # whole on every rank, used inside a TP region: grad summed over TP
    COLUMN = "column"  # dim 0 split (heads / MLP columns), used locally
    ROW = "row"  # dim 1 split; each rank reduces over its share of K, the partials are combined in a fixed order
    VOCAB = "vocab"  # dim 0 split over the vocabulary (embedding, lm_head)
    EXPERT = "expert"  # whole, on the EP rank that owns the expert
    HEADS_DIM2 = "heads_dim2"  # like COLUMN, split along dim 2: Kimi Linear's A_log, stored [1, 1, heads, 1]

    @property
    def tp_dim(self) -> int | None:
        """The dim split over TP ranks, or None when every TP rank holds the whole tensor."""
        dims = {Split.COLUMN: 0, Split.VOCAB: 0, Split.ROW: 1, Split.HEADS_DIM2: 2}
        return dims.get(self)


# Names relative to a decoder layer (`parity.weights.TextNames.layer`).
_LAYER: dict[str, Split] = {
    "input_layernorm.weight": Split.REPLICATED,
    "post_attention_layernorm.weight": Split.REPLICATED,
    "self_attention_res_norm.weight": Split.REPLICATED,
    "self_attention_res_proj.weight": Split.REPLICATED,
    "mlp_res_norm.weight": Split.REPLICATED,
    "mlp_res_proj.weight": Split.REPLICATED,
    # KDA
    "self_attn.q_proj.weight": Split.COLUMN,
    "self_attn.k_proj.weight": Split.COLUMN,
    "self_attn.v_proj.weight": Split.COLUMN,
    "self_attn.g_proj.weight": Split.COLUMN,
    "self_attn.g_a_proj.weight": Split.REGION_REPLICATED,  # Kimi Linear's low-rank output gate
    "self_attn.g_b_proj.weight": Split.COLUMN,
    "self_attn.f_a_proj.weight": Split.REGION_REPLICATED,
    "self_attn.f_b_proj.weight": Split.COLUMN,
    "self_attn.b_proj.weight": Split.COLUMN,
    "self_attn.dt_bias": Split.COLUMN,
    "self_attn.A_log": Split.COLUMN,
    "self_attn.q_conv1d.weight": Split.COLUMN,
    "self_attn.k_conv1d.weight": Split.COLUMN,
    "self_attn.v_conv1d.weight": Split.COLUMN,
    "self_attn.o_norm.weight": Split.REGION_REPLICATED,
    # MLA (q_proj and g_proj as above; o_proj is row-parallel like KDA's)
    "self_attn.q_a_proj.weight": Split.REGION_REPLICATED,
    "self_attn.q_a_layernorm.weight": Split.REGION_REPLICATED,
    "self_attn.q_b_proj.weight": Split.COLUMN,
    "self_attn.kv_a_proj_with_mqa.weight": Split.REGION_REPLICATED,
    "self_attn.kv_a_layernorm.weight": Split.REGION_REPLICATED,
    "self_attn.kv_b_proj.weight": Split.COLUMN,
    # the DSA indexer (K3.1): whole on every rank inside the MLA region, frozen
    "self_attn.indexer.wq_b.weight": Split.REGION_REPLICATED,
    "self_attn.indexer.wk.weight": Split.REGION_REPLICATED,
    "self_attn.indexer.k_norm.weight": Split.REGION_REPLICATED,
    "self_attn.indexer.k_norm.bias": Split.REGION_REPLICATED,
    "self_attn.indexer.weights_proj.weight": Split.REGION_REPLICATED,
    # dense MLP and LatentMoE
    "mlp.gate_proj.weight": Split.COLUMN,
    "mlp.up_proj.weight": Split.COLUMN,
    "block_sparse_moe.gate.weight": Split.REPLICATED,
    "block_sparse_moe.gate.e_score_correction_bias": Split.REPLICATED,
    "block_sparse_moe.routed_expert_down_proj.weight": Split.REPLICATED,
    "block_sparse_moe.routed_expert_norm.weight": Split.REPLICATED,
    "block_sparse_moe.routed_expert_up_proj.weight": Split.REPLICATED,
    "block_sparse_moe.shared_experts.gate_proj.weight": Split.COLUMN,
    "block_sparse_moe.shared_experts.up_proj.weight": Split.COLUMN,
}
_LAYER.update({name: Split.ROW for name in ROW_PARALLEL})  # the projections whose GEMMs parity.model segments along K
# Per family: entries that differ from `_LAYER` (tensors whose stored shape differs between the families).
_FAMILY_LAYER: dict[str, dict[str, Split]] = {"kimi_linear": {"self_attn.A_log": Split.HEADS_DIM2}}
_TOP: dict[str, Split] = {
    name: split
    for names in NAMES.values()
    for name, split in ((names.embed, Split.VOCAB), (names.norm, Split.REPLICATED),
                        (names.output_res_norm, Split.REPLICATED), (names.output_res_proj, Split.REPLICATED),
                        (names.lm_head, Split.VOCAB))
}
_LAYER_NAMES = {family: re.compile(rf"^{re.escape(names.layers)}\.\d+\.(.+)$") for family, names in NAMES.items()}
_EXPERT_NAME = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.w[123]\.weight$")


def _in_layer(name: str) -> tuple[str, str] | None:
    """(checkpoint family, name relative to its decoder layer) of a decoder-layer tensor name, else None."""
    for family, pattern in _LAYER_NAMES.items():
        m = pattern.match(name)
        if m is not None:
            return family, m.group(1)
    return None


def split_of(name: str) -> Split:
    """The `Split` of one official text tensor name (either family); KeyError naming it when the table has no
    entry."""
    if name in _TOP:
        return _TOP[name]
    where = _in_layer(name)
    if where is not None:
        family, rel = where
        if _EXPERT_NAME.match(rel):
            return Split.EXPERT
        split = _FAMILY_LAYER.get(family, {}).get(rel, _LAYER.get(rel))
        if split is not None:
            return split
    raise KeyError(f"no sharding entry for {name}")


def expert_of(name: str) -> int | None:
    """The expert index of a routed-expert tensor name, else None."""
    where = _in_layer(name)
    e = _EXPERT_NAME.match(where[1]) if where else None
    return int(e.group(1)) if e else None


def split_roles(cfg: TextConfig) -> dict[str, Split]:
    """Every text tensor of `cfg` with its `Split` (fails on a name the table cannot place)."""
    return dict(_split_roles(cfg))


@functools.cache
def _split_roles(cfg: TextConfig) -> dict[str, Split]:
    return {name: split_of(name) for name in text_specs(cfg)}


def lora_splits(base: Split) -> tuple[Split, Split]:
    """Placement of (A, B) of a LoRA on a base weight placed as `base` (see trainer/megatron/README.md, LoRA):

    - COLUMN: A whole (used inside the TP region: gradient summed over TP), B split by rows like the base,
      so each rank adds the LoRA term of its own output columns;
    - REGION_REPLICATED: both whole, used inside a TP region (gradients summed over TP);
    - ROW: both whole; each rank reduces over its own columns of A (gradient summed over TP), the partial x A^T are
      combined and every rank applies the whole B (so every rank holds B's whole gradient);
    - REPLICATED: both whole; every rank computes the whole term and holds the whole gradient.
    VOCAB (embedding, lm_head) and EXPERT weights take no LoRA."""
    if base is Split.COLUMN:
        return Split.REGION_REPLICATED, Split.COLUMN
    if base is Split.REGION_REPLICATED:
        return Split.REGION_REPLICATED, Split.REGION_REPLICATED
    if base is Split.ROW:
        return Split.REGION_REPLICATED, Split.REPLICATED
    if base is Split.REPLICATED:
        return Split.REPLICATED, Split.REPLICATED
    raise ValueError(f"a {base.value} weight takes no LoRA")


def check_divisible(cfg: TextConfig, tp: int, ep: int) -> None:
    """Raise ValueError naming the config field that `tp` or `ep` does not divide; the row-parallel GEMMs split their
    fixed K segments over TP (the invariant and the Triton kernels alike), so TP must divide those too."""
    need = {
        "linear_attn_config.num_heads": (cfg.kda_num_heads, tp),
        "num_attention_heads": (cfg.num_attention_heads, tp),
        "intermediate_size": (cfg.intermediate_size, tp),
        "moe_intermediate_size * num_shared_experts": (cfg.moe_intermediate_size * max(cfg.num_shared_experts, 1), tp),
        "vocab_size": (cfg.vocab_size, tp),
        "num_experts": (cfg.num_experts or ep, ep),
    }
    for field, (size, parts) in need.items():
        if size % parts:
            raise ValueError(f"{field} = {size} is not divisible by the parallel size {parts}")
    if tp > 1:
        for name, spec in text_specs(cfg).items():
            k = spec.shape[-1]
            if split_of(name) is Split.ROW and k_segments(k) % tp:
                raise ValueError(f"{name}: its {k} input features form {k_segments(k)} fixed reduction segment(s) "
                                 f"(parity.kernels.linear.k_segments), which TP = {tp} does not divide")


def shard(name: str, full: torch.Tensor, split: Split, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's part of `full` (a view; whole tensor when `split` is not TP-split)."""
    part = shard_range(name, tuple(full.shape), split, tp_rank, tp)
    return full if part is None else full.narrow(*part)


def shard_range(name: str, shape: tuple[int, ...], split: Split, tp_rank: int, tp: int) -> tuple[int, int, int] | None:
    """(dim, start, length) of this TP rank's part of a tensor of `shape`, or None when `split` is not TP-split;
    ValueError when TP does not divide the split dim."""
    dim = split.tp_dim
    if dim is None:
        return None
    size = shape[dim]
    if size % tp:
        raise ValueError(f"{name}: dim {dim} of size {size} is not divisible by TP = {tp}")
    return dim, tp_rank * (size // tp), size // tp
