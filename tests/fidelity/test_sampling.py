"""Truncated sampling (`parity.kernels.logprobs.Sampling`): the trainer's mask is vLLM's CPU sampler's, op for op.

vLLM's own `apply_top_k_top_p_pytorch` (what its CPU sampler runs) on the temperature-scaled fp32 logits must give the
bits `processed_logits` gives, over vocabularies of many sizes, with ties, every top-k / top-p combination, and a row
alone equal to the same row in a batch. The engine path (min_p included) is checked against real vLLM in
tests/engines/test_rollout.py::test_truncated_sampling_equals_the_trainers_processed_logprobs.
"""

from __future__ import annotations

import pytest
import torch

from parity.kernels.logprobs import Sampling, processed_logits, token_logprobs_invariant
from trainer.logprobs import next_token_entropy


def _vllm(z: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    n, v = z.shape
    k = None if top_k is None or top_k >= v else torch.full((n,), top_k, dtype=torch.int32)  # InputBatch's "off"
    p = None if top_p is None or top_p >= 1 else torch.full((n,), top_p, dtype=torch.float32)
    return apply_top_k_top_p_pytorch(z.clone(), k, p, allow_cpu_sync=True)


@pytest.mark.parametrize("ties", [False, True])
def test_processed_logits_are_vllms(ties: bool) -> None:
    g = torch.Generator().manual_seed(1 + ties)
    for _ in range(20):
        v = int(torch.randint(5, 400, (1,), generator=g))
        x = torch.randn(6, v, generator=g) * 3
        if ties:
            x = x.round()
        x = x.to(torch.bfloat16)
        for top_k, top_p in ((5, None), (None, 0.7), (5, 0.7), (1, 0.3), (v, 0.99), (3, 1.0), (None, None)):
            s = Sampling(0.7, top_k, top_p)
            want = _vllm(x.float() / torch.tensor(0.7), top_k, top_p)
            got = processed_logits(x, s)
            assert torch.equal(got, want), (v, top_k, top_p)
            alone = torch.cat([processed_logits(x[i : i + 1], s) for i in range(len(x))])
            assert torch.equal(alone, got), (v, top_k, top_p)


def test_truncated_logprobs_renormalise_and_entropy_has_finite_gradients() -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 50, generator=g) * 2).requires_grad_()
    s = Sampling(1.0, top_k=5, top_p=0.8, min_p=0.05)
    z = processed_logits(x, s)
    kept = torch.isfinite(z)
    assert (kept.sum(-1) <= 5).all() and (kept.sum(-1) >= 1).all()
    assert torch.allclose(torch.softmax(z, -1).sum(-1), torch.ones(4))
    top = x.argmax(-1)
    assert torch.equal(token_logprobs_invariant(x, top, s), torch.log_softmax(z, -1).gather(1, top[:, None])[:, 0])
    assert (token_logprobs_invariant(x, top, s) >= token_logprobs_invariant(x, top, 1.0)).all()
    ent = next_token_entropy(x, s)
    assert torch.isfinite(ent).all() and (ent <= next_token_entropy(x, 1.0)).all()
    ent.sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[~kept] == 0).all()


def test_no_truncation_is_the_temperature_alone() -> None:
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    tok = torch.tensor([0, 5, 39])
    assert torch.equal(token_logprobs_invariant(x, tok, Sampling(0.9)), token_logprobs_invariant(x, tok, 0.9))
    assert torch.equal(token_logprobs_invariant(x, tok, 0.9),
                       torch.log_softmax(x / torch.tensor(0.9), -1).gather(1, tok[:, None])[:, 0])
