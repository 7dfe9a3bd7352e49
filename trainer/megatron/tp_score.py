"""One rank of the Megatron trainer scoring a batch at tensor parallelism TP: the trainer side of
`zerokl parity check --tp N` (launched on TP local ranks by `zerokl.engine_check.TensorParallelScorer`).

Every rank loads the checkpoint (and adapter) and keeps its TP shard (`trainer.megatron.train.build_model`); the ranks
score `DIR/batch.pt` ({"input_ids", "lens"}) together with no gradient, and rank 0 saves the [B, T] log-probs to
`DIR/logprobs.pt`. The forward is the training forward (`MegatronK3Model`), so the bits are those a TP training step
sees.
Usage (torchrun's environment): python -m trainer.megatron.tp_score --checkpoint CKPT --tp N --kernels K
    --temperature T --dir DIR [--adapter PEFT_DIR]
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

BATCH_FILE = "batch.pt"
LOGPROBS_FILE = "logprobs.pt"


def score(checkpoint: str, tp: int, kernels: str, temperature: float, workdir: Path, adapter: str | None) -> None:
    """This rank's part of scoring `workdir/BATCH_FILE`; rank 0 writes `workdir/LOGPROBS_FILE`."""
    from lora.adapter import load_adapter
    from parity.io.checkpoint import load_checkpoint
    from parity.weights import master_weights
    from trainer.megatron.parallel import destroy_parallel, init_parallel
    from trainer.megatron.train import build_model

    par = init_parallel(tp, 1)
    try:
        model_cfg, weights = load_checkpoint(checkpoint)
        lora = None if adapter is None else load_adapter(adapter, model_cfg.text)
        model = build_model(model_cfg, master_weights(model_cfg.text, weights), par, kernels, adapter=lora)
        batch = torch.load(workdir / BATCH_FILE, weights_only=True)
        with torch.no_grad():
            lp = model(batch["input_ids"], batch["lens"], temperature)
        if dist.get_rank() == 0:
            torch.save(lp, workdir / LOGPROBS_FILE)
    finally:
        destroy_parallel(par)


def main() -> None:
    warnings.filterwarnings("ignore")  # Megatron's deprecation notices (imported in `score`) are not the user's concern
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--kernels", required=True)
    ap.add_argument("--temperature", type=float, required=True)
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--adapter")
    a = ap.parse_args()
    score(a.checkpoint, a.tp, a.kernels, a.temperature, a.dir, a.adapter)


if __name__ == "__main__":
    main()
