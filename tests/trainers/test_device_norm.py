"""The trainer's gradient norm and clipping on the device (`trainer.megatron.device_norm`), read on CPU tensors: the
norm against float64 within fp32's rounding, the clip exactly Megatron's factor (and bit-identity when unclipped),
the patch held to its megatron-core release. The whole step under CUDA's sync-debug mode is
tests/generator/test_trainer_gpu.py."""

from __future__ import annotations

import pytest
import torch

from megatron.core.optimizer import optimizer as megatron_optimizer
from parity.patching import UnsupportedVersion
from trainer.megatron import device_norm


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) * 10.0 ** float(torch.randint(-3, 3, (1,), generator=g))
            for shape in ((64, 32), (7,), (3, 5, 9), (1,))]


def test_norm_is_the_float64_norm_within_fp32_rounding() -> None:
    """fp32 norms of each tensor (<= n 2^-24 relative, n its size), their norm, the square and root: within
    (max size + count + 4) 2^-24 relative of the float64 norm; a 0-d float64 tensor."""
    grads = _grads(1)
    got = device_norm.grad_norm(grads)
    ref = torch.cat([g.double().reshape(-1) for g in grads]).norm()
    assert got.dtype == torch.float64 and got.dim() == 0
    bound = (max(g.numel() for g in grads) + len(grads) + 4) * 2.0 ** -24
    assert abs(got.item() - ref.item()) <= bound * ref.item()
    assert device_norm.grad_norm([]).item() == 0.0


@pytest.mark.parametrize("max_norm", [1e-3, 1e6])
def test_clip_is_megatrons_factor_and_exact_when_unclipped(max_norm: float) -> None:
    grads = _grads(2)
    before = [g.clone() for g in grads]
    norm = device_norm.grad_norm(grads)
    device_norm.clip_grads(grads, max_norm, norm)
    coeff = max_norm / (norm.item() + 1.0e-6)  # Megatron's host-side factor
    for g, b in zip(grads, before):
        assert torch.equal(g, b * coeff if coeff < 1.0 else b)


def test_the_patch_holds_to_its_release(monkeypatch: pytest.MonkeyPatch) -> None:
    """apply() replaces the two names megatron's optimizer module imported (CPU gradients still reach Megatron's
    own functions) and refuses another megatron-core release before touching anything."""
    import megatron.core

    for name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32"):
        monkeypatch.setattr(megatron_optimizer, name, getattr(megatron_optimizer, name))  # restored after the test
    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    before = megatron_optimizer.get_grad_norm_fp32
    with pytest.raises(UnsupportedVersion, match=r"megatron-core 0.17.0 is not supported by .*device_norm"):
        device_norm.apply()
    assert megatron_optimizer.get_grad_norm_fp32 is before
    monkeypatch.setattr(megatron.core, "__version__", device_norm.WRITTEN_FOR[-1])
    device_norm.apply()
    for name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32"):
        assert getattr(megatron_optimizer, name).__zerokl_patch__ == device_norm.MARK
