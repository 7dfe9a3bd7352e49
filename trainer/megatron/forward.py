"""The shared K3 forward (`parity.model.K3Forward`) on one rank's shards, with Megatron's TP/EP communication.

Every arithmetic op is the parity forward's; this file only moves tensors, with Megatron's autograd-aware
mappings, so that each token's log-prob keeps the bits of the one-process forward (`trainer/megatron/README.md`):

- column-parallel projections run this rank's heads or columns (`K3Forward` sees a config with heads / TP); a
  GEMM's column has the same bits whatever the matrix width (the invariant GEMM pads narrow outputs to
  `parity.kernels.linear.MIN_COLUMNS`);
- row-parallel projections compute only this rank's share of the reduction: its K / TP input features are whole
  segments of the invariant GEMM (`parity.kernels.linear`), so the rank's fp32 partial is one subtree of the
  GEMM's pairwise segment sum; the TP partials are all-gathered and added by the same pairwise sum in rank order,
  then rounded once: the one-process bits at 1 / TP of the FLOPs. A LoRA on a row-parallel weight splits A the
  same way (its x A^T is a reduction over the same K) and applies B on every rank. On the Triton kernels (CUDA, or
  the triton set) the GEMM adds the same S segments in order rather than pairwise: each rank forms its segments'
  sums and every rank adds all S in order (`trainer.megatron.row_segments`), also at 1 / TP of the FLOPs;
- the vocab-parallel embedding adds exact zeros; lm_head logits are all-gathered before the log-softmax;
- routed experts (EP > 1): each (token, slot) row goes to the EP rank owning its expert (all-to-all), which
  forms weight * expert(row) with `experts_combine` (one slot per row, so each product is the one the
  one-process combine forms); the products come back and are added in slot order j = 0..k-1, the order of
  `experts_combine`. With TP > 1 too, each TP rank dispatches a contiguous share of the tokens. On the Triton
  kernels the owner forms each row's unweighted fp32 expert output (`expert_outputs`: the grouped op's GEMMs, whose
  rows are independent), and the token's rank weights and adds its slots with the grouped op's own combine kernel
  (`combine_slots`): the bits of the one-process grouped `experts` call.

Gradients: inside a TP region (a KDA/MLA block or a gated MLP) each rank back-propagates its heads only, so
the region input and the region's replicated parameters are entered through `copy_to` (gradient summed over
TP); gathers split the gradient back to the shard (a row-parallel output is used whole on every rank, so each
partial's gradient is the output's). With TP = EP = 1 every mapping is the identity.

Communication of a row-parallel layer with M tokens and N outputs: each rank all-gathers the TP fp32 partials,
(TP - 1) * M * N * 4 bytes received per rank, where Megatron's all-reduce of the bf16 output moves
2 (TP - 1) / TP * M * N * 2 bytes and its sequence-parallel reduce-scatter (TP - 1) / TP * M * N * 2: TP and 2 TP
times as much. A fixed-order reduce-scatter of the partials followed by an all-gather of the rounded output would
move (TP - 1) / TP * M * N * (4 + 2) bytes; not built yet.

LoRA: `K3Weights.lora` holds each adapted weight's (A, B, scale) as `lora_view` places them
(`trainer.megatron.sharding.lora_splits`); the parity linear adds scale * ((x A^T) B^T) inside the same `_lin` call
as the base GEMM.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)

from parity.kernels import get_kernels, runs_triton
from parity.kernels.linear import LoRA, gemm, k_segments, pairwise_sum
from parity.kernels.primitives import wide
from parity.kernels.moe import experts_combine
from parity.caches import KDACache, MLACache
from parity.model import K3Forward, K3Weights
from trainer.megatron.sharding import Split, lora_splits, split_of, split_roles

if TYPE_CHECKING:
    from megatron.core.tensor_parallel import VocabParallelEmbedding


class ShardedModel(Protocol):
    """What the parallel forward reads of the Megatron model (`trainer.megatron.modules.MegatronK3Model`): its config,
    its official-named parameter shards, its LoRA modules and scales, and `model.embed_tokens`."""

    config: Any
    model: Any
    lora_scales: dict[str, float]

    def official_parameters(self) -> dict[str, torch.nn.Parameter]: ...

    def lora_module(self, base: str) -> Any: ...


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward passes on a contiguous gradient. Megatron's `_reduce`
    (megatron/core/tensor_parallel/mappings.py:31) all-reduces `grad.contiguous()` but returns `grad`, so a
    non-contiguous gradient (a GEMM weight's, which arrives transposed) would leave `copy_to` unreduced."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Megatron's `copy_to_tensor_model_parallel_region` (identity forward, gradient summed over TP), fed a
    contiguous gradient."""
    return _ContiguousGrad.apply(copy_to_tensor_model_parallel_region(x, group=group))


