"""PPO math: advantages (GRPO group baseline, GAE), the clipped surrogate loss and the clipped value loss, on padded
token tensors.

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
        next_v = torch.where(is_last, 0.0, next_v)
        r = torch.where(is_last, rewards.to(values.dtype), 0.0)
        delta = r + gamma * next_v - values[:, i]
        last = torch.where(valid, delta + gamma * lam * torch.where(is_last, 0.0, last), last)
        adv[:, i] = torch.where(valid, last, 0.0)
    return adv, (adv + values) * mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with the mean and the (unbiased) variance over the valid tokens (verl's
    `masked_whiten`); 0 on padding."""
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp(min=1)
    var = ((x - mean) ** 2 * mask).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, float]:
    """PPO's clipped value loss (verl, OpenRLHF): 0.5 x the token mean of max((V - R)^2, (V_clip - R)^2) with
    V_clip = old_values + clamp(V - old_values, -clip, clip). All [N, T]. Returns (loss, clip fraction: the share of
    tokens whose clipped error is the larger)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    err, err_clipped = (values - returns) ** 2, (clipped - returns) ** 2
    denom = mask.sum().clamp(min=1)
    loss = 0.5 * (torch.maximum(err, err_clipped) * mask).sum() / denom
    return loss, float(((err_clipped > err).float() * mask).sum() / denom)


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the valid tokens: 1 for a perfect critic, 0 for one no better
    than the mean return, negative for worse; 0 when the returns do not vary."""
    n = mask.sum().clamp(min=1)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * mask).sum() / n
        return ((x - mean) ** 2 * mask).sum() / n

    total = var(returns)
    return 0.0 if total == 0 else float(1 - var(returns - values) / total)


KL_ESTIMATORS = ("k1", "k3")


def kl_to_reference(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from log-probs of tokens the policy sampled (Schulman's):
    k1 = logp - ref_logp (unbiased, any sign); k3 = exp(r) - 1 - r with r = ref_logp - logp (unbiased, >= 0, lower
    variance; verl's `low_var_kl`)."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        r = ref_logp - logp
        return torch.exp(r) - 1 - r
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")


def ppo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, clip: float,
             ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0, kl_estimator: str = "k3",
             entropy: torch.Tensor | None = None, entropy_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean clipped surrogate -min(rho A, clip(rho) A), plus `kl_coef` x the KL to a reference policy
    (`kl_to_reference`), minus `entropy_coef` x the policy's entropy (a bonus).

    logp, old_logp, ref_logp, entropy, mask: [N, T]; adv: [N] (broadcast over tokens) or [N, T].
    Returns (loss, stats): the clip fraction, the mean ratio, and `kl_ref` / `entropy` (token means) when given."""
    if adv.dim() == 1:
        adv = adv.unsqueeze(1).expand_as(logp)
    ratio = torch.exp(logp - old_logp)
    surrogate = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    denom = mask.sum().clamp(min=1)
    loss = (surrogate * mask).sum() / denom
    rd = ratio.detach()
    stats = {"clip_frac": float((((rd - 1).abs() > clip).float() * mask).sum() / denom),
             "ratio_mean": float((rd * mask).sum() / denom)}
    if ref_logp is not None:
        kl = (kl_to_reference(logp, ref_logp, kl_estimator) * mask).sum() / denom
        loss = loss + kl_coef * kl
        stats["kl_ref"] = float(kl.detach())
    if entropy is not None:
        ent = (entropy * mask).sum() / denom
        loss = loss - entropy_coef * ent
        stats["entropy"] = float(ent.detach())
    return loss, stats
