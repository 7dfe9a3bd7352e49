"""The DeepSpeed trainer at ZeRO-3 on two CPU ranks (`torchrun --nproc_per_node 2`) against one rank.

tests/dist/deepspeed_zero.py runs the base model and a LoRA adapter: on every rank it checks the log-probs against
the one-process shared forward (bits) and that an export lands on rank 0 only, trains on the same batches on every
rank, then takes one step on rank-specific batches (different experts routed on each rank). This test runs the
same `run` on one rank in its own process and requires the log-probs, every (loss, grad norm), every fp32 master
weight and the trained adapter to be equal bit for bit.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lora.adapter import save_adapter
from lora.init import random_adapter
from trainer.deepspeed.engine import destroy_dist, init_dist
from parity.io.checkpoint import load_checkpoint
from helpers import torchrun_checks

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "dist" / "deepspeed_zero.py"
CHECKS = 6  # "ok" lines the worker prints on success
TIMEOUT_S = 300



def _worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deepspeed_zero_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def inputs(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """k3-tiny (bf16, seed 0) and a `zerokl lora init` adapter on attention and MLP projections."""
    root = tmp_path_factory.mktemp("ds-dist")
    checkpoint = k3_tiny
    cfg, _ = load_checkpoint(checkpoint)
    adapter = random_adapter(cfg.text, rank=4, targets=["q_proj", "kv_b_proj", "o_proj", "gate_proj"], seed=2)
    return checkpoint, save_adapter(adapter, root / "adapter")


@pytest.fixture(scope="module")
def one_rank(inputs: tuple[Path, Path]) -> Iterator[dict]:
    owns = init_dist()
    checkpoint, adapter = inputs
    worker = _worker()
    yield {"base": worker.run(checkpoint, None), "lora": worker.run(checkpoint, adapter)}
    if owns:
        destroy_dist()


def test_zero3_two_ranks_equal_one_rank(inputs: tuple[Path, Path], one_rank: dict, tmp_path: Path) -> None:
    checkpoint, adapter = inputs
    out = tmp_path / "two_ranks.pt"
    torchrun_checks(WORKER, ["--checkpoint", str(checkpoint), "--adapter", str(adapter), "--out", str(out)], CHECKS,
                    TIMEOUT_S)
    two_ranks = torch.load(out)
    for what in ("base", "lora"):
        one, two = one_rank[what], two_ranks[what]
        assert torch.equal(one["logprobs"], two["logprobs"]), what
        assert one["history"] == two["history"], f"{what}: (loss, grad norm) per step"
        assert one["masters"].keys() == two["masters"].keys()
        differ = [n for n, t in one["masters"].items() if not torch.equal(t, two["masters"][n])]
        assert not differ, f"{what}: {len(differ)} master weights differ, first {differ[0]}"
    adapter_one, adapter_two = one_rank["lora"]["adapter"], two_ranks["lora"]["adapter"]
    assert adapter_one.keys() == adapter_two.keys()
    assert all(torch.equal(t, adapter_two[n]) for n, t in adapter_one.items())
