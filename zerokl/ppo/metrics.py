"""A step's metrics line (`OUT/metrics.jsonl`, wandb): the zero-KL check, rewards, lengths, versions, throughput, and
what the optional parts measured (routing agreement, drafts, turns, the updates' statistics, the sync).

Invariant: every metric but the TIMING_KEYS is a function of the run's inputs and seed, so a resumed run's lines equal
an uninterrupted one's.
"""

from __future__ import annotations

from typing import Any

from parity.weights import bf16_bytes
from zerokl.ppo.config import PPOConfig
from zerokl.ppo.samples import Rolled
from zerokl.ppo.update import Updated

METRIC_KEYS = ("step", "kl", "max_abs_logprob_diff", "bitwise_equal_frac", "parity_checked_frac", "reward_mean",
               "response_length_mean",
               "policy_version", "rollout_tokens_per_s", "train_tokens_per_s")
# Wall-clock figures (seconds, or per second), the only metrics that differ between a run and its resumed twin:
# rollout (`time_gen`), the reference policy's log-probs (`time_ref`: 0 without a KL penalty), the separate
# old-log-prob pass (`time_old_logprob`: 0 when the one update's forward is the check), the optimizer steps
# (`time_update`), export + weight sync (`time_sync`).
TIMING_KEYS = ("rollout_tokens_per_s", "train_tokens_per_s", "time_gen", "time_ref", "time_old_logprob",
               "time_update", "time_sync", "sync_seconds", "full_sync_seconds")


class StepMetrics:
    """The metrics of each step in turn; the engine's draft counters are read as differences since the last step."""

    def __init__(self, cfg: PPOConfig, engine: Any, task: Any):
        self.cfg, self.engine, self.task = cfg, engine, task
        self.drafts = (0, 0)  # the engine's (draft tokens, accepted) when the last metrics were taken

    def checked(self, step: int, version: int, report: dict[str, Any], rolled: Rolled, t_train: float | None,
                staleness: int) -> dict[str, float]:
        """What the rollout and the check measured (`t_train` None: the check stopped the step before its update)."""
        samples = rolled.samples
        rep, raw = report["parity"], report["parity_raw"]
        gen_tokens = sum(len(s.completion_ids) for s in samples)
        train_tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
        out = {"step": step, "kl": rep.kl_k1, "max_abs_logprob_diff": rep.max_abs_diff,
               "bitwise_equal_frac": rep.bitwise_equal / max(rep.tokens, 1),
               "raw_kl": raw.kl_k1, "raw_bitwise_equal_frac": raw.bitwise_equal / max(raw.tokens, 1),
               "parity_checked_frac": report["checked"] / len(samples), "reward_mean": float(rolled.rewards.mean()),
               "response_length_mean": gen_tokens / len(samples), "policy_version": version,
               "staleness": staleness,
               **({"routing_agreement": report["routing"].fraction} if "routing" in report else {}),
               "time_gen": rolled.seconds, "rollout_tokens_per_s": gen_tokens / rolled.seconds,
               "train_tokens_per_s": train_tokens / t_train if t_train else 0.0}
        if self.cfg.speculative is not None and self.engine is not None:  # the drafts since the last step's metrics
            drafted, accepted = self.engine.draft_counts()
            new_drafts, new_accepted = drafted - self.drafts[0], accepted - self.drafts[1]
            self.drafts = (drafted, accepted)
            out.update({"draft_tokens": new_drafts, "draft_acceptance": new_accepted / max(new_drafts, 1)})
        if hasattr(self.task, "episode"):  # multi-turn: turns, environment tokens, prefix hits, environment errors
            env_tokens = sum(int((~s.policy_mask).sum()) for s in samples)
            later = [c for s in samples for c in s.cached_tokens[1:]]  # the requests of turns 2, 3, ...
            out.update({"turns_mean": sum(s.turns for s in samples) / len(samples),
                        "env_token_frac": env_tokens / max(gen_tokens, 1),
                        "later_turn_prefix_hit_frac": sum(c > 0 for c in later) / max(len(later), 1),
                        "tool_calls": sum(s.tool_calls for s in samples),
                        "tool_errors": sum(s.tool_errors for s in samples),
                        "episode_errors": sum(s.end.startswith("error") for s in samples)})
        return out


def updated(metrics: dict[str, float], cfg: PPOConfig, done: Updated, targets: Any, mask: Any, t_ref: float,
            t_sync: float, sync: Any, text: Any) -> None:
    """Add what the update and the sync measured to `metrics`: timings, loss, grad norm, the updates' statistics,
    GAE's explained variance, the data-parallel shards and the sync's seconds and bytes (rank 0)."""
    from zerokl.ppo.algo import explained_variance

    metrics.update(old_logprob_recomputed=float(done.recomputed), time_ref=t_ref, time_old_logprob=done.seconds_old,
                   time_update=done.seconds - done.seconds_old, time_sync=t_sync)
    metrics.update(loss=done.loss, grad_norm=done.grad_norm, **done.stats)
    if cfg.advantage == "gae":
        metrics.update(explained_var=explained_variance(targets["returns"], targets["values"], mask))
    if done.shards:
        metrics.update(dp_size=len(done.shards), **{f"dp_rank{r}_{key}": value for r, shard in enumerate(done.shards)
                                                   for key, value in zip(("samples", "tokens", "reward_mean"), shard)})
    if sync.last is not None:  # rank 0
        metrics.update(sync_seconds=sync.last.seconds, sync_bytes=sync.last.nbytes)
        if not cfg.lora and text.expert_format is not None:
            metrics.update(sync_bytes_bf16=bf16_bytes(text))  # the same weights unpacked
    if sync.full is not None:
        metrics.update(full_sync_seconds=sync.full.seconds, full_sync_bytes=sync.full.nbytes)
