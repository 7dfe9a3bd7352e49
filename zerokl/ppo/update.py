"""The update stage: a step's optimizer steps on the trainer backend, with the zero-KL check in front of the first.

With one update per step the check is that update's own forward (every pass of it runs at the generating version, so
their log-probs together are the check, taken before its optimizer step). With `ppo_epochs` x `num_minibatches` > 1
it is a no-grad pass over every sample first (the "old log-probs" recompute; with GAE it also gives the old values),
then each epoch shuffles the samples (seeded by the step) and takes one clipped-surrogate optimizer step per
minibatch, old log-probs being the rollout's (the check proved them the trainer's). Later minibatches are off-policy
by design: `ppo_kl` (mean old - new log-prob over the updates' tokens) and `clipfrac` say how far. `old_logprobs:
rollout` skips the no-grad pass except every `parity_check_every` steps; on the other steps the check covers the rows
of the first update. Rollouts older than the trainer (`max_staleness`) are checked on the kept weights of their
version (`check.kept_logprobs`), and every update is then off-policy.

`micro_batch_size` splits each minibatch into forward/backward passes of that many samples whose gradients add up
(each pass's loss weighted by its share of the minibatch's tokens) before the one optimizer step. With
`data_parallel: shard` (the default) each of the R data-parallel ranks runs its own block of every minibatch, its
loss scaled by R (Megatron's DDP averages the DP ranks' gradients; tensor-parallel peers
run the same block), and the check gathers the first update's rows from every DP rank.

The loss: the clipped surrogate (`zerokl.ppo.algo.ppo_loss`, with a KL penalty to the reference's log-probs and an
entropy bonus when configured) on the kind of log-prob `logprobs_mode` names, plus `vf_coef` x the clipped value loss
with GAE.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from parity.model import record_routing
from parity.routing import per_sequence
from zerokl.ppo.advantages import Targets
from zerokl.ppo.algo import ppo_loss, value_loss
from zerokl.ppo.check import check
from zerokl.ppo.config import PPOConfig
from zerokl.ppo.samples import StepBatch, step_seed

# per-update statistics reported as their token-weighted means (metric name, key in `ppo_loss`'s stats)
UPDATE_STATS = (("ppo_kl", "ppo_kl"), ("clipfrac", "clip_frac"), ("entropy", "entropy"), ("kl_ref", "kl_ref"),
                ("value_loss", "value_loss"), ("vf_clipfrac", "vf_clip_frac"))


@dataclass
class Updated:
    """What the stage did: the losses' and grad norms' means, each update's stats weighted by its passes' token
    shares (`stats`), whether the no-grad pass ran, its seconds and the whole stage's, and with sharding each rank's
    (samples, completion tokens, mean reward) of the first update."""

    loss: float
    grad_norm: float
    stats: dict[str, float]
    recomputed: bool
    seconds_old: float
    seconds: float
    shards: list[tuple[int, float, float]] = field(default_factory=list)


class Update:
    """One step's updates on `backend` over `step`'s samples; `report` receives the check's results, `ref` is the
    reference policy's log-probs [N, T] (None without a KL penalty); with `ranks` > 1 this is rank `rank`'s share."""

    def __init__(self, cfg: PPOConfig, backend: Any, step: StepBatch, targets: Targets, ref: torch.Tensor | None,
                 report: dict[str, Any], ranks: int, rank: int):
        self.cfg, self.backend, self.step, self.targets, self.ref = cfg, backend, step, targets, ref
        self.report, self.ranks, self.rank = report, ranks, rank
        self.per_update: list[tuple[float, dict[str, float]]] = []  # (token share in its minibatch, stats) per pass
        # the first update's (log-probs, raw log-probs, rows, routing) per pass, until all are in
        self.first_update: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]] = []

    def run(self, step_index: int, kept: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None) -> Updated:
        """The old-log-prob pass where one is due, then every update. `kept` gives the check's log-probs of stale
        rollouts (None when the rollouts are the trainer's version). Raises `check.ParityViolation` (stop mode)."""
        cfg, n = self.cfg, len(self.step)
        updates = cfg.ppo_epochs * cfg.num_minibatches
        t0 = time.perf_counter()
        recomputed = self._old_pass(step_index, updates, kept)
        seconds_old = time.perf_counter() - t0
        losses, norms, shards = [], [], []
        shuffle = torch.Generator().manual_seed(step_seed(cfg.seed, step_index))
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=shuffle) if updates > 1 else torch.arange(n)
            for rows in order.tensor_split(cfg.num_minibatches):
                mine = rows.tensor_split(self.ranks)[self.rank]  # with data_parallel: shard, this rank's block
                if self.ranks > 1 and not shards:
                    shards.extend(self.backend.dp_all_gather((len(mine), float(self.step.mask[mine].sum()),
                                                           float(self.targets.rewards[mine].mean()))))
                passes = mine.split(cfg.micro_batch_size) if cfg.micro_batch_size else (mine,)
                loss, grad_norm = self.backend.train_step(*(self._loss_for(r, rows) for r in passes))
                losses.append(loss)
                norms.append(grad_norm)
        per_update = self.per_update
        if self.ranks > 1:  # each rank's losses and stats are its shard's part of the whole: add them up, in rank order
            losses = [sum(ls) / self.ranks for ls in zip(*self.backend.dp_all_gather(losses))]
            per_update = [u for part in self.backend.dp_all_gather(per_update) for u in part]
        stats = {name: sum(share * u[key] for share, u in per_update) / updates
                 for name, key in UPDATE_STATS if key in per_update[0][1]}
        return Updated(sum(losses) / len(losses), sum(norms) / len(norms), stats, recomputed, seconds_old,
                       time.perf_counter() - t0, shards)

    def _old_pass(self, step_index: int, updates: int,
                  kept: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None) -> bool:
        """The no-grad pass over every sample at the generating version where one is due, and its check; whether it
        ran. With GAE it also sets the targets from its values. With `ranks` > 1 each rank scores its own block of the
        samples and the blocks are gathered (a row's log-probs do not depend on the rows beside it)."""
        cfg, step = self.cfg, self.step
        gae_pass = cfg.advantage == "gae" and (updates > 1 or cfg.micro_batch_size is not None)
        recompute = gae_pass or (updates > 1 and (cfg.old_logprobs == "recompute"
                                                  or step_index % cfg.parity_check_every == 0))
        if kept is not None:  # stale rollouts (one process): the check runs on the kept generating version
            with record_routing() as log:
                lp, raw = kept()
            check(self.report, step, lp, raw, torch.arange(len(step)), per_sequence(log, step.batch.lens),
                  cfg.on_mismatch)
            return True
        if not recompute:
            return False
        rows = torch.arange(len(step)).tensor_split(self.ranks)[self.rank]
        batch = step.batch.select(rows) if self.ranks > 1 else step.batch
        index = step.index[rows]
        with record_routing() as log:
            if gae_pass:  # the old-log-prob pass, with the old values
                outs = self.backend.logprobs_raw_and_values(batch, cfg.sampling)
            else:  # the old-log-prob pass: every sample at the generating version, before any update
                outs = self.backend.logprobs_and_raw(batch, cfg.sampling)
        scored = [x.gather(1, index.to(x.device)) for x in outs]
        routing = per_sequence(log, batch.lens)
        if self.ranks > 1:  # every rank's block, in rank order: the whole step's rows
            blocks = self.backend.dp_all_gather(([x.cpu() for x in scored], routing))
            scored = [torch.cat([b[0][i] for b in blocks]).to(x.device) for i, x in enumerate(scored)]
            routing = [r for b in blocks for r in b[1]]
        if gae_pass:
            self.targets.from_values(scored[2])
        check(self.report, step, scored[0], scored[1], torch.arange(len(step)), routing, cfg.on_mismatch)
        return True

    def _loss_for(self, rows: torch.Tensor, minibatch: torch.Tensor) -> Callable[[torch.nn.Module], torch.Tensor]:
        """The clipped surrogate on the samples `rows` (+ `vf_coef` x the clipped value loss with GAE), one pass of
        `minibatch`, weighted by its share of the minibatch's tokens (the passes' gradients add up to the minibatch's
        token mean); old log-probs are the rollout's (bitwise the trainer's at the generating version, which the check
        establishes)."""
        from trainer.logprobs import token_logprobs_and_entropy, token_logprobs_entropy_and_values

        cfg, step, targets, gae = self.cfg, self.step, self.targets, self.cfg.advantage == "gae"
        sub = step.batch.select(rows)
        mask = step.mask[rows]
        share = mask.sum() / step.mask[minibatch].sum().clamp(min=1)

        def loss_fn(model: torch.nn.Module) -> torch.Tensor:
            forward = token_logprobs_entropy_and_values if gae else token_logprobs_and_entropy
            checking = "parity" not in self.report  # the step's first update runs at the generating version: its
            with record_routing() if checking else nullcontext() as log:  # rows' check, once its last pass is in,
                outs = forward(model, sub, cfg.sampling, raw=True)
                lp, raw, ent, *value = (x.gather(1, step.index[rows].to(x.device)) for x in outs)
            if checking:  # before its optimizer step
                self._first_update_pass(lp, raw, rows, per_sequence(log, sub.lens), len(minibatch))
            if cfg.logprobs_mode == "raw_logprobs":  # the loss's log-probs (the old ones are the same kind)
                lp = raw
            if not targets.ready:  # GAE, one update in one pass: its forward (every sample, generating version)
                targets.from_values(value[0])

            def here(t: torch.Tensor) -> torch.Tensor:  # the step's tensors (CPU) where the forward ran
                return t[rows].to(lp.device)

            m, old = mask.to(lp.device), here(step.old)
            loss, stats = ppo_loss(lp, old, here(targets["adv"]), m, cfg.clip,
                                   ref_logp=None if self.ref is None else here(self.ref), kl_coef=cfg.kl_coef,
                                   kl_estimator=cfg.kl_estimator, entropy=ent, entropy_coef=cfg.entropy_coef)
            if gae:
                vf_loss, stats["vf_clip_frac"] = value_loss(value[0], here(targets["values"]), here(targets["returns"]),
                                                            m, cfg.value_clip)
                loss = loss + cfg.vf_coef * vf_loss
                stats["value_loss"] = float(vf_loss.detach())
            stats["ppo_kl"] = float(((old - lp.detach()) * m).sum() / m.sum().clamp(min=1))
            self.per_update.append((float(share), stats))
            if self.ranks > 1:  # the trainer averages the ranks' gradients: each rank's share of the sum, times ranks
                return loss * (share * self.ranks)
            return loss if len(rows) == len(minibatch) else loss * share

        return loss_fn

    def _first_update_pass(self, lp: torch.Tensor, raw: torch.Tensor, rows: torch.Tensor,
                           routing: list[torch.Tensor], minibatch_size: int) -> None:
        """Keep one pass of the first update; after this rank's last pass, check every rank's passes together."""
        self.first_update.append((lp.detach(), raw.detach(), rows, routing))
        if sum(len(u[2]) for u in self.first_update) != minibatch_size // self.ranks:
            return
        every = [u for part in self.backend.dp_all_gather(self.first_update) for u in part] \
            if self.ranks > 1 else self.first_update
        check(self.report, self.step, *(torch.cat([u[i] for u in every]) for i in (0, 1, 2)),
              [r for *_, routing in every for r in routing], self.cfg.on_mismatch)
