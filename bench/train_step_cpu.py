"""One Megatron training step (forward + backward + Adam) of K3 on CPU: peak memory and step time, parity (invariant
kernels) vs fast, same run.

For each config (`--configs`, default k3-small) a random checkpoint in the config's compute dtype is written to a
temporary directory; each kernel set then trains in its own child process (so one's allocations never count in the
other's peak): one warm-up step, then `--repeats` timed steps (the fastest counts: the machine is shared). The loss is
the mean token log-prob of `--batch` random sequences of `--seq-len` tokens. Peak memory is the step's growth of the
resident set over what the process held before it (the kernel's peak-RSS counter, reset just before the step).
Prints seconds per step, peak MiB and the parity / fast ratios.
Usage: python bench/train_step_cpu.py [--configs configs/k3-small.yaml] [--batch 4] [--seq-len 256] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(checkpoint: str, kernels: str, batch: int, seq_len: int, repeats: int) -> None:
    """Runs in a fresh process: prints one JSON line {"seconds": fastest step, "peak_mib": step's RSS growth}."""
    from trainer.backend import build_backend
    from trainer.logprobs import PaddedBatch

    torch.manual_seed(0)
    seqs = torch.randint(4, 1000, (batch, seq_len)).tolist()
    data = PaddedBatch.from_sequences(seqs)
    backend = build_backend(checkpoint, lr=1e-5, kernels=kernels)

    def loss_fn(model):  # noqa: ANN001 - the backend's model: (ids, lens, temperature) -> log-probs [B, T]
        return -model(data.input_ids, data.lens, 1.0).mean()

    backend.train_step(loss_fn)  # warm-up
    times, peaks = [], []
    for _ in range(repeats):
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
        before = _status_kib("VmRSS")
        t0 = time.perf_counter()
        backend.train_step(loss_fn)
        times.append(time.perf_counter() - t0)
        peaks.append((_status_kib("VmHWM") - before) / 1024)
    backend.close()
    print(json.dumps({"seconds": min(times), "peak_mib": max(peaks)}))


def _measure(checkpoint: Path, kernels: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", str(checkpoint), kernels, "--batch", str(args.batch),
           "--seq-len", str(args.seq_len), "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["configs/k3-small.yaml"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("CHECKPOINT", "KERNELS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], args.batch, args.seq_len, args.repeats)
        return
    from parity.io.checkpoint import init_checkpoint

    print(f"batch {args.batch} x {args.seq_len} tokens, fastest of {args.repeats} steps after one warm-up")
    print("| config | parity s/step | fast s/step | ratio | parity peak MiB | fast peak MiB | ratio |")
    print("|---|---|---|---|---|---|---|")
    for config in args.configs:
        with tempfile.TemporaryDirectory() as tmp:
            init_checkpoint(config, tmp, seed=0)
            parity = _measure(Path(tmp), "invariant", args)
            fast = _measure(Path(tmp), "fast", args)
        print(f"| {Path(config).stem} | {parity['seconds']:.2f} | {fast['seconds']:.2f} | "
              f"{parity['seconds'] / fast['seconds']:.2f}x | {parity['peak_mib']:.0f} | {fast['peak_mib']:.0f} | "
              f"{parity['peak_mib'] / fast['peak_mib']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
