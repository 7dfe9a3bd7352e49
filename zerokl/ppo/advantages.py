"""The advantages stage: what the loss needs of each sample beyond its log-probs, from the rewards (and, with GAE, the
generating version's values). The math is `zerokl.ppo.algo`'s.

- GRPO (`advantage: grpo`): `adv` [N], each reward less its prompt group's mean (divided by the group's std with
  `normalize_adv_std`), known before any forward.
- GAE (`advantage: gae`): per-token `adv` [N, T] from the old values (the value head's at the generating version, read
  at the position whose hidden state predicts each token), whitened over the batch's valid tokens as verl does, and
  the unwhitened `returns` and the `values` themselves [N, T], for the clipped value loss; known once the first
  forward at the generating version has run (the update's own, or the no-grad pass before it).
"""

from __future__ import annotations

import torch

from zerokl.ppo.algo import gae_advantages, grpo_advantages, masked_whiten
from zerokl.ppo.config import PPOConfig


class Targets(dict):
    """`adv` (and with GAE `returns`, `values`) by name, on the CPU like the step's samples; empty under GAE until
    `from_values` fills it."""

    def __init__(self, cfg: PPOConfig, rewards: torch.Tensor, mask: torch.Tensor):
        super().__init__()
        self.cfg, self.rewards, self.mask = cfg, rewards, mask
        if cfg.advantage != "gae":
            self["adv"] = grpo_advantages(rewards, cfg.samples_per_prompt, cfg.normalize_adv_std)

    @property
    def ready(self) -> bool:
        return "adv" in self

    def from_values(self, values: torch.Tensor) -> None:
        """GAE from the old values [N, T] (every sample, generating version)."""
        values = values.detach().cpu() * self.mask
        adv, returns = gae_advantages(self.rewards, values, self.mask, self.cfg.gamma, self.cfg.lam)
        self.update(adv=masked_whiten(adv, self.mask), returns=returns, values=values)
