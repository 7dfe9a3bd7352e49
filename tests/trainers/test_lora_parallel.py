"""The K3 trainer with a LoRA adapter at TP = 2 with EP = 2 (two CPU ranks on gloo, `torchrun --nproc_per_node 2`), on
the invariant and on the Triton kernels.

Runs tests/dist/lora_parallel.py, which checks on every rank: adapter load -> export is bitwise; every token's
log-prob with the adapter equals the one-process shared forward with `K3Weights.lora` (torch.equal); adapter
gradients and Megatron's grad norm match the one-process ones; an Adam step leaves the base alone and lowers the
loss; the per-TP-rank adapter state shards reassemble bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import torchrun_checks

from parity.io.checkpoint import init_checkpoint

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)


ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "lora_parallel.py"
CHECKS = 6  # "ok" lines the worker prints on success (one more on the Triton kernels: the launches counted)



def test_lora_trainer_tp2_ep2(k3_tiny: Path, tmp_path: Path) -> None:
    checkpoint = k3_tiny
    torchrun_checks(WORKER, ["--tp", "2", "--ep", "2", "--checkpoint", str(checkpoint),
                             "--out", str(tmp_path / "state")], CHECKS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU ranks run the Triton kernels under the interpreter")
def test_lora_trainer_tp2_ep2_on_triton_kernels(tmp_path: Path) -> None:
    """The same checks at TP = 2 with EP = 2 on the Triton kernels (Triton's interpreter on CPU; k3-micro in fp32 with
    MXFP4 experts: in bf16 the backward's rounding alone moves gradients by ~1e-2 between layouts, bench/layouts.py):
    each rank forms only its K / TP columns' segment sums of a row-parallel GEMM (and of its LoRA's x A^T), counted
    from the Triton launches, and every rank adds all of them in order; each rank runs the grouped expert GEMMs for
    the experts it owns on the rows dispatched to it, and the tokens' ranks combine their slots with the grouped op's
    kernel: the one-process bits."""
    micro = init_checkpoint(ROOT / "configs" / "k3-micro.yaml", tmp_path / "k3-micro", seed=0, dtype="float32")
    torchrun_checks(WORKER, ["--tp", "2", "--ep", "2", "--kernels", "triton", "--checkpoint", str(micro),
                             "--out", str(tmp_path / "state")], CHECKS + 1, timeout=600, env={"TRITON_INTERPRET": "1"})
