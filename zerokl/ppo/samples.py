"""A step's samples as the trainer needs them: the `Rollout` record rank 0 broadcasts, the padded tensors every stage
after the rollout reads (`StepBatch`), and the plain-data form of rollouts kept across a checkpoint.

Invariant: everything here is plain data (lists, ints, tensors, images), so a rollout record is the same on every rank
and a checkpoint reads back with `torch.load(weights_only=True)`, without running code.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image


@dataclass(frozen=True)
class Rollout:
    """One sample as the trainer needs it: plain data, what rank 0 broadcasts."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: torch.Tensor  # [len(completion_ids)] fp32, the engine's, under the distribution sampled from
    raw_logprobs: torch.Tensor  # [len(completion_ids)] fp32, the engine's raw ones (temperature 1, no truncation)
    routing: torch.Tensor | None  # the engine's experts per input position (`parity.routing`), MoE models
    images: tuple[Any, ...] = ()  # the prompt's images (RGB `PIL.Image`s), whose rows fill its image placeholders
    # multi-turn (an agent task): which completion tokens the policy sampled (True) and which the environment wrote
    # (their log-probs are NaN; the check and the loss skip them); the policy turns and how the trajectory ended
    policy_mask: torch.Tensor | None = None
    turns: int = 1
    end: str = ""
    cached_tokens: tuple[int, ...] = ()  # per turn: its prompt tokens served from the engine's prefix cache
    tool_calls: int = 0
    tool_errors: int = 0


class Rolled(NamedTuple):
    """A step's rollouts: the samples, their rewards [N], the rollout's seconds, each sample's policy version."""

    samples: list[Rollout]
    rewards: torch.Tensor
    seconds: float
    versions: list[int]


def step_seed(seed: int, step: int) -> int:
    """The rollout seed of `step` (depends on nothing else, so a resumed run samples the same tokens)."""
    return int.from_bytes(hashlib.blake2b(f"ppo:{seed}:{step}".encode(), digest_size=8).digest(), "little") >> 1


def images_of(item: Any) -> tuple[Any, ...]:
    """The images of a problem or rollout (none for a text one)."""
    return tuple(getattr(item, "images", ()))


@dataclass
class StepBatch:
    """The samples of one step laid out for the trainer: `batch` the padded sequences (prompt + completion), and per
    sample and completion token [N, T]: `index` the position whose log-prob scores it, `mask` 1 where the policy
    sampled it (environment tokens and padding 0: neither checked nor trained on), `old` the rollout's log-prob of the
    kind the loss reads (0 where masked)."""

    samples: list[Rollout]
    batch: Any  # trainer.logprobs.PaddedBatch
    index: torch.Tensor
    mask: torch.Tensor
    old: torch.Tensor

    @classmethod
    def of(cls, samples: list[Rollout], images: Any, logprobs_mode: str) -> StepBatch:
        from trainer.logprobs import PaddedBatch

        batch = PaddedBatch.from_sequences([s.prompt_ids + s.completion_ids for s in samples], images=images)
        n_tok = max(len(s.completion_ids) for s in samples)
        index = torch.zeros(len(samples), n_tok, dtype=torch.long)
        mask = torch.zeros(len(samples), n_tok)
        old = torch.zeros(len(samples), n_tok)
        for i, s in enumerate(samples):
            c = len(s.completion_ids)
            index[i, :c] = torch.arange(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + c)
            policy = torch.ones(c, dtype=torch.bool) if s.policy_mask is None else s.policy_mask
            mask[i, :c] = policy.float()  # environment tokens: neither trained on nor checked
            rollout_lp = s.raw_logprobs if logprobs_mode == "raw_logprobs" else s.logprobs
            old[i, :c] = torch.where(policy, rollout_lp, torch.zeros(()))
        return cls(samples, batch, index, mask, old)

    def __len__(self) -> int:
        return len(self.samples)


def rolled_record(step: int, rolled: Rolled) -> dict[str, Any]:
    """A step's finished rollouts as plain lists, dicts and tensors (`rolled_from_record` reads them back)."""
    samples = rolled.samples
    return {"step": step, "prompt_ids": [s.prompt_ids for s in samples],
            "completion_ids": [s.completion_ids for s in samples], "logprobs": [s.logprobs for s in samples],
            "raw_logprobs": [s.raw_logprobs for s in samples], "routing": [s.routing for s in samples],
            "images": [[torch.from_numpy(np.array(im)) for im in s.images] for s in samples],
            "policy_mask": [s.policy_mask for s in samples], "turns": [s.turns for s in samples],
            "end": [s.end for s in samples], "cached_tokens": [list(s.cached_tokens) for s in samples],
            "tool_calls": [s.tool_calls for s in samples], "tool_errors": [s.tool_errors for s in samples],
            "rewards": rolled.rewards, "seconds": rolled.seconds, "versions": rolled.versions}


def rolled_from_record(row: dict[str, Any]) -> tuple[int, Rolled]:
    """`rolled_record` read back: (its step, the rollouts)."""
    images = [tuple(Image.fromarray(t.numpy(), "RGB") for t in held) for held in row["images"]]
    samples = [Rollout(*fields[:9], tuple(fields[9]), *fields[10:]) for fields in zip(
        row["prompt_ids"], row["completion_ids"], row["logprobs"], row["raw_logprobs"], row["routing"], images,
        row["policy_mask"], row["turns"], row["end"], row["cached_tokens"], row["tool_calls"], row["tool_errors"])]
    return row["step"], Rolled(samples, row["rewards"], row["seconds"], row["versions"])
