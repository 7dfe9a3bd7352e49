"""Weight sync: versioned, checksummed, all-or-nothing, over each transport."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parity.sync.bundle import SyncError, TensorStore, WeightBundle, checksum
from parity.sync.transports import Disk, InProcess, TorchDistributed, WeightSync


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g).bfloat16(),
            "c.A_log": torch.randn(2, generator=g)}


def _corrupt(bundle: WeightBundle, name: str) -> WeightBundle:
    tensors = dict(bundle.tensors)
    t = tensors[name].clone()
    t.view(torch.uint8)[0] ^= 1  # one flipped bit in flight
    tensors[name] = t
    return WeightBundle(bundle.version, bundle.kind, tensors, bundle.checksums)


def test_in_process_sync_and_hooks() -> None:
    store = TensorStore(_weights(0))
    seen: list[str] = []
    sync = WeightSync(InProcess(store), before_sync=[lambda b: seen.append(f"before {b.version}")],
                      after_sync=[lambda b, r: seen.append(f"after {r.version} {r.error}")])
    new = _weights(1)
    result = sync(WeightBundle.make(1, new))
    assert store.version == 1 and all(torch.equal(store.tensors[n], new[n]) for n in new)
    assert seen == ["before 1", "after 1 None"] and result.nbytes > 0


@pytest.mark.parametrize("fault", ["corrupt", "partial", "stale", "extra", "shape"])
def test_bad_update_leaves_previous_version(fault: str) -> None:
    old = _weights(0)
    store = TensorStore(old, version=3)
    new = _weights(1)
    bundle = WeightBundle.make(4, new)
    if fault == "corrupt":
        bundle, match = _corrupt(bundle, "b.bias"), "b.bias: checksum mismatch"
    elif fault == "partial":
        bundle, match = WeightBundle.make(4, {k: v for k, v in new.items() if k != "c.A_log"}), "partial update"
    elif fault == "stale":
        bundle, match = WeightBundle.make(3, new), "stale update"
    elif fault == "extra":
        bundle, match = WeightBundle.make(4, {**new, "d": torch.zeros(1)}), "unexpected tensors"
    else:
        bundle, match = WeightBundle.make(4, {**new, "a.weight": torch.zeros(3, 4)}), "a.weight: got"
    with pytest.raises(SyncError, match=match):
        store.apply(bundle)
    assert store.version == 3 and all(torch.equal(store.tensors[n], old[n]) for n in old)
    report = WeightSync(InProcess(store), strict=False)(bundle)
    assert report.error is not None and store.version == 3


def test_disk_transport_round_trip(tmp_path: Path) -> None:
    disk = Disk(tmp_path, keep=2)
    store = TensorStore(_weights(0))
    for v in (1, 2, 3):
        disk.send(WeightBundle.make(v, _weights(v)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002", "v00000003"]
    store.apply(Disk.read(disk.path(3)))
    assert store.version == 3 and torch.equal(store.tensors["b.bias"], _weights(3)["b.bias"])
    with pytest.raises(SyncError, match="no manifest.json"):
        Disk.read(tmp_path / "v00000009")


def _dist_worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        link = TorchDistributed(src=0)
        if rank == 0:
            link.send(WeightBundle.make(7, _weights(7)))
        else:
            store = TensorStore(_weights(0), version=6)
            store.apply(link.receive())
            torch.save({"version": store.version, "sums": {n: checksum(t) for n, t in store.tensors.items()}}, out)
    finally:
        dist.destroy_process_group()


def test_torch_distributed_transport_gloo(tmp_path: Path) -> None:
    out = tmp_path / "received.pt"
    mp.start_processes(_dist_worker, args=(f"file://{tmp_path / 'init'}", str(out)), nprocs=2, start_method="spawn")
    got = torch.load(out)
    assert got["version"] == 7
    assert got["sums"] == {n: checksum(t) for n, t in _weights(7).items()}


def test_ppo_engine_transport_through_disk(tmp_path: Path) -> None:
    """`sync: disk` in the PPO loop: the bundle is written, read back, verified and applied."""
    from zerokl.ppo.loop import EngineTransport

    class Engine:
        def __init__(self) -> None:
            self.store = TensorStore(_weights(0))

        def update_weights(self, bundle: WeightBundle) -> None:
            self.store.apply(bundle)

    engine = Engine()
    WeightSync(EngineTransport(engine, tmp_path / "sync"))(WeightBundle.make(1, _weights(5)))
    assert engine.store.version == 1 and (tmp_path / "sync" / "v00000001" / "manifest.json").is_file()
    assert torch.equal(engine.store.tensors["a.weight"], _weights(5)["a.weight"])
