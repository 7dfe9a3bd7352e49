"""Weight receiving in the real vLLM engine (CPU): the `zerokl` weight-transfer backend.

An accepted update changes the policy version, drops the prefix cache and gives log-probs equal to the
trainer's scoring on the new weights (bits). A corrupt, partial, non-finite, wrongly typed or stale
update is rejected and leaves the engine on its previous weights (same bits before and after) and version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from parity.kernels import INVARIANT
from parity.model import K3Forward, K3Weights, score_sequences
from parity.weights import master_weights, serving_weights
from rollout.engine import RolloutEngine, Sample
from parity.io.checkpoint import load_checkpoint, random_weights
from parity.sync.bundle import SyncError, WeightBundle
from parity.sync.transports import Disk, SharedMemory

PROMPTS = [list(range(5, 40)), [(7 * i) % 1000 + 4 for i in range(200)]]  # the second spans a 128-token block



@pytest.fixture(scope="module")
def checkpoint(k3_tiny: Path) -> Path:
    return k3_tiny


@pytest.fixture(scope="module")
def engine(k3_engine: RolloutEngine, checkpoint: Path) -> Iterator[RolloutEngine]:
    """The session's shared engine; afterwards it is given the checkpoint's weights again, as a newer version, and
    must then sample what it sampled before this module's updates."""
    before = _rollout(k3_engine)
    yield k3_engine
    cfg, tensors = load_checkpoint(checkpoint)
    k3_engine.update_weights(WeightBundle.make(k3_engine.policy_version + 1,
                                               serving_weights(cfg.text, master_weights(cfg.text, tensors))))
    for a, b in zip(_rollout(k3_engine), before):
        assert a.completion_ids == b.completion_ids and torch.equal(a.logprobs, b.logprobs)


def _text_weights(checkpoint: Path, seed: int) -> dict[str, torch.Tensor]:
    """New random text weights in the form a sync carries (`parity.weights.serving_weights`)."""
    cfg, _ = load_checkpoint(checkpoint)
    return serving_weights(cfg.text, master_weights(cfg.text, random_weights(cfg, seed=seed)))


def _rollout(engine: RolloutEngine) -> list[Sample]:
    return engine.generate(PROMPTS, temperature=1.0, max_tokens=6, seed=3)


@pytest.mark.parametrize("transport", ["shared_memory", "disk"])
def test_update_installs_new_policy(engine: RolloutEngine, checkpoint: Path, transport: str, tmp_path: Path) -> None:
    """Through either transport the workers use (`shared_memory`: one segment, no disk; `disk`: one write)."""
    _rollout(engine)  # warm the prefix cache with the old weights' latents and states
    new = _text_weights(checkpoint, seed=7 + len(transport))
    version = engine.policy_version + 1
    engine.update_weights(WeightBundle.make(version, new), SharedMemory() if transport == "shared_memory" else Disk(tmp_path))
    assert engine.policy_version == version
    samples = _rollout(engine)
    cfg, _ = load_checkpoint(checkpoint)
    fwd = K3Forward(K3Weights.from_official(cfg.text, new), INVARIANT)
    for s in samples:
        assert s.policy_version == version and s.cached_tokens == 0  # the old weights' cache was dropped
        ref = score_sequences(fwd, [s.prompt_ids + s.completion_ids])[0][len(s.prompt_ids) - 1 :]
        assert torch.equal(ref, s.logprobs), f"max |d| = {(ref - s.logprobs).abs().max().item():.3e}"


def _flip_bit(b: WeightBundle) -> WeightBundle:
    name = sorted(b.tensors)[3]
    t = b.tensors[name].clone()
    t.view(torch.uint8)[0] ^= 1
    return WeightBundle(b.version, b.kind, {**b.tensors, name: t}, b.checksums)


def _drop_one(b: WeightBundle) -> WeightBundle:
    name = sorted(b.tensors)[-1]
    return WeightBundle(b.version, b.kind, {n: t for n, t in b.tensors.items() if n != name}, b.checksums)


def _nan(b: WeightBundle) -> WeightBundle:
    tensors = dict(b.tensors)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")
    return WeightBundle.make(b.version, tensors)  # checksums match: only the finiteness check rejects it


def _retyped(b: WeightBundle) -> WeightBundle:
    """Every bf16 tensor sent as fp32 and the reverse (the values fit; the dtypes are not the engine's)."""
    return WeightBundle.make(b.version, {n: t.float() if t.dtype == torch.bfloat16 else t.bfloat16()
                                         for n, t in b.tensors.items()})


def _stale(b: WeightBundle) -> WeightBundle:
    return WeightBundle(b.version - 1, b.kind, b.tensors, b.checksums)


@pytest.mark.parametrize(("damage", "message"), [
    (_flip_bit, "checksum mismatch"),
    (_drop_one, "partial update"),
    (_nan, "non-finite"),
    (_retyped, "expected"),
    (_stale, "stale update"),
])
def test_rejected_update_keeps_previous_weights(engine: RolloutEngine, checkpoint: Path,
                                                damage: Callable[[WeightBundle], WeightBundle], message: str) -> None:
    before, version = _rollout(engine), engine.policy_version
    bundle = damage(WeightBundle.make(version + 1, _text_weights(checkpoint, seed=11)))
    with pytest.raises(SyncError, match=message):
        engine.update_weights(bundle)
    after = _rollout(engine)
    assert engine.policy_version == version
    for a, b in zip(after, before):
        assert a.completion_ids == b.completion_ids and torch.equal(a.logprobs, b.logprobs)
        assert a.policy_version == version
