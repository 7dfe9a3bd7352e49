"""First-divergence diagnosis: run one sequence on two sides capturing every block, name the first
block whose outputs differ (bits), and by how much.

Block order is the model's: `embed`, then `layer{i}.attn` and `layer{i}.mlp` for each layer, `final`
(the AttnRes output mix), `logits`. A side is a `K3Forward` plus a schedule: `one_pass` (how the trainer
scores) or `decode` (prefill a prefix, then one token per step through the caches, how a rollout engine
generates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from parity.caches import new_cache
from parity.model import K3Forward

Schedule = Literal["one_pass", "decode"]


@dataclass(frozen=True)
class Divergence:
    """The first block whose outputs differ: its name, what it is, the first differing token, max |d|."""

    block: str
    kind: str
    token: int
    max_abs_diff: float

    def describe(self) -> str:
        return (f"first divergence at {self.block} ({self.kind}): token {self.token}, "
                f"max |d| = {self.max_abs_diff:.3e}")


def capture(fwd: K3Forward, seq: list[int], schedule: Schedule, prefill: int | None = None) -> dict[str, torch.Tensor]:
    """Every block's output for every position of `seq`: name -> [T, ...] fp32 (steps concatenated), computed on the
    device of the forward's weights (ids, positions and caches made there)."""
    steps = [(0, len(seq))]
    if schedule == "decode":
        first = max(1, min(prefill if prefill is not None else len(seq) // 2, len(seq)))
        steps = [(0, first)] + [(i, i + 1) for i in range(first, len(seq))]
    parts: dict[str, list[torch.Tensor]] = {}
    with torch.device(fwd.weight(fwd.names.embed).device):
        caches = new_cache(fwd.cfg, 1, fwd.dtype)
        for start, end in steps:
            cap: dict[str, torch.Tensor] = {}
            hidden = fwd.hidden(torch.tensor([seq[start:end]]), torch.arange(start, end).view(1, -1),
                                torch.tensor([end - start]), caches, capture=cap)
            cap["logits"] = fwd.logits(hidden)
            for name, t in cap.items():
                parts.setdefault(name, []).append(t[0])
    return {name: torch.cat(ts) for name, ts in parts.items()}


def block_kind(fwd: K3Forward, block: str) -> str:
    """Human name of a block: 'KDA attention', 'MLA attention', 'LatentMoE', 'dense MLP', ..."""
    if block.startswith("layer"):
        layer, part = block[len("layer"):].split(".")
        i = int(layer)
        if part == "attn":
            return "KDA attention" if fwd.cfg.is_kda(i) else "MLA attention"
        return "LatentMoE" if fwd.cfg.is_moe(i) else "dense MLP"
    return {"embed": "embedding", "final": "AttnRes output mix", "logits": "final norm + lm_head"}.get(block, block)


def first_divergence(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], fwd: K3Forward) -> Divergence | None:
    """Walk blocks in model order; None when every captured output is bitwise equal."""
    for name, ta in a.items():
        tb = b[name]
        if torch.equal(ta, tb):
            continue
        rows = (ta != tb).reshape(ta.shape[0], -1).any(dim=1).nonzero()
        return Divergence(name, block_kind(fwd, name), int(rows[0]), float((ta.double() - tb.double()).abs().max()))
    return None


def diagnose(side_a: tuple[K3Forward, Schedule], side_b: tuple[K3Forward, Schedule], seq: list[int],
             prefill: int | None = None) -> Divergence | None:
    """Run `seq` on both sides and return where they first differ."""
    (fa, sa), (fb, sb) = side_a, side_b
    return first_divergence(capture(fa, seq, sa, prefill), capture(fb, seq, sb, prefill), fa)
