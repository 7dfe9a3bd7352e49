"""Verifiable tasks for RL: prompts with a known answer and a rule-based reward.

A task is any object with `name`, `sample(rng) -> Problem` and `reward(completion, problem) -> float`
(`zerokl.tasks.base.Task`); `sample` must draw only from `rng`, the run's `random.Random`, which a checkpoint restores.
Built in: `addition` and `reversal` (`toy`), `squares` (`vision`: counting squares in a generated picture, for a
checkpoint with a vision tower), `guess` (`agent`: a multi-turn game against an environment, guess-the-number with
higher/lower feedback), `calculator` (`calculator`: a question with a calculator tool), both also in K3's chat format
(`chat: true`, `zerokl.tasks.chat`), `env` (`agent.EnvTask`: a user's environment class from a Python file), and `jsonl`
(`jsonl`): a user's JSONL dataset with a user or builtin reward function. An agent task has `episode(problem)` instead
of `reward` (`zerokl.tasks.agent`). A problem with images (`zerokl.tasks.vision.ImageProblem`) carries them beside its
prompt. Add one by writing such a class, its `__init__` keyword arguments typed (they are the task's `task_args`), and
registering it in `TASKS` (docs/ppo.md, "Adding a task").
"""

from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Any

from parity.config import ConfigError
from zerokl.tasks.agent import EnvTask, Episode, Guess, Turn
from zerokl.tasks.calculator import Calculator
from zerokl.tasks.base import Problem, Task
from zerokl.tasks.jsonl import JsonlTask
from zerokl.tasks.rewards import RewardError
from zerokl.tasks.toy import Addition, Reversal
from zerokl.tasks.vision import ImageProblem, Squares

__all__ = ["TASKS", "Addition", "Calculator", "EnvTask", "Episode", "Guess", "ImageProblem", "JsonlTask", "Problem",
           "RewardError", "Reversal", "Squares", "Task", "Turn", "make_task", "resolve_paths"]

TASKS: dict[str, type] = {"addition": Addition, "reversal": Reversal, "squares": Squares, "guess": Guess,
                          "calculator": Calculator, "env": EnvTask, "jsonl": JsonlTask}

_KINDS = {int: "an integer", str: "a string", bool: "true or false"}


def make_task(name: str, **args: Any) -> Task:
    """The task `name` built from `args` (its `task_args`); ConfigError naming an unknown task, an unknown or missing
    key (with the accepted ones), a value of the wrong type, or what the task itself refuses (a bad dataset line)."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; choose one of {', '.join(sorted(TASKS))}")
    cls = TASKS[name]
    params = {p.name: p for p in inspect.signature(cls).parameters.values()}
    types = typing.get_type_hints(cls.__init__)
    accepted = ", ".join(f"{k} ({_KINDS[types[k]]})" for k in params) or "none"
    unknown = sorted(set(args) - set(params))
    if unknown:
        raise ConfigError(f"task {name}: unknown task_args key(s) {', '.join(map(repr, unknown))}; accepted: "
                          f"{accepted}")
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in args]
    if missing:
        raise ConfigError(f"task {name}: task_args needs {', '.join(map(repr, missing))}; accepted: {accepted}")
    for key, value in args.items():
        if (isinstance(value, bool) and types[key] is not bool) or not isinstance(value, types[key]):  # not an int
            raise ConfigError(f"task {name}: task_args {key} must be {_KINDS[types[key]]}, got {value!r}")
    return cls(**args)


def resolve_paths(name: str, args: dict[str, Any], base: Path) -> dict[str, Any]:
    """`args` with the task's relative file paths made absolute against `base` (the directory of the config that
    names them); tasks without file arguments (no `resolve_paths` of their own) keep theirs as given."""
    resolve = getattr(TASKS.get(name), "resolve_paths", None)
    return resolve(args, base) if resolve is not None else dict(args)
