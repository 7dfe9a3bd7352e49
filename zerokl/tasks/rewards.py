"""Reward functions for `task: jsonl`, named in its `reward` arg: `builtin:NAME` (`BUILTINS`) or `FILE.py:FUNCTION`, a
function `fn(completion: str, sample: dict) -> float` in a user's Python file, `sample` being the dataset line.

The builtin `math` reward is GSM8K-style final-number matching: the last number in the completion (thousands commas
removed) against the final number of the sample's `answer`, compared exactly as rationals (7 = 7.0 = 7.00):
1.0 when equal, 0.1 for a completion that ends in another number (partial credit for the format, so a randomly
initialised tiny model has signal), 0.0 when the completion has no number.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any

from parity.config import ConfigError

RewardFn = Callable[[str, dict[str, Any]], float]


class RewardError(Exception):
    """A reward function failed on a sample during a run (it raised, or returned something that is not a finite
    number); the message names the dataset file and line, the function and the reason."""


@dataclass(frozen=True)
class Reward:
    """A loaded reward: `fn` as the config spells it (`spec`), and `check(sample)`, run on every dataset line at load:
    why the line cannot be scored, or None."""

    spec: str
    fn: RewardFn
    check: Callable[[dict[str, Any]], str | None] | None = None


# a minus sign counts when it does not follow a word character or ')' ("5-3" is 5 and 3, "(-3)" is -3); commas
# only as thousands separators ("1,234" is 1234, "7,8" is 7 and 8); a decimal point only between digits ("7." is 7)
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?")


def last_number(text: str) -> Fraction | None:
    """The last number written in `text`, exactly (commas removed), or None when it has none."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def answer_number(answer: Any) -> Fraction | None:
    """The number an answer states: a JSON number itself, or the last number in an answer text (GSM8K's
    "... #### 72")."""
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return Fraction(str(answer))
    return last_number(answer) if isinstance(answer, str) else None


def math_reward(completion: str, sample: dict[str, Any]) -> float:
    """1.0 when the completion's last number equals the answer's, 0.1 for another number, 0.0 for none."""
    got = last_number(completion)
    if got is None:
        return 0.0
    return 1.0 if got == answer_number(sample["answer"]) else 0.1


def _math_check(sample: dict[str, Any]) -> str | None:
    if answer_number(sample["answer"]) is None:
        return f"answer {sample['answer']!r} has no number for builtin:math to compare with"
    return None


BUILTINS: dict[str, Reward] = {"math": Reward("builtin:math", math_reward, _math_check)}


def load_reward(spec: str) -> Reward:
    """The reward `spec` names (`builtin:NAME` or `FILE.py:FUNCTION`, FILE absolute or relative to the working
    directory), imported and checked to be callable with (completion, sample); ConfigError otherwise."""
    kind, _, name = spec.partition(":")
    if kind == "builtin":
        if name not in BUILTINS:
            raise ConfigError(f"reward {spec!r}: no builtin reward {name!r}; builtins: "
                              f"{', '.join('builtin:' + b for b in sorted(BUILTINS))}")
        return BUILTINS[name]
    file, _, name = spec.rpartition(":")
    if not file.endswith(".py") or not name.isidentifier():
        raise ConfigError(f"reward {spec!r}: expected FILE.py:FUNCTION (a function in your Python file) or "
                          f"builtin:NAME ({', '.join('builtin:' + b for b in sorted(BUILTINS))})")
    module = import_file(Path(file), f"reward {spec!r}")
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items()
                         if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise ConfigError(f"reward {spec!r}: {file} has no function {name!r}; it defines "
                          f"{', '.join(defined) if defined else 'no functions'}")
    fn = getattr(module, name)
    if not callable(fn):
        raise ConfigError(f"reward {spec!r}: {name} in {file} is not callable: {fn!r}")
    try:
        inspect.signature(fn).bind("completion", {})
    except TypeError:
        raise ConfigError(f"reward {spec!r}: {name}{inspect.signature(fn)} cannot be called as "
                          f"{name}(completion, sample)") from None
    except ValueError:
        pass  # no signature to inspect (some builtins): left to the first call
    return Reward(spec, fn)


def import_file(file: Path, label: str) -> ModuleType:
    """The module in `file`, executed once per process (as `import` does), under a name derived from its path;
    ConfigError starting with `label` (what names the file in the config) when it is missing or its import raises."""
    if not file.is_file():
        raise ConfigError(f"{label}: no such file {file}")
    module_name = "zerokl_user_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:16]
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader = importlib.util.spec_from_file_location(module_name, file)
    assert loader is not None and loader.loader is not None  # a .py file always has a source loader
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    try:
        loader.loader.exec_module(module)
    except Exception as e:  # a user's file: its own error, reported, not a traceback
        del sys.modules[module_name]
        raise ConfigError(f"{label}: importing {file} raised {type(e).__name__}: {e}") from None
    return module
