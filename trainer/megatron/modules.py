"""The K3 text model as Megatron-core modules: they own the parameters and their TP/EP sharding, nothing else.

Module paths mirror the official checkpoint names (official name = the family's `parity.weights.TextNames.root` +
parameter name: `language_model.` for Kimi K3, nothing for Kimi Linear, whose decoder layers sit under `model.`),
so the sharding table, the loader and the exporter share one naming. Head- and column-indexed projections are
`ColumnParallelLinear`, output projections `RowParallelLinear`, the embedding `VocabParallelEmbedding`, routed
experts expert-parallel linears in a ModuleDict keyed by the *global* expert index (an EP rank names its experts
as the checkpoint does); norms, KDA gate parameters, conv kernels and the router are plain parameters.

No block has numerics of its own: `MegatronK3Model.forward` gives the live parameters to the shared forward in
`parity.model` through `trainer.megatron.forward.ParallelK3Forward`, which adds the TP/EP communication.

LoRA (`MegatronK3Model.add_lora`): a target projection gets two children named as PEFT names them, `lora_A` ([r, in])
and `lora_B` ([out, r]), each holding a `weight`; the base parameters are frozen. `lora_splits` places them.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.module import MegatronModule
from torch import nn

from lora.spec import LoraSpec
from parity.io.vision import vision_specs
from parity.kernels import get_kernels
from parity.weights import kda_specs, parameter_tree, text_names, text_specs
from trainer.megatron.config import K3TransformerConfig
from trainer.megatron.forward import ParallelK3Forward
from parity.kernels.logprobs import Sampling
from parity.vision import ImageInputs, ImageRows, TowerShape, VisionTower
from trainer.logprobs import padded_logprobs
from trainer.megatron.sharding import lora_splits, split_of

LORA_PARTS = ("lora_A", "lora_B")


def _unused_init(weight: torch.Tensor) -> None:
    """Megatron's init hook; never called (`perform_initialization=False`): weights come from a checkpoint."""
    raise RuntimeError("K3 parameters are loaded from an official checkpoint, not initialised by Megatron")


_M = TypeVar("_M", bound=nn.Module)


def _mark_split(module: _M, dim: int) -> _M:
    """Set the TP-split attributes of `module.weight`. Megatron sets them only inside its weight initialisation,
    which is off here; without them its grad norm would count a TP-split weight on TP rank 0 only."""
    set_tensor_model_parallel_attributes(module.weight, is_parallel=True, dim=dim, stride=1)
    return module


def _column(config: K3TransformerConfig, in_f: int, out_f: int) -> ColumnParallelLinear:
    return _mark_split(ColumnParallelLinear(in_f, out_f, config=config, init_method=_unused_init, bias=False,
                                            gather_output=False,
                                            tp_group=parallel_state.get_tensor_model_parallel_group()), 0)


def _row(config: K3TransformerConfig, in_f: int, out_f: int) -> RowParallelLinear:
    return _mark_split(RowParallelLinear(in_f, out_f, config=config, init_method=_unused_init, bias=False,
                                         input_is_parallel=True, skip_bias_add=True,
                                         tp_group=parallel_state.get_tensor_model_parallel_group()), 1)


def _expert(config: K3TransformerConfig, layer: _M, dim: int) -> _M:
    """An expert projection is whole (expert TP is 1). With EP > 1 it sits in Megatron's expert optimizer, whose
    grad norm sums over the expert (TP x EP) group but keeps only weights marked TP-split or on dense-TP rank 0,
    so it is marked split to count on every rank; with EP = 1 it is a replicated dense weight and counts once."""
    return _mark_split(layer, dim) if config.expert_model_parallel_size > 1 else layer


def _expert_column(config: K3TransformerConfig, in_f: int, out_f: int) -> ColumnParallelLinear:
    return _expert(config, ColumnParallelLinear(in_f, out_f, config=config, init_method=_unused_init, bias=False,
                                                gather_output=False, is_expert=True,
                                                tp_group=parallel_state.get_expert_tensor_parallel_group()), 0)


