"""PPO run configs: small YAML files validated into typed objects; errors name the bad key, the bad value and what is
expected."""

from __future__ import annotations

import math
import random
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from parity.config import ConfigError, load_model_config
from parity.kernels import KERNEL_SETS, get_kernels, platform_device
from parity.kernels.logprobs import Sampling
from trainer.backend import RETIRED_DEEPSPEED
from zerokl.tasks import make_task, resolve_paths
from zerokl.ppo.algo import KL_ESTIMATORS


GAE_DEFAULTS = {"gamma": 1.0, "lam": 0.95, "vf_coef": 0.1, "value_clip": 0.2, "value_lr": 1e-2}  # only gae reads
LORA_DEFAULTS = {"lora_rank": 8, "lora_alpha": 16.0}  # with lora: true and no lora_init (PEFT's init)
LORA_INIT_KEYS = ("lora_rank", "lora_alpha", "lora_targets")  # what an adapter from lora_init brings itself
ON_MISMATCH = ("stop", "warn")
WANDB_MODES = ("offline", "online", "disabled")
SYNC_TRANSPORTS = ("shared_memory", "disk", "cuda_ipc", "torch_distributed")
RETIRED_KEYS = {"backend", "zero_stage"}  # the DeepSpeed backend's keys (`trainer.backend.RETIRED_DEEPSPEED`)


