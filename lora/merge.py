"""`zerokl lora merge`: fold an adapter into a checkpoint, W' = W + scale * (B A), cast back to storage.

Merging changes bits: the adapter run computes W x + scale * ((x A^T) B^T) (two extra GEMMs, then an add),
the merged model W' x with W' rounded to its storage dtype. Log-probs of the merged model are therefore close
to the adapter run, not equal: with fp32 storage the difference is fp32 rounding of the GEMM; with bf16
storage (the default for K3 checkpoints) every merged weight is also rounded to 8 mantissa bits.
For bitwise parity between engines, serve the adapter unmerged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from lora.adapter import Adapter, load_adapter
from lora.spec import AdapterError
from parity.config import ModelConfig
from parity.io.checkpoint import DTYPES, all_specs, load_checkpoint, save_checkpoint


def merge_weights(weights: dict[str, torch.Tensor], adapter: Adapter) -> dict[str, torch.Tensor]:
    """A copy of the official `weights` with each adapted weight replaced by W + scale * (B @ A), computed in
    fp32 and stored in W's dtype. Other tensors are shared, not copied."""
    merged = dict(weights)
    for name, lora in adapter.lora().items():
        w = weights[name]
        delta = (lora.b @ lora.a) * lora.scale  # [out, r] @ [r, in] -> [out, in] fp32
        merged[name] = (w.to(torch.float32) + delta).to(w.dtype)
    return merged


def merge_checkpoint(model: str | Path, adapter_dir: str | Path, out: str | Path, dtype: str | None = None,
                     progress: Callable[[str], None] | None = None) -> Path:
    """Load the checkpoint `model` and the adapter (validated against it), write the merged checkpoint to `out`.

    `dtype` (bfloat16 / float32) re-stores every model-dtype tensor (fp32-stored ones and packed MXFP4 experts stay)
    before merging, e.g. float32 to keep the merged delta unrounded; default: as stored in `model`."""
    if dtype is not None and dtype not in DTYPES:
        raise AdapterError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    cfg, weights = load_checkpoint(model)
    adapter = load_adapter(adapter_dir, cfg.text)
    if dtype is not None:
        specs = all_specs(cfg)
        weights = {n: t if specs[n].fp32 or specs[n].packing else t.to(DTYPES[dtype]) for n, t in weights.items()}
        cfg = ModelConfig(cfg.model_type, cfg.text, cfg.vision, {**cfg.raw, "torch_dtype": dtype})
    merged = merge_weights(weights, adapter)
    if progress:
        progress(f"merged {len(adapter.weights)} modules of {adapter_dir} into {model}")
    return save_checkpoint(cfg, merged, out, progress=progress)
