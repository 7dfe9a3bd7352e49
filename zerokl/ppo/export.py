"""`zerokl export`: the trained weights of a `zerokl ppo` checkpoint as an official checkpoint directory (what `zerokl
serve`, `zerokl parity check --model` and vLLM load), on the model config the run trained.

The weights come from the trainer's saved state: `weights.pt` (one process), or the Megatron ranks' own
files gathered here (`trainer.megatron.io.gather_rank_weights`). Each tensor is written in the dtype the run's model
stores it in: the fp32 masters rounded as the trainer's forward rounds them, MXFP4 experts quantised again
(`parity.io.checkpoint.save_checkpoint`), so the exported model computes what the trained policy computed. A LoRA
run's checkpoint holds its adapter (`adapter/`, PEFT) instead: refused, with the commands that use it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from parity.config import ConfigError, load_model_config
from parity.io.checkpoint import check_new_dir, open_checkpoint, save_checkpoint
from trainer.base import ADAPTER_DIR, WEIGHTS_FILE
from trainer.megatron.io import gather_rank_weights
from zerokl.ppo.state import read_run_state, resume_point


def export_checkpoint(checkpoint: str | Path, out: str | Path,
                      progress: Callable[[str], None] | None = None) -> Path:
    """Write the trained weights of `checkpoint` (a run directory: its latest complete checkpoint, or
    `OUT/checkpoints/step-N`) as an official checkpoint directory `out` (new or empty)."""
    check_new_dir(Path(out))  # before anything is read
    state = resume_point(Path(checkpoint))
    saved = read_run_state(state)["config"]
    if (state / ADAPTER_DIR).is_dir():
        raise ConfigError(f"{state} is a LoRA run's checkpoint: its {ADAPTER_DIR}/ is the trained adapter (PEFT); "
                          f"serve it with `zerokl serve --lora-root` or merge it with `zerokl lora merge --model "
                          f"{saved['model']} --adapter {state / ADAPTER_DIR}`")
    model = Path(saved["model"])
    cfg, source = load_model_config(model), open_checkpoint(model)
    trained = (torch.load(state / WEIGHTS_FILE, weights_only=True) if (state / WEIGHTS_FILE).is_file()
               else gather_rank_weights(state, cfg.text))
    # the checkpoint's own dtype where it stores the tensor as is; MXFP4 experts stay fp32 for save_checkpoint to pack
    stored = {n: t.to(source.dtype(n)) if n in source.names else t for n, t in trained.items()}
    if progress:
        progress(f"exporting step {state.name.removeprefix('step-')} of the run on {model}")
    return save_checkpoint(cfg, stored, out, progress=progress)
