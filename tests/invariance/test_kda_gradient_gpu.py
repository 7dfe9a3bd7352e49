"""KDA's gradient on the GPU trainer, bf16: fla's chunked kernels (forward recompute and Triton backward), each pinned
to one launch configuration (`parity.kernels.fla_pinned`), at K3's KDA shapes (16 heads x 128). Skips without CUDA or
fla; the CPU suite tests the gradient's other readings (test_kernels_triton.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs fla-core")]

REPO = Path(__file__).resolve().parents[2]
SHAPE = (2, 300, 16, 128)  # batch, tokens (not a multiple of the 64-token chunk), K3's KDA heads, head dim
ROUNDINGS = 8  # bf16 stores on the longest path of fla's backward (w/u/qg/kg, h, v_new, dv, dh, dv2, the gradient)


def _case(seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(q, k, v bf16; g fp32; beta bf16) on the CPU as a KDA layer makes them, the valid mask (row 1 padded after 211
    tokens) and the output's cotangent."""
    from parity.kernels.registry import INVARIANT

    b, t, h, d = SHAPE
    gen = torch.Generator().manual_seed(seed)
    q = INVARIANT.l2norm(torch.randn(b, t, h, d, generator=gen)).bfloat16()
    k = INVARIANT.l2norm(torch.randn(b, t, h, d, generator=gen)).bfloat16()
    v = torch.randn(b, t, h, d, generator=gen).bfloat16()
    g = INVARIANT.kda_gate(torch.randn(b, t, h, d, generator=gen), torch.zeros(h), torch.zeros(h, d), -5.0)
    beta = torch.sigmoid(torch.randn(b, t, h, generator=gen)).bfloat16()
    valid = torch.arange(t).expand(b, t) < torch.tensor([[t], [211]])
    return [q, k, v, g, beta], valid, torch.randn(b, t, h, d, generator=gen)


def triton_gradients(seed: int = 0) -> list[torch.Tensor]:
    """d(q, k, v, g, beta) of <TRITON.kda(...), cotangent> on the GPU, on the CPU."""
    from parity.kernels.triton import TRITON

    inputs, valid, cot = _case(seed)
    leaves = [x.cuda().requires_grad_() for x in inputs]
    state = torch.zeros(SHAPE[0], SHAPE[2], SHAPE[3], SHAPE[3], device="cuda")
    out, _ = TRITON.kda(*leaves[:5], 0.25, state, valid.cuda())
    return [x.cpu() for x in torch.autograd.grad(out, leaves, cot.cuda().to(out.dtype))]


def test_gpu_kda_gradient_within_bf16_rounding_of_float64() -> None:
    """Each gradient within ROUNDINGS bf16 units (2^-8) of float64 in norm, relative to its norm: the first-order
    bound for that many roundings on a path when the chunk's triangular solve is well conditioned (l2-normed keys,
    beta < 1, decays <= 1, as here and in a K3 layer). A wrong gradient is off by O(1)."""
    from parity.kernels.kda import kda_chunked

    inputs, valid, cot = _case()
    leaves = [x.double().requires_grad_() for x in inputs]
    state = torch.zeros(SHAPE[0], SHAPE[2], SHAPE[3], SHAPE[3], dtype=torch.float64)
    out, _ = kda_chunked(*leaves, 0.25, state, valid)
    ref = torch.autograd.grad(out, leaves, cot.double())
    for name, got, want in zip("q k v g beta".split(), triton_gradients(), ref):
        err = (got.double() - want).norm() / want.norm()
        assert err <= ROUNDINGS * 2.0**-8, (name, float(err))


def test_gpu_kda_gradient_is_the_same_bits_in_another_process(tmp_path: Path) -> None:
    """The gradient repeats bit for bit in this process and in a fresh one (a run and its resume), with fla's
    autotuners holding one configuration inside the backward and all of theirs again after it."""
    from parity.kernels import fla_pinned

    here = triton_gradients()
    counts = {id(t): len(t.configs) for t in fla_pinned.autotuners()}
    assert counts and any(n > 1 for n in counts.values())  # restored: fla outside the backward autotunes as before
    for a, b in zip(here, triton_gradients()):
        assert torch.equal(a, b)
    out = tmp_path / "grads.pt"
    child = subprocess.run([sys.executable, __file__, str(out)], cwd=REPO, capture_output=True, text=True,
                           timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    for a, b in zip(here, torch.load(out)):
        assert torch.equal(a, b)


def test_pinned_holds_one_configuration_per_autotuner() -> None:
    from parity.kernels import fla_pinned

    with fla_pinned.pinned():
        inside = fla_pinned.autotuners()
        assert inside and all(len(t.configs) == 1 for t in inside)


if __name__ == "__main__":  # the other process of the bits test
    sys.path.insert(0, str(REPO))
    torch.save(triton_gradients(), sys.argv[1])