def _expert_row(config: K3TransformerConfig, in_f: int, out_f: int) -> RowParallelLinear:
    return _expert(config, RowParallelLinear(in_f, out_f, config=config, init_method=_unused_init, bias=False,
                                             input_is_parallel=True, skip_bias_add=True, is_expert=True,
                                             tp_group=parallel_state.get_expert_tensor_parallel_group()), 1)


def _param(config: K3TransformerConfig, *shape: int, tp_dim: int | None = None) -> nn.Parameter:
    """A plain parameter; with `tp_dim` its local shape divides that dim by TP and Megatron marks it TP-split."""
    tp = config.tensor_model_parallel_size
    local = [n // tp if d == tp_dim else n for d, n in enumerate(shape)]
    p = nn.Parameter(torch.empty(local, dtype=config.params_dtype))
    if tp_dim is not None:
        set_tensor_model_parallel_attributes(p, is_parallel=True, dim=tp_dim, stride=1)
    return p


class Weight(nn.Module):
    """Holds one parameter called `weight` (norms, small replicated projections, conv kernels)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


class KDA(MegatronModule):
    """Kimi Delta Attention: q/k/v, the output gate (full-rank g, or Kimi Linear's low-rank g_a -> g_b), f_b, b and
    the gate parameters split by head; f_a, g_a and o_norm replicated."""

    def __init__(self, config: K3TransformerConfig):
        super().__init__(config)
        c = config.k3.text
        h, p, d, nh, w = c.hidden_size, c.kda_proj_size, c.kda_head_dim, c.kda_num_heads, c.conv_kernel
        self.q_proj, self.k_proj, self.v_proj = (_column(config, h, p) for _ in range(3))
        if c.use_full_rank_gate:
            self.g_proj = _column(config, h, p)
        else:
            self.g_a_proj = Weight(_param(config, d, h))
            self.g_b_proj = _column(config, d, p)
        self.f_a_proj = Weight(_param(config, d, h))
        self.f_b_proj = _column(config, d, p)
        self.b_proj = _column(config, h, nh)
        self.dt_bias = _param(config, p, tp_dim=0)
        a_log = kda_specs(c)["A_log"].shape  # [H] (K3) or [1, 1, H, 1] (Kimi Linear): split over the heads
        self.A_log = _param(config, *a_log, tp_dim=0 if len(a_log) == 1 else 2)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (Weight(_param(config, p, 1, w, tp_dim=0)) for _ in range(3))
        self.o_norm = Weight(_param(config, d))
        self.o_proj = _row(config, p, h)


class MLA(MegatronModule):
    """NoPE MLA: q and kv up-projections and the output gate split by head; the low-rank down-projections replicated."""

    def __init__(self, config: K3TransformerConfig):
        super().__init__(config)
        c = config.k3.text
        h, nh = c.hidden_size, c.num_attention_heads
        if c.q_lora_rank is not None:
            self.q_a_proj = Weight(_param(config, c.q_lora_rank, h))
            self.q_a_layernorm = Weight(_param(config, c.q_lora_rank))
            self.q_b_proj = _column(config, c.q_lora_rank, nh * c.qk_head_dim)
        else:
            self.q_proj = _column(config, h, nh * c.qk_head_dim)
        self.kv_a_proj_with_mqa = Weight(_param(config, c.mla_latent_size, h))
        self.kv_a_layernorm = Weight(_param(config, c.kv_lora_rank))
        self.kv_b_proj = _column(config, c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim))
        if c.mla_use_output_gate:
            self.g_proj = _column(config, h, nh * c.v_head_dim)
        self.o_proj = _row(config, nh * c.v_head_dim, h)
        if c.index_topk is not None:
            self.indexer = Indexer(config)


class Indexer(MegatronModule):
    """The DSA lightning indexer (K3.1), replicated and frozen (`parity.weights.is_indexer`)."""

    def __init__(self, config: K3TransformerConfig):
        super().__init__(config)
        c = config.k3.text
        assert c.index_n_heads is not None and c.index_head_dim is not None and c.q_lora_rank is not None
        h, nh, d = c.hidden_size, c.index_n_heads, c.index_head_dim
        self.wq_b = Weight(_param(config, nh * d, c.q_lora_rank))
        self.wk = Weight(_param(config, d, h))
        self.k_norm = Weight(_param(config, d))
        self.k_norm.bias = _param(config, d)
        self.weights_proj = Weight(_param(config, nh, h))
        for p in self.parameters():
            p.requires_grad_(False)


class MLP(MegatronModule):
    """Gated MLP (dense layer or shared experts): gate/up column-parallel, down row-parallel."""

    def __init__(self, config: K3TransformerConfig, hidden: int, inter: int):
        super().__init__(config)
        self.gate_proj = _column(config, hidden, inter)
        self.up_proj = _column(config, hidden, inter)
        self.down_proj = _row(config, inter, hidden)


class Router(nn.Module):
    """noaux_tc router: scoring weight and selection-only correction bias (replicated)."""

    def __init__(self, config: K3TransformerConfig, experts: int, hidden: int):
        super().__init__()
        self.weight = _param(config, experts, hidden)
        self.e_score_correction_bias = _param(config, experts)


class Expert(MegatronModule):
    """One routed expert in the latent width, whole on its EP rank (expert TP is 1)."""

    def __init__(self, config: K3TransformerConfig, latent: int, inter: int):
        super().__init__(config)
        self.w1 = _expert_column(config, latent, inter)
        self.w3 = _expert_column(config, latent, inter)
        self.w2 = _expert_row(config, inter, latent)


def local_experts(config: K3TransformerConfig) -> range:
    """Global indices of the experts this EP rank owns (a contiguous range)."""
    n = config.k3.text.num_experts or 0
    per_rank = n // config.expert_model_parallel_size
    start = parallel_state.get_expert_model_parallel_rank() * per_rank
    return range(start, start + per_rank)


class LatentMoE(MegatronModule):
    """Router, latent down/norm/up (replicated), this rank's routed experts, shared experts (TP-split MLP)."""

    def __init__(self, config: K3TransformerConfig):
        super().__init__(config)
        c = config.k3.text
        assert c.num_experts is not None
        h, lat, inter = c.hidden_size, c.moe_hidden_size, c.moe_intermediate_size
        self.gate = Router(config, c.num_experts, h)
        if c.routed_expert_hidden_size is not None:
            self.routed_expert_down_proj = Weight(_param(config, lat, h))
            if c.latent_moe_use_norm:
                self.routed_expert_norm = Weight(_param(config, lat))
            self.routed_expert_up_proj = Weight(_param(config, h, lat))
        self.experts = nn.ModuleDict({str(e): Expert(config, lat, inter) for e in local_experts(config)})
        if c.num_shared_experts:
            self.shared_experts = MLP(config, h, inter * c.num_shared_experts)


class DecoderLayer(MegatronModule):
    """One K3 layer: norms, AttnRes scorers, KDA or MLA, dense MLP or LatentMoE (attribute names as official)."""

    def __init__(self, config: K3TransformerConfig, layer: int):
        super().__init__(config)
        c = config.k3.text
        h = c.hidden_size
        self.input_layernorm = Weight(_param(config, h))
        self.post_attention_layernorm = Weight(_param(config, h))
        self.self_attn = KDA(config) if c.is_kda(layer) else MLA(config)
        if c.is_moe(layer):
            self.block_sparse_moe = LatentMoE(config)
        else:
            self.mlp = MLP(config, h, c.intermediate_size)
        if c.attn_res_block_size is not None:
            self.self_attention_res_norm = Weight(_param(config, h))
            self.self_attention_res_proj = Weight(_param(config, 1, h))
            self.mlp_res_norm = Weight(_param(config, h))
            self.mlp_res_proj = Weight(_param(config, 1, h))


class ModelGroup(nn.Module):
    """The official `model.` group: vocab-parallel embedding, [the decoder layers,] final norm, output AttnRes
    scorer. `layers` is given where the family keeps them in this group (Kimi Linear: `model.layers`)."""

    def __init__(self, config: K3TransformerConfig, layers: nn.ModuleList | None = None):
        super().__init__()
        c = config.k3.text
        h = c.hidden_size
        self.embed_tokens = _mark_split(VocabParallelEmbedding(
            c.vocab_size, h, init_method=_unused_init, config=config,
            tp_group=parallel_state.get_tensor_model_parallel_group()), 0)
        if layers is not None:
            self.layers = layers
        self.norm = Weight(_param(config, h))
        if c.attn_res_block_size is not None:
            self.output_attn_res_norm = Weight(_param(config, h))
            self.output_attn_res_proj = Weight(_param(config, 1, h))


class MegatronK3Model(MegatronModule):
    """The K3 text model on Megatron. `forward(input_ids, lens, temperature)` -> per-token log-probs [B, T].

    Parameters are fp32 masters (`config.params_dtype`) filled by `trainer.megatron.io.load_official`;
    `passthrough` keeps the checkpoint's non-text tensors (vision tower) and `storage_dtypes` each text
    tensor's checkpoint dtype, so an export writes back exactly what was loaded. `lora_scales` maps each
    official base weight name that carries a LoRA (`add_lora`) to its scale; `lora_spec` is the adapter's
    config (set by `trainer.megatron.io.load_adapter`, kept for export).
    """

    def __init__(self, config: K3TransformerConfig):
        super().__init__(config)
        c = config.k3.text
        names = text_names(c)
        self.root = names.root  # official name = root + parameter name
        layers = nn.ModuleList(DecoderLayer(config, i) for i in range(c.num_hidden_layers))
        in_model = names.layers == f"{names.model}.layers"
        self.model = ModelGroup(config, layers if in_model else None)
        if not in_model:
            self.layers = layers
        self.lm_head = _column(config, c.hidden_size, c.vocab_size)
        self.passthrough: dict[str, torch.Tensor] = {}
        self.storage_dtypes: dict[str, torch.dtype] = {}
        self.lora_scales: dict[str, float] = {}
        self.lora_spec: LoraSpec | None = None
        self.value_head: Weight | None = None
        self.vision: nn.Module | None = None
        self.vision_shape: TowerShape | None = None
        self._named: tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]] | None = None

    def official_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters under their official text tensor names (local shards, local experts); no LoRA, no
        value head, no vision tower."""
        return dict(self._by_name()[0])

    def vision_parameters(self) -> dict[str, nn.Parameter]:
        """The trained vision tower's parameters under their official names (whole on every rank); {} when it is
        frozen (`add_vision_tower` not called)."""
        return dict(self._by_name()[1])

    def _by_name(self) -> tuple[dict[str, nn.Parameter], dict[str, nn.Parameter]]:
        """(official text, vision) parameters by name, found by one walk of the module tree and kept: the tree is fixed
        once built (`add_vision_tower` and `add_value_head` walk it again) and parameters are updated in place, never
        replaced (a weight sync exports thousands of them each step)."""
        if self._named is None:
            named = list(self.named_parameters())
            self._named = ({f"{self.root}{name}": p for name, p in named
                            if not _is_lora(name) and not name.startswith((VALUE_HEAD_PREFIX, VISION_PREFIX))},
                           {name.removeprefix(VISION_PREFIX): p for name, p in named if name.startswith(VISION_PREFIX)})
        return self._named

    def add_vision_tower(self, max_grid_side: int) -> None:
        """Train the checkpoint's vision tower: its tensors become fp32 master parameters (uninitialised: fill them
        with `trainer.megatron.io.load_official`), replicated on every rank, and the forward runs the tower on its
        live weights for `ImageInputs` (`max_grid_side`: the preprocessor's side limit, which fixes the RoPE table as
        the engine's). Call before wrapping in DDP (which registers trainable parameters)."""
        k3 = self.config.k3
        if k3.vision is None:
            raise ValueError("this checkpoint has no vision tower (no vision_config)")
        if self.vision is not None:
            raise ValueError("the model already trains its vision tower")
        device = self.model.embed_tokens.weight.device
        specs = vision_specs(k3.vision, k3.text.hidden_size)
        with torch.device(device):
            self.vision = parameter_tree({n: (spec.shape, self.config.params_dtype) for n, spec in specs.items()},
                                         requires_grad=True)
        self.vision_shape = TowerShape.from_config(k3.vision, max_grid_side)
        self._named = None

    def vision_tower(self) -> VisionTower:
        """The tower over the live vision parameters, cast to the compute dtype (as the engine holds them)."""
        if self.vision_shape is None:
            raise ValueError("image patches given to a model whose vision tower is frozen: give it ImageRows")
        dtype = self.config.k3.text.compute_dtype
        weights = {n: p.to(dtype) for n, p in self.vision_parameters().items()}
        return VisionTower(self.vision_shape, weights, get_kernels(self.config.kernels), dtype)

    def add_value_head(self) -> None:
        """A critic for GAE: a [1, hidden + 1] fp32 affine map (weights, then a bias: the mean return needs no
        direction in the hidden state) of the final-normed hidden state, its weight term divided by the hidden size
        (`trainer.logprobs.padded_logprobs`), zero-initialised (every value 0 at the
        start), trained with the trunk. Not an official tensor: exports and syncs never see it. Call before wrapping in
        DDP (which registers trainable parameters)."""
        if self.value_head is not None:
            raise ValueError("the model already carries a value head")
        h = self.config.k3.text.hidden_size
        self.value_head = Weight(nn.Parameter(torch.zeros(1, h + 1, dtype=torch.float32,
                                                          device=self.model.embed_tokens.weight.device)))
        self._named = None

    def lora_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's LoRA parameters under their official-style names
        (`language_model.layers.N.<module>.lora_A.weight`: PEFT's names without `base_model.model.`)."""
        return {f"{self.root}{name}": p for name, p in self.named_parameters() if _is_lora(name)}

    def lora_module(self, base: str) -> nn.Module:
        """The module holding the official base weight `base` (and its `lora_A` / `lora_B`)."""
        return self.get_submodule(base.removeprefix(self.root).removesuffix(".weight"))

    def add_lora(self, targets: dict[str, tuple[int, float]]) -> None:
        """Give each official base weight name in `targets` a LoRA of (rank, scale) and freeze every base parameter.

        A and B are uninitialised parameters in `config.params_dtype` (placed by `lora_splits`); fill them with
        `trainer.megatron.io.load_adapter`. Call before wrapping in DDP (which registers trainable parameters)."""
        if self.lora_scales:
            raise ValueError("the model already carries LoRA adapters")
        config: K3TransformerConfig = self.config
        specs = text_specs(config.k3.text)
        for p in self.parameters():
            p.requires_grad_(False)
        for base, (rank, scale) in targets.items():
            module = self.lora_module(base)
            out_f, in_f = specs[base].shape
            _, b_split = lora_splits(split_of(base))
            module.lora_A = Weight(_param(config, rank, in_f))
            module.lora_B = Weight(_param(config, out_f, rank, tp_dim=b_split.tp_dim))
            self.lora_scales[base] = scale

    def forward(self, input_ids: torch.Tensor, lens: torch.Tensor, temperature: float | Sampling,
                entropy: bool = False, values: bool = False, raw: bool = False,
                images: ImageRows | ImageInputs | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """input_ids: [B, T] right-padded int64, lens: [B] -> lp: [B, T] (`trainer.logprobs.padded_logprobs`; with
        `raw`, `entropy` and / or `values` (the value head's), a tuple (lp, [raw,] [entropy,] [values])), on the
        parameters' device (the forward's own tensors are made there too). `images`: the frozen tower's rows, or,
        when the model trains its tower, the patches it runs through it."""
        if values and self.value_head is None:
            raise ValueError("values asked of a model without a value head (add_value_head)")
        device = self.model.embed_tokens.weight.device
        with torch.device(device):
            if isinstance(images, ImageInputs):
                images = images.embed(self.vision_tower())
            return padded_logprobs(ParallelK3Forward.for_model(self), input_ids.to(device), lens.to(device), temperature,
                                   entropy, self.value_head.weight if values else None, raw, images)


VALUE_HEAD_PREFIX = "value_head."  # the value head's parameter name in the module (`add_value_head`)
VISION_PREFIX = "vision."  # the trained vision tower's parameters in the module (`add_vision_tower`)


def _is_lora(name: str) -> bool:
    return any(f".{part}." in name for part in LORA_PARTS)
