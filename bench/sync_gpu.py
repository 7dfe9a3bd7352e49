"""The in-process weight sync (trainer and rollout weights on one device) against a plain `copy_` of the same bytes, in
one process: GB/s of each phase and of the whole sync, and the ratio to the copy.

The Megatron trainer on `--config` (a random checkpoint) exports its weights as the engine holds them
(`zerokl.ppo.sync.Sync.export_base`'s steps: `export_official`, then `parity.weights.serving_weights`: bf16 casts,
the routed experts quantised to MXFP4 and packed), `WeightBundle.make` checksums every tensor on the device, and a
`TensorStore` on the same device (the engine's side in miniature) receives it in memory (the tensors by reference:
CUDA IPC, `sync: cuda_ipc` between the trainer and vLLM's worker, cannot open a handle in the process that made it;
the PPO run's `time_sync` measures that path), verifies every checksum there and copies the tensors in. Each phase is timed with the device
synchronised around it, median of `--reps` after one warm-up. The ceiling: `dst.copy_(src)` of one buffer of the
bundle's byte count (bytes read once and written once, like the sync's final copy).

    python bench/sync_gpu.py --config configs/k3-1b.yaml --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.io.checkpoint import init_checkpoint  # noqa: E402
from parity.sync.bundle import TensorStore, WeightBundle  # noqa: E402
from parity.sync.transports import Memory  # noqa: E402
from parity.weights import serving_weights  # noqa: E402
from trainer.megatron.backend import MegatronBackend  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/k3-1b.yaml")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(args.config, Path(tmp) / "ckpt", seed=0)
        backend = MegatronBackend(ckpt, lr=1e-5, clip_grad=1.0, weight_decay=0.0, kernels="invariant", adapter=None)
        text = backend.model_cfg.text
        transport = Memory()
        store: TensorStore | None = None
        rows: dict[str, list[float]] = {k: [] for k in ("export", "checksums", "transfer_verify_apply", "sync")}
        nbytes = 0
        for rep in range(args.reps + 1):
            t_export, weights = timed(lambda: serving_weights(text, backend.export_official()))
            t_make, bundle = timed(lambda: WeightBundle.make(rep + 1, weights))
            if store is None:
                store = TensorStore({n: torch.empty_like(t) for n, t in bundle.tensors.items()})

            def deliver() -> None:
                message = transport.send(bundle)
                try:
                    store.receive(transport, message)
                finally:
                    transport.release(message)

            t_apply, _ = timed(deliver)
            nbytes = bundle.nbytes()
            if rep:  # the first is a warm-up
                for k, v in (("export", t_export), ("checksums", t_make), ("transfer_verify_apply", t_apply),
                             ("sync", t_export + t_make + t_apply)):
                    rows[k].append(v)
        src = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        copies = [timed(lambda: dst.copy_(src))[0] for _ in range(args.reps + 1)][1:]
        backend.close()
    copy_s = statistics.median(copies)
    device = torch.cuda.get_device_name() if CUDA else "cpu"
    print(f"# {args.config}, {device}: {nbytes / 1e9:.3f} GB a sync")
    print("| phase | median s | GB/s | copy / phase |\n|---|---|---|---|")
    result = {"config": args.config, "device": device, "bytes": nbytes,
              "copy_s": copy_s, "phases": {}}
    for k, v in [*rows.items(), ("copy_", copies)]:
        s = statistics.median(v)
        print(f"| {k} | {s:.4f} | {nbytes / s / 1e9:.1f} | {copy_s / s:.3f} |")
        result["phases"][k] = {"median_s": s, "all_s": v, "GBps": nbytes / s / 1e9}
    print(f"sync at {copy_s / statistics.median(rows['sync']):.1%} of the copy's bandwidth (goal >= 50%)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
