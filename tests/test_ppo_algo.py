"""PPO math and the verifiable tasks' rewards."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.logprobs import next_token_entropy
from zerokl.ppo.algo import gae_advantages, grpo_advantages, kl_to_reference, ppo_loss
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
