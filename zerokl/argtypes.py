"""argparse types shared by the subcommands: a bad value ends in argparse's usage error (exit 2) naming the flag."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def temperature(text: str) -> float:
    """A finite sampling temperature >= 1e-5: below it vLLM samples greedily and then reports log-probs at
    temperature 1, which is not the distribution used."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 1e-5):
        raise argparse.ArgumentTypeError(f"expected a finite temperature >= 1e-5, got {value}")
    return value
