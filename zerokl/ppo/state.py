"""The state stage: checkpoints of a run and resuming from them, bit for bit.

Everything the next step depends on is saved: the trainer's state (`TrainerBackend.save_state`: the weights, each
rank its part on several processes, or adapter/; the optimizer), the RNG states (the task samples by the run's Random
alone), the step, the policy version, the config and process count (`state.json`, plain JSON), and with
`max_staleness` the rollouts generated ahead and the kept serving weights (`ahead.pt`, plain tensors and lists). A checkpoint is written into a sibling `.partial` directory
that rank 0 renames into place, so a crash never leaves a half-written `step-N`; a write that fails (a full disk)
removes its partial directory and stops the run with `CheckpointError`, the latest complete checkpoint intact, and a
checkpoint is not begun on a filesystem with less free space than the latest one took.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from parity.config import ConfigError
from parity.io.atomic import commit_partial, partial_path
from trainer.backend import RETIRED_DEEPSPEED
from zerokl.ppo.config import PPOConfig
from zerokl.ppo.rollouts import Ahead

class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the run's latest complete checkpoint is intact. The message says why."""


STATE_FILE = "state.json"  # in a checkpoint: step, version, RNG states, config, process count
AHEAD_FILE = "ahead.pt"  # with max_staleness: the rollouts generated ahead and the kept serving weights


def _free_gb(path: Path) -> float:
    """Free space on the filesystem of `path` (or of its nearest existing parent), in GB."""
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free / 1e9


def check_room(path: Path) -> None:
    """Refuse (CheckpointError) to begin checkpoint `path` when its filesystem has less free space than the latest
    complete checkpoint beside it took (nothing to compare with before the first one)."""
    done = [p for p in path.parent.glob("step-*") if re.fullmatch(r"step-\d+", p.name) and (p / STATE_FILE).is_file()]
    if not done:
        return
    latest = max(done, key=lambda p: int(p.name.removeprefix("step-")))
    need = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file()) / 1e9
    free = _free_gb(path)
    if free < need:
        raise CheckpointError(f"checkpoint {path.name} would take about {need:.1f} GB (as {latest.name} did) and its "
                              f"filesystem has {free:.1f} GB free: free space, then --resume {path.parent.parent}")


def save(path: Path, cfg: PPOConfig, backend: Any, step: int, version: int, rng: random.Random, ahead: Ahead | None,
         kept: dict[int, dict[str, torch.Tensor]]) -> None:
    """Write the run's state at `path`. Collective: every rank saves its trainer state, rank 0 the rest."""
    rank0 = backend.rank == 0
    tmp = partial_path(path)
    check_room(path)
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        backend.save_state(tmp)
        if rank0:
            if ahead is not None:  # the rollouts generated ahead and the versions they came from
                ahead.drain()
                torch.save({"ahead": ahead.record(), "kept": {str(v): w for v, w in kept.items()}}, tmp / AHEAD_FILE)
            task_rng = rng.getstate()
            state = {"step": step, "version": version, "task_rng": [task_rng[0], list(task_rng[1]), task_rng[2]],
                     "torch_rng": torch.get_rng_state().tolist(), "config": asdict(cfg),
                     "world_size": backend.world_size}
            (tmp / STATE_FILE).write_text(json.dumps(state))
    except (OSError, RuntimeError) as e:  # torch's writer reports a full disk as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        latest = "the latest complete checkpoint is intact" if path.parent.is_dir() else "no checkpoint was written"
        raise CheckpointError(f"writing checkpoint {path.name} failed ({str(e).strip().splitlines()[-1]}); "
                              f"{_free_gb(path):.1f} GB free on its filesystem; {latest}") from None
    if rank0:
        commit_partial(path, replace=True)
    backend.barrier()


def load(path: Path, backend: Any, rng: random.Random, ahead: Ahead | None) -> tuple[int, int, dict[int, Any]]:
    """Read the state `save` wrote into the backend, `rng`, torch's RNG and `ahead`: (step, version, kept weights)."""
    state = read_run_state(path)
    backend.load_state(path)
    version, internal, gauss = state["task_rng"]
    rng.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
    kept: dict[int, Any] = {}
    if ahead is not None:
        record = torch.load(path / AHEAD_FILE, weights_only=True)
        ahead.restore(record["ahead"])
        kept = {int(v): w for v, w in record["kept"].items()}
    return state["step"], state["version"], kept


def resume_point(path: Path) -> Path:
    """The checkpoint `--resume path` means: `path` itself when it is a checkpoint (`checkpoints/step-N`), else, for a
    run directory, its latest complete checkpoint (a `step-N.partial` one, cut short by a crash, is skipped)."""
    if (path / STATE_FILE).is_file() or not (path / "checkpoints").is_dir():
        return path
    steps = [p for p in (path / "checkpoints").iterdir()
             if p.is_dir() and re.fullmatch(r"step-\d+", p.name) and (p / STATE_FILE).is_file()]
    if not steps:
        raise ConfigError(f"--resume {path}: the run directory has no complete checkpoint under checkpoints/")
    return max(steps, key=lambda p: int(p.name.removeprefix("step-")))


def read_run_state(path: Path) -> dict:
    """The loop's own state in a `zerokl ppo` checkpoint (`state.json`: plain JSON, never unpickled)."""
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a zerokl ppo checkpoint (no {STATE_FILE})")
    try:
        return json.loads((path / STATE_FILE).read_text())
    except json.JSONDecodeError as e:
        raise FileNotFoundError(f"{path / STATE_FILE} is not a zerokl ppo state ({e})") from None


def check_resumable(path: Path, cfg: PPOConfig) -> None:
    """Before anything starts: `path` is a `zerokl ppo` checkpoint written by the trainer this run uses, the same
    backend (Megatron), the same layout (process count, tp, ep: each rank keeps its own share of the optimizer
    state)."""
    state = read_run_state(path)
    saved = state["config"]
    same = {"model": Path(str(saved.get("model"))).resolve() == Path(cfg.model).resolve(),
            "lora": saved.get("lora", False) == cfg.lora, "task": saved.get("task") == cfg.task,
            "task_args": saved.get("task_args") == cfg.task_args, "advantage": saved.get("advantage") == cfg.advantage}
    for key, ok in same.items():
        if not ok:
            raise ConfigError(f"{path} was written by a run with {key}: {saved.get(key)!r}; this run has {key}: "
                              f"{getattr(cfg, key)!r}: resume with the config that wrote it")
    if saved.get("backend", "megatron") != "megatron":
        raise ConfigError(f"{path} was written by the {saved['backend']} backend, whose optimizer state the Megatron "
                          f"trainer cannot read ({RETIRED_DEEPSPEED}); `zerokl export --checkpoint {path} --out DIR` "
                          "still writes its weights as a checkpoint to start a new run from")
    was, now = state.get("world_size", 1), int(os.environ.get("WORLD_SIZE", "1"))
    layout = {key: (saved.get(key, 1), getattr(cfg, key)) for key in ("tp", "ep")}
    for key, (before, here) in layout.items():
        if before != here:
            raise ConfigError(f"{path} was written at {key}: {before}, each rank keeping its shard's optimizer state; "
                              f"this run has {key}: {here}: resume with the same layout")
    if was != now:
        raise ConfigError(f"{path} was written on {was} processes, each keeping its share of the optimizer state; this "
                          f"run is on {now}: resume with the same process count")
