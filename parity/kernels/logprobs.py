"""Log-probabilities of chosen tokens: log_softmax(logits / temperature)[token], fp32.

Invariant form: lse = m + log(tree_sum(exp(z - m))) with m the row max, z = logits / temperature.
"""

from __future__ import annotations

import torch

from parity.kernels.primitives import tree_sum


def token_logprobs_invariant(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits: [N, V] fp32, tokens: [N] int64 -> [N] fp32."""
    z = logits / temperature
    m = z.amax(dim=-1, keepdim=True)
    lse = m.squeeze(-1) + torch.log(tree_sum(torch.exp(z - m)))
    return z.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse


def token_logprobs_fast(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
