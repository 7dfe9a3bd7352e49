"""What a rollout is, whichever engine made it (`rollout.engine` in this process, `rollout.client.remote` over HTTP): the
`Sample` record, the per-sample seeds that make a sample depend only on (weights, prompt, seed), and the checks on
sampling settings. Light to import: no vLLM.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from parity.kernels.logprobs import Sampling

_GREEDY_EPS = 1e-5  # vLLM's sampler treats temperature below this as greedy (`_SAMPLING_EPS`)


class RolloutError(ValueError):
    """A request the rollout engine refuses; the message says why and what to do instead."""


@dataclass(frozen=True)
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: torch.Tensor  # [len(completion_ids)] fp32
    policy_version: int
    cached_tokens: int  # prompt tokens served from vLLM's prefix cache
    # with `generate(record=True)`: the raw log-probs of the completion tokens (log_softmax of the model's logits, no
    # temperature or truncation: vLLM's `raw_logprobs`), [len(completion_ids)] fp32; and, for a model with MoE layers,
    # the experts chosen at each input position (`parity.routing`), [len(prompt_ids) + len(completion_ids) - 1,
    # MoE layers, top_k]
    raw_logprobs: torch.Tensor | None = None
    routing: torch.Tensor | None = None


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with images: token ids holding one image placeholder token (`<|kimi_image_placeholder|>`) per image,
    where the image goes, and the RGB images (`PIL.Image.Image`, `parity.image.to_rgb`) in order. The engine expands
    each placeholder into the image's tokens; a sample's `prompt_ids` are the expanded ids."""

    token_ids: list[int]
    images: tuple[Any, ...]


def sample_seed(seed: int, index: int) -> int:
    """The vLLM request seed of sample `index` of a prompt whose seed is `seed` (63-bit, well mixed)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_sampling(n: int, temperature: float, max_tokens: int, top_p: float | None, top_k: int | None,
                   min_p: float | None) -> None:
    """RolloutError unless these are sampling settings whose log-probs the trainer can recompute."""
    if n < 1 or max_tokens < 1:
        raise RolloutError(f"n and max_tokens must be >= 1, got n={n}, max_tokens={max_tokens}")
    if temperature < _GREEDY_EPS:
        raise RolloutError(
            f"temperature must be >= {_GREEDY_EPS}: vLLM samples greedily below it and then reports "
            f"log-probs at temperature 1, which is not the distribution used (got {temperature})")
    try:
        Sampling(temperature, top_k, top_p, min_p)
    except ValueError as e:
        raise RolloutError(str(e)) from None


def prompt_seeds(prompts: Sequence[Sequence[int] | str | ImagePrompt], seed: int | Sequence[int]) -> list[int]:
    """One seed per prompt: `sample_seed(seed, i)` for prompt i of a call seeded `seed`, or the given list."""
    if not prompts:
        raise RolloutError("no prompts given")
    if isinstance(seed, int):
        return [sample_seed(seed, i) for i in range(len(prompts))]
    if len(seed) != len(prompts):
        raise RolloutError(f"got {len(seed)} seeds for {len(prompts)} prompts; give one per prompt or one int")
    return list(seed)


def root_message(error: BaseException | str) -> str:
    """The worker's own message inside vLLM's RPC error ("... Worker failed with error '<msg>', please ...")."""
    text = str(error)
    found = re.search(r"Worker failed with error '(.*)', please check", text, re.S)
    return found.group(1) if found else text
