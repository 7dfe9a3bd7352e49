"""The speculative configs zerokl's rollout engine runs under parity, checked before any engine starts.

Drafts come from the checkpoint's MTP layers (`mtp`, `rollout.vllm.mtp`) or a DSpark draft checkpoint (`dspark` with
its directory as `model`, `rollout.vllm.dspark`); the target verifies them on the parity kernels and keeps the KDA state
of exactly the accepted tokens (`rollout.vllm.caches.KDAStateLayer`), so every emitted token's log-prob is the one plain
decoding gives. The dict is vLLM's `speculative_config`.
"""

from __future__ import annotations

import json
from typing import Any

from parity.config import ConfigError, TextConfig, read_config
from parity.dspark import check_fits_target, parse_dspark_config
from parity.kernels import platform_device, runs_triton

METHODS = ("mtp", "dspark")
MAX_SPECULATIVE_TOKENS = 5
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
KEYS = ("method", "num_speculative_tokens", "draft_sample_method", "model")  # model: the DSpark draft's directory


def parse_speculative(text: str) -> dict[str, Any]:
    """A JSON object from the command line (`--speculative`), not yet checked against a checkpoint."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative: not JSON ({e.msg}): {text!r}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"--speculative: a JSON object like {{\"method\": \"mtp\", \"num_speculative_tokens\": 3}}, "
                          f"got {text!r}")
    return spec


def check_speculative(spec: Any, cfg: TextConfig, kernels: str, where: str = "speculative") -> dict[str, Any]:
    """`spec` as vLLM's speculative_config, or ConfigError naming what is wrong: keys other than `KEYS`, a method
    other than `METHODS`, num_speculative_tokens outside 1..MAX_SPECULATIVE_TOKENS, an unknown draft_sample_method, a
    checkpoint that is not Kimi K3; for `mtp` one without MTP layers (or a `model`), for `dspark` a missing `model` or a
    draft checkpoint that is unreadable or does not fit this target (`parity.dspark.check_fits_target`); or the Triton
    kernels (their chunked KDA state keeps no state per token for a rejection to resume from)."""
    if runs_triton(kernels, platform_device()):
        raise ConfigError(f"{where}: speculative decoding runs on the CPU's invariant or the fast kernels, not the Triton "
                          "kernels (their chunked KDA state keeps no state per token for a rejection to resume from)")
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: a mapping with {', '.join(KEYS)}, got {spec!r}")
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; zerokl takes {', '.join(KEYS)}")
    method = spec.get("method")
    if method not in METHODS:
        raise ConfigError(f"{where}: method must be one of {', '.join(METHODS)} (the checkpoint's MTP layers, or a "
                          f"DSpark draft checkpoint), got {method!r}")
    n = spec.get("num_speculative_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SPECULATIVE_TOKENS:
        raise ConfigError(f"{where}: num_speculative_tokens must be an integer 1..{MAX_SPECULATIVE_TOKENS}, got {n!r}")
    sample = spec.get("draft_sample_method", "probabilistic")
    if sample not in DRAFT_SAMPLE_METHODS:
        raise ConfigError(f"{where}: draft_sample_method must be one of {', '.join(DRAFT_SAMPLE_METHODS)}, "
                          f"got {sample!r}")
    if cfg.checkpoint_family != "kimi_k3":
        raise ConfigError(f"{where}: drafts are served for Kimi K3 checkpoints (vLLM's kimi_k3_mtp, k3_dspark); this "
                          f"one is {cfg.checkpoint_family}")
    out = {"method": method, "num_speculative_tokens": n, "draft_sample_method": sample}
    if method == "mtp":
        if "model" in spec:
            raise ConfigError(f"{where}: method 'mtp' drafts with the checkpoint's own MTP layers and takes no model")
        if not cfg.num_nextn_predict_layers:
            raise ConfigError(f"{where}: method 'mtp' drafts with the checkpoint's MTP layers, and this checkpoint has "
                              "none (text_config.num_nextn_predict_layers is 0)")
        layers = cfg.num_nextn_predict_layers
        if n % layers:
            raise ConfigError(f"{where}: num_speculative_tokens {n} must be a multiple of the checkpoint's {layers} MTP "
                              f"layers (vLLM's MTP proposer runs them in turn, each draft round all {layers})")
        return out
    draft = spec.get("model")
    if not isinstance(draft, str) or not draft:
        raise ConfigError(f"{where}: method 'dspark' needs the draft checkpoint's directory as model (zerokl "
                          "init-checkpoint with a k3_dspark config writes one)")
    check_fits_target(parse_dspark_config(read_config(draft), f"{draft}/config.json"), cfg, f"{where}: {draft}")
    return {**out, "model": draft}


def vllm_speculative_config(spec: Any, cfg: TextConfig, kernels: str) -> dict[str, Any]:
    """`check_speculative`'s config as vLLM takes it for this checkpoint: with MXFP4 experts the draft's quantization
    is named, since vLLM resolves the draft architecture's compressed-tensors MXFP4 config to `mxfp4`
    (`vllm/model_executor/models/config.py`, `KimiK3ForConditionalGenerationConfig`) while it would give the draft
    the target's `compressed-tensors`, and refuses the mismatch. The draft computes on the parity kernels either way."""
    out = check_speculative(spec, cfg, kernels)
    if cfg.expert_format == "mxfp4" and out["method"] == "mtp":
        out["quantization"] = "mxfp4"
    return out
