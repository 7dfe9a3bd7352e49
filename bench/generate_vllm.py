"""Generation through real vLLM, the invariant kernels against `--kernels fast`, in one process: tokens/s per batch
size on the same checkpoint, prompts and seeds, with the ratio (invariant time / fast time).

Each kernel set gets its own `RolloutEngine` (one at a time, on `--gpu-memory-utilization` of the device); a first
call at each batch size compiles and warms (not timed), then `--reps` timed calls, the median kept. On CUDA the
invariant engine replays its decode steps from CUDA graphs and the fast one runs eagerly (`rollout.vllm.graphs`);
`--enforce-eager` runs both eagerly, like for like. Each row says which. Every prompt is
the same `--prompt-len` tokens, every sample runs `--max-tokens` tokens (`ignore_eos`), so the rows are decode-bound
at the batch sizes given.

    python bench/generate_vllm.py --model CKPT --batch-sizes 1,16,64 --max-tokens 64 --json OUT.json

Runs wherever vLLM runs zerokl (CUDA, or the CPU for a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

KERNEL_SETS = ("invariant", "fast")


def _timed_rows(checkpoint: str, kernels: str, args: argparse.Namespace) -> tuple[dict[int, float], str]:
    """({batch size: median seconds of one generate call}, "graphs" or "eager") for one kernel set."""
    from rollout.engine import RolloutEngine

    extra = {"gpu_memory_utilization": args.gpu_memory_utilization} if args.gpu_memory_utilization else {}
    engine = RolloutEngine(checkpoint, kernels=kernels, max_model_len=args.prompt_len + args.max_tokens + 16,
                           max_num_seqs=max(args.batch_sizes), enforce_eager=args.enforce_eager, **extra)
    mode = "graphs" if engine.graphs else "eager"
    prompt = [(7 * i) % 1000 + 4 for i in range(args.prompt_len)]
    rows = {}
    try:
        for batch in args.batch_sizes:
            def call(seed: int) -> None:
                engine.generate([prompt] * batch, temperature=1.0, max_tokens=args.max_tokens, seed=seed,
                                ignore_eos=True)

            call(0)
            times = []
            for rep in range(args.reps):
                start = time.perf_counter()
                call(rep + 1)
                times.append(time.perf_counter() - start)
            rows[batch] = statistics.median(times)
            print(f"{kernels:9s} ({mode}) batch {batch:3d}: {rows[batch]:.3f} s "
                  f"({batch * args.max_tokens / rows[batch]:.1f} tokens/s)", flush=True)
    finally:
        engine.close()
    return rows, mode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="official-format checkpoint directory")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for either kernel set")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    timed = {kernels: _timed_rows(args.model, kernels, args) for kernels in KERNEL_SETS}
    rows = {kernels: r for kernels, (r, _) in timed.items()}
    modes = {kernels: m for kernels, (_, m) in timed.items()}
    print(f"\n| batch x tokens | invariant ({modes['invariant']}) | fast ({modes['fast']}) | ratio |\n|---|---|---|---|")
    for batch in args.batch_sizes:
        inv, fast = rows["invariant"][batch], rows["fast"][batch]
        print(f"| {batch} x {args.max_tokens} | {inv:.3f} s | {fast:.3f} s | {inv / fast:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "modes": modes, "seconds": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
