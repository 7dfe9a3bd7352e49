"""Weight sync: versioned, checksummed, all-or-nothing, over each transport."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parity.sync.bundle import SyncError, TensorStore, WeightBundle, checksum, verify
from parity.sync.flat import FlatLayout
from parity.sync.group import StandaloneGroup, host_store
from parity.sync.transports import (ALIGN, CudaIpc, Disk, Memory, SharedMemory, TorchDistributed, WeightSync, buckets,
                                     by_name)


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


def test_memory_sync_and_hooks() -> None:
    """In memory the message is the bundle itself: no copy on the way, one checksum per tensor per side."""
    store = TensorStore(_weights(0))
    seen: list[str] = []
    sync = WeightSync(Memory(), store, before_sync=[lambda b: seen.append(f"before {b.version}")],
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
    report = WeightSync(Memory(), store, strict=False)(bundle)
    assert report.error is not None and store.version == 3


def test_disk_transport_round_trip(tmp_path: Path) -> None:
    """Each version written once; the receiving side (`Disk()`, or `by_name("disk")` in another process) reads the
    directory the message names."""
    disk = Disk(tmp_path, keep=2)
    store = TensorStore(_weights(0))
    messages = [disk.send(WeightBundle.make(v, _weights(v))) for v in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002", "v00000003"]
    assert messages[2] == {"version": 3, "kind": "full", "path": str(disk.path(3))}
    store.receive(by_name("disk"), messages[2])
    assert store.version == 3 and torch.equal(store.tensors["b.bias"], _weights(3)["b.bias"])
    with pytest.raises(SyncError, match="no manifest.json"):
        Disk().receive({"version": 9, "kind": "full", "path": str(tmp_path / "v00000009")})
    with pytest.raises(SyncError, match="already exists"):
        disk.send(WeightBundle.make(3, _weights(3)))
    with pytest.raises(SyncError, match="only receives"):
        Disk().send(WeightBundle.make(4, _weights(4)))
    with pytest.raises(SyncError, match="unknown weight transport"):
        by_name("carrier-pigeon")


def test_shared_memory_round_trip_and_release() -> None:
    """One segment per version; the receiving side (`by_name("shared_memory")`, as in a vLLM worker) copies the
    tensors out; `WeightSync` releases the segment once the receiver is done, accepted or not."""
    segments = lambda: set(Path("/dev/shm").glob(f"zerokl-{os.getpid()}-*"))  # noqa: E731
    before = segments()
    store = TensorStore(_weights(0))
    shm = SharedMemory()
    message = shm.send(WeightBundle.make(1, _weights(1)))
    segment = Path(message["segment"])
    assert segment.is_file() and segment.stat().st_size == WeightBundle.make(1, _weights(1)).nbytes()
    store.receive(by_name("shared_memory"), message)
    shm.release(message)
    assert not segment.exists() and store.version == 1
    assert all(torch.equal(store.tensors[n], t) for n, t in _weights(1).items())
    with pytest.raises(SyncError, match="no such shared-memory segment"):
        shm.receive(message)
    bad = _corrupt(WeightBundle.make(2, _weights(2)), "a.weight")
    report = WeightSync(SharedMemory(), store, strict=False)(bad)
    assert "checksum mismatch" in report.error and store.version == 1
    assert segments() == before


def test_checksum_is_device_and_order_free_and_catches_one_bit() -> None:
    """Same values -> same checksum whatever the thread count or memory layout; any flipped bit, a swap of two
    elements, or another dtype or shape of the same bytes changes it."""
    x = torch.randn(4097, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = checksum(x)
    finally:
        torch.set_num_threads(before)
    assert one == checksum(x.clone())
    assert checksum(x.view(17, 241)) == checksum(x.view(17, 241).t().contiguous().t())  # layout: same bytes
    for byte in (0, 7, 8, 4097 * 4 - 1):
        for bit in (0, 7):
            y = x.clone()
            y.view(torch.uint8)[byte] ^= 1 << bit
            assert checksum(y) != one
    swapped = x.clone()
    swapped[[2, 3]] = x[[3, 2]]
    assert checksum(swapped) != one
    assert checksum(x.view(torch.int32)) != one and checksum(x[:4096].view(64, 64)) != checksum(x[:4096])


def _dist_worker(index: int, init: str, out: str, world: int, standalone: bool, flat: bool, store: Any = None) -> None:
    rank = index + standalone  # standalone: rank 0 is the test's own process, which hosts the store
    if standalone:  # no default group at all: a trainer and servers that share no torch.distributed world
        host, port = init.split(":")
        group = StandaloneGroup(host, int(port), rank, world, store=store)
    else:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        group = None
    try:
        link = TorchDistributed(src=0, group=group, bucket_bytes=64 if standalone else 1 << 28)
        if rank == 0:
            link.send(_flat_bundle(7) if flat else WeightBundle.make(7, _weights(7)))
        else:
            receiver = TensorStore(_weights(0), version=6)
            bundle = link.receive()
            verify(bundle, receiver.expected(), receiver.version)  # as a vLLM worker does
            receiver.apply(bundle)
            torch.save({"version": receiver.version, "flat": bundle.flat is not None,
                        "sums": {n: checksum(t) for n, t in receiver.tensors.items()}}, f"{out}.{rank}")
    finally:
        if group is None:
            dist.destroy_process_group()


def _flat_bundle(version: int) -> WeightBundle:
    """`_weights(version)` as a flat bundle (one buffer, each tensor 16-byte aligned: 80 bytes)."""
    tensors = _weights(version)
    layout = FlatLayout.of((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
    buffer = layout.empty("cpu")
    for name, view in layout.views(buffer).items():
        view.copy_(tensors[name])
    return WeightBundle.make_flat(version, buffer, layout)


def test_a_hosted_store_serves_rank_0_on_the_port_the_ranks_were_given() -> None:
    store = host_store()
    for rank, port in ((1, store.port), (0, store.port ^ 1)):
        with pytest.raises(ValueError, match="a hosted store is rank 0's, on the group's port"):
            StandaloneGroup("127.0.0.1", port, rank, 2, store=store)


@pytest.mark.parametrize("standalone,flat", [(False, False), (True, False), (True, True)],
                         ids=["default-group", "standalone-group", "standalone-flat"])
def test_torch_distributed_transport_gloo(tmp_path: Path, standalone: bool, flat: bool) -> None:
    """One sender, two receivers: each gets the bundle, verified, with every checksum; over the default group of a
    shared world (all tensors in one bucket), and over a `StandaloneGroup` in processes with no default group (64-byte
    buckets: two tensors packed in one, one alone). A flat bundle arrives flat (its 80-byte buffer in a 64-byte and a
    16-byte slice) and is verified by its word sums."""
    out, world = tmp_path / "received.pt", 3
    store = host_store() if standalone else None
    init = f"127.0.0.1:{store.port}" if store else f"file://{tmp_path / 'init'}"
    ranks = mp.start_processes(_dist_worker, args=(init, str(out), world, standalone, flat),
                               nprocs=world - standalone, start_method="spawn", join=False)
    if store:
        _dist_worker(-1, init, str(out), world, standalone, flat, store)
    while not ranks.join():  # each call returns as one more rank ends (raises if one failed)
        pass
    for rank in range(1, world):
        got = torch.load(f"{out}.{rank}")
        assert got["version"] == 7 and got["flat"] == flat
        assert got["sums"] == {n: checksum(t) for n, t in _weights(7).items()}


def _ipc_receiver(rank: int, message_file: str) -> None:
    """A receiving process on the same GPU: rebuilds the `cuda_ipc` bundle (`by_name`, as a vLLM worker does),
    applies it to a store on its GPU (checksums verified there) and saves the tensors' checksums, or the error."""
    store = TensorStore({n: t.cuda() for n, t in _weights(0).items()})
    with open(message_file, "rb") as f:
        message = pickle.load(f)
    try:
        store.receive(by_name("cuda_ipc"), message)
        result = {"version": store.version, "sums": {n: checksum(t) for n, t in store.tensors.items()}}
    except SyncError as e:
        result = {"error": str(e)}
    torch.save(result, f"{message_file}.result")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_round_trip_between_processes_on_one_gpu(tmp_path: Path) -> None:
    """The sender's tensors on the GPU, a receiver in another process on the same GPU: the bundle arrives verified
    (every checksum computed on the receiver's device), bit for bit; a corrupted bundle is refused there."""
    ipc = CudaIpc()
    want = {n: t.cuda() for n, t in _weights(7).items()}
    good = WeightBundle.make(1, want)
    for bundle in (good, _corrupt(good, "a.weight")):
        message = ipc.send(bundle)
        path = tmp_path / "message.pkl"
        path.write_bytes(pickle.dumps(message))
        mp.start_processes(_ipc_receiver, args=(str(path),), nprocs=1, start_method="spawn")
        ipc.release(message)
        got = torch.load(f"{path}.result")
        if bundle is good:
            assert got == {"version": 1, "sums": {n: checksum(t) for n, t in want.items()}}
        else:
            assert "a.weight: checksum mismatch" in got["error"]
    assert not ipc.held


