"""Rollout with and without drafts (MTP, DSpark) in the real vLLM engine on CPU, parity (invariant kernels) vs fast,
same run.

A random checkpoint of `--config` (default configs/k3-tiny-mxfp4.yaml: bf16, MXFP4 experts, FP8 latents, one MTP
layer) and a random DSpark draft of `--draft-config` (default configs/k3-tiny-dspark.yaml) are written to a temporary
directory; for each kernel set and each setting (no drafts; MTP and DSpark with `--num-speculative-tokens`
probabilistic drafts) one engine generates the same workload `--repeats` times after a
warm-up call (the fastest repeat counts: the machine is shared): `--prompts` prompts of `--prompt-len` random tokens,
`--max-tokens` sampled tokens each (EOS ignored). Prints generated tokens per second, the drafts' acceptance rate
(accepted / proposed draft tokens, all repeats) and each row's time against the fast kernels without drafts (the
non-invariant baseline). A random draft accepts little; the rates show the machinery, not a trained draft.
Usage: python bench/speculative_cpu.py [--config configs/k3-tiny-mxfp4.yaml] [--draft-config configs/k3-tiny-dspark.yaml]
[--prompts 16] [--max-tokens 48]
(the table goes to stdout, vLLM's logs to stderr)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from rollout.engine import RolloutEngine
from parity.io.checkpoint import init_checkpoint
from rollout_cpu import _workload


def _measure(checkpoint: Path, kernels: str, spec: dict | None, prompts: list[list[int]], max_tokens: int,
             repeats: int) -> tuple[float, int, tuple[int, int]]:
    """(fastest seconds, generated tokens, (draft tokens, accepted) over the timed repeats) on a fresh engine."""
    extra = {} if spec is None else {"speculative_config": spec}
    with RolloutEngine(checkpoint, kernels=kernels, max_model_len=2048, max_num_seqs=16, enable_prefix_caching=False,
                       **extra) as engine:
        engine.generate(prompts[:2], max_tokens=4, ignore_eos=True)
        before = engine.draft_counts()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            samples = engine.generate(prompts, max_tokens=max_tokens, seed=1, ignore_eos=True)
            times.append(time.perf_counter() - t0)
        after = engine.draft_counts()
    return min(times), sum(len(s.completion_ids) for s in samples), (after[0] - before[0], after[1] - before[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/k3-tiny-mxfp4.yaml")
    parser.add_argument("--draft-config", default="configs/k3-tiny-dspark.yaml")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    prompts = _workload(args.prompts, args.prompt_len)
    k = args.num_speculative_tokens
    mtp = {"method": "mtp", "num_speculative_tokens": k, "draft_sample_method": "probabilistic"}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(args.config, Path(tmp) / "ckpt", seed=0)
        draft = init_checkpoint(args.draft_config, Path(tmp) / "draft", seed=0)
        dspark = {**mtp, "method": "dspark", "model": str(draft)}
        rows = []
        for kernels in ("fast", "invariant"):
            for name, setting in (("none", None), (f"mtp x{k}", mtp), (f"dspark x{k}", dspark)):
                secs, tokens, (drafted, accepted) = _measure(ckpt, kernels, setting, prompts, args.max_tokens,
                                                             args.repeats)
                rows.append((kernels, name, secs, tokens, drafted, accepted))
    base = rows[0][2]
    print(f"{args.config}: {args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} sampled each")
    print(f"{'kernels':<10} {'drafts':<10} {'gen tok/s':>10} {'acceptance':>11} {'time / fast, no drafts':>23}")
    for kernels, name, secs, tokens, drafted, accepted in rows:
        rate = f"{accepted / drafted:.1%}" if drafted else "-"
        print(f"{kernels:<10} {name:<10} {tokens / secs:>10.1f} {rate:>11} {secs / base:>23.2f}")


if __name__ == "__main__":
    main()
