"""What an adapter's `adapter_config.json` says, checked once into a typed `LoraSpec`.

The file is PEFT's `LoraConfig` (`peft_type: LORA`). Supported, with PEFT's semantics: `r`, `lora_alpha`,
`use_rslora` (scale alpha / sqrt(r) instead of alpha / r), `target_modules` (a list of module-name suffixes,
or a regex matched against the whole module name), `exclude_modules`, `layers_to_transform` / `layers_pattern`,
`rank_pattern` / `alpha_pattern` (per-module r and alpha; the first key whose regex matches the end of the
module name wins). Module names are the base model's module paths, e.g.
`language_model.layers.3.self_attn.q_proj` (see `lora.targets`).

Options that change what the adapter computes and that zerokl does not implement (DoRA, LoRA bias, weight-
modifying initialisations such as PiSSA or LoftQ, extra trainable modules, ...) are refused with an
`AdapterError` naming the key; bookkeeping keys (`peft_version`, `task_type`, `inference_mode`, dropout, ...)
are accepted and do not affect the forward. Dropout is a training-time regulariser zerokl's trainer does not
apply (its forward must equal the rollout engine's).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

MAX_RANK = 512  # the largest `max_lora_rank` vLLM accepts


class AdapterError(ValueError):
    """An adapter that zerokl cannot load or build exactly; the message names the file, key or tensor."""


# key -> (value that means "off", why zerokl refuses anything else)
_REFUSED: dict[str, tuple[Any, str]] = {
    "use_dora": (False, "DoRA (weight-decomposed LoRA) is not supported"),
    "lora_bias": (False, "a bias on lora_B is not supported"),
    "bias": ("none", "adapter biases are not supported (bias must be 'none')"),
    "fan_in_fan_out": (False, "fan_in_fan_out weights (Conv1D layout) are not supported"),
    "modules_to_save": (None, "extra fully trained modules (modules_to_save) are not supported"),
    "target_parameters": (None, "parameter targets (target_parameters) are not supported"),
    "trainable_token_indices": (None, "trainable token embeddings are not supported"),
    "layer_replication": (None, "layer_replication is not supported"),
    "alora_invocation_tokens": (None, "activated LoRA (aLoRA) is not supported"),
    "use_qalora": (False, "QALoRA is not supported"),
    "use_bdlora": (None, "block-diagonal LoRA (BD-LoRA) is not supported"),
    "arrow_config": (None, "Arrow routing is not supported"),
    "kasa_config": (None, "KaSA is not supported"),
    "velora_config": (None, "VeLoRA is not supported"),
    "monteclora_config": (None, "MonteCLoRA is not supported"),
    "megatron_config": (None, "PEFT's Megatron parallel layers are not supported (zerokl's trainer shards them)"),
}
# init_lora_weights values that rewrite the base weights when PEFT loads the adapter
_BASE_MODIFYING_INITS = ("olora", "pissa", "corda", "loftq")


def _off(value: Any, off: Any) -> bool:
    """True when `value` is the "off" value of its key (empty lists and dicts count as None)."""
    if off is None:
        return value is None or value == [] or value == {}
    return value == off


@dataclass(frozen=True)
class LoraSpec:
    """The supported part of PEFT's LoraConfig. Invariant: `r` and every `rank_pattern` value are in
    [1, MAX_RANK]; `target_modules` is a non-empty tuple of suffixes or a regex string."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False
    exclude_modules: tuple[str, ...] | str | None = None
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None

    def __post_init__(self) -> None:
        for key, rank in {"r": self.r, **{f"rank_pattern[{k!r}]": v for k, v in self.rank_pattern.items()}}.items():
            if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
                raise AdapterError(f"adapter_config.json: {key} = {rank!r} must be an integer in [1, {MAX_RANK}]")
        for key, alpha in {"lora_alpha": self.lora_alpha, **{f"alpha_pattern[{k!r}]": v
                                                            for k, v in self.alpha_pattern.items()}}.items():
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
                raise AdapterError(f"adapter_config.json: {key} = {alpha!r} must be a finite number")
        if not self.target_modules:
            raise AdapterError("adapter_config.json: target_modules is empty")
        if self.target_modules == "all-linear":
            raise AdapterError("adapter_config.json: target_modules 'all-linear' is not supported for K3; "
                               "list the module names (see `zerokl lora init --help`)")

    # --- PEFT's module matching (peft.tuners.tuners_utils.check_target_module_exists) ---------------
    def targets(self, module: str) -> bool:
        """Whether PEFT would put this adapter on `module` (a base-model module path)."""
        if self.exclude_modules is not None and _matches(self.exclude_modules, module):
            return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        if module in self.target_modules:
            return True
        if not _matches(self.target_modules, module):
            return False
        if self.layers_to_transform is None:
            return True
        return _layer_index(module, self.layers_pattern) in self.layers_to_transform

    def rank(self, module: str) -> int:
        """r for `module`: the first `rank_pattern` key matching the end of its name, else `r`."""
        key = _pattern_key(self.rank_pattern, module)
        return self.r if key is None else self.rank_pattern[key]

    def alpha(self, module: str) -> float:
        key = _pattern_key(self.alpha_pattern, module)
        return self.lora_alpha if key is None else self.alpha_pattern[key]

    def scale(self, module: str) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA (a Python float, as PEFT and vLLM hold it)."""
        r = self.rank(module)
        return self.alpha(module) / (math.sqrt(r) if self.use_rslora else r)

    # --- adapter_config.json --------------------------------------------------------------------
    @classmethod
    def from_peft(cls, cfg: dict[str, Any]) -> LoraSpec:
        """Validate a parsed adapter_config.json; fails naming the first unsupported or malformed key."""
        if cfg.get("peft_type") != "LORA":
            raise AdapterError(f"adapter_config.json: peft_type is {cfg.get('peft_type')!r}, only 'LORA' is supported")
        for key, (off, why) in _REFUSED.items():
            if key in cfg and not _off(cfg[key], off):
                raise AdapterError(f"adapter_config.json: {key} = {cfg[key]!r}: {why}")
        init = cfg.get("init_lora_weights", True)
        if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
            raise AdapterError(f"adapter_config.json: init_lora_weights = {init!r} modifies the base weights; "
                               "convert the adapter to a plain LoRA first")
        for key in ("r", "lora_alpha", "target_modules"):
            if cfg.get(key) is None:
                raise AdapterError(f"adapter_config.json: missing required key {key!r}")
        return cls(
            r=cfg["r"],
            lora_alpha=cfg["lora_alpha"],
            target_modules=_names(cfg["target_modules"], "target_modules"),
            use_rslora=bool(cfg.get("use_rslora", False)),
            exclude_modules=_names(cfg["exclude_modules"], "exclude_modules") if cfg.get("exclude_modules") else None,
            layers_to_transform=_layers(cfg.get("layers_to_transform")),
            layers_pattern=_strings(cfg.get("layers_pattern"), "layers_pattern"),
            rank_pattern=dict(cfg.get("rank_pattern") or {}),
            alpha_pattern=dict(cfg.get("alpha_pattern") or {}),
            base_model_name_or_path=cfg.get("base_model_name_or_path"),
        )

    def to_peft(self) -> dict[str, Any]:
        """adapter_config.json content: the keys PEFT's LoraConfig writes that matter here, at PEFT's defaults
        otherwise (`peft.PeftConfig.from_pretrained` reads it; vLLM's `PEFTHelper` too)."""
        def listed(v: tuple | str | None) -> list | str | None:
            return list(v) if isinstance(v, tuple) else v

        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base_model_name_or_path,
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "use_rslora": self.use_rslora,
            "target_modules": listed(self.target_modules),
            "exclude_modules": listed(self.exclude_modules),
            "layers_to_transform": listed(self.layers_to_transform),
            "layers_pattern": listed(self.layers_pattern),
            "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_dora": False,
            "lora_bias": False,
            "init_lora_weights": True,
            "modules_to_save": None,
            "inference_mode": True,
        }


