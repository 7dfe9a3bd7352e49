"""Log-probabilities of chosen tokens under the sampling distribution: log_softmax(logits / T)[token], fp32.

The invariant form is exactly the arithmetic of vLLM's sampler in `processed_logprobs` mode: divide the
fp32 logits by the temperature as an fp32 value, then `log_softmax` over the vocabulary. ATen reduces
each contiguous row of `log_softmax` with the same loop whatever the number of rows
(`tests/invariance/test_kernels.py` checks a row alone against the same row in batches), so the rollout engine's
sampler and the trainer produce the same bits from the same logits.

With truncation (`Sampling`: min_p, top-k, top-p) the distribution sampled from is the renormalised truncated one,
and the engine's processed log-probs are log-probs under it. `processed_logits` is vLLM's CPU sampler op for op
(`Sampler.sample`: temperature, the min-p logits processor, then `apply_top_k_only` or
`apply_top_k_top_p_pytorch`): masks come from exact comparisons, and the softmax / cumsum behind min-p and top-p
reduce each row alone, so the trainer recomputes the engine's mask from its (bitwise equal) logits. The truncation
reads each row only; what vLLM decides per batch (whether any request has top-k, top-p, min-p) is the same for
every request of a PPO batch, which share one `Sampling`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.kernels.primitives import wide


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits (bf16 ones upcast first, as vLLM's sampler does) divided by T as an fp32 tensor on the logits'
    device (true division, as vLLM's per-request temperatures on the device; a CPU scalar would make CUDA multiply by
    its reciprocal), made by a fill: no host-to-device copy."""
    z = wide(logits).contiguous()
    return z / torch.full((), temperature, dtype=torch.float32, device=z.device)


@dataclass(frozen=True)
class Sampling:
    """The distribution the engine samples from: softmax(fp32 logits / temperature) truncated as vLLM does, in its
    order: min_p (drop tokens whose probability is below min_p times the largest), then top_k (keep the k largest
    logits, ties at the k-th kept) and top_p (keep the smallest high-probability set reaching p). None: not applied.
    Values that vLLM treats as off (top_k >= vocabulary, top_p >= 1, min_p 0) are off here too."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                                       or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def truncates(self) -> bool:
        """Whether any truncation is asked for (beyond the temperature)."""
        return (self.top_k, self.top_p, self.min_p) != (None, None, None)


def as_sampling(sampling: float | Sampling) -> Sampling:
    """A temperature alone is sampling without truncation."""
    return sampling if isinstance(sampling, Sampling) else Sampling(float(sampling))


def processed_logits(logits: torch.Tensor, sampling: float | Sampling) -> torch.Tensor:
    """logits [N, V] -> the fp32 logits vLLM's CPU sampler draws from: / temperature, then -inf outside min-p, top-k
    and top-p, each with vLLM's ops and dtypes (thresholds as fp32 tensors filled on the device, as vLLM holds them
    per request)."""
    s = as_sampling(sampling)
    z = _scaled(logits, s.temperature)
    f32 = dict(dtype=torch.float32, device=z.device)
    if s.min_p:  # MinPLogitsProcessor.apply
        probs = torch.softmax(z, dim=-1)
        floor = torch.amax(probs, dim=-1, keepdim=True) * torch.full((), s.min_p, **f32)
        z = z.masked_fill(probs < floor, float("-inf"))
    top_k = s.top_k if s.top_k is not None and s.top_k < z.shape[-1] else None
    top_p = s.top_p if s.top_p is not None and s.top_p < 1 else None
    if top_p is None:
        if top_k is None:
            return z
        kth = z.topk(top_k, dim=-1).values[:, -1:]  # apply_top_k_only
        return z.masked_fill(z < kth, float("-inf"))
    zs, order = z.sort(dim=-1, descending=False)  # apply_top_k_top_p_pytorch
    if top_k is not None:
        zs = zs.masked_fill(zs < zs[:, -top_k:-top_k + 1 or None], float("-inf"))
    cum = torch.cumsum(zs.softmax(dim=-1), dim=-1)
    drop = cum <= 1 - torch.full((), top_p, **f32)
    drop[:, -1] = False
    return z.scatter(-1, order, zs.masked_fill(drop, float("-inf")))


def token_logprobs_invariant(logits: torch.Tensor, tokens: torch.Tensor, temperature: float | Sampling) -> torch.Tensor:
    """logits: [N, V] fp32 or bf16, tokens: [N] int64 -> [N] fp32 (`temperature`: a temperature, or a `Sampling` with
    truncation: log-probs under the truncated distribution, -inf for a token outside it)."""
    z = processed_logits(logits, temperature)
    return torch.log_softmax(z, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)


def token_logprobs_fast(logits: torch.Tensor, tokens: torch.Tensor, temperature: float | Sampling) -> torch.Tensor:
    """Same value by the logsumexp identity: z[token] - logsumexp(z) (a different reduction)."""
    s = as_sampling(temperature)
    z = processed_logits(logits, s) if s.truncates else wide(logits) / s.temperature
    return z.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(z, dim=-1)
