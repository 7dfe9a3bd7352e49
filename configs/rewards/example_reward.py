"""An example reward function for `task: jsonl` (configs/ppo-tiny-jsonl-reward.yaml).

zerokl calls `fn(completion, sample)` once per sampled completion: `completion` is the generated text (after the
prompt, EOS removed), `sample` a copy of the dataset line as a dict (here {"prompt", "answer", "op"}). Return a finite
number; raising, or returning NaN, inf or a non-number, stops the run naming the dataset line. Keep it a pure function
of its arguments, so a resumed run scores as the uninterrupted one did.
"""


def score(completion: str, sample: dict) -> float:
    """1.0 when the first word is the answer, 0.5 when the answer is a later word, 0.1 for any digit, else 0."""
    answer = str(sample["answer"])
    words = [w.strip(".,!?") for w in completion.split()]
    if words and words[0] == answer:
        return 1.0
    if answer in words:
        return 0.5
    return 0.1 if any(ch.isdigit() for ch in completion) else 0.0
