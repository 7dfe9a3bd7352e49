"""Log-probabilities of chosen tokens under the sampling distribution: log_softmax(logits / T)[token], fp32.

The invariant form is exactly the arithmetic of vLLM's sampler in `processed_logprobs` mode: divide the
fp32 logits by the temperature as an fp32 value, then `log_softmax` over the vocabulary. ATen reduces
each contiguous row of `log_softmax` with the same loop whatever the number of rows
(`tests/test_kernels.py` checks a row alone against the same row in batches), so the rollout engine's
sampler and the trainer produce the same bits from the same logits.
"""

from __future__ import annotations

import torch

from parity.kernels.primitives import wide


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits (bf16 ones upcast first, as vLLM's sampler does) divided by T as an fp32 value."""
    return wide(logits).contiguous() / torch.tensor(temperature, dtype=torch.float32)


def token_logprobs_invariant(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits: [N, V] fp32 or bf16, tokens: [N] int64 -> [N] fp32."""
    return torch.log_softmax(_scaled(logits, temperature), dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)


def token_logprobs_fast(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Same value by the logsumexp identity: z[token] - logsumexp(z) (a different reduction)."""
    z = wide(logits) / temperature
    return z.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(z, dim=-1)
