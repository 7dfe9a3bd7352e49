"""An example user environment for `task: env` (configs/ppo-tiny-agent-env.yaml): spell a word back, letter hints.

The class is instantiated with no arguments; `sample(rng)` draws a problem from the run's `random.Random` only (so a
resumed run draws the same ones); `episode(problem)` makes one trajectory's environment, whose `step(action)` gets
the policy's turn as text and returns a `Turn(observation, reward, done)`.
"""

import random

from zerokl.tasks import Problem, Turn

WORDS = ["cat", "dog", "sun", "map", "pen", "cup", "box", "hat"]


class SpellBack:
    def sample(self, rng: random.Random) -> Problem:
        word = rng.choice(WORDS)
        return Problem(f"Repeat the word {word}. Answer:", word)

    def episode(self, problem: Problem) -> "Episode":
        return Episode(problem.answer)


class Episode:
    def __init__(self, word: str):
        self.word, self.turns = word, 0

    def step(self, action: str) -> Turn:
        self.turns += 1
        said = action.strip().split()[:1]
        if said == [self.word]:
            return Turn("", 1.0 / self.turns, True)
        shown = self.word[: self.turns]
        return Turn(f" no, it starts with {shown}. Answer:", 0.0, self.turns >= 3)
