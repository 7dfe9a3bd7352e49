"""`zerokl ppo`'s orchestrator: one `PPORun` wires the stages and runs them in order, every step.

    rollout (`rollouts`)  ->  check (`check`)  ->  advantages (`advantages`)  ->  update (`update`)  ->  sync (`sync`)
                                                                                        state (`state`): checkpoints

Rank 0 owns the rollout engine (`rollout.engine.RolloutEngine` in this process, or rollout servers over HTTP), the
task and the rewards, and broadcasts each step's samples; every rank runs the trainer step (Megatron: `trainer.backend`), whose
first forward at the generating version is checked against the rollout's log-probs bit for bit (KL = 0) before any
update; then every rank exports and rank 0 syncs the next version
into the engine. On a mismatch the step ends with a first-divergence diagnosis (and the run stops, unless
`on_mismatch: warn`). Variations live in their stage: staleness (`rollouts.Ahead`, `sync.Sync.kept`), LoRA (adapter
syncs, `sync.Sync.start_lora`), GAE (`advantages.Targets`), rollout servers (`sync.RemoteSync`,
`sync.Sync.align_servers`), multi-turn episodes (`rollouts.Rollouts`), a KL penalty (`reference`).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from parity.weights import is_indexer, text_specs
from zerokl.ppo import state
from zerokl.ppo.advantages import Targets
from zerokl.ppo.check import ParityViolation, diagnosis, kept_logprobs, parity_holds
from zerokl.ppo.config import PPOConfig
from zerokl.ppo.episodes import TextDialogue
from zerokl.ppo.metrics import StepMetrics, updated
from zerokl.ppo.reference import reference_forward, reference_logprobs
from zerokl.ppo.rollouts import ENGINE_ARGS, Ahead, Rollouts, StaleRollout, engine_args_for
from zerokl.ppo.samples import Rolled, StepBatch
from zerokl.ppo.setup import (adapter_rank, base_checkpoint, chat_dialogue, check_prompt_lengths, check_reference,
                              check_sharding, data_parallel_ranks, eos_token_id, image_encoder, initial_adapter)
from zerokl.ppo.sync import Sync, kept_copy
from zerokl.ppo.update import Update
from zerokl.tasks import RewardError, make_task
from zerokl.tasks.chat import is_chat_task


@dataclass
class StepResult:
    metrics: dict[str, float]
    diagnosis: str | None


class PPORun:
    """One PPO run in `out`; `resume` is a checkpoint directory written by an earlier run."""

    def __init__(self, cfg: PPOConfig, out: Path, resume: Path | None = None,
                 log: Callable[[str], None] = print, engine_args: dict[str, Any] | None = None):
        from tokenizers import Tokenizer
        from trainer.backend import build_backend

        if resume is not None:
            state.check_resumable(resume, cfg)
        self.sharded = check_sharding(cfg, data_parallel_ranks(cfg, int(os.environ.get("WORLD_SIZE", "1"))))
        self.cfg, self.out, self.log = cfg, out, log
        out.mkdir(parents=True, exist_ok=True)
        self.task = make_task(cfg.task, **(cfg.task_args or {}))
        base = base_checkpoint(cfg, out)
        if cfg.ref_model is not None:
            check_reference(Path(cfg.ref_model), base)
        tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
        max_length = (engine_args or ENGINE_ARGS)["max_model_len"]  # a trajectory's tokens, prompt included
        check_prompt_lengths(self.task, tokenizer, max_length - cfg.max_tokens)
        eos = eos_token_id(base)

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text).ids

        def decode(ids: list[int]) -> str:
            return tokenizer.decode([t for t in ids if t != eos])

        dialogue = chat_dialogue(base, self.task) if is_chat_task(self.task) else TextDialogue(encode, decode)
        adapter = initial_adapter(cfg, base, resume) if cfg.lora else None
        self.backend = build_backend(base, lr=cfg.lr, clip_grad=cfg.grad_clip, kernels=cfg.kernels, adapter=adapter,
                                     value_head_lr=cfg.value_lr, train_vision=cfg.vision_tower == "trainable",
                                     tp=cfg.tp, ep=cfg.ep)
        self.rank0 = self.backend.rank == 0  # owns the rollout engine, the task's prompts and the rewards
        if self.backend.world_size > 1 and self.rank0:
            log(f"trainer: {self.backend.world_size} processes, TP {cfg.tp} x DP {self.backend.dp_size}, experts over "
                f"EP {cfg.ep}; each DP rank trains on "
                f"{'its own part of every minibatch' if self.sharded else 'the whole batch'}")
        frozen = [n for n in text_specs(self.backend.model_cfg.text) if is_indexer(n)]
        if frozen and self.rank0:
            log(f"DSA indexer: its {len(frozen)} tensors stay frozen (the loss reaches them only through the top-k "
                f"selection, which has no gradient); they are synced unchanged")
        self.reference = reference_forward(cfg, base) if self.rank0 and cfg.kl_coef > 0 else None
        self.encoder = image_encoder(base, self.backend.model_cfg, cfg.kernels)
        self.engine = self._engine(base, adapter, engine_args) if self.rank0 else None
        self.rng = random.Random(cfg.seed)
        self.rollouts = Rollouts(cfg, self.engine, self.task, self.rng, dialogue, encode, decode, max_length, log)
        self.ahead = Ahead(self.rollouts, cfg.max_staleness) if cfg.max_staleness and self.rank0 else None
        self.sync = Sync(cfg, self.backend, self.engine, out, log)
        self.metrics = StepMetrics(cfg, self.engine, self.task)
        self.step = 0
        self.version = 0
        if resume is not None:
            self.step, self.version, self.sync.kept = state.load(resume, self.backend, self.rng, self.ahead)
            if self.version and not cfg.lora:
                self.sync.reinstall(self.version)
            log(f"resumed from {resume} at step {self.step}, policy version {self.version}")
        elif self.ahead is not None:
            self.sync.kept[0] = kept_copy(self.sync.export_base())
        if cfg.rollout_servers:  # a LoRA run's base goes in at version >= 1 (`start_lora`)
            self.sync.align_servers(base, self.version if adapter is None else max(self.version, 1))
        if adapter is not None:
            self.version = max(self.version, 1)
            self.sync.start_lora(adapter, self.version, adapter_rank(adapter))

    def _engine(self, base: Path, adapter: Any, engine_args: dict[str, Any] | None) -> Any:
        """Rank 0's rollout engine: rollout servers over HTTP, or vLLM in this process."""
        from rollout.client.remote import RemoteRollout
        from rollout.engine import RolloutEngine, lora_engine_args

        cfg = self.cfg
        if self.backend.world_size > 1:  # a forked engine process would inherit the multi-rank process group
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if cfg.rollout_servers:
            return RemoteRollout(cfg.rollout_servers, self.backend.model_cfg.text, log=self.log)
        args = engine_args_for(cfg, engine_args)
        if adapter is not None:
            args.update(lora_engine_args(adapter_rank(adapter)))
        return RolloutEngine(base, kernels=cfg.kernels, vision_synced=cfg.vision_tower == "trainable", **args)

    @property
    def trainer(self) -> Any:
        """The backend's own trainer (`trainer.megatron.train.Trainer`; `.module` is the model)."""
        return self.backend.trainer

    def run_step(self) -> StepResult:
        """One PPO step. Collective: every rank gets rank 0's samples and runs the same trainer step."""
        cfg = self.cfg
        rolled, generated = self._rollout()
        step = StepBatch.of(rolled.samples, self._image_rows(rolled), cfg.logprobs_mode)
        t_ref = time.perf_counter()
        ref = self.backend.broadcast(reference_logprobs(self.reference, step, cfg.loss_sampling, self.encoder)
                                     if self.rank0 else None)
        t_ref = time.perf_counter() - t_ref
        report: dict[str, Any] = {}
        targets = Targets(cfg, rolled.rewards, step.mask)
        ranks, rank = (self.backend.dp_size, self.backend.dp_rank) if self.sharded else (1, 0)
        kept = None if generated == self.version else lambda: kept_logprobs(
            self.backend.model_cfg.text, self.sync.kept[generated], cfg.kernels, step, cfg.sampling)
        try:
            done = Update(cfg, self.backend, step, targets, ref, report, ranks, rank).run(self.step, kept)
        except ParityViolation:
            return StepResult(self.metrics.checked(self.step, self.version, report, rolled, None,
                                                   self.version - generated), self._diagnose(report, rolled))
        metrics = self.metrics.checked(self.step, self.version, report, rolled, done.seconds, self.version - generated)
        t_sync = time.perf_counter()
        self.sync.push(self.version + 1, before=self.ahead.drain if self.ahead is not None else lambda: None)
        self.version += 1
        updated(metrics, cfg, done, targets, step.mask, t_ref, time.perf_counter() - t_sync, self.sync,
                self.backend.model_cfg.text)
        diagnosed = None if parity_holds(report) else self._diagnose(report, rolled)
        self.step += 1
        return StepResult(metrics, diagnosed)

    def _rollout(self) -> tuple[Rolled, int]:
        """This step's rollouts on every rank (rank 0 generates, or takes them from the queue ahead, and broadcasts)
        and the policy version that generated them; StaleRollout when that is not one the trainer may train on."""
        rolled: Any = None
        if self.rank0:
            try:
                rolled = self.ahead.next(self.step) if self.ahead is not None else self.rollouts.generate(self.step)
            except RewardError as e:  # every rank stops with it, none waits in the broadcast
                rolled = RewardError(str(e))
        rolled = self.backend.broadcast(rolled)
        if isinstance(rolled, RewardError):
            raise rolled
        versions = rolled.versions
        generated = versions[0]
        if set(versions) != {generated} or not self.version - self.cfg.max_staleness <= generated <= self.version:
            raise StaleRollout(f"rollouts sampled with policy versions {sorted(set(versions))}, trainer holds "
                               f"{self.version} (max_staleness {self.cfg.max_staleness})")
        return rolled, generated

    def _image_rows(self, rolled: Rolled) -> Any:
        """The batch's image rows (the tower frozen), or its images' patches (the trainer trains the tower and runs it
        in every forward), or None when no sample has images."""
        if self.encoder is None or not any(s.images for s in rolled.samples):
            return None
        self.encoder.forget()  # this step's images only
        images = [s.images for s in rolled.samples]
        return self.encoder.inputs(images) if self.cfg.vision_tower == "trainable" else self.encoder.rows(images)

    def _diagnose(self, report: dict[str, Any], rolled: Rolled) -> str:
        """The first divergence of the step's check (`check.diagnosis`). Collective: every rank exports, rank 0
        diagnoses, every rank returns its text."""
        base = self.sync.export_base()
        adapter = self.backend.export_adapter() if self.cfg.lora else None
        if not self.rank0:
            return self.backend.broadcast(None)
        return self.backend.broadcast(diagnosis(report, rolled.samples, self.backend.model_cfg.text, base, adapter,
                                                self.cfg.kernels, self.out))

    def save_state(self, path: Path) -> None:
        """A checkpoint of the run at `path` (`state.save`). Collective."""
        state.save(path, self.cfg, self.backend, self.step, self.version, self.rng, self.ahead, self.sync.kept)

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
        if self.engine is not None:
            self.engine.close()
        self.backend.close()
