"""Routing agreement: how many (position, MoE layer) expert choices two runs of the same tokens share.

RL stacks whose rollout and trainer disagree by an ulp see routers flip experts between the two (a token routed to
other experts gets another log-prob entirely), and add routing replay or importance-sampling corrections to live with
it. zerokl's engines compute every router logit with the same bits, so the choices are the same and the fraction is
exactly 1.0: this is the evidence, measured where the zero-KL check runs (`zerokl ppo`'s `routing_agreement`).

A run's routing is one `[P, L, top_k]` integer tensor per sequence: the experts of position p (the token at p as
input, which shapes the log-prob of the token at p + 1) in MoE layer l, in any order within the top-k; -1 where the
run did not compute the position (a prefix-cache hit served it from the cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NOT_COMPUTED = -1


@dataclass(frozen=True)
class RoutingAgreement:
    matched: int  # (position, layer) pairs whose expert sets are equal
    compared: int  # (position, layer) pairs both runs computed

    @property
    def fraction(self) -> float:
        return self.matched / self.compared if self.compared else float("nan")


def routing_agreement(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> RoutingAgreement:
    """Compare sequence by sequence the expert sets of every (position, layer) both runs computed. Shapes must match
    (the same sequences, the same layers and top-k)."""
    if len(a) != len(b):
        raise ValueError(f"routing of {len(a)} and {len(b)} sequences")
    matched = compared = 0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            raise ValueError(f"routing shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}")
        both = (x[..., 0] != NOT_COMPUTED) & (y[..., 0] != NOT_COMPUTED)  # [P, L]
        same = (torch.sort(x, dim=-1).values == torch.sort(y, dim=-1).values).all(dim=-1)
        matched += int((same & both).sum())
        compared += int(both.sum())
    return RoutingAgreement(matched, compared)


def per_sequence(log: Sequence[torch.Tensor], lens: torch.Tensor) -> list[torch.Tensor]:
    """A padded batch's recorded routing (`parity.model.record_routing`: one [B, T, top_k] tensor per MoE layer) as
    one [lens[b] - 1, L, top_k] tensor per sequence: the positions whose routing shapes a next-token log-prob. Empty
    for a model without MoE layers (nothing recorded)."""
    if not log:
        return []
    stacked = torch.stack(list(log), dim=2).cpu()  # [B, T, L, k]
    return [stacked[b, : int(n) - 1] for b, n in enumerate(lens.tolist())]
