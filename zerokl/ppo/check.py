"""The check stage: the zero-KL check of a step's samples, and the diagnosis when it fails.

Before any update changes the weights, the trainer's log-probs of the sampled tokens at the generating policy version
must equal the rollout engine's bit for bit (KL = 0, every ratio exactly 1). Two kinds are compared per token: the
ones under the distribution sampled from (vLLM's processed log-probs, which the engine returns) and the raw ones
(temperature 1, no truncation), which the engine's worker records with vLLM's raw op (`rollout.vllm.records`); on MoE
models also the experts the trainer's forward chose at every position against the engine's (`routing_agreement`,
`parity.routing`). Environment tokens of multi-turn samples are skipped.

Where the trainer's log-probs come from is the update stage's business (its first update's forward, or a no-grad pass
over every sample first); for rollouts older than the trainer's version (`max_staleness`) they come from the kept
serving weights of that version through the shared forward (`kept_logprobs`): the bits the trainer's forward had then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from parity.compare import SequenceLogprobs, compare
from parity.diagnose import diagnose
from parity.kernels import get_kernels
from parity.model import K3Forward, K3Weights
from parity.routing import routing_agreement
from zerokl.ppo.samples import StepBatch


class ParityViolation(RuntimeError):
    """The trainer's log-probs of the rollout tokens differ from the rollout engine's."""


def parity_holds(report: dict[str, Any]) -> bool:
    """Whether a step's check found every log-prob, processed and raw, bitwise equal."""
    return report["parity"].all_equal and report["parity_raw"].all_equal


def check(report: dict[str, Any], step: StepBatch, lp: torch.Tensor, raw: torch.Tensor, rows: torch.Tensor,
          routing: list[torch.Tensor], on_mismatch: str) -> None:
    """The zero-KL check into `report`: the trainer's log-probs `lp` (the sampling distribution's) and `raw` ones
    [len(rows), T] of the samples `rows` at the generating version against the rollout's, every policy token; and
    the experts its forward chose (`routing`, per sample; empty for a dense model) against the engine's. Raises
    ParityViolation on a mismatch when `on_mismatch` is "stop"."""
    ids = rows.tolist()
    samples, mask = step.samples, step.mask

    def seqs(values: list[torch.Tensor] | torch.Tensor) -> list[SequenceLogprobs]:
        """Each sample's policy tokens (every completion token but an environment's) and their values."""
        out = []
        for i, x in zip(ids, values):
            s, keep = samples[i], mask[i, : len(samples[i].completion_ids)].bool()
            tokens = [t for t, k in zip(s.completion_ids, keep.tolist()) if k]
            out.append(SequenceLogprobs(str(i), tokens, x[: len(keep)].detach()[keep]))
        return out

    report["parity"] = compare(seqs([samples[i].logprobs for i in ids]), seqs(lp))
    report["parity_raw"] = compare(seqs([samples[i].raw_logprobs for i in ids]), seqs(raw))
    report["checked"] = len(rows)
    if routing:
        report["routing"] = routing_agreement([samples[i].routing for i in ids], routing)
    if not parity_holds(report) and on_mismatch == "stop":
        raise ParityViolation("trainer log-probs differ from the rollout engine's")


def kept_logprobs(text: Any, weights: dict[str, torch.Tensor], kernels: str, step: StepBatch,
                  sampling: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probs and raw log-probs of the sampled tokens [N, T] under kept serving `weights` (official names) of
    an older version, through the shared forward (no grad): the bits the trainer's forward had at that version (the
    engine's equal both)."""
    from trainer.logprobs import padded_logprobs

    fwd = K3Forward(K3Weights.from_official(text, weights), get_kernels(kernels))
    with torch.no_grad():
        lp, raw = padded_logprobs(fwd, step.batch.input_ids, step.batch.lens, sampling, raw=True,
                                  images=step.batch.images)
    index = step.index.to(lp.device)
    return lp.gather(1, index), raw.gather(1, index)


def diagnosis(report: dict[str, Any], samples: list[Any], text: Any, weights: dict[str, torch.Tensor],
              adapter: Any, kernels: str, out: Path) -> str:
    """Re-run the first mismatching text sequence through the shared forward on the trainer's `weights` (and
    `adapter`): the rollout schedule (prefill the prompt, then decode) against the trainer's one pass, capturing every
    block; the sentence is also written to `out/diagnosis.txt`."""
    rep, which = (report["parity_raw"], "raw ") if report["parity"].all_equal else (report["parity"], "")
    failed = [d for d in rep.sequences if d.first_mismatch is not None]
    text_only = [d for d in failed if not samples[int(d.id)].images]  # the block replay runs token ids
    if not text_only:
        sentence = (f"sequence {failed[0].id}: first {which}log-prob mismatch at completion token "
                    f"{failed[0].first_mismatch} (max |d| {failed[0].max_abs_diff:.3e}); every mismatching sequence "
                    "has images, which the block-by-block replay does not take")
    else:
        first = text_only[0]
        s = samples[int(first.id)]
        k3 = K3Weights.from_official(text, weights)
        if adapter is not None:
            k3.lora = adapter.lora()
        fwd = K3Forward(k3, get_kernels(kernels))
        div = diagnose((fwd, "decode"), (fwd, "one_pass"), s.prompt_ids + s.completion_ids, prefill=len(s.prompt_ids))
        where = div.describe() if div else (
            "replayed alone, the sequence's schedules agree at every block on the trainer's weights: the engine's bits "
            f"depend on something outside it, the other sequences of its batch (kernels {kernels!r} are "
            "batch-invariant only when 'invariant') or weights that differ from the trainer's (check the last sync)")
        sentence = (f"sequence {first.id}: first {which}log-prob mismatch at completion token {first.first_mismatch} "
                    f"(max |d| {first.max_abs_diff:.3e}); {where}")
    (out / "diagnosis.txt").write_text(sentence + "\n")
    return sentence
