"""Weight-sync rate against an NCCL broadcast measured in the same run, for any number of ranks, extrapolated to K3's
2.8T parameters.

Rank 0 is the trainer; every other rank is a rollout rank (its own GPU on a CUDA host, NCCL; CPU ranks over gloo
elsewhere). Three measurements, each a median over `--reps` after one warm-up:

1. the ceiling: `dist.broadcast` of one `--buffer-mib` buffer from rank 0 to all ranks;
2. a full-weight sync of `--config`'s text weights in bf16 (fp32-stored tensors in fp32) and in the stored form with
   MXFP4-packed routed experts (`parity.weights.stored_specs`), each a versioned `WeightBundle` through
   `TorchDistributed` (bucketed broadcasts): `make` (a checksum per tensor on rank 0's device), `transfer` (manifest
   and buckets, on the rollout ranks) and `verify` (every checksum recomputed on the rollout rank's device, names,
   shapes, dtypes, version; a failure stops the run);
3. the seconds a 2.8T sync would take at the measured rates, from `configs/k3-full.yaml`'s tensor sizes (no tensor
   allocated), in each form.

The tensors hold random bits drawn on the device (a sync moves bytes: their values do not change its cost).

    torchrun --nproc-per-node N bench/sync_rate.py --config configs/k3-1b.yaml --json OUT.json

On CUDA, NVLink multicast must be off in the environment (`NCCL_NVLS_ENABLE=0`). Exit 0 only if every sync
verified on every rollout rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.config import TextConfig, load_model_config  # noqa: E402
from parity.sync.bundle import SyncError, WeightBundle, verify  # noqa: E402
from parity.sync.transports import TorchDistributed  # noqa: E402
from parity.weights import WeightSpec, serving_dtype, stored_specs, text_specs  # noqa: E402

TRAINER = 0
FULL_SCALE = "configs/k3-full.yaml"
PUBLISHED_S = {"checkpoint-engine": 16.0, "SGLang P2P": 7.2, "RDMA point-to-point (under)": 1.3}


def init(timeout_min: int = 10) -> tuple[torch.device, dist.ProcessGroup]:
    """NCCL with rank r on GPU LOCAL_RANK on a CUDA host (multicast off), else gloo; plus a gloo group for host-side
    coordination (barriers, timings) that runs no GPU kernel."""
    timeout = datetime.timedelta(minutes=timeout_min)
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise SystemExit("run with at least 2 ranks (torchrun --nproc-per-node N, N >= 2): rank 0 sends, the rest receive")
    if torch.cuda.is_available():
        if os.environ.get("NCCL_NVLS_ENABLE") != "0":
            raise SystemExit("NVLink multicast must be off: set NCCL_NVLS_ENABLE=0")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device, dist.new_group(backend="gloo", timeout=timeout)


def wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: float, host: dist.ProcessGroup) -> float:
    """The largest of every rank's `seconds` (a broadcast is done when its last receiver has the bytes)."""
    out: list[float] = [0.0] * dist.get_world_size()
    dist.all_gather_object(out, seconds, group=host)
    return max(out)


def median_s(fn: Callable[[], object], device: torch.device, host: dist.ProcessGroup, reps: int) -> float:
    """Median over `reps` (after one warm-up) of the slowest rank's seconds for `fn`, started from a host barrier."""
    times = []
    for i in range(reps + 1):
        wait(device)
        dist.barrier(group=host)
        t0 = time.perf_counter()
        fn()
        wait(device)
        s = slowest(time.perf_counter() - t0, host)
        if i:
            times.append(s)
    return statistics.median(times)


def form_config(text: TextConfig, form: str) -> TextConfig:
    """`text` in bf16 with its routed experts as `form` says: "bf16" (every model-dtype tensor in bf16) or "mxfp4"
    (the stored form, routed experts MXFP4-packed)."""
    return dataclasses.replace(text, torch_dtype="bfloat16", expert_format=None if form == "bf16" else "mxfp4")


def sync_specs(text: TextConfig, form: str) -> dict[str, WeightSpec]:
    """The text tensors a sync in `form` carries."""
    return stored_specs(form_config(text, form))


def spec_dtype(text: TextConfig, form: str, spec: WeightSpec) -> torch.dtype:
    return serving_dtype(form_config(text, form), spec)


def spec_bytes(text: TextConfig, form: str) -> int:
    return sum(math.prod(s.shape) * spec_dtype(text, form, s).itemsize for s in sync_specs(text, form).values())


