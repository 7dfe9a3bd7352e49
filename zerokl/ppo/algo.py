"""PPO math: advantages (GRPO group baseline, GAE) and the clipped surrogate loss, on padded token tensors.

Shapes: `[N, T]` for N sampled completions of up to T tokens with a 0/1 `mask`; rewards `[N]`.
"""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """rewards: [N] with N = groups * group_size, samples of one prompt adjacent -> advantages [N]:
    r - mean(group), divided by the group's std when `normalize_std`."""
    g = rewards.view(-1, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                   lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Terminal reward only. rewards: [N], values: [N, T] (value before each token), mask: [N, T]
    -> (advantages [N, T], returns [N, T]); delta_t = r_t + gamma V_{t+1} - V_t with r_t = reward at the
    last valid token and V after the last token = 0."""
    n, t = values.shape
    lens = mask.sum(dim=1).long()
    adv = torch.zeros_like(values)
    last = torch.zeros(n, dtype=values.dtype)
    for i in reversed(range(t)):
        valid = mask[:, i].bool()
        is_last = (lens - 1) == i
        next_v = values[:, i + 1] if i + 1 < t else torch.zeros(n, dtype=values.dtype)
        next_v = torch.where(is_last, torch.zeros_like(next_v), next_v)
        r = torch.where(is_last, rewards.to(values.dtype), torch.zeros_like(next_v))
        delta = r + gamma * next_v - values[:, i]
        last = torch.where(valid, delta + gamma * lam * torch.where(is_last, torch.zeros_like(last), last), last)
        adv[:, i] = torch.where(valid, last, torch.zeros_like(last))
    return adv, (adv + values) * mask


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip: float,
             ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean clipped surrogate -min(rho A, clip(rho) A) (+ kl_coef * k3 KL to a reference policy).

    logp, old_logp, ref_logp, mask: [N, T]; adv: [N] (broadcast over tokens) or [N, T].
    Returns (loss, stats) with the clip fraction and the mean ratio."""
    if adv.dim() == 1:
        adv = adv.unsqueeze(1).expand_as(logp)
    ratio = torch.exp(logp - old_logp)
    surrogate = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    denom = mask.sum().clamp(min=1)
    loss = (surrogate * mask).sum() / denom
    rd = ratio.detach()
    stats = {"clip_frac": float((((rd - 1).abs() > clip).float() * mask).sum() / denom),
             "ratio_mean": float((rd * mask).sum() / denom)}
    if ref_logp is not None and kl_coef:
        r = ref_logp - logp
        kl = ((torch.exp(r) - 1 - r) * mask).sum() / denom
        loss = loss + kl_coef * kl
        stats["kl_ref"] = float(kl)
    return loss, stats


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position: [..., V] -> [...]."""
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
