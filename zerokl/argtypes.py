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


def kernel_set(text: str) -> str:
    """A `parity.kernels` kernel set name that this machine can run ('triton' needs CUDA or TRITON_INTERPRET=1)."""
    from parity.kernels import KERNEL_SETS, get_kernels

    if text not in KERNEL_SETS:
        raise argparse.ArgumentTypeError(f"choose one of {', '.join(KERNEL_SETS)}, got {text!r}")
    try:
        get_kernels(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


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
