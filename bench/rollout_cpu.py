"""Rollout throughput of K3 in the real vLLM engine on CPU: parity (invariant kernels) vs fast, same run.

For each config (k3-tiny, k3-small) and compute dtype (`--dtypes`: the checkpoint's torch_dtype, fp32 and bf16) a
random checkpoint is written to a temporary directory, then one vLLM engine per kernel backend generates the same workload `--repeats` times after one warm-up call
(the fastest repeat counts: the machine is shared): `--prompts` prompts
of `--prompt-len` random tokens, `--max-tokens` sampled tokens each (EOS ignored, so every run produces
the same number of tokens). Prints generated and total (prompt + generated) tokens per second, end to end,
and the parity / fast time ratio.
Usage: python bench/rollout_cpu.py [--configs configs/k3-tiny.yaml ...] [--dtypes float32 bfloat16] [--prompts 16]
       [--max-tokens 32]
(the table goes to stdout, vLLM's logs to stderr)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from rollout.engine import RolloutEngine
from parity.io.checkpoint import init_checkpoint


def _workload(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 1000, (length,), generator=g).tolist() for _ in range(n)]


def _measure(checkpoint: Path, kernels: str, prompts: list[list[int]], max_tokens: int, max_num_seqs: int,
             repeats: int) -> tuple[float, int]:
    """(fastest seconds for the workload, generated tokens) on a fresh engine, after a warm-up call."""
    with RolloutEngine(checkpoint, kernels=kernels, max_model_len=2048, max_num_seqs=max_num_seqs,
                       enable_prefix_caching=False) as engine:
        engine.generate(prompts[:2], max_tokens=4, ignore_eos=True)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            samples = engine.generate(prompts, max_tokens=max_tokens, seed=1, ignore_eos=True)
            times.append(time.perf_counter() - t0)
    return min(times), sum(len(s.completion_ids) for s in samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["configs/k3-tiny.yaml", "configs/k3-small.yaml"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    prompts = _workload(args.prompts, args.prompt_len)
    prompt_tokens = args.prompts * args.prompt_len
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} generated tokens each, "
          f"max_num_seqs {args.max_num_seqs}, fastest of {args.repeats} repeats")
    print(f"{'config':<16} {'dtype':<9} {'kernels':<10} {'seconds':>8} {'gen tok/s':>10} {'total tok/s':>12} "
          f"{'parity/fast':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            for dtype in args.dtypes:
                checkpoint = init_checkpoint(config, Path(tmp) / f"{Path(config).stem}-{dtype}", seed=0, dtype=dtype)
                rows = {k: _measure(checkpoint, k, prompts, args.max_tokens, args.max_num_seqs, args.repeats)
                        for k in ("invariant", "fast")}
                for kernels, (seconds, generated) in rows.items():
                    ratio = f"{seconds / rows['fast'][0]:.2f}x time" if kernels == "invariant" else ""
                    print(f"{Path(config).stem:<16} {dtype:<9} {kernels:<10} {seconds:8.2f} {generated / seconds:10.1f} "
                          f"{(prompt_tokens + generated) / seconds:12.1f} {ratio:>12}", flush=True)


if __name__ == "__main__":
    main()
