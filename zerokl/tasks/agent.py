"""Multi-turn tasks: the policy writes, an environment answers, the policy writes again.

An agent task is a task (`zerokl.tasks.base.Task`: `name`, `sample(rng) -> Problem`) with `episode(problem) ->
Episode`, one environment per trajectory: `step(action)` takes the text of the policy's turn (its tokens decoded, the
end-of-sequence token dropped) and returns a `Turn`: the observation appended to the trajectory as environment tokens
(never trained on, never checked), the reward the turn earned, and whether the trajectory ends. A trajectory's
reward is the sum of its turns' rewards. `zerokl.ppo.episodes` runs the episodes token-in/token-out.

Built in: `guess` (guess-the-number with higher/lower feedback; a tiny model learns the answer format and to move
its guess the way the feedback says within a few dozen steps on CPU), `calculator` (`zerokl.tasks.calculator`: an
arithmetic question with a calculator tool), and `env`: a user's task class from a Python file (`EnvTask`).
"""

from __future__ import annotations

import inspect
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from parity.config import ConfigError
from zerokl.tasks.base import Problem
from zerokl.tasks.chat import ChatAction, ToolCall
from zerokl.tasks.rewards import RewardError, import_file


@dataclass(frozen=True)
class Turn:
    """What the environment answers to one policy turn: the observation appended to the trajectory as environment
    tokens ("" when the trajectory ends; to a chat turn with tool calls, a tuple of one answer per call, in the calls'
    order, each rendered as its own tool message), the reward the turn earned, whether the trajectory ends, and how
    many tools the turn called and how many of those calls failed (counted per step)."""

    observation: str | tuple[str, ...]
    reward: float
    done: bool
    tool_calls: int = 0
    tool_errors: int = 0


def answer_tools(action: ChatAction, run: Callable[[ToolCall], tuple[str, bool]]) -> Turn:
    """A chat turn's tool calls answered in order: `run(call)` -> (answer, failed) for each well-formed call; a call
    whose arguments did not parse (`ToolCall.error`) is answered with that error, a failed call the policy sees."""
    answers, failed = [], 0
    for call in action.tool_calls:
        answer, bad = (f"error: {call.error}", True) if call.error is not None else run(call)
        answers.append(answer)
        failed += bad
    return Turn(tuple(answers), 0.0, False, tool_calls=len(answers), tool_errors=failed)


class Episode(Protocol):
    def step(self, action: str | ChatAction) -> Turn: ...


def action_text(action: str | ChatAction) -> str:
    """What a turn says: its text, or in K3's chat format its response channel."""
    return action.content if isinstance(action, ChatAction) else action


_INTEGER = re.compile(r"-?\d+")


class GuessEpisode:
    """One game: the secret is `int(problem.answer)` in [1, high]; each turn's first integer is the guess."""

    def __init__(self, secret: int, high: int, max_turns: int):
        self.secret, self.high, self.max_turns = secret, high, max_turns
        self.turns = 0

    def step(self, action: str | ChatAction) -> Turn:
        """Partial credit per turn: 0.1 for a guess at all, up to 0.2 for its closeness; 0.5 + 0.5 x (turns left
        share) for the right number, which ends the game. Feedback ' higher.' / ' lower.' / ' no number.', then the
        next ' Guess:'."""
        self.turns += 1
        found = _INTEGER.search(action_text(action))
        if found is None:
            return Turn(" no number. Guess:", 0.0, self.turns >= self.max_turns)
        guess = int(found.group())
        closeness = max(0.0, 1.0 - abs(guess - self.secret) / self.high)
        if guess == self.secret:
            return Turn("", 0.1 + 0.2 + 0.5 + 0.5 * (self.max_turns - self.turns) / self.max_turns, True)
        hint = " higher." if guess < self.secret else " lower."
        return Turn(f"{hint} Guess:", 0.1 + 0.2 * closeness, self.turns >= self.max_turns)