def random_tensors(text: TextConfig, form: str, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """The sync's tensors with random bits, drawn on `device`."""
    gen = torch.Generator(device).manual_seed(seed)
    out = {}
    for name, spec in sync_specs(text, form).items():
        dtype = spec_dtype(text, form, spec)
        raw = torch.randint(0, 256, (math.prod(spec.shape) * dtype.itemsize,), dtype=torch.uint8, generator=gen,
                            device=device)
        out[name] = raw.view(dtype).view(spec.shape)
    return out


def measure_sync(text: TextConfig, form: str, device: torch.device, host: dist.ProcessGroup, reps: int,
                 bucket_bytes: int) -> dict[str, object]:
    """`reps` + 1 syncs (the first a warm-up) of version v = 1, 2, ... from rank 0; each rollout rank verifies every
    one against the expected names, shapes and dtypes and its last version. Median seconds per part, slowest rank."""
    rank = dist.get_rank()
    tensors = random_tensors(text, form, device, seed=1) if rank == TRAINER else {}
    expected = {n: (tuple(s.shape), spec_dtype(text, form, s)) for n, s in sync_specs(text, form).items()}
    link = TorchDistributed(src=TRAINER, device=device, bucket_bytes=bucket_bytes)
    version, parts = 0, {"make_s": [], "transfer_s": [], "verify_s": []}
    nbytes = sum(math.prod(shape) * dt.itemsize for shape, dt in expected.values())
    for i in range(reps + 1):
        made = [0.0, 0.0, 0.0]
        bundle = None
        wait(device)
        dist.barrier(group=host)
        if rank == TRAINER:
            t0 = time.perf_counter()
            bundle = WeightBundle.make(version + 1, tensors)
            wait(device)
            made[0] = time.perf_counter() - t0
        dist.barrier(group=host)
        t0 = time.perf_counter()
        if rank == TRAINER:
            link.send(bundle)
        else:
            bundle = link.receive()
        wait(device)
        made[1] = time.perf_counter() - t0
        error = None
        if rank != TRAINER:
            t0 = time.perf_counter()
            try:
                verify(bundle, expected, version)
            except SyncError as e:
                error = str(e)
            wait(device)
            made[2] = time.perf_counter() - t0
        every: list[tuple] = [()] * dist.get_world_size()
        dist.all_gather_object(every, (made, error), group=host)
        errors = [e for _, e in every if e]
        if errors:
            raise SystemExit(f"{form} sync v{version + 1} rejected on a rollout rank: {errors[0]}")
        version += 1
        if i:
            for key, k in (("make_s", 0), ("transfer_s", 1), ("verify_s", 2)):
                parts[key].append(max(m[k] for m, _ in every))
    out: dict[str, object] = {"form": form, "bytes": nbytes, "tensors": len(expected), "verified_versions": version}
    out.update({k: statistics.median(v) for k, v in parts.items()})
    total = out["make_s"] + out["transfer_s"] + out["verify_s"]
    out["transfer_GBps"] = nbytes / out["transfer_s"] / 1e9
    out["end_to_end_GBps"] = nbytes / total / 1e9
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/k3-1b.yaml", help="the model whose weights are synced")
    ap.add_argument("--buffer-mib", type=int, default=1024, help="the broadcast ceiling's buffer")
    ap.add_argument("--bucket-mib", type=int, default=256, help="TorchDistributed's bucket size")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the report here (rank 0)")
    args = ap.parse_args()
    device, host = init()
    rank, world = dist.get_rank(), dist.get_world_size()
    text = load_model_config(args.config).text
    buf = torch.empty(args.buffer_mib << 20, dtype=torch.uint8, device=device)
    bcast = median_s(lambda: dist.broadcast(buf, TRAINER), device, host, args.reps)
    report: dict[str, object] = {"config": args.config, "world_size": world, "device": str(device),
                                 "backend": dist.get_backend(), "bucket_bytes": args.bucket_mib << 20,
                                 "broadcast": {"bytes": buf.numel(), "seconds": bcast,
                                               "GBps": buf.numel() / bcast / 1e9}}
    del buf
    if rank == TRAINER:
        print(json.dumps(report), flush=True)
    full = load_model_config(FULL_SCALE).text
    full_params = sum(math.prod(s.shape) for s in text_specs(full).values())
    for form in ("bf16", "mxfp4"):
        row = measure_sync(text, form, device, host, args.reps, args.bucket_mib << 20)
        row["transfer_over_broadcast"] = row["transfer_GBps"] / report["broadcast"]["GBps"]
        row["end_to_end_over_broadcast"] = row["end_to_end_GBps"] / report["broadcast"]["GBps"]
        full_bytes = spec_bytes(full, form)
        row["k3_full"] = {"parameters": full_params, "bytes": full_bytes,
                          "seconds_at_end_to_end_rate": full_bytes / row["end_to_end_GBps"] / 1e9,
                          "seconds_at_transfer_rate": full_bytes / row["transfer_GBps"] / 1e9,
                          "seconds_at_broadcast_rate": full_bytes / report["broadcast"]["GBps"] / 1e9}
        report[form] = row
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if rank == TRAINER:
            print(json.dumps(row), flush=True)
    report["published_seconds_2_8T"] = PUBLISHED_S
    if rank == TRAINER and args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
