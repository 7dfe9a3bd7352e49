"""`zerokl ppo` with `vision_tower: trainable` on k3-tiny-mxfp4 (bf16, MXFP4 experts, FP8 latent cache), task
`squares`: the tower trains with the text model, every full sync carries it into the engine, and each step's sampled
log-probs (processed and raw) equal the trainer's bit for bit, which after step 0 holds only if the engine's image rows
come from the trained tower. (The frozen tower in PPO: tests/engines/test_ppo_async.py, tests/engines/test_ray.py.)"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import assert_zero_kl_step
from parity.io.checkpoint import load_checkpoint
from parity.io.vision import vision_specs
from parity.sync.bundle import SyncError, WeightBundle
from trainer.backend import build_backend
from zerokl.ppo.config import load_ppo_config
from zerokl.ppo.loop import PPORun

pytestmark = pytest.mark.slow  # starts an engine and a trainer: scheduled first (conftest.py)

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def test_trained_vision_tower_is_synced_every_step_and_saved(k3_tiny_mxfp4: Path, tmp_path: Path) -> None:
    cfg = replace(load_ppo_config(REPO / "configs/ppo-tiny-vision.yaml"), model=str(k3_tiny_mxfp4), steps=STEPS,
                  prompts_per_step=2, wandb="disabled", vision_tower="trainable")
    model_cfg, base = load_checkpoint(k3_tiny_mxfp4)
    names = list(vision_specs(model_cfg.vision, model_cfg.text.hidden_size))
    run = PPORun(cfg, tmp_path / "run", log=lambda _: None)
    try:
        results = [run.run_step() for _ in range(STEPS)]
        run.save_state(tmp_path / "state")
        final = {n: t.clone() for n, t in run.backend.export_official().items()}
        # the engine takes full bundles only with the tower in them (all or nothing): it runs the synced tower
        text_only = {n: t for n, t in run.sync.export_base().items() if n not in names}
        with pytest.raises(SyncError, match=f"partial update: {len(names)} tensors missing"):
            run.engine.update_weights(WeightBundle.make(run.version + 1, text_only))
        # the trained tower gives an image other rows than the checkpoint's (the frozen encoder's)
        image = run.task.sample(random.Random(1)).images[0]
        with torch.no_grad():
            trained = run.backend.trainer.module.vision_tower()(run.encoder.patches(image))
        assert not torch.equal(trained, run.encoder.embed(image))
    finally:
        run.close()
    for r in results:
        assert_zero_kl_step(r)
    assert all(not torch.equal(final[n].to(base[n].dtype), base[n]) for n in names)  # every tower tensor trained
    # the saved state holds the trained tower: a fresh trainer loads it back bit for bit
    backend = build_backend(k3_tiny_mxfp4, lr=cfg.lr, kernels=cfg.kernels, train_vision=True)
    try:
        backend.load_state(tmp_path / "state")
        loaded = backend.export_official()
    finally:
        backend.close()
    assert loaded.keys() == final.keys() and all(torch.equal(loaded[n], final[n]) for n in final)
