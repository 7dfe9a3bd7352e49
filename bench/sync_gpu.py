"""The in-process weight sync (trainer and rollout weights on one device) against a plain `copy_` of the same bytes, in
one process: GB/s of each phase and of the whole sync, and the ratio to the copy.

The Megatron trainer on `--config` (a random checkpoint) exports its weights as the engine holds them, the way
`zerokl.ppo.sync.Sync.base_bundle` does: `export_official` (the fp32 masters by official name), then
`parity.sync.serving.ServingBuffer` (bf16 casts and the routed experts' MXFP4 packing written into one flat buffer,
its checksums one launch); a `TensorStore` on the same device (the engine's side in miniature) receives it in memory
(the buffer by reference: CUDA IPC, `sync: cuda_ipc` between the trainer and vLLM's worker, cannot open a handle in
the process that made it; the PPO run's `time_sync` measures that path), copies it whole, verifies its word sums
and swaps it in. Each phase is timed with the device synchronised around it, median of `--reps` after one warm-up.
The per-tensor path it replaced (`serving_weights`, `WeightBundle.make`, a store verifying and cloning each tensor)
runs in the same process as the `before` row.

The ceiling: `dst.copy_(src)` of one buffer of the bundle's byte count (read once, written once). A sync must read
the fp32 masters, write the bundle, and the receiver read and write it again, so its best ratio to the copy is
2 B / (M + 3 B) for B bundle bytes and M master bytes (printed as `bound`), before any checksum is read.

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
from parity.sync.serving import ServingBuffer  # noqa: E402
from parity.sync.transports import Memory  # noqa: E402
from parity.weights import serving_weights, text_specs  # noqa: E402
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


def deliver(bundle: WeightBundle, store: TensorStore) -> None:
    transport = Memory()
    message = transport.send(bundle)
    try:
        store.receive(transport, message)
    finally:
        transport.release(message)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/k3-1b.yaml")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    phases = ("export", "serve", "transfer_verify_apply", "sync", "before")
    rows: dict[str, list[float]] = {k: [] for k in phases}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_checkpoint(args.config, Path(tmp) / "ckpt", seed=0)
        backend = MegatronBackend(ckpt, lr=1e-5, clip_grad=1.0, weight_decay=0.0, kernels="invariant", adapter=None)
        text = backend.model_cfg.text
        serving = ServingBuffer(text)
        store: TensorStore | None = None
        before: TensorStore | None = None
        for rep in range(args.reps + 1):
            t_export, masters = timed(backend.export_official)
            t_serve, bundle = timed(lambda: serving.bundle(rep + 1, masters))
            if store is None:
                store = TensorStore({n: torch.empty_like(t) for n, t in bundle.tensors.items()})
            t_apply, _ = timed(lambda: deliver(bundle, store))
            assert store.version == rep + 1

            def per_tensor() -> None:
                old = WeightBundle.make(rep + 1, serving_weights(text, backend.export_official()))
                deliver(old, before)

            if before is None:
                before = TensorStore({n: torch.empty_like(t) for n, t in bundle.tensors.items()})
            t_before, _ = timed(per_tensor)
            if rep:  # the first is a warm-up
                for k, v in zip(phases, (t_export, t_serve, t_apply, t_export + t_serve + t_apply, t_before)):
                    rows[k].append(v)
        assert all(torch.equal(store.tensors[n], t) for n, t in before.tensors.items())  # the same bytes
        nbytes = bundle.nbytes()
        master_bytes = sum(masters[n].numel() * masters[n].element_size() for n in text_specs(text))
        src = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        copies = [timed(lambda: dst.copy_(src))[0] for _ in range(args.reps + 1)][1:]
        backend.close()
    copy_s = statistics.median(copies)
    device = torch.cuda.get_device_name() if CUDA else "cpu"
    bound = 2 * nbytes / (master_bytes + 3 * nbytes)
    print(f"# {args.config}, {device}: {nbytes / 1e9:.3f} GB a sync from {master_bytes / 1e9:.3f} GB of masters")
    print("| phase | median s | GB/s | copy / phase |\n|---|---|---|---|")
    result = {"config": args.config, "device": device, "bytes": nbytes, "master_bytes": master_bytes,
              "copy_s": copy_s, "bound": bound, "phases": {}}
    for k, v in [*rows.items(), ("copy_", copies)]:
        s = statistics.median(v)
        print(f"| {k} | {s:.4f} | {nbytes / s / 1e9:.1f} | {copy_s / s:.3f} |")
        result["phases"][k] = {"median_s": s, "all_s": v, "GBps": nbytes / s / 1e9}
    sync_s, before_s = statistics.median(rows["sync"]), statistics.median(rows["before"])
    print(f"sync at {copy_s / sync_s:.1%} of the copy's bandwidth (goal >= 50%; bound {bound:.1%}); "
          f"{before_s / sync_s:.1f}x faster than the per-tensor path ({copy_s / before_s:.2%})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
