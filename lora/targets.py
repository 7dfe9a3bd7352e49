"""Which K3 projections take a LoRA, and the adapter tensor names for them.

A LoRA target is a module of the official checkpoint, named by its path: the official weight name without
`.weight` (`language_model.layers.3.self_attn.q_proj` for `language_model.layers.3.self_attn.q_proj.weight`).
Supported are the projections that `parity.model.K3Forward` runs through `_lin` (so the shared parity linear
adds scale * (x A^T) B^T) and that the trainer shards:

| block | module names (suffixes for `target_modules`) |
|---|---|
| KDA | q_proj, k_proj, v_proj, g_proj (Kimi Linear: g_a_proj, g_b_proj), f_a_proj, f_b_proj, b_proj, o_proj |
| MLA | q_a_proj, q_b_proj (q_proj without q-LoRA), kv_a_proj_with_mqa, kv_b_proj, g_proj, o_proj |
| dense MLP, shared experts | gate_proj, up_proj, down_proj |
| LatentMoE | routed_expert_down_proj, routed_expert_up_proj |

Not supported (refused by name): routed experts (w1/w2/w3: `experts_combine` has no LoRA term, and on the
real model they are the MXFP4 path), the router `gate` (scores in fp32, selection-only bias), embeddings,
lm_head, AttnRes scorers, norms and conv kernels.

Tensor names follow PEFT: `base_model.model.<module path>.lora_A.weight` ([r, in_features]) and
`.lora_B.weight` ([out_features, r]); see lora/README.md for how vLLM's LoRA loader maps them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from parity.config import TextConfig
from parity.weights import text_specs

PEFT_PREFIX = "base_model.model."
_ATTENTION = ("q_proj", "k_proj", "v_proj", "g_proj", "g_a_proj", "g_b_proj", "f_a_proj", "f_b_proj", "b_proj",
              "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
SUPPORTED = re.compile(
    r"^(?:.+\.)?layers\.\d+\.(?:"
    rf"self_attn\.(?:{'|'.join(_ATTENTION)})"
    rf"|mlp\.(?:{'|'.join(_MLP)})"
    rf"|block_sparse_moe\.shared_experts\.(?:{'|'.join(_MLP)})"
    r"|block_sparse_moe\.routed_expert_(?:down|up)_proj)$"
)
_TENSOR = re.compile(rf"^{re.escape(PEFT_PREFIX)}(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


@dataclass(frozen=True)
class Target:
    """One LoRA-able projection: its weight is [out_features, in_features]."""

    module: str
    out_features: int
    in_features: int

    @property
    def weight(self) -> str:
        """The official base weight name (the key of `K3Weights.tensors` and `K3Weights.lora`)."""
        return f"{self.module}.weight"


def model_modules(cfg: TextConfig) -> dict[str, tuple[int, ...]]:
    """Every module of the text model that holds a `.weight`, by path, with the weight's shape."""
    return {name.removesuffix(".weight"): spec.shape for name, spec in text_specs(cfg).items()
            if name.endswith(".weight")}


def lora_targets(cfg: TextConfig) -> dict[str, Target]:
    """The supported LoRA targets of `cfg`'s model, by module path, in checkpoint order."""
    return {m: Target(m, *shape) for m, shape in model_modules(cfg).items() if SUPPORTED.match(m)}


def unsupported_reason(module: str) -> str:
    """Why a module of the model takes no LoRA (for error messages)."""
    if ".experts." in module:
        return "routed experts take no LoRA (experts_combine has no LoRA term; see lora/README.md)"
    if module.endswith("block_sparse_moe.gate"):
        return "the MoE router takes no LoRA"
    return "only the projections listed in lora/targets.py take a LoRA"


def tensor_name(module: str, which: str) -> str:
    """PEFT's tensor name for `module`'s lora_A (`which` = 'A') or lora_B ('B') weight."""
    return f"{PEFT_PREFIX}{module}.lora_{which}.weight"


def parse_tensor_name(name: str) -> tuple[str, str] | None:
    """(module path, 'A' or 'B') of a PEFT LoRA tensor name, else None."""
    m = _TENSOR.match(name)
    return (m.group("module"), m.group("which")) if m else None


def suffixes(cfg: TextConfig) -> list[str]:
    """The last name component of every supported target of `cfg` (the default `target_modules`)."""
    return sorted({m.rsplit(".", 1)[-1] for m in lora_targets(cfg)})
