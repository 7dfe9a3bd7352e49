"""PEFT LoRA on the DeepSpeed trainer's `DeepSpeedK3Model`, in the adapter format of `zerokl lora` (`lora/`).

`attach_lora` runs PEFT's `get_peft_model` on the module: every targeted `Projection` becomes a PEFT `lora.Linear`
whose `lora_A` / `lora_B` / `scaling` the module's forward hands to the parity linear as
`K3Weights.lora[official name]` (PEFT's own forward, `F.linear` with dropout, never runs). Adapter names are
PEFT's `base_model.model.<official module path>.lora_A.weight`, what `lora.adapter` reads and vLLM loads.

Refused, naming the key or module: what `lora.spec` refuses (DoRA, LoRA bias, ...) and targets `lora.targets`
excludes (routed experts, router, embedding, lm_head, ...). `lora_dropout` is accepted and has no effect, as in
`lora.spec`: the training forward must equal the rollout engine's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model

from lora.adapter import Adapter, load_adapter, validate
from lora.spec import AdapterError, LoraSpec
from lora.targets import lora_targets, unsupported_reason
from trainer.deepspeed.io import gathered
from trainer.deepspeed.module import DeepSpeedK3Model
from trainer.deepspeed.trainer import DeepSpeedTrainer

ADAPTER = "default"  # PEFT's adapter name


def lora_spec(config: LoraConfig) -> LoraSpec:
    """zerokl's checked view of a PEFT `LoraConfig` (raises `AdapterError` on an unsupported option)."""
    raw: dict[str, Any] = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    raw["peft_type"] = "LORA"
    return LoraSpec.from_peft(raw)


def attach_lora(module: DeepSpeedK3Model, lora: LoraConfig | Adapter | str | Path, seed: int = 0) -> PeftModel:
    """`get_peft_model(module, ...)` with a `LoraConfig` (PEFT's initialisation: A kaiming-uniform drawn under
    `seed`, the same on every rank; B = 0), a `lora.adapter.Adapter` (its spec as PEFT config, its tensors) or an
    adapter directory (its config, and its tensors after `lora.adapter.load_adapter` validated them). Freezes every
    base parameter. The PEFT config is made task-less, so the PeftModel passes `(input_ids, lens, temperature)`
    straight to `DeepSpeedK3Model.forward`."""
    adapter: Adapter | None = None
    if isinstance(lora, Adapter):
        adapter = validate(lora, module.cfg)
        lora = LoraConfig(**adapter.spec.to_peft())
    elif not isinstance(lora, LoraConfig):
        adapter = load_adapter(lora, module.cfg)
        lora = LoraConfig.from_pretrained(str(lora))
    lora_spec(lora)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        peft = get_peft_model(module, dataclasses.replace(lora, task_type=None, inference_mode=False),
                              adapter_name=ADAPTER)
    layers = dict(module.lora_layers())
    supported = lora_targets(module.cfg)
    for path in layers:
        if path not in supported:
            raise AdapterError(f"target_modules selects {path!r}: {unsupported_reason(path)}")
    if adapter is not None:
        if set(layers) != set(adapter.weights):
            raise AdapterError(f"adapter tensors {sorted(set(adapter.weights) ^ set(layers))[:3]} do not match the "
                               "modules its target_modules selects in this model")
        with torch.no_grad():
            for path, (a, b) in adapter.weights.items():
                layers[path].lora_A[ADAPTER].weight.copy_(a)
                layers[path].lora_B[ADAPTER].weight.copy_(b)
    return peft


def _require_lora(trainer: DeepSpeedTrainer) -> PeftModel:
    if trainer.peft is None:
        raise ValueError("the trainer carries no LoRA adapter (build it with lora=...)")
    return trainer.peft


def export_adapter(trainer: DeepSpeedTrainer, rank: int = 0) -> Adapter | None:
    """The adapter as `lora.adapter.Adapter` (spec + fp32 A/B per module, validated against the model) on `rank`,
    None elsewhere; `.lora()` gives `K3Weights.lora`, `lora.adapter.save_adapter` writes it. Collective; ZeRO-3
    adapter parameters are gathered one module at a time."""
    peft = _require_lora(trainer)
    me = dist.get_rank()
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for path, layer in trainer.module.lora_layers():
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        with gathered([a, b]):
            if me == rank:
                weights[path] = (a.detach().clone(), b.detach().clone())
    if me != rank:
        return None
    return validate(Adapter(lora_spec(peft.peft_config[ADAPTER]), weights), trainer.module.cfg)


def save_adapter(trainer: DeepSpeedTrainer, out: str | Path) -> Path:
    """PEFT's `save_pretrained` from rank 0 with the gathered adapter tensors: `out/adapter_config.json` and
    `out/adapter_model.safetensors` (fp32, `base_model.model.<module>.lora_A.weight` names). Collective."""
    peft = _require_lora(trainer)
    me = dist.get_rank()
    state: dict[str, torch.Tensor] = {}
    for name, p in peft.named_parameters():
        if p.requires_grad:  # exactly the adapter tensors: PEFT froze everything else
            with gathered([p]):
                if me == 0:
                    state[name] = p.detach().clone()
    peft.save_pretrained(str(out), state_dict=state, is_main_process=me == 0)
    dist.barrier()
    return Path(out)