def test_cuda_ipc_refuses_a_bundle_without_a_gpu_tensor() -> None:
    with pytest.raises(SyncError, match="cuda_ipc transport carries the tensors of one CUDA device"):
        CudaIpc().send(WeightBundle.make(1, _weights(1)))


def test_buckets_keep_order_alignment_and_size() -> None:
    """Buckets hold consecutive tensors in manifest order at aligned offsets, within the bucket size unless a tensor
    alone is larger."""
    meta = [(f"t{i}", [n], dtype) for i, (n, dtype) in
            enumerate([(5, "torch.bfloat16"), (3, "torch.float32"), (20, "torch.uint8"), (100, "torch.float32"), (1, "torch.int64")])]
    got = buckets(meta, 64)
    assert [n for b in got for n, _ in b] == [m[0] for m in meta]
    assert got == [[("t0", 0), ("t1", 16), ("t2", 32)], [("t3", 0)], [("t4", 0)]]
    assert all(start % ALIGN == 0 for b in got for _, start in b)


def test_ppo_sync_through_disk_writes_each_version_once(tmp_path: Path) -> None:
    """`sync: disk` in the PPO loop's shape: `WeightSync(Disk(root), receiver)` writes the version once and the
    receiver reads that directory (no second copy)."""
    store = TensorStore(_weights(0))
    WeightSync(Disk(tmp_path / "sync"), store)(WeightBundle.make(1, _weights(5)))
    assert store.version == 1 and [p.name for p in (tmp_path / "sync").iterdir()] == ["v00000001"]
    assert torch.equal(store.tensors["a.weight"], _weights(5)["a.weight"])
