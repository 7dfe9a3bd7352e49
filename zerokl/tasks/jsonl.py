"""`task: jsonl`: prompts and answers from a user's JSONL file, scored by a reward function the config names
(`zerokl.tasks.rewards`).

Each non-blank line is an object with `prompt` (non-empty text) and `answer` (text or a finite number), plus any
other fields; the reward function receives the whole line. Every line is checked when the task is built (at config
load), so a bad file stops the run before anything starts, naming the file, the line and the reason.
"""

from __future__ import annotations

import copy
import math
import numbers
import random
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.compare import DumpError, jsonl_rows
from parity.config import ConfigError
from zerokl.tasks.base import Problem
from zerokl.tasks.rewards import Reward, RewardError, load_reward


@dataclass(frozen=True)
class Sample(Problem):
    """A dataset line: its 1-based line number in the file and the parsed object (`record`)."""

    line: int
    record: dict[str, Any] = field(compare=False)


def resolve_paths(args: dict[str, Any], base: Path) -> dict[str, Any]:
    """`args` with a relative `path` and a relative reward FILE.py made absolute against `base` (the PPO config's
    directory); anything else (a builtin reward, values of the wrong type) as given."""
    out = dict(args)
    if isinstance(out.get("path"), str):
        out["path"] = str(base / Path(out["path"]).expanduser())
    reward = out.get("reward")
    if isinstance(reward, str) and not reward.startswith("builtin:") and ":" in reward:
        file, _, name = reward.rpartition(":")
        out["reward"] = f"{base / Path(file).expanduser()}:{name}"
    return out


def load_samples(path: Path, reward: Reward) -> list[Sample]:
    """Every sample of the file, each line checked (object, `prompt`, `answer`, the reward's own check); the first
    bad line, an unreadable or empty file fail with ConfigError naming the file and line."""
    if not path.is_file():
        raise ConfigError(f"task jsonl: dataset {path}: no such file")
    try:
        rows = list(jsonl_rows(path))
    except DumpError as e:
        raise ConfigError(f"task jsonl: dataset {e}") from None
    except OSError as e:
        raise ConfigError(f"task jsonl: dataset {path}: cannot read ({e.strerror})") from None
    if not rows:
        raise ConfigError(f"task jsonl: dataset {path}: no samples (the file is empty)")
    return [_sample(row, lineno, f"{path}:{lineno}", reward) for lineno, row in rows]


def _sample(row: Any, lineno: int, where: str, reward: Reward) -> Sample:
    need = "each line is an object with 'prompt' (text) and 'answer' (text or a number)"
    if not isinstance(row, dict):
        raise ConfigError(f"task jsonl: dataset {where}: got a JSON {type(row).__name__}; {need}")
    for key in ("prompt", "answer"):
        if key not in row:
            raise ConfigError(f"task jsonl: dataset {where}: no {key!r} field; {need}")
    prompt, answer = row["prompt"], row["answer"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"task jsonl: dataset {where}: 'prompt' must be non-empty text, got {prompt!r}")
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool) or \
            (isinstance(answer, float) and not math.isfinite(answer)):
        raise ConfigError(f"task jsonl: dataset {where}: 'answer' must be text or a finite number, got {answer!r}")
    reason = reward.check(row) if reward.check is not None else None
    if reason is not None:
        raise ConfigError(f"task jsonl: dataset {where}: {reason}")
    return Sample(prompt, str(answer), lineno, row)


class JsonlTask:
    """Samples drawn uniformly, with replacement, from a JSONL dataset by the run's `random.Random` alone (the task
    holds no cursor: a resumed run that restores the Random draws what an uninterrupted one draws); rewards from
    `reward` (`builtin:NAME` or `FILE.py:FUNCTION`)."""

    name = "jsonl"
    resolve_paths = staticmethod(resolve_paths)

    def __init__(self, path: str, reward: str):
        self.path = Path(path)
        try:
            self.score = load_reward(reward)
        except ConfigError as e:
            raise ConfigError(f"task jsonl: {e}") from None
        self.samples = load_samples(self.path, self.score)

    def sample(self, rng: random.Random) -> Sample:
        return self.samples[rng.randrange(len(self.samples))]

    def reward(self, completion: str, problem: Sample) -> float:
        """The reward function's value on a copy of the sample's line (it cannot alter the dataset), as a finite
        float; RewardError naming the line if it raises or returns anything else."""
        where = f"{self.path}:{problem.line}: reward function {self.score.spec}"
        try:
            value = self.score.fn(completion, copy.deepcopy(problem.record))
        except Exception as e:  # the user's function: its failure is reported, with where it raised
            raise RewardError(f"{where} raised {type(e).__name__}: {e}{_raised_at(e)}") from e
        if isinstance(value, numbers.Real):
            try:
                number = float(value)
            except OverflowError:  # an int beyond float's range
                number = math.inf
            if math.isfinite(number):
                return number
        raise RewardError(f"{where} returned {value!r} ({type(value).__name__}); expected a finite number")


def _raised_at(e: BaseException) -> str:
    """' (at FILE:LINE)': the innermost frame below `JsonlTask.reward`'s call, where the function raised; '' when the
    call itself failed."""
    frames = traceback.extract_tb(e.__traceback__)[1:]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