def _matches(names: tuple[str, ...] | str, module: str) -> bool:
    """PEFT's list rule (the name itself or a `.`-suffix of it), or its regex rule for a string."""
    if isinstance(names, str):
        return re.fullmatch(names, module) is not None
    return module in names or any(module.endswith(f".{n}") for n in names)


def _layer_index(module: str, patterns: tuple[str, ...] | None) -> int | None:
    """The first numbered segment after a layers module (PEFT's rule for `layers_to_transform`)."""
    if not patterns:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        m = next((m for p in patterns if (m := re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module))), None)
    return int(m.group("idx")) if m else None


def _pattern_key(pattern: dict[str, Any], module: str) -> str | None:
    """PEFT's `get_pattern_key`: the first key whose regex matches the end of `module` at a `.` boundary."""
    return next((k for k in pattern if re.match(rf"(.*\.)?({k})$", module)), None)


def _names(value: Any, key: str) -> tuple[str, ...] | str:
    if isinstance(value, str):
        return value
    return _strings(value, key) or ()


def _strings(value: Any, key: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, set):  # PeftConfig.to_dict() keeps target_modules as a set
        value = sorted(value)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise AdapterError(f"adapter_config.json: {key} must be a string or a list of strings, got {value!r}")
    return tuple(value)


def _layers(value: Any) -> tuple[int, ...] | None:
    if value is None or value == []:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise AdapterError(f"adapter_config.json: layers_to_transform must be an int or a list of ints, got {value!r}")
    return tuple(value)
