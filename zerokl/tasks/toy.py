"""The built-in toy tasks, `addition` and `reversal`, with a partial-credit reward in [0, 1], so a randomly
initialised tiny model has signal from the first step:
  0.2 * format (share of valid answer characters among the first len(answer) + 1 characters)
+ 0.3 * position-wise match of the answer's characters
+ 0.5 * exact match of the first whitespace-separated word.
"""

from __future__ import annotations

import random

from parity.config import ConfigError
from zerokl.tasks.base import Problem


def partial_credit(completion: str, answer: str, alphabet: str) -> float:
    """The shared reward shape above; `alphabet` is the set of characters a well-formed answer uses."""
    text = completion.lstrip()
    head = text[: len(answer) + 1]
    fmt = sum(ch in alphabet for ch in head) / len(head) if head else 0.0
    pos = sum(a == b for a, b in zip(text, answer)) / len(answer)
    words = text.split()
    exact = 1.0 if words and words[0] == answer else 0.0
    return 0.2 * fmt + 0.3 * pos + 0.5 * exact


class Addition:
    """'What is a + b? Answer:' with a, b < 10**digits; the answer is the decimal sum."""

    name = "addition"

    def __init__(self, digits: int = 2):
        if digits < 1:
            raise ConfigError(f"task addition: digits must be >= 1, got {digits}")
        self.digits = digits

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randrange(10**self.digits), rng.randrange(10**self.digits)
        return Problem(f"What is {a} + {b}? Answer:", str(a + b))

    def reward(self, completion: str, problem: Problem) -> float:
        return partial_credit(completion, problem.answer, "0123456789")


class Reversal:
    """'Reverse the string abc. Answer:' -> 'cba'."""

    name = "reversal"

    def __init__(self, length: int = 4):
        if length < 1:
            raise ConfigError(f"task reversal: length must be >= 1, got {length}")
        self.length = length

    def sample(self, rng: random.Random) -> Problem:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(self.length))
        return Problem(f"Reverse the string {word}. Answer:", word[::-1])

    def reward(self, completion: str, problem: Problem) -> float:
        return partial_credit(completion, problem.answer, "abcdefghijklmnopqrstuvwxyz")