class Guess:
    """'I picked a number from 1 to high. Guess:' with ' higher.' / ' lower.' feedback after each guess, for up to
    `max_turns` guesses (the trajectory also ends at the run's `max_turns`, whichever comes first). With `chat`, in
    K3's chat format (`zerokl.tasks.chat`): the guess is the response channel's first integer, the feedback a user
    message."""

    name = "guess"
    system = "Guess the number. Reply with one number."

    def __init__(self, high: int = 9, max_turns: int = 3, chat: bool = False):
        if high < 2:
            raise ConfigError(f"task guess: high must be >= 2, got {high}")
        if max_turns < 1:
            raise ConfigError(f"task guess: max_turns must be >= 1, got {max_turns}")
        self.high, self.max_turns, self.chat = high, max_turns, chat

    def sample(self, rng: random.Random) -> Problem:
        return Problem(f"I picked a number from 1 to {self.high}. Guess:", str(rng.randint(1, self.high)))

    def episode(self, problem: Problem) -> GuessEpisode:
        return GuessEpisode(int(problem.answer), self.high, self.max_turns)


class _Failed:
    """The episode of a problem whose environment could not be made: its first step ends the trajectory."""

    def __init__(self, why: str):
        self.why = why

    def step(self, action: str | ChatAction) -> Turn:
        raise RuntimeError(self.why)


class EnvTask:
    """A user's agent task: `path` is FILE.py:CLASS, a class whose instance (made with no arguments) has
    `sample(rng) -> Problem` (drawing only from `rng`) and `episode(problem)` -> an object with `step(action) ->
    Turn` (`from zerokl.tasks import Problem, Turn`); a class with `chat = True` (and optionally `tools`, `system`,
    `thinking`) runs in K3's chat format and its `step` receives a `ChatAction`. Checked at config load (the file
    imports, the class is there, an instance samples a problem); a `sample` that fails later stops the run naming it,
    an `episode` or `step` that fails ends its trajectory."""

    name = "env"

    def __init__(self, path: str):
        file, _, cls_name = path.rpartition(":")
        label = f"task env: path {path!r}"
        if not file.endswith(".py") or not cls_name.isidentifier():
            raise ConfigError(f"{label}: expected FILE.py:CLASS (an environment class in your Python file)")
        cls = getattr(import_file(Path(file), label), cls_name, None)
        if not inspect.isclass(cls):
            raise ConfigError(f"{label}: {file} has no class {cls_name!r}")
        try:
            self.impl = cls()
        except Exception as e:  # a user's class: its own error, reported
            raise ConfigError(f"{label}: {cls_name}() raised {type(e).__name__}: {e}") from None
        missing = [m for m in ("sample", "episode") if not callable(getattr(self.impl, m, None))]
        if missing:
            raise ConfigError(f"{label}: {cls_name} has no method {missing[0]}(...)")
        self.label = label
        # K3's chat format when the class asks for it (`zerokl.tasks.chat`): its tools, system message and thinking
        self.chat = bool(getattr(self.impl, "chat", False))
        self.tools = getattr(self.impl, "tools", None)
        self.system = getattr(self.impl, "system", None)
        self.thinking = bool(getattr(self.impl, "thinking", False))
        try:
            self.sample(random.Random(0))  # a throwaway draw: a class that cannot sample is refused now
        except RewardError as e:
            raise ConfigError(str(e)) from None

    @staticmethod
    def resolve_paths(args: dict[str, Any], base: Path) -> dict[str, Any]:
        """`args` with a relative FILE.py of `path` made absolute against `base` (the PPO config's directory)."""
        out = dict(args)
        if isinstance(out.get("path"), str) and ":" in out["path"]:
            file, _, name = out["path"].rpartition(":")
            out["path"] = f"{base / Path(file).expanduser()}:{name}"
        return out

    def sample(self, rng: random.Random) -> Problem:
        try:
            problem = self.impl.sample(rng)
        except Exception as e:
            raise RewardError(f"{self.label}: sample raised {type(e).__name__}: {e}") from None
        if not isinstance(problem, Problem) or not isinstance(problem.prompt, str) or not problem.prompt:
            raise RewardError(f"{self.label}: sample returned {problem!r}, not a Problem with a prompt")
        return problem

    def episode(self, problem: Problem) -> Any:
        try:
            return self.impl.episode(problem)
        except Exception as e:  # this trajectory ends at its first step; the run goes on
            return _Failed(f"episode(problem) raised {type(e).__name__}: {e}")
