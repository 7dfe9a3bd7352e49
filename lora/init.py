"""`zerokl lora init`: a seeded random adapter whose B is non-zero, so it changes the model's outputs.

PEFT's default initialisation (B = 0) makes an adapter a no-op, which would let a LoRA parity test pass with
the LoRA term ignored. Here A is PEFT's kaiming-uniform draw (bound 1 / sqrt(in_features)) and B is Gaussian,
scaled so that scale * (x A^T) B^T has about `INIT_DELTA` times the RMS of a unit-RMS input: a visible but
small change of every targeted projection.
"""

from __future__ import annotations

import math

import torch

from lora.adapter import Adapter, validate
from lora.spec import AdapterError, LoraSpec
from lora.targets import lora_targets, suffixes
from parity.config import TextConfig

INIT_DELTA = 0.1


def random_adapter(cfg: TextConfig, rank: int, alpha: float | None = None, targets: list[str] | None = None,
                   seed: int = 0, use_rslora: bool = False, base_model: str | None = None) -> Adapter:
    """A validated random adapter on every module matching `targets` (PEFT `target_modules` suffixes; default:
    every supported projection). `alpha` defaults to `rank` (scale 1).

    Invariant: the same (config, rank, alpha, targets, seed, rslora) gives the same bits: one generator seeded
    with `seed` draws A then B for each module in checkpoint order."""
    available = suffixes(cfg)
    chosen = available if not targets else list(dict.fromkeys(targets))
    unknown = [t for t in chosen if t not in available]
    if unknown:
        raise AdapterError(f"--targets: {unknown[0]!r} is not a LoRA target of this model; choose from "
                           f"{', '.join(available)}")
    spec = LoraSpec(r=rank, lora_alpha=float(rank if alpha is None else alpha), target_modules=tuple(chosen),
                    use_rslora=use_rslora, base_model_name_or_path=base_model)
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, t in lora_targets(cfg).items():
        if not spec.targets(module):
            continue
        bound = 1.0 / math.sqrt(t.in_features)
        a = torch.empty(rank, t.in_features).uniform_(-bound, bound, generator=gen)
        # x A^T has RMS ~ 1/sqrt(3) per unit-RMS input; B's std makes scale * (x A^T) B^T ~ INIT_DELTA RMS.
        std = INIT_DELTA * math.sqrt(3.0) / (spec.scale(module) * math.sqrt(rank))
        b = torch.randn(t.out_features, rank, generator=gen) * std
        weights[module] = (a, b)
    return validate(Adapter(spec, weights), cfg)


def peft_default_adapter(cfg: TextConfig, rank: int, alpha: float | None = None, targets: list[str] | None = None,
                         seed: int = 0) -> Adapter:
    """PEFT's initialisation for training: A as in `random_adapter`, B = 0, so the adapted model starts
    exactly at the base model (what `zerokl ppo --lora` trains from)."""
    drawn = random_adapter(cfg, rank, alpha, targets, seed)
    return Adapter(drawn.spec, {m: (a, torch.zeros_like(b)) for m, (a, b) in drawn.weights.items()})
