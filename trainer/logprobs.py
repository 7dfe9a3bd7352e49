"""Per-token log-probs of a padded or packed batch in one differentiable forward, as the rollout engine defines them.

lp of token t+1 of a sequence = log_softmax(logits_t / temperature)[token_{t+1}] by the parity kernels'
`token_logprobs` (the vLLM sampler's arithmetic), with logits_t from the shared K3 forward over tokens 0..t. Where
`temperature` is a `parity.kernels.logprobs.Sampling` with truncation (top-k / top-p / min-p), log-probs and entropy
are under the truncated distribution, as the engine's processed log-probs are.
Outputs use next-token alignment (Megatron's labels = tokens shifted by one): `out[..., t]` scores token t + 1;
the last token of each sequence and every padding position hold 0.

A packed batch (THD: sequences back to back, `cu_seqlens` offsets as Megatron's `PackedSeqParams`) is laid out
as right-padded rows for the forward and packed back; the forward is batch-invariant, so each token gets the
same bits either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from parity.kernels.logprobs import Sampling, processed_logits
from parity.caches import new_cache
from parity.model import K3Forward
from parity.vision import ImageInputs, ImageRows


@dataclass(frozen=True)
class PaddedBatch:
    """input_ids: [B, T] int64, right-padded; lens: [B] int64 (each >= 1); images: each row's image embeddings, which
    fill its image placeholder rows, or its images' patches for a trainer that trains its tower (None: text only)."""

    input_ids: torch.Tensor
    lens: torch.Tensor
    images: ImageRows | ImageInputs | None = None

    @classmethod
    def from_sequences(cls, seqs: Sequence[Sequence[int]], pad_id: int = 0,
                       images: ImageRows | ImageInputs | None = None) -> PaddedBatch:
        lens = torch.tensor([len(s) for s in seqs])
        ids = torch.full((len(seqs), int(lens.max())), pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        return cls(ids, lens, images)

    def select(self, rows: torch.Tensor) -> PaddedBatch:
        """The batch of rows `rows` (a 1-D index), their images with them."""
        images = None if self.images is None else replace(self.images,
                                                          rows=tuple(self.images.rows[i] for i in rows.tolist()))
        return PaddedBatch(self.input_ids[rows], self.lens[rows], images)

    def model_kwargs(self) -> dict[str, ImageRows | ImageInputs]:
        """What a trainer model's forward takes beside the ids: the rows' images, when there are any."""
        return {} if self.images is None else {"images": self.images}

    def mask(self) -> torch.Tensor:
        """[B, T] bool: positions holding a token."""
        return torch.arange(self.input_ids.shape[1]).view(1, -1) < self.lens.view(-1, 1)


@dataclass(frozen=True)
class PackedBatch:
    """tokens: [N] int64, sequences back to back; cu_seqlens: [S + 1] int64 offsets (0, len_0, len_0 + len_1, ...)."""

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor

    def to_padded(self, pad_id: int = 0) -> PaddedBatch:
        lens = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        ids = torch.full((len(lens), int(lens.max())), pad_id, dtype=torch.long)
        padded = PaddedBatch(ids, lens)
        ids[padded.mask()] = self.tokens  # row-major order of the mask is the packed order
        return padded


def padded_logprobs(fwd: K3Forward, input_ids: torch.Tensor, lens: torch.Tensor, temperature: float | Sampling,
                    entropy: bool = False, value_head: torch.Tensor | None = None,
                    raw: bool = False, images: ImageRows | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """One forward over right-padded rows -> lp: [B, T] (next-token aligned, zeros past each row's last
    scored token). Same calls as `parity.model.score_sequences`, so the same bits. With `raw`, also the raw
    log-probs (temperature 1, no truncation: vLLM's `raw_logprobs`) from the same logits, aligned and zeroed alike.
    With `entropy`, also the
    entropy of each position's next-token distribution softmax(logits / temperature), aligned and zeroed alike
    (fp32, differentiable; a loss term, not part of the parity contract). With `value_head` ([1, D + 1] fp32: weights,
    then a bias), also the values: w . final_norm(hidden) / D + bias at each position, the value before the token it
    predicts (D = hidden size: a mean-field readout, so an Adam step of size lr on w moves a value by about lr, as one
    on the bias does, whatever D), aligned and zeroed alike, fp32, computed beside the logits (their bits are
    untouched). With `images`, each row's image placeholder rows take its images' embeddings (as in the engine).
    Returns lp, or (lp, [raw,] [entropy,] [values])."""
    b, t = input_ids.shape
    pos = torch.arange(t).expand(b, t).clamp(max=(lens - 1).clamp(min=0).view(b, 1))
    embeds = None if images is None else images.merge(fwd.embed(input_ids), input_ids)
    hidden = fwd.hidden(input_ids, pos, lens, new_cache(fwd.cfg, b, fwd.dtype), embeds=embeds)
    logits = fwd.logits(hidden[:, :-1])
    lp = fwd.token_logprobs(logits, input_ids[:, 1:], temperature)  # [B, T-1]
    scored = torch.arange(t - 1, device=lp.device).view(1, -1) < (lens - 1).view(-1, 1)
    out = [F.pad(torch.where(scored, lp, 0.0), (0, 1))]
    if raw:
        out.append(F.pad(torch.where(scored, fwd.token_logprobs(logits, input_ids[:, 1:], 1.0), 0.0), (0, 1)))
    if entropy:
        out.append(F.pad(torch.where(scored, next_token_entropy(logits, temperature), 0.0), (0, 1)))
    if value_head is not None:
        normed = fwd.k.rmsnorm(hidden[:, :-1], fwd.weight(fwd.names.norm), fwd.cfg.rms_norm_eps)
        values = (normed.float() @ value_head[:, :-1].t()).squeeze(-1) / normed.shape[-1] + value_head[0, -1]
        out.append(F.pad(torch.where(scored, values, 0.0), (0, 1)))
    return out[0] if len(out) == 1 else tuple(out)


def next_token_entropy(logits: torch.Tensor, temperature: float | Sampling) -> torch.Tensor:
    """Entropy of the sampling distribution per position (softmax(logits / temperature), truncated when `temperature`
    is a `Sampling` that truncates), in fp32: [..., V] -> [...]; tokens outside the truncation add nothing."""
    z = processed_logits(logits.reshape(-1, logits.shape[-1]), temperature).view(logits.shape)
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, 0.0)).sum(dim=-1)  # no 0 * -inf, also in grads


