"""Score 8 prompts on a checkpoint three ways (batched, alone, token by token) with both kernel
backends and print how many log-probs are bit-identical: the parity contract in one screen."""

from __future__ import annotations

import sys

import torch

from parity.kernels import FAST, INVARIANT
from parity.model import K3Forward, K3Weights, new_cache, score_sequences
from zerokl.checkpoint import load_checkpoint


def decode_schedule(fwd: K3Forward, seq: list[int]) -> torch.Tensor:
    """Prefill the first half, then feed one token per step through the caches."""
    caches = new_cache(fwd.cfg, 1)
    half = len(seq) // 2
    steps = [(0, half)] + [(i, i + 1) for i in range(half, len(seq) - 1)]
    out = []
    for start, end in steps:
        hidden = fwd.hidden(torch.tensor([seq[start:end]]), torch.arange(start, end).view(1, -1),
                            torch.tensor([end - start]), caches)
        out.append(fwd.token_logprobs(fwd.logits(hidden[0]), torch.tensor(seq[start + 1 : end + 1]), 1.0))
    return torch.cat(out)


def main(ckpt: str) -> None:
    cfg, tensors = load_checkpoint(ckpt)
    weights = K3Weights.from_official(cfg.text, tensors)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, cfg.text.vocab_size, (int(n),), generator=g).tolist()
            for n in torch.randint(16, 48, (8,), generator=g)]
    print(f"{'kernels':<10} {'tokens':>7} {'alone==batched':>15} {'decode==batched':>16} {'max |d|':>10}")
    for kernels in (INVARIANT, FAST):
        fwd = K3Forward(weights, kernels)
        batched = score_sequences(fwd, seqs)
        alone = [score_sequences(fwd, [s])[0] for s in seqs]
        decoded = [decode_schedule(fwd, s) for s in seqs]
        n = sum(len(b) for b in batched)
        eq_alone = sum(int((a == b).sum()) for a, b in zip(alone, batched))
        eq_dec = sum(int((d == b).sum()) for d, b in zip(decoded, batched))
        diff = max(float((x - b).abs().max()) for pair in (alone, decoded) for x, b in zip(pair, batched))
        print(f"{kernels.name:<10} {n:>7} {eq_alone:>10}/{n:<4} {eq_dec:>11}/{n:<4} {diff:>10.2e}")


if __name__ == "__main__":
    main(sys.argv[1])
