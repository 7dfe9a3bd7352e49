"""Per-op and whole-forward time of the invariant kernels against the fast (plain torch) baseline.

Prints one table per config (k3-tiny, k3-small): median milliseconds over repeats and the
invariant / fast ratio, measured in the same run. Usage: python bench/kernels_cpu.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from parity.config import load_model_config
from parity.kernels import FAST, INVARIANT, Kernels
from parity.model import K3Forward, K3Weights, score_sequences
from parity.io.checkpoint import random_weights


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _op_cases(cfg, tokens: int) -> dict[str, Callable[[Kernels], object]]:
    t = cfg.text
    g = torch.Generator().manual_seed(0)
    d, h, k = t.hidden_size, t.kda_num_heads, t.kda_head_dim
    x = torch.randn(tokens, d, generator=g)
    w = torch.randn(t.intermediate_size, d, generator=g)
    seq = torch.randn(1, tokens, h, k, generator=g)
    gate = -torch.rand(1, tokens, h, k, generator=g)
    beta = torch.rand(1, tokens, h, generator=g)
    s0 = torch.zeros(1, h, k, k)
    qh = torch.randn(1, tokens, t.num_attention_heads, t.qk_head_dim, generator=g)
    vh = torch.randn(1, tokens, t.num_attention_heads, t.v_head_dim, generator=g)
    pos = torch.arange(tokens).view(1, -1)
    logits = torch.randn(tokens, t.vocab_size, generator=g)
    toks = torch.randint(0, t.vocab_size, (tokens,), generator=g)
    cands = torch.randn(tokens, 4, d, generator=g)
    router = torch.randn(tokens, t.num_experts or 8, generator=g)
    return {
        "linear": lambda kk: kk.linear(x, w),
        "rmsnorm": lambda kk: kk.rmsnorm(x, x[0], 1e-6),
        "situ_glu": lambda kk: kk.situ_glu(x, x, 4.0, 25.0),
        "short_conv": lambda kk: kk.short_conv(x.unsqueeze(0), torch.randn(d, 4), torch.zeros(1, 3, d)),
        "kda": lambda kk: kk.kda(kk.l2norm(seq), kk.l2norm(seq), seq, gate, beta, k**-0.5, s0),
        "attention": lambda kk: kk.attention(qh, qh, vh, pos, torch.tensor([tokens]), 0.1),
        "attn_res_mix": lambda kk: kk.attn_res_mix(cands, x[0], x[1], 1e-6),
        "route": lambda kk: kk.route(router, None, max(t.num_experts_per_token, 1), True, 2.5, "sigmoid"),
        "token_logprobs": lambda kk: kk.token_logprobs(logits, toks, 1.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 keeps timings stable when other jobs share the cores)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, tokens/op {args.tokens}")
    for name in ("k3-tiny", "k3-small"):
        cfg = load_model_config(f"configs/{name}.yaml")
        print(f"\n## {name}\n| op | invariant ms | fast ms | invariant / fast |\n|---|---|---|---|")
        for op, fn in _op_cases(cfg, args.tokens).items():
            inv = _median_ms(lambda: fn(INVARIANT), args.repeats)
            fast = _median_ms(lambda: fn(FAST), args.repeats)
            print(f"| {op} | {inv:.2f} | {fast:.2f} | {inv / fast:.2f}x |")
        weights = K3Weights.from_official(cfg.text, random_weights(cfg, 0))
        g = torch.Generator().manual_seed(1)
        seqs = [torch.randint(4, cfg.text.vocab_size, (64,), generator=g).tolist() for _ in range(8)]
        inv = _median_ms(lambda: score_sequences(K3Forward(weights, INVARIANT), seqs), max(args.repeats // 2, 1))
        fast = _median_ms(lambda: score_sequences(K3Forward(weights, FAST), seqs), max(args.repeats // 2, 1))
        print(f"| whole forward 8 x 64 | {inv:.1f} | {fast:.1f} | {inv / fast:.2f}x |")


if __name__ == "__main__":
    main()
