"""The routed experts' weights as `K3Forward` computes with them, and the routed-expert product.

Held packed (the rollout engine: `MXFP4Weight`, dequantised inside the kernel), as bf16 copies, or as fp32 masters
(the trainer: fake-quantised with the sync's quantiser, straight-through), the experts give the same values either way;
a grouped op takes them stacked. `ExpertWeights` is a part of `parity.model.K3Forward` (its methods read the forward's
weights, kernels and config).
"""

from __future__ import annotations

import torch

from parity.kernels.moe import experts_combine
from parity.quant import mxfp4
from parity.quant.bf16 import holds_bf16_values, mark_bf16_valued
from parity.quant.mxfp4 import MXFP4Weight


class ExpertWeights:
    """`K3Forward`'s routed experts (`_routed_experts`) and their weights (`expert_weights`, `_expert_stack`)."""

    def _routed_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, p: str) -> torch.Tensor:
        """x: [N, L], ids/weights: [N, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x): [N, L] fp32
        (`experts_combine`, or the kernel set's grouped `experts` op on the stacked weights: the Triton set).
        Hook: an expert-parallel engine overrides this to run the experts it owns and exchange rows."""
        e = range(self.cfg.num_experts or 0)
        if self.k.experts is not None:
            stacked = [self._expert_stack(p, w, e) for w in ("w1", "w3", "w2")]
            return self.k.experts(x, ids, weights, *stacked, *self._experts_activation())
        return experts_combine(x, ids, weights, *(self.expert_weights(p, w, e) for w in ("w1", "w3", "w2")),
                               self.k.linear, self._act)

    def _experts_activation(self) -> tuple[str, float, float | None]:
        """(activation, beta, linear_beta) as the grouped `experts` op takes them: SiTU with the config's soft-clips,
        or SiLU."""
        c = self.cfg
        return ("situ", c.situ_beta or 1.0, c.situ_linear_beta) if c.hidden_act == "situ" else ("silu", 1.0, None)

    def expert_weights(self, p: str, w: str, experts: range) -> list[torch.Tensor | MXFP4Weight]:
        """`weight` of the experts' `w` ("w1", "w3" or "w2") in MoE block `p`, one per expert."""
        stacked = self._masters_fake_quantized(p, w, experts)
        if stacked is None:
            return [self.weight(f"{p}.experts.{e}.{w}.weight") for e in experts]
        return [mark_bf16_valued(t) for t in stacked.unbind(0)]

    def _expert_stack(self, p: str, w: str, experts: range) -> torch.Tensor | MXFP4Weight:
        """`expert_weights` stacked for a grouped op (`_stacked`)."""
        stacked = self._masters_fake_quantized(p, w, experts)
        if stacked is None:
            return self._stacked([self.weight(f"{p}.experts.{e}.{w}.weight") for e in experts])
        return stacked

    def _masters_fake_quantized(self, p: str, w: str, experts: range) -> torch.Tensor | None:
        """When the experts' `w` are MXFP4 masters (a trainer's): their fake-quantised values stacked [E, N, K] and
        marked, from one `mxfp4.fake_quantize` over the stack. The quantiser's groups lie within a row, so each expert
        gets the values (and the straight-through gradient) it gets alone, in one call's launches
        instead of one per expert. None otherwise (packed or unquantised weights)."""
        names = [f"{p}.experts.{e}.{w}.weight" for e in experts]
        held = [self.w.get(n) for n in names]
        if len(names) < 2 or not all(n in self._quantized and isinstance(t, torch.Tensor) for n, t in zip(names, held)):
            return None
        stacked = torch.stack(held)
        try:
            values = mxfp4.fake_quantize(stacked.reshape(-1, stacked.shape[-1]), f"{p}.experts.*.{w}.weight")
        except mxfp4.QuantError:
            for name in names:  # the error names the expert
                self.weight(name)
            raise
        return mark_bf16_valued(values.view(stacked.shape))

    @staticmethod
    def _stacked(ws: list[torch.Tensor | MXFP4Weight]) -> torch.Tensor | MXFP4Weight:
        """The experts' weights stacked for a grouped op: packed ones as one stacked `MXFP4Weight`; tensors stacked,
        keeping their bf16-values mark (`parity.quant.bf16`) when every one carries it."""
        if all(isinstance(w, MXFP4Weight) for w in ws):
            return MXFP4Weight.stack(ws)
        out = torch.stack(ws)
        return mark_bf16_valued(out) if all(holds_bf16_values(w) for w in ws) else out