def token_logprobs(model: torch.nn.Module, batch: PaddedBatch | PackedBatch,
                   temperature: float | Sampling) -> torch.Tensor:
    """Per-token log-probs from `model` (a `MegatronK3Model`, or Megatron's DDP around one): [B, T] for a padded
    batch, [N] for a packed one (entry i scores token i + 1 of its sequence; 0 at each sequence's end)."""
    if isinstance(batch, PackedBatch):
        padded = batch.to_padded()
        return model(padded.input_ids, padded.lens, temperature)[padded.mask()]
    return model(batch.input_ids, batch.lens, temperature, **batch.model_kwargs())


def token_logprobs_and_entropy(model: torch.nn.Module, batch: PaddedBatch, temperature: float | Sampling,
                               raw: bool = False) -> tuple[torch.Tensor, ...]:
    """`token_logprobs` of a padded batch [and the raw ones] and the entropy of each position's next-token
    distribution, all [B, T] (`padded_logprobs` with `entropy`), from one forward."""
    return model(batch.input_ids, batch.lens, temperature, entropy=True, raw=raw, **batch.model_kwargs())


def token_logprobs_entropy_and_values(model: torch.nn.Module, batch: PaddedBatch, temperature: float | Sampling,
                                      raw: bool = False) -> tuple[torch.Tensor, ...]:
    """`token_logprobs_and_entropy` and the value head's values (`padded_logprobs` with `value_head`), all [B, T],
    from one forward of a model with a value head."""
    return model(batch.input_ids, batch.lens, temperature, entropy=True, values=True, raw=raw, **batch.model_kwargs())