@dataclass(frozen=True)
class PPOConfig:
    """One PPO run. `model` is a model config (YAML) or a checkpoint directory."""

    model: str
    task: str = "addition"  # zerokl.tasks.TASKS
    task_args: dict[str, int | str] | None = None  # the task's own keys and types (its __init__'s)
    steps: int = 100
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    temperature: float = 1.0
    top_k: int | None = None  # truncation (parity.kernels.logprobs.Sampling): log-probs, loss and check under it
    top_p: float | None = None
    min_p: float | None = None
    logprobs_mode: str = "processed_logprobs"  # the log-probs the loss reads (vLLM's names); the check compares both
    max_tokens: int = 8  # sampled tokens per (policy) turn
    max_turns: int = 1  # an agent task (one with `episode`): policy turns per trajectory at most
    env_timeout_s: float = 30.0  # an agent task: an environment step that takes longer ends its trajectory
    lr: float = 3e-3
    clip: float = 0.2
    ppo_epochs: int = 1  # passes over each step's samples
    num_minibatches: int = 1  # optimizer steps per pass (the samples shuffled, then split)
    micro_batch_size: int | None = None  # samples per forward/backward within a minibatch (gradient accumulation)
    old_logprobs: str = "recompute"  # recompute: a no-grad pass before the updates; rollout: the engine's (bitwise)
    parity_check_every: int = 1  # with old_logprobs: rollout, the full recompute (zero-KL check) every N steps
    max_staleness: int = 0  # k > 0: step t+k's rollouts are generated (by version t) while step t trains
    kl_coef: float = 0.0  # > 0: a KL penalty to the reference policy in the loss
    kl_estimator: str = "k3"  # k1 or k3 (zerokl.ppo.algo.kl_to_reference)
    ref_model: str | None = None  # the reference: this checkpoint directory; None: the run's starting checkpoint
    entropy_coef: float = 0.0  # > 0: an entropy bonus in the loss
    advantage: str = "grpo"  # grpo (group baseline) or gae (a value head on the trunk: GAE_DEFAULTS)
    normalize_adv_std: bool = False
    gamma: float | None = None  # advantage: gae only; the discount
    lam: float | None = None  # advantage: gae only; GAE's lambda
    vf_coef: float | None = None  # advantage: gae only; the value loss's weight in the joint loss
    value_clip: float | None = None  # advantage: gae only; PPO's value clipping range around the old values
    value_lr: float | None = None  # advantage: gae only; the value head's learning rate (its own Adam group)
    grad_clip: float = 1.0
    seed: int = 0
    kernels: str = "invariant"
    on_mismatch: str = "stop"
    sync: str = "shared_memory"  # weight transport into the engine's processes: shared_memory, disk (OUT/sync),
    # cuda_ipc (the engine on the trainer's GPU: device to device), or torch_distributed (rollout servers only: a
    # broadcast over a gloo / NCCL group joined per sync)
    rollout_servers: list[str] | None = None  # URLs of running `zerokl serve` servers: rollouts and syncs over HTTP
    num_rollout_servers: int = 0  # > 0: `zerokl ppo` starts this many servers on this machine (and stops them)
    checkpoint_every: int = 25
    wandb: str = "offline"
    data_parallel: str = "shard"  # on several data-parallel ranks: shard (each its own part of every minibatch) or
    # replicate (each the whole batch)
    tp: int = 1  # tensor-parallel ranks (attention heads, MLP and vocabulary columns split)
    ep: int = 1  # expert-parallel ranks (the routed experts split); DP = processes / tp
    lora: bool = False  # train only a LoRA adapter (base frozen) and sync only the adapter
    lora_rank: int | None = None  # lora only (LORA_DEFAULTS)
    lora_alpha: float | None = None  # lora only (LORA_DEFAULTS)
    lora_targets: list[str] | None = None  # target_modules suffixes; None: every supported projection
    lora_init: str | None = None  # start from this PEFT adapter directory instead of PEFT's init (B = 0)
    vision_tower: str = "frozen"  # a model with a vision tower: frozen, or trainable (trained with the text model and
    # carried by every weight sync)
    speculative: dict[str, Any] | None = None  # roll out with drafts: the checkpoint's MTP layers or a DSpark draft
    # checkpoint (`rollout.speculative`); the draft stays as its checkpoint has it (the policy loss does not reach it)

    @property
    def sampling(self) -> Sampling:
        """The distribution the engine samples from and the trainer scores (log-probs, entropy, the zero-KL check)."""
        return Sampling(self.temperature, self.top_k, self.top_p, self.min_p)

    @property
    def loss_sampling(self) -> Sampling:
        """The distribution whose log-probs the loss reads (`logprobs_mode`): the sampling one (vLLM's processed
        log-probs) or the raw one (temperature 1, no truncation: vLLM's raw log-probs); the reference's are taken
        under it too."""
        return self.sampling if self.logprobs_mode == "processed_logprobs" else Sampling(1.0)

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), str(f.type))
        try:  # the whole task, here: a bad dataset or reward function stops the run before anything starts
            task = make_task(self.task, **{str(k): v for k, v in (self.task_args or {}).items()})
        except ConfigError as e:
            raise ConfigError(f"ppo config: {e}") from None
        self._check_agent(hasattr(task, "episode"))
        if getattr(task.sample(random.Random(0)), "images", ()) and Path(self.model).exists() \
                and load_model_config(self.model).vision is None:  # a throwaway draw
            raise ConfigError(f"ppo config: task {self.task} gives images, but model {self.model} has no vision tower "
                              "(vision_config)")
        _choice("advantage", self.advantage, ("grpo", "gae"))
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("old_logprobs", self.old_logprobs, ("recompute", "rollout"))
        _choice("logprobs_mode", self.logprobs_mode, ("processed_logprobs", "raw_logprobs"))
        if self.old_logprobs == "rollout" and self.ppo_epochs * self.num_minibatches == 1:
            raise ConfigError("ppo config: old_logprobs 'rollout' skips the old-log-prob pass that only runs with "
                              "several updates per step; with ppo_epochs x num_minibatches = 1 the update's own "
                              "forward is the check already: use old_logprobs: recompute")
        if self.max_staleness < 0:
            raise ConfigError(f"ppo config: max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_staleness:
            for key, value, why in (("advantage", "gae", "GAE's old values would need the critic at the generating "
                                     "version"), ("lora", True, "only full-weight versions are kept for the check")):
                if getattr(self, key) == value:
                    raise ConfigError(f"ppo config: max_staleness > 0 with {key}: {str(value).lower()} is not "
                                      f"supported ({why}); set max_staleness: 0")
            if self.old_logprobs == "rollout":
                raise ConfigError("ppo config: old_logprobs is not read with max_staleness > 0 (old log-probs are the "
                                  "rollout's and the check runs on the kept generating version every step); drop it")
        if self.parity_check_every != 1 and self.old_logprobs != "rollout":
            raise ConfigError("ppo config: parity_check_every is only read with old_logprobs: rollout (recompute "
                              "checks every step)")
        if self.ref_model is not None:
            if self.kl_coef == 0:
                raise ConfigError("ppo config: ref_model is only read with kl_coef > 0 (the KL penalty); set kl_coef "
                                  "or drop ref_model")
            if not (Path(self.ref_model) / "config.json").is_file():
                raise ConfigError(f"ppo config: ref_model {self.ref_model!r} is not a checkpoint directory "
                                  "(no config.json)")
        _choice("kernels", self.kernels, KERNEL_SETS)
        try:
            get_kernels(self.kernels)  # 'triton' needs CUDA or TRITON_INTERPRET=1
        except ValueError as e:
            raise ConfigError(f"ppo config: kernels {self.kernels!r}: {e}") from None
        _choice("on_mismatch", self.on_mismatch, ON_MISMATCH)
        _choice("sync", self.sync, SYNC_TRANSPORTS)
        self._check_rollout_servers()
        _choice("wandb", self.wandb, WANDB_MODES)
        _choice("data_parallel", self.data_parallel, ("replicate", "shard"))
        self._check_lora_keys()
        self._check_model_parallel()
        for name in ("steps", "prompts_per_step", "samples_per_prompt", "max_tokens", "max_turns", "checkpoint_every",
                     "ppo_epochs", "num_minibatches", "parity_check_every"):
            _at_least(name, getattr(self, name), 1)
        if self.num_minibatches > self.prompts_per_step * self.samples_per_prompt:
            raise ConfigError(f"ppo config: num_minibatches = {self.num_minibatches} is more than the "
                              f"{self.prompts_per_step * self.samples_per_prompt} samples of a step "
                              "(prompts_per_step x samples_per_prompt)")
        if self.micro_batch_size is not None:
            smallest = self.prompts_per_step * self.samples_per_prompt // self.num_minibatches
            if not 1 <= self.micro_batch_size < smallest:
                raise ConfigError(f"ppo config: micro_batch_size must be >= 1 and less than the {smallest} samples of "
                                  f"the smallest minibatch (prompts_per_step x samples_per_prompt / num_minibatches), "
                                  f"got {self.micro_batch_size}; drop it to run each minibatch in one pass")
        if self.samples_per_prompt < 2 and self.advantage == "grpo":
            raise ConfigError("ppo config: samples_per_prompt must be >= 2 for the GRPO group baseline")
        for name in ("temperature", "lr", "clip", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ppo config: {name} must be > 0, got {getattr(self, name)}")
        try:
            self.sampling
        except ValueError as e:
            raise ConfigError(f"ppo config: {e}") from None
        if self.kl_coef > 0 and self.loss_sampling.truncates:
            raise ConfigError("ppo config: kl_coef > 0 with top_k / top_p / min_p is refused: the KL to the reference "
                              "is infinite where the two truncated distributions keep different tokens; drop the "
                              "truncation or the KL penalty, or put the loss on logprobs_mode: raw_logprobs")
        for name in ("kl_coef", "entropy_coef", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"ppo config: {name} must be >= 0, got {getattr(self, name)}")
        self._check_vision_tower()
        self._check_speculative(hasattr(task, "episode"))
        if self.advantage == "gae":
            self._check_gae()
        else:
            for name in GAE_DEFAULTS:
                if getattr(self, name) is not None:
                    raise ConfigError(f"ppo config: {name} is only read with advantage: gae (the value head); "
                                      f"drop {name} or set advantage: gae")

    def _check_agent(self, agent: bool) -> None:
        """Multi-turn keys: read with an agent task (one whose problems run against an environment) only."""
        if not agent:
            if self.max_turns != 1:
                raise ConfigError(f"ppo config: max_turns is only read with an agent task (task {self.task} is "
                                  "single-turn); drop max_turns or choose an agent task such as guess")
            return
        if not (self.env_timeout_s > 0 and math.isfinite(self.env_timeout_s)):
            raise ConfigError(f"ppo config: env_timeout_s must be > 0, got {self.env_timeout_s}")
        if self.advantage == "gae":
            raise ConfigError("ppo config: advantage 'gae' with an agent task is not built (values across environment "
                              "tokens); use advantage: grpo")

    def _check_vision_tower(self) -> None:
        """vision_tower: trainable needs a tower and what trains it here: full weights, this process's engine, the
        current version's weights for every check."""
        _choice("vision_tower", self.vision_tower, ("frozen", "trainable"))
        if self.vision_tower == "frozen":
            return
        if Path(self.model).exists() and load_model_config(self.model).vision is None:
            raise ConfigError(f"ppo config: vision_tower: trainable, but model {self.model} has no vision tower "
                              "(vision_config); drop vision_tower")
        refused = {"lora: true": (self.lora, "lora freezes the base and syncs the adapter alone"),
                   "max_staleness > 0": (self.max_staleness > 0, "the kept versions' check runs the tower as loaded")}
        for what, (given, why) in refused.items():
            if given:
                raise ConfigError(f"ppo config: vision_tower: trainable with {what} is not supported ({why}); "
                                  "use vision_tower: frozen")

    def _check_speculative(self, agent: bool) -> None:
        """speculative: a config `rollout.speculative.check_speculative` accepts for the model, in this process's
        engine (not an agent task's prefix-cached turns, no min_p)."""
        if self.speculative is None:
            return
        from rollout.speculative import check_speculative

        refused = {"an agent task": (agent, "its turns reuse the prefix cache, which speculative decoding does not "
                                            "run with"),
                   "min_p": (self.min_p is not None, "vLLM's speculative sampling does not apply it"),
                   "rollout servers": (self.rollout_servers is not None or self.num_rollout_servers > 0,
                                       "the run's own engine drafts; servers are not started with drafts")}
        for what, (given, why) in refused.items():
            if given:
                raise ConfigError(f"ppo config: speculative with {what} is not supported ({why}); drop speculative")
        if Path(self.model).exists():
            check_speculative(self.speculative, load_model_config(self.model).text, self.kernels,
                              "ppo config: speculative")

    def _check_rollout_servers(self) -> None:
        """rollout_servers (URLs) or num_rollout_servers (started here), not both; what they do not run."""
        _at_least("num_rollout_servers", self.num_rollout_servers, 0)
        if self.rollout_servers is not None and self.num_rollout_servers:
            raise ConfigError("ppo config: give rollout_servers (running servers) or num_rollout_servers (servers "
                              "started by this run), not both")
        for url in self.rollout_servers or ():
            parts = urllib.parse.urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
                raise ConfigError(f"ppo config: rollout server {url!r} is not a server URL (http://HOST:PORT)")
        if self.rollout_servers is not None and not self.rollout_servers:
            raise ConfigError("ppo config: rollout_servers is empty; drop it to roll out in this process")
        remote = bool(self.rollout_servers) or self.num_rollout_servers > 0
        if self.sync == "torch_distributed" and not remote:
            raise ConfigError("ppo config: sync torch_distributed reaches rollout servers; the in-process engine "
                              "takes shared_memory, cuda_ipc or disk (or give rollout_servers / num_rollout_servers)")
        if self.sync == "cuda_ipc":
            if remote:
                raise ConfigError("ppo config: sync cuda_ipc reaches the in-process engine on the trainer's GPU; rollout "
                                  "servers take torch_distributed, shared_memory or disk")
            if platform_device().type != "cuda":
                raise ConfigError("ppo config: sync cuda_ipc needs a CUDA GPU (the engine's and the trainer's); this "
                                  "machine has none: use shared_memory")

    def _check_lora_keys(self) -> None:
        """The adapter keys: refused without lora, and (but lora_init) with lora_init, whose adapter brings its own;
        else LORA_DEFAULTS fill the keys not given; values in range."""
        given = [k for k in (*LORA_INIT_KEYS, "lora_init") if getattr(self, k) is not None]
        if not self.lora and given:
            raise ConfigError(f"ppo config: {given[0]} is only read with lora: true; drop {given[0]} or set lora: true")
        if self.lora_init is not None:
            given = [k for k in LORA_INIT_KEYS if getattr(self, k) is not None]
            if given:
                raise ConfigError(f"ppo config: {given[0]} is not read with lora_init: the adapter in "
                                  f"{self.lora_init!r} brings its own rank, alpha and targets; drop {given[0]}")
            return
        if not self.lora:
            return
        for name, default in LORA_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        if self.lora_rank < 1:
            raise ConfigError(f"ppo config: lora_rank must be >= 1, got {self.lora_rank}")
        if not self.lora_alpha > 0:
            raise ConfigError(f"ppo config: lora_alpha must be > 0, got {self.lora_alpha}")

    def _check_model_parallel(self) -> None:
        """tp and ep: at least 1."""
        for name in ("tp", "ep"):
            _at_least(name, getattr(self, name), 1)

    def _check_gae(self) -> None:
        """advantage: gae: GAE_DEFAULTS fill the keys not given; values in range; what the value head runs with."""
        for name, default in GAE_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"ppo config: {name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("vf_coef", "value_clip", "value_lr"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ppo config: {name} must be > 0, got {getattr(self, name)}")
        if self.lora:
            raise ConfigError("ppo config: advantage 'gae' trains the value head with the trunk, which lora freezes; "
                              "use lora: false or advantage: grpo")
        if self.old_logprobs == "rollout":
            raise ConfigError("ppo config: advantage 'gae' needs the old values of the no-grad pass every step, which "
                              "old_logprobs 'rollout' skips; use old_logprobs: recompute")
        if self.normalize_adv_std:
            raise ConfigError("ppo config: normalize_adv_std is GRPO's (per-group std); advantage 'gae' whitens the "
                              "advantages over the batch's tokens already: drop normalize_adv_std")


_FLOAT_TEXT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")  # what YAML 1.1 leaves a string, e.g. 3e-3


def _check_type(key: str, value: Any, annotation: str) -> None:
    """Refuse a value that is not of the field's annotated type (`int`, `float`, `str`, `bool`, `dict[...]`,
    `list[str]`, each optionally `| None`); a float must be finite. A bool is not an int; an int is a float."""
    base = annotation.removesuffix(" | None")
    if value is None and base != annotation:
        return
    if base == "int":
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif base == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        kind = "a finite number"
    elif base == "str":
        ok, kind = isinstance(value, str), "a string"
    elif base == "bool":
        ok, kind = isinstance(value, bool), "true or false"
    elif base.startswith("dict["):
        ok, kind = isinstance(value, dict), "a mapping"
    elif base == "list[str]":
        ok, kind = isinstance(value, list) and all(isinstance(x, str) for x in value), "a list of strings"
    else:
        raise TypeError(f"PPOConfig.{key}: no type check for {annotation}")
    if not ok:
        raise ConfigError(f"ppo config: {key} must be {kind}, got {'null' if value is None else repr(value)}")


def _choice(key: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"ppo config: {key} must be one of {', '.join(options)}, got {value!r}")


def _at_least(key: str, value: int, low: int) -> None:
    if value < low:
        raise ConfigError(f"ppo config: {key} must be >= {low}, got {value}")


# The keys a command-line flag may override, with what their own value must be whatever the other keys say
# (`PPOConfig.__post_init__` checks them in the context of the whole config).
OWN_VALUE_CHECKS: dict[str, Callable[[Any], None]] = {
    "steps": lambda v: _at_least("steps", v, 1),
    "kernels": lambda v: _choice("kernels", v, KERNEL_SETS),
    "on_mismatch": lambda v: _choice("on_mismatch", v, ON_MISMATCH),
    "wandb": lambda v: _choice("wandb", v, WANDB_MODES),
    "num_rollout_servers": lambda v: _at_least("num_rollout_servers", v, 0),
    "tp": lambda v: _at_least("tp", v, 1),
    "ep": lambda v: _at_least("ep", v, 1),
    "lora": lambda v: None,
    "rollout_servers": lambda v: None,
}


def load_ppo_config(path: str | Path, **overrides: Any) -> PPOConfig:
    """Read YAML, reject unknown keys (naming them), check the file's own value of every key a command-line override
    replaces (its type and range: a value in the file is checked even where a flag replaces it), apply the overrides
    that are not None and validate the whole config."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"ppo config not found: {p}")
    raw = yaml.safe_load(p.read_text()) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping")
    retired = sorted(set(raw) & RETIRED_KEYS)
    if retired:
        raise ConfigError(f"{p}: {' and '.join(retired)}: {RETIRED_DEEPSPEED}; drop the key")
    known = {f.name for f in fields(PPOConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{p}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    given = {k: v for k, v in overrides.items() if v is not None}
    types = {f.name: str(f.type) for f in fields(PPOConfig)}
    for key in sorted(given.keys() & raw.keys()):
        try:
            _check_type(key, raw[key], types[key])
            OWN_VALUE_CHECKS[key](raw[key])
        except ConfigError as e:
            raise ConfigError(f"{p}: {str(e).removeprefix('ppo config: ')}") from None
    return _parsed(p, {**raw, **given})


def _parsed(p: Path, raw: dict[str, Any]) -> PPOConfig:
    """The config the mapping `raw` (read from `p`) describes, or ConfigError naming `p` and the bad key."""
    floats = {f.name for f in fields(PPOConfig) if str(f.type).removesuffix(" | None") == "float"}
    for key in floats & raw.keys():
        if isinstance(raw[key], str) and _FLOAT_TEXT.fullmatch(raw[key].strip()):
            raw[key] = float(raw[key])  # YAML 1.1 reads 3e-3 (no dot) as a string
    if "model" not in raw:
        raise ConfigError(f"{p}: missing required key 'model'")
    if not isinstance(raw["model"], str):
        raise ConfigError(f"{p}: model must be a model config or checkpoint path (a string), got {raw['model']!r}")
    model = Path(raw["model"])
    if not model.is_absolute() and not model.exists():
        model = p.parent.parent / model  # configs are written relative to the repo root
    raw["model"] = str(model)
    if isinstance(raw.get("task", "addition"), str) and isinstance(raw.get("task_args"), dict):
        raw["task_args"] = resolve_paths(raw.get("task", "addition"), raw["task_args"], p.parent)  # config-relative
    if isinstance(raw.get("ref_model"), str) and not Path(raw["ref_model"]).exists():
        raw["ref_model"] = str(p.parent.parent / raw["ref_model"])  # relative to the repo root, as `model`
    try:
        return PPOConfig(**raw)
    except ConfigError as e:
        raise ConfigError(f"{p}: {str(e).removeprefix('ppo config: ')}") from None
