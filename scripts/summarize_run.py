"""Summarise a `zerokl ppo` metrics.jsonl: parity at every step, reward over the run, throughput.
Exits non-zero if any step had KL != 0 or a log-prob that was not bitwise equal."""

from __future__ import annotations

import json
import sys


def main(path: str) -> int:
    rows = [json.loads(line) for line in open(path)]
    n = len(rows)
    exact = sum(r["kl"] == 0.0 and r["bitwise_equal_frac"] == 1.0 for r in rows)
    first = rows[: min(10, n)]
    last = rows[-min(10, n):]
    mean = lambda xs, k: sum(x[k] for x in xs) / len(xs)  # noqa: E731
    print(f"steps: {n}; steps with KL exactly 0 and every log-prob bitwise equal: {exact}/{n}")
    print(f"reward_mean: first {len(first)} steps {mean(first, 'reward_mean'):.3f} -> "
          f"last {len(last)} steps {mean(last, 'reward_mean'):.3f}")
    print(f"rollout {mean(rows, 'rollout_tokens_per_s'):.0f} tok/s, train {mean(rows, 'train_tokens_per_s'):.0f} tok/s, "
          f"weight sync {mean(rows, 'sync_seconds') * 1e3:.0f} ms ({rows[0]['sync_bytes'] / 1e6:.1f} MB) per step")
    return 0 if exact == n else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
