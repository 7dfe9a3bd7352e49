"""`squares`: a multimodal task a tiny model can learn on CPU. Each problem is a small generated picture of 1 to
`max_count` coloured squares on a plain background, and the question "How many squares are in the image?"; the answer is
the count, rewarded with the toy tasks' partial credit (format, position-wise match, exact first word). The picture is
drawn from the run's `random.Random` alone, so a resumed run draws the same pictures.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from PIL import Image, ImageDraw

from parity.config import ConfigError
from parity.image import IMAGE_PLACEHOLDER
from zerokl.tasks.base import Problem
from zerokl.tasks.toy import partial_credit

GRID = 4  # squares sit in the cells of a GRID x GRID layout, one per cell


@dataclass(frozen=True)
class ImageProblem(Problem):
    """A problem whose prompt holds one image placeholder per image, and the images (RGB) in order."""

    images: tuple[Any, ...] = field(compare=False, default=())


class Squares:
    """'How many squares are in the image?' about a `size` x `size` picture of 1..max_count coloured squares."""

    name = "squares"

    def __init__(self, max_count: int = 4, size: int = 112):
        if not 1 <= max_count <= GRID * GRID:
            raise ConfigError(f"task squares: max_count must be in [1, {GRID * GRID}], got {max_count}")
        if size < 2 * GRID:
            raise ConfigError(f"task squares: size must be >= {2 * GRID} pixels, got {size}")
        self.max_count, self.size = max_count, size

    def sample(self, rng: random.Random) -> ImageProblem:
        count = rng.randint(1, self.max_count)
        cell = self.size // GRID
        image = Image.new("RGB", (self.size, self.size), _colour(rng, dark=True))
        draw = ImageDraw.Draw(image)
        for k in rng.sample(range(GRID * GRID), count):
            side = rng.randint(cell // 2, cell - 2)
            x, y = (k % GRID) * cell + 1, (k // GRID) * cell + 1
            draw.rectangle([x, y, x + side - 1, y + side - 1], fill=_colour(rng, dark=False))
        return ImageProblem(f"{IMAGE_PLACEHOLDER}How many squares are in the image? Answer:", str(count), (image,))

    def reward(self, completion: str, problem: Problem) -> float:
        return partial_credit(completion, problem.answer, "0123456789")


def _colour(rng: random.Random, dark: bool) -> tuple[int, int, int]:
    """A dark background or a bright square colour, so the squares stand out."""
    lo, hi = (0, 80) if dark else (150, 255)
    return rng.randint(lo, hi), rng.randint(lo, hi), rng.randint(lo, hi)
