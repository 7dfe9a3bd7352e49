"""A PPO checkpoint that cannot be written (`zerokl.ppo.state.save`): a write that fails leaves no partial directory
and raises `CheckpointError` naming the cause and the free space, the latest complete checkpoint untouched; a
checkpoint is not begun on a filesystem with less free space than the latest one took."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from zerokl.ppo import state
from zerokl.ppo.state import STATE_FILE, CheckpointError


class FullDisk:
    """A one-rank trainer whose state write fails as torch's writer does on a full disk."""

    rank, world_size = 0, 1

    def save_state(self, path: Path) -> None:
        path.mkdir(parents=True)
        (path / "weights.pt").write_bytes(b"x" * 10)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6512092928 vs 6512092824")

    def barrier(self) -> None:
        pass


def _complete(root: Path, step: int, nbytes: int) -> Path:
    done = root / "checkpoints" / f"step-{step}"
    done.mkdir(parents=True)
    (done / STATE_FILE).write_text("{}")
    (done / "weights.pt").write_bytes(b"w" * nbytes)
    return done


def test_a_failed_write_leaves_no_partial_and_keeps_the_latest_checkpoint(tmp_path: Path) -> None:
    done = _complete(tmp_path, 5, 100)
    target = tmp_path / "checkpoints" / "step-10"
    with pytest.raises(CheckpointError, match=r"writing checkpoint step-10 failed \(.*unexpected pos.*\); "
                                              r"[\d.]+ GB free on its filesystem; the latest complete checkpoint"):
        state.save(target, SimpleNamespace(), FullDisk(), 10, 10, random.Random(0), None, {})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-5"]
    assert (done / "weights.pt").read_bytes() == b"w" * 100
    assert state.resume_point(tmp_path) == done


def test_no_checkpoint_begun_without_the_room_the_last_one_took(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _complete(tmp_path, 5, 3_000_000)
    target = tmp_path / "checkpoints" / "step-10"
    state.check_room(target)  # this machine has 3 MB free
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: SimpleNamespace(free=1_000_000))
    with pytest.raises(CheckpointError, match=rf"checkpoint step-10 would take about 0.0 GB \(as step-5 did\) and its "
                                              rf"filesystem has 0.0 GB free: free space, then --resume {tmp_path}"):
        state.check_room(target)
    assert not target.exists() and not state.partial_path(target).exists()
