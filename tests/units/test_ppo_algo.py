"""PPO math and the verifiable tasks' rewards."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.logprobs import next_token_entropy
from zerokl.ppo.algo import (explained_variance, gae_advantages, grpo_advantages, kl_to_reference, masked_whiten,
                             ppo_loss, value_loss)
from zerokl.tasks import Addition, Problem, Reversal, make_task


def test_grpo_group_baseline() -> None:
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.4]), group_size=2)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, -0.1, 0.1]))
    std = grpo_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), group_size=2, normalize_std=True)
    assert std[0] == pytest.approx(-std[1]) and std[0] > 0


def test_gae_matches_hand_computation() -> None:
    values = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv, ret = gae_advantages(torch.tensor([1.0, 2.0]), values, mask, gamma=1.0, lam=0.5)
    d2 = 1.0 - 0.3
    d1 = 0.3 - 0.2
    d0 = 0.2 - 0.1
    torch.testing.assert_close(adv[0], torch.tensor([d0 + 0.5 * (d1 + 0.5 * d2), d1 + 0.5 * d2, d2]))
    torch.testing.assert_close(adv[1], torch.tensor([1.5, 0.0, 0.0]))
    torch.testing.assert_close(ret[0, 2], torch.tensor(1.0))


def test_value_loss_clips_around_the_old_values() -> None:
    """0.5 x the token mean of max(unclipped, clipped) squared errors; padding ignored; the clip fraction counts the
    tokens where the clipped error is the larger."""
    old = torch.tensor([[0.0, 0.0], [1.0, 9.0]])
    returns = torch.tensor([[1.0, 1.0], [1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    new = torch.tensor([[0.5, 1.0], [1.0, 0.0]], requires_grad=True)
    loss, frac = value_loss(new, old, returns, mask, clip=0.2)
    # token (0,0): V 0.5 -> clipped 0.2: max(0.25, 0.64); (0,1): V 1.0 -> 0.2: max(0, 0.64); (1,0): exact, 0
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.64 + 0.0) / 3)
    assert frac == pytest.approx(2 / 3)
    loss.backward()
    assert new.grad[0].abs().sum() == 0 and new.grad[1, 1] == 0  # the clipped branch and padding carry no gradient
    unclipped, frac = value_loss(new.detach(), old, returns, mask, clip=10.0)
    assert unclipped.item() == pytest.approx(0.5 * 0.25 / 3) and frac == 0.0
    pulled = torch.tensor([[2.0, 1.0], [1.0, 0.0]], requires_grad=True)  # unclipped error the larger: its gradient
    value_loss(pulled, old, returns, mask, clip=0.2)[0].backward()
    assert pulled.grad[0, 0].item() == pytest.approx((2.0 - 1.0) / 3)


def test_whiten_and_explained_variance_over_valid_tokens() -> None:
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 0.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    w = masked_whiten(x, mask)
    torch.testing.assert_close(w, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), atol=1e-6, rtol=0)
    returns = torch.tensor([[1.0, 2.0, 7.0], [3.0, 0.0, 7.0]])
    assert explained_variance(returns, returns, mask) == 1.0
    assert explained_variance(returns, torch.full_like(returns, 2.0), mask) == pytest.approx(0.0, abs=1e-6)
    halfway = torch.full_like(returns, 2.0) + (returns - 2.0) * 0.5
    assert explained_variance(returns, halfway, mask) == pytest.approx(0.75)
    assert explained_variance(torch.ones(2, 3), torch.zeros(2, 3), mask) == 0.0


def test_ppo_loss_on_policy_is_minus_mean_advantage_and_clips() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.9]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = ppo_loss(logp, logp, adv, mask, clip=0.2)
    assert loss.item() == pytest.approx(-(1 + 1 - 2) / 3)
    assert stats["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0
    new = logp + torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    _, stats = ppo_loss(new, logp, adv, mask, clip=0.2)
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    loss_kl, stats = ppo_loss(new, logp, adv, mask, clip=0.2, ref_logp=logp, kl_coef=0.1)
    assert stats["kl_ref"] > 0
    ent = torch.tensor([[2.0, 1.0], [0.5, 9.0]])
    loss_ent, stats = ppo_loss(new, logp, adv, mask, clip=0.2, entropy=ent, entropy_coef=0.1)
    assert stats["entropy"] == pytest.approx(3.5 / 3)
    assert loss_ent.item() == pytest.approx(ppo_loss(new, logp, adv, mask, clip=0.2)[0].item() - 0.1 * 3.5 / 3)


def test_kl_estimators() -> None:
    """k1 and k3 are zero where policy = reference; k3 is never negative; both average to KL(p || q) over samples
    of p (here exactly: the expectation over a two-point distribution)."""
    p, q = torch.tensor([0.7, 0.3]), torch.tensor([0.4, 0.6])
    exact = float((p * (p / q).log()).sum())
    for est in ("k1", "k3"):
        values = kl_to_reference(p.log(), q.log(), est)
        assert float((p * values).sum()) == pytest.approx(exact)
        assert torch.equal(kl_to_reference(p.log(), p.log(), est), torch.zeros(2))
    assert (kl_to_reference(p.log(), q.log(), "k3") >= 0).all()
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_to_reference(p, q, "k2")


def test_ppo_gradient_raises_advantaged_logprob() -> None:
    logits = torch.zeros(1, 1, 4, requires_grad=True)
    logp = torch.log_softmax(logits, -1)[..., 2]
    loss, _ = ppo_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 1), clip=0.2)
    loss.backward()
    assert logits.grad[0, 0, 2] < 0 and (logits.grad[0, 0, [0, 1, 3]] > 0).all()


def test_entropy_uniform() -> None:
    assert next_token_entropy(torch.zeros(3, 8), 1.0)[0].item() == pytest.approx(torch.log(torch.tensor(8.0)).item())
    assert next_token_entropy(torch.tensor([[0.0, -1e4]]), 1.0).item() == pytest.approx(0.0, abs=1e-6)


def test_task_rewards() -> None:
    task = Addition(digits=2)
    p = Problem("What is 12 + 7? Answer:", "19")
    assert task.reward(" 19", p) == pytest.approx(1.0)
    assert task.reward(" 18 and more", p) == pytest.approx(0.2 * 2 / 3 + 0.3 * 0.5)
    assert task.reward(" cat", p) == 0.0
    assert 0.0 < task.reward("1", p) < 0.5
    rev = Reversal(length=3)
    q = rev.sample(random.Random(0))
    assert rev.reward(" " + q.answer, q) == pytest.approx(1.0)
    assert task.sample(random.Random(1)) == task.sample(random.Random(1))
    with pytest.raises(ValueError, match="unknown task"):
        make_task("chess")
