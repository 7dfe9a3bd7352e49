"""The frozen reference policy of the KL penalty (`kl_coef > 0`): the starting checkpoint, or `ref_model`, run by
rank 0 through the shared forward on the run's kernels; its log-probs of a step's sampled tokens go to every rank.
With LoRA the reference is the base without any adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from parity.kernels import get_kernels
from parity.model import K3Forward, K3Weights
from parity.vision import ImageInputs
from zerokl.ppo.config import PPOConfig
from zerokl.ppo.samples import StepBatch


def reference_forward(cfg: PPOConfig, base: Path) -> K3Forward:
    """The reference policy: `cfg.ref_model`, or the run's starting checkpoint `base`, on the run's kernels."""
    from parity.io.checkpoint import load_checkpoint

    model_cfg, weights = load_checkpoint(Path(cfg.ref_model) if cfg.ref_model is not None else base)
    return K3Forward(K3Weights.from_official(model_cfg.text, weights), get_kernels(cfg.kernels))


def reference_logprobs(reference: K3Forward | None, step: StepBatch, sampling: Any, encoder: Any) -> torch.Tensor | None:
    """The reference policy's log-probs of the sampled tokens [N, T] under the loss's distribution `sampling`; None
    without a reference. Its vision tower is the checkpoint's, as loaded (`encoder` turns a trained tower's inputs
    into its image rows)."""
    if reference is None:
        return None
    from trainer.logprobs import padded_logprobs

    with torch.no_grad():
        images = step.batch.images
        lp = padded_logprobs(reference, step.batch.input_ids, step.batch.lens, sampling,
                             images=encoder.rows(images) if isinstance(images, ImageInputs) else images)
    return lp.gather(1, step.index.to(lp.device))
