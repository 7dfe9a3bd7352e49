"""Flat weight updates: one buffer per bundle, its checksums those of its tensors, the serving form written into it
the bytes of `serving_weights`, and a receiver that copies, verifies and swaps it whole (all or nothing)."""

from __future__ import annotations

import pytest
import torch

from parity.config import load_model_config
from parity.io.checkpoint import random_weights
from parity.quant.mxfp4 import QuantError
from parity.sync.bundle import SyncError, TensorStore, WeightBundle, checksums, verify
from parity.sync.flat import ALIGN, Flat, FlatChecksums, FlatLayout
from parity.sync.serving import ServingBuffer
from parity.sync.transports import Memory, WeightSync
from parity.weights import master_weights, serving_weights

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    """Odd byte counts (the padding to the next word matters), an empty tensor, several dtypes."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(37, 11, generator=g).bfloat16(), "b": torch.zeros(0),
            "c": torch.randint(0, 255, (4099,), dtype=torch.uint8, generator=g),
            "d": torch.randn(3, 5, generator=g), "e": torch.randint(0, 255, (1,), dtype=torch.uint8, generator=g)}


def _flat(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, FlatLayout]:
    layout = FlatLayout.of((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
    buffer = layout.empty("cpu")
    for name, view in layout.views(buffer).items():
        view.copy_(tensors[name])
    return buffer, layout


def test_layout_aligns_every_tensor_and_its_digests_are_the_tensors_checksums() -> None:
    tensors = _tensors(0)
    buffer, layout = _flat(tensors)
    assert all(o % ALIGN == 0 for o in layout.offsets) and layout.total % ALIGN == 0
    assert layout.tensor_bytes() == sum(t.numel() * t.element_size() for t in tensors.values())
    views = layout.views(buffer)
    assert all(torch.equal(views[n], t) and views[n].dtype == t.dtype for n, t in tensors.items())
    assert layout.digests(layout.word_sums(buffer)) == checksums(tensors)
    bundle = WeightBundle.make_flat(1, buffer, layout)
    assert isinstance(bundle.checksums, FlatChecksums) and dict(bundle.checksums) == checksums(tensors)
    assert bundle.nbytes() == layout.tensor_bytes()


def _store_and_sync(tensors: dict[str, torch.Tensor]) -> tuple[TensorStore, WeightSync]:
    store = TensorStore({n: torch.zeros_like(t) for n, t in tensors.items()})
    return store, WeightSync(Memory(), store)


def test_store_takes_flat_updates_whole_and_keeps_its_version_on_a_bad_one() -> None:
    """Versions 1 and 2 arrive flat and are held bit for bit (the second in the other buffer); a copy whose sums
    differ from the sender's, a stale version and a layout of other tensors are refused, the store unchanged."""
    store, sync = _store_and_sync(_tensors(0))
    for version, seed in ((1, 1), (2, 2)):
        buffer, layout = _flat(_tensors(seed))
        sync(WeightBundle.make_flat(version, buffer, layout))
        assert store.version == version
        assert all(torch.equal(store.tensors[n], t) for n, t in _tensors(seed).items())
    held = {n: t.clone() for n, t in store.tensors.items()}
    buffer, layout = _flat(_tensors(3))
    good = WeightBundle.make_flat(3, buffer, layout)
    sums = good.flat.sums.clone()
    sums[2] += 1
    bad = Flat(buffer, layout, sums)
    with pytest.raises(SyncError, match="^c: checksum mismatch"):
        sync(WeightBundle(3, "full", good.tensors, FlatChecksums(bad), bad))
    with pytest.raises(SyncError, match="stale update"):
        sync(WeightBundle.make_flat(2, buffer, layout))
    other = {**_tensors(3), "f": torch.zeros(2)}
    with pytest.raises(SyncError, match="unexpected tensors"):
        sync(WeightBundle.make_flat(3, *_flat(other)))
    assert store.version == 2 and all(torch.equal(store.tensors[n], t) for n, t in held.items())
    sync(good)
    assert store.version == 3 and all(torch.equal(store.tensors[n], t) for n, t in _tensors(3).items())


@pytest.mark.parametrize("config", ["k3-tiny-mxfp4", "k3.1-tiny"])
def test_serving_buffer_holds_the_bytes_of_serving_weights(config: str) -> None:
    """The flat bundle's tensors and checksums are those of `serving_weights` (MXFP4 experts packed, bf16 casts,
    fp32-stored tensors as they are), with an extra tensor after them; a second bundle reuses the buffer."""
    cfg = load_model_config(ROOT / "configs" / f"{config}.yaml")
    writer = ServingBuffer(cfg.text)
    extra = {"vision.w": torch.randn(3, 4).bfloat16()}
    for seed in (0, 1):
        masters = master_weights(cfg.text, random_weights(cfg, seed=seed))
        want = {**serving_weights(cfg.text, masters), **extra}
        bundle = writer.bundle(seed + 1, masters, extra)
        assert list(bundle.tensors) == list(want)
        assert all(torch.equal(bundle.tensors[n], t) and bundle.tensors[n].dtype == t.dtype for n, t in want.items())
        assert dict(bundle.checksums) == checksums(want)
    masters = master_weights(cfg.text, random_weights(cfg, seed=2))
    name = next(n for n in masters if n.endswith(".experts.1.w3.weight")) if cfg.text.expert_format else None
    if name is not None:
        masters[name] = masters[name].clone()
        masters[name][0, 5] = float("nan")
        with pytest.raises(QuantError, match=name.replace(".", r"\.")):
            writer.bundle(3, masters)
    missing = dict(masters)
    first = next(iter(missing))
    del missing[first]
    with pytest.raises(KeyError, match="weights lack"):
        writer.bundle(3, missing)


def test_flat_bundle_travels_over_disk(tmp_path) -> None:
    """A flat bundle's views go to disk as they are (they share one buffer without overlapping) and arrive intact."""
    from parity.sync.transports import Disk

    store, _ = _store_and_sync(_tensors(0))
    buffer, layout = _flat(_tensors(4))
    WeightSync(Disk(tmp_path), store)(WeightBundle.make_flat(1, buffer, layout))
    assert store.version == 1 and all(torch.equal(store.tensors[n], t) for n, t in _tensors(4).items())


def test_verify_checks_a_flat_bundle_as_it_arrived_in_one_pass() -> None:
    """`verify` (what a vLLM worker runs on an update) takes a flat bundle by its buffer's word sums against the
    sender's: intact, it passes; any flipped bit of a tensor's bytes is refused naming that tensor; a stale version
    or another layout is refused before the bytes are read."""
    tensors = _tensors(5)
    buffer, layout = _flat(tensors)
    sent = WeightBundle.make_flat(4, buffer, layout)
    expected = {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()}
    verify(sent, expected, 3)
    for name in ("a", "c", "d", "e"):
        i = layout.names.index(name)
        for byte in (layout.offsets[i], layout.offsets[i] + layout.nbytes(i) - 1):
            arrived = buffer.clone()
            arrived[byte] ^= 0x10
            flat = Flat(arrived, layout, sent.flat.sums)
            with pytest.raises(SyncError, match=f"^{name}: checksum mismatch"):
                verify(WeightBundle(4, "full", layout.views(arrived), FlatChecksums(flat), flat), expected, 3)
    with pytest.raises(SyncError, match="stale update"):
        verify(sent, expected, 4)
    with pytest.raises(SyncError, match="partial update"):
        verify(sent, {**expected, "f": ((2,), torch.float32)}, 3)
