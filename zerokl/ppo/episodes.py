"""Multi-turn rollouts, token in / token out: each trajectory is the prompt's ids, then per turn the tokens the policy
sampled (kept as sampled, with their log-probs) and the environment's answer tokenised once and appended as ids. No
text the trajectory already holds is tokenised again, so turn k+1's request is turn k's ids plus new ones (its prefix
is served from the engine's prefix cache where the cache holds it) and the trainer scores the very ids that were
sampled, in one pass over the whole trajectory.

Every token carries a mask (policy / environment); the zero-KL check and the loss read policy tokens only. Every
turn of a trajectory is sampled by one policy version (no sync runs during a rollout).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from parity.routing import NOT_COMPUTED
from rollout.sampling import sample_seed
from zerokl.tasks.agent import Turn


@dataclass
class Trajectory:
    """One multi-turn sample: `prompt_ids`, then `completion_ids` (policy and environment tokens interleaved),
    `policy_mask` [len(completion_ids)] bool, the engine's `logprobs` / `raw_logprobs` at policy tokens (NaN at
    environment tokens), its experts per input position (`routing`, NOT_COMPUTED where no turn computed one)."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    policy_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    routing: torch.Tensor | None = None
    reward: float = 0.0
    turns: int = 0
    cached_tokens: list[int] = field(default_factory=list)  # per turn: prompt tokens served from the prefix cache
    versions: set[int] = field(default_factory=set)
    tool_calls: int = 0
    tool_errors: int = 0
    end: str = "running"  # done | max_turns | length | error: ...

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids

    def add(self, sample: Any) -> None:
        """Append a turn's sampled tokens with their log-probs and the experts of the positions it computed."""
        n = len(sample.completion_ids)
        self.completion_ids += sample.completion_ids
        self.policy_mask += [True] * n
        self.logprobs += sample.logprobs.tolist()
        self.raw_logprobs += (sample.raw_logprobs if sample.raw_logprobs is not None
                              else torch.full((n,), float("nan"))).tolist()
        self.cached_tokens.append(sample.cached_tokens)
        self.versions.add(sample.policy_version)
        self.turns += 1
        if sample.routing is not None:
            merged = torch.full((len(self.ids) - 1, *sample.routing.shape[1:]), NOT_COMPUTED,
                                dtype=sample.routing.dtype)
            if self.routing is not None:
                merged[: len(self.routing)] = self.routing
            known = sample.routing[..., 0] != NOT_COMPUTED
            merged[: len(sample.routing)][known] = sample.routing[known]
            self.routing = merged

    def observe(self, ids: list[int]) -> None:
        """Append environment tokens (no log-probs: NaN)."""
        self.completion_ids += ids
        self.policy_mask += [False] * len(ids)
        self.logprobs += [float("nan")] * len(ids)
        self.raw_logprobs += [float("nan")] * len(ids)


@dataclass(frozen=True)
class Limits:
    max_turns: int  # policy turns per trajectory
    max_tokens: int  # sampled tokens per turn
    max_length: int  # prompt + completion tokens of a trajectory (the engine's context)
    step_timeout_s: float  # an environment step that takes longer ends its trajectory


class Dialogue(Protocol):
    """How turns become actions and answers become ids: plain text (`TextDialogue`) or K3's chat format
    (`zerokl.tasks.chat.ChatDialogue`)."""

    stop_token_ids: list[int]  # besides end-of-sequence, the tokens that end a turn

    def prompt_ids(self, text: str) -> list[int]: ...  # a problem's prompt as the trajectory's first ids

    def action(self, ids: list[int]) -> Any: ...  # what the episode's step receives for the turn `ids`

    def observation(self, ids: list[int], action: Any, answer: str | tuple[str, ...]) -> list[int]: ...  # what follows


class TextDialogue:
    """Plain text: a turn is its tokens decoded (end-of-sequence dropped), an answer its text tokenised once."""

    stop_token_ids: list[int] = []

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]):
        self.encode, self.decode = encode, decode

    def prompt_ids(self, text: str) -> list[int]:
        return self.encode(text)

    def action(self, ids: list[int]) -> str:
        return self.decode(ids)

    def observation(self, ids: list[int], action: Any, answer: str | tuple[str, ...]) -> list[int]:
        return self.encode(answer if isinstance(answer, str) else "".join(answer))


class Environment(Protocol):
    """A trajectory's environment: its episode's answer to an action, or why there is none
    (`zerokl.ppo.environments.Environment`: the episode in a child process that a timeout ends for good)."""

    def step(self, action: Any, timeout_s: float) -> Turn | str: ...


def run_episodes(generate: Callable[..., list[Any]], dialogue: Dialogue, prompts: Sequence[list[int]],
                 environments: Sequence[Environment], limits: Limits, seed: int, **sampling: Any) -> list[Trajectory]:
    """Run trajectory i from `prompts[i]` against `environments[i]`, all active ones batched per turn through
    `generate` (the engine's, called with `n=1`, per-request seeds `sample_seed(seed, turn * len(prompts) + i)`,
    `record=True`, the dialogue's stop tokens and `sampling`); each turn reaches its environment as
    `dialogue.action(ids)` and the answer comes back as `dialogue.observation(...)` ids. A trajectory ends when its
    episode says done, at `max_turns`, when the next turn would not fit in `max_length`, or when its environment
    raises, answers something else or exceeds `step_timeout_s` (`end` says which and why; the run goes on)."""
    runs = [Trajectory(list(p)) for p in prompts]
    for turn in range(limits.max_turns):
        active = [i for i, r in enumerate(runs) if r.end == "running"]
        if not active:
            break
        samples = generate([runs[i].ids for i in active], n=1, max_tokens=limits.max_tokens, record=True,
                           seed=[sample_seed(seed, turn * len(runs) + i) for i in active],
                           stop_token_ids=dialogue.stop_token_ids, **sampling)
        for i, sample in zip(active, samples):
            run = runs[i]
            run.add(sample)
            action = dialogue.action(sample.completion_ids)
            reply = environments[i].step(action, limits.step_timeout_s)
            if isinstance(reply, str):
                run.end = f"error: {reply}"
                continue
            run.reward += reply.reward
            run.tool_calls += reply.tool_calls
            run.tool_errors += reply.tool_errors
            if reply.done:
                run.end = "done"
            elif turn + 1 == limits.max_turns:
                run.end = "max_turns"
            else:
                ids = dialogue.observation(sample.completion_ids, action, reply.observation)
                if len(run.ids) + len(ids) + limits.max_tokens > limits.max_length:
                    run.end = "length"
                else:
                    run.observe(ids)
    return runs