def parameter_view(model: ShardedModel, roles: dict[str, Split], tp_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Official name -> the tensor the parity forward reads: the live parameter (this rank's shard), entered through
    `copy_to` for REGION_REPLICATED ones (autograd reaches every parameter)."""
    view: dict[str, torch.Tensor] = {}
    for name, p in model.official_parameters().items():
        split = roles[name]
        if split is Split.REGION_REPLICATED:
            view[name] = copy_to_tp(p, tp_group)
        else:
            view[name] = p
    return view


def lora_view(model: ShardedModel, tp_group: dist.ProcessGroup) -> dict[str, LoRA]:
    """Official base weight name -> the LoRA the parity forward adds to it: this rank's A and B, the
    REGION_REPLICATED ones entered through `copy_to` (gradient summed over TP), with the model's scale."""
    view: dict[str, LoRA] = {}
    for base, scale in model.lora_scales.items():
        module = model.lora_module(base)
        a, b = module.lora_A.weight, module.lora_B.weight
        a_split, b_split = lora_splits(split_of(base))
        view[base] = LoRA(copy_to_tp(a, tp_group) if a_split is Split.REGION_REPLICATED else a,
                          copy_to_tp(b, tp_group) if b_split is Split.REGION_REPLICATED else b, scale)
    return view


def fold_slots(products: torch.Tensor) -> torch.Tensor:
    """products: [N, k, L], products[:, j] = weight_j * expert_j(x) -> [N, L], added in slot order j = 0..k-1,
    the order and operands of `parity.kernels.moe.experts_combine` (so the same bits)."""
    out = products[:, 0]
    for j in range(1, products.shape[1]):
        out = out + products[:, j]
    return out


class ParallelK3Forward(K3Forward):
    """`K3Forward` over this rank's shards: overrides only the hooks where tensors cross ranks."""

    def __init__(self, weights: K3Weights, kernels_name: str, roles: dict[str, Split],
                 embedding: VocabParallelEmbedding, num_experts: int):
        """`weights.cfg` is the rank-local config (heads / TP); `weights.tensors` the `parameter_view`."""
        super().__init__(weights, get_kernels(kernels_name))
        self.roles = roles
        self.embedding = embedding
        self.num_experts = num_experts
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp = self.tp_group.size()
        self.tp_rank = self.tp_group.rank()
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.ep = self.ep_group.size()
        self.ep_rank = self.ep_group.rank()

    @classmethod
    def for_model(cls, model: ShardedModel) -> ParallelK3Forward:
        """Bind `model`'s live parameters (call once per forward: the view follows the current weights)."""
        config = model.config
        text = config.k3.text
        tp = config.tensor_model_parallel_size
        local = dataclasses.replace(text, kda_num_heads=text.kda_num_heads // tp,
                                    num_attention_heads=text.num_attention_heads // tp)
        roles = split_roles(text)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        weights = K3Weights(local, parameter_view(model, roles, tp_group), lora_view(model, tp_group))
        return cls(weights, config.kernels, roles, model.model.embed_tokens, text.num_experts or 0)

    # --- tensor parallel ------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Megatron's vocab-parallel lookup: own rows, exact zeros elsewhere, all-reduced."""
        return self.embedding(ids)

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W^T for the tensor `name`, by its split: ROW reduces over this rank's share of K (`_row`), VOCAB gathers
        the logits; others run locally."""
        split = self.roles[name]
        if split is Split.ROW and self.tp > 1:
            return self._row(x, name)
        if split is Split.VOCAB:
            y = super()._lin(copy_to_tp(x, self.tp_group), name)
            return gather_from_tensor_model_parallel_region(y, group=self.tp_group)
        return super()._lin(x, name)

    def _combine(self, partial: torch.Tensor) -> torch.Tensor:
        """The TP ranks' fp32 partials [M, N] added by `pairwise_sum` in rank order (all-gathered; the gradient of
        each partial is the sum's)."""
        parts = gather_from_tensor_model_parallel_region(partial, group=self.tp_group)  # [M, TP * N]
        return pairwise_sum(list(parts.view(partial.shape[0], self.tp, -1).unbind(1)))

    def _row(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """A row-parallel projection on this rank's K / TP input features x: [..., K / TP] -> [..., N], whole on every
        rank. Invariant kernels: this rank's segments of the invariant GEMM (one subtree of its pairwise sum), the
        partials combined in rank order, the LoRA term likewise, one rounding: the one-process bits. Triton kernels:
        this rank's segment sums, all of them added in order (`row_segments`). Fast kernels: the local `F.linear`
        all-reduced (Megatron's row-parallel layer)."""
        w = self.weight(name)
        lora = self._lora(name)
        lead, k_local = x.shape[:-1], x.shape[-1]
        if lora is not None:  # A is whole (gradient summed over TP): this rank's columns
            lora = LoRA(lora.a.narrow(1, self.tp_rank * k_local, k_local), lora.b, lora.scale)
        if self.k.name == "fast":  # (x_r A_r^T) B^T summed over r is the whole LoRA term
            return reduce_from_tensor_model_parallel_region(self.k.linear(x, w, lora), group=self.tp_group)
        if runs_triton(self.k.name, x.device):
            from trainer.megatron.row_segments import row_segments  # imports Triton: only where it runs

            return row_segments(x, w, lora, k_segments(k_local * self.tp), self.tp, self.tp_group)
        segments = k_segments(k_local * self.tp) // self.tp
        x2 = wide(x.reshape(-1, k_local))
        y = self._combine(gemm(x2, w, segments))
        if lora is not None:
            y = y + gemm(self._combine(gemm(x2, lora.a, segments)), lora.b) * lora.scale
        return y.reshape(*lead, w.shape[0]).to(x.dtype)

    def _region(self, x: torch.Tensor) -> torch.Tensor:
        """Enter a TP region: identity forward, gradient summed over TP."""
        return copy_to_tp(x, self.tp_group)

    def _kda(self, x: torch.Tensor, p: str, cache: KDACache, lens: torch.Tensor) -> torch.Tensor:
        return super()._kda(self._region(x), p, cache, lens)

    def _mla(self, x: torch.Tensor, p: str, cache: MLACache, pos: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return super()._mla(self._region(x), p, cache, pos, lens)

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        return super()._mlp(self._region(x), p)

    # --- routed experts -------------------------------------------------------------------------
    def _routed_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, p: str) -> torch.Tensor:
        """x: [N, L], ids/weights: [N, k] (same on every TP rank) -> [N, L].

        EP = 1: every rank runs all rows through all experts (experts are replicated like any non-TP-split
        parameter, so their gradients are whole on each rank). EP > 1: experts are dispatched over the EP group;
        with TP > 1 each TP rank first takes a contiguous 1/TP share of the rows (zero rows with weight 0 pad N to
        a multiple of TP), so no token is dispatched twice, and the shares are all-gathered after."""
        if self.ep == 1:
            return super()._routed_experts(x, ids, weights, p)
        n = x.shape[0]
        if self.tp > 1:
            pad = (-n) % self.tp
            x = scatter_to_sequence_parallel_region(F.pad(x, (0, 0, 0, pad)), group=self.tp_group)
            weights = scatter_to_sequence_parallel_region(F.pad(weights, (0, 0, 0, pad)), group=self.tp_group)
            share = (n + pad) // self.tp
            ids = F.pad(ids, (0, 0, 0, pad)).narrow(0, self.tp_rank * share, share)
        y = self._dispatch(x, ids, weights, p)
        if self.tp > 1:
            y = gather_from_sequence_parallel_region(y, tensor_parallel_output_grad=False, group=self.tp_group)[:n]
        return y

    def _dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, p: str) -> torch.Tensor:
        """Expert parallel: send each (token, slot) row to the EP rank owning its expert, get back
        weight * expert(row), add a token's k products in slot order (as `experts_combine` does); on the Triton
        kernels get back expert(row) and combine as the grouped op does."""
        n, k = ids.shape
        per_rank = self.num_experts // self.ep
        slot_ids = ids.reshape(-1)  # slot s = token * k + j
        owner = slot_ids // per_rank
        order = torch.argsort(owner, stable=True)  # slots grouped by owning rank
        send = torch.bincount(owner, minlength=self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()

        def exchange(t: torch.Tensor, out_sizes: list[int], in_sizes: list[int]) -> torch.Tensor:
            return all_to_all(self.ep_group, t, out_sizes, in_sizes)

        rows = exchange(x[order // k], recv_sizes, send_sizes)  # [M, L] rows for the experts owned here
        row_w = exchange(weights.reshape(-1)[order].unsqueeze(1), recv_sizes, send_sizes)  # [M, 1]
        row_ids = exchange(slot_ids[order].unsqueeze(1), recv_sizes, send_sizes) - self.ep_rank * per_rank
        owned = range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)
        if runs_triton(self.k.name, x.device):  # each row's unweighted fp32 output; the grouped op's combine at home
            from parity.kernels.triton.moe_grad import combine_slots, expert_outputs  # imports Triton

            stacked = (self._expert_stack(p, w, owned) for w in ("w1", "w3", "w2"))
            y = expert_outputs(rows, row_ids, *stacked, *self._experts_activation())
            back = exchange(y, send_sizes, recv_sizes)  # [N * k, L] in `order`
            return combine_slots(back[torch.argsort(order)], weights, x.dtype)
        experts = (self.expert_weights(p, w, owned) for w in ("w1", "w3", "w2"))
        products = experts_combine(rows, row_ids, row_w, *experts, self.k.linear,
                                   self._act)  # [M, L]: row_w * expert(row), the product experts_combine forms
        back = exchange(products, send_sizes, recv_sizes)  # [N * k, L] in `order`
        return fold_slots(back[torch.argsort(order)].view(n, k, -1))
