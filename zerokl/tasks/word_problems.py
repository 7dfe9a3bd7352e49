"""One-digit word problems for `task: jsonl` with `reward: builtin:math`: short prompts, one-digit operands and
answers (0-9), so a randomly initialised tiny model gets partial signal. Deterministic (seed 0);
`python -m zerokl.tasks.word_problems configs/data/word-problems.jsonl` writes the file the repo ships.

Each line: {"prompt": "...? Answer:", "answer": 7, "op": "+" or "-"}.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COUNT, SEED = 300, 0
NAMES = ("Tom", "Ann", "Sam", "Mia", "Ben", "Liz")
ITEMS = ("apple", "pen", "cup", "book", "ball", "card")


def _things(n: int, item: str) -> str:
    return f"{n} {item}" if n == 1 else f"{n} {item}s"


def word_problem(rng: random.Random) -> dict[str, object]:
    """One problem drawn from `rng`: addition with a sum below 10, or subtraction with a result of at least 0."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if rng.random() < 0.5:
        a = rng.randrange(10)
        b = rng.randrange(10 - a)
        return {"prompt": f"{name} has {_things(a, item)} and gets {b} more. How many {item}s now? Answer:",
                "answer": a + b, "op": "+"}
    a = rng.randrange(10)
    b = rng.randrange(a + 1)
    return {"prompt": f"{name} has {_things(a, item)} and gives {b} away. How many {item}s are left? Answer:",
            "answer": a - b, "op": "-"}


def write(path: Path, count: int = COUNT, seed: int = SEED) -> None:
    """`count` problems from `random.Random(seed)`, one JSON object per line: the same bytes on every run."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(word_problem(rng)) + "\n" for _ in range(count)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSONL file to write, e.g. configs/data/word-problems.jsonl")
    write(parser.parse_args().out)


if __name__ == "__main__":
    main()
