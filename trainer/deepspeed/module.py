"""The K3 text model as a plain `torch.nn.Module` for DeepSpeed and PEFT: a parameter tree, no numerics of its own.

Module paths are the official checkpoint names: parameter `language_model.layers.3.self_attn.q_proj.weight` lives
at module `language_model.layers.3.self_attn.q_proj`. Every official projection weight ([out, in], spec init
"linear") sits in a `Projection`, an `nn.Linear` subclass, so PEFT's `target_modules` matching wraps it like any
linear layer and its adapter tensors get the names `zerokl lora` and vLLM use
(`base_model.model.<module path>.lora_A.weight`, `lora.targets`). All other tensors (norms, conv kernels, KDA gate
parameters, router bias, AttnRes scorers, embedding) are plain parameters of container modules.

`DeepSpeedK3Model.forward` never calls a submodule's forward (a `Projection` refuses to run: `nn.Linear.forward` is
`F.linear`, not the parity linear). It builds `K3Weights` from the live parameters, with a PEFT layer's
`lora_A`/`lora_B`/`scaling` as `K3Weights.lora[official name] = LoRA(a, b, scale)`, and runs the shared
`parity.model.K3Forward` on the named parity kernels, so the log-probs have the rollout engine's bits.

ZeRO-3 gathers a module's parameters only around that module's forward. The shared forward reads parameters
directly, so each top-level step of it runs as the forward of a module holding what that step reads
(`ScopedK3Forward`): a layer's attention block and its MLP / MoE block are `Block`s of the tree, flagged as
DeepSpeed "z3 leaf" modules (the whole subtree, adapters included, is gathered at once; its gradients are reduced
together when the block's backward ends, in a fixed order, with zeros for parameters that got none: the routed
experts no token picked on this rank); the norms and AttnRes scorers before each block, the embedding, the output
mix and the head are read by `Scope`s, parameterless modules on which those tensors are registered as ZeRO-3
external parameters (they get a gradient on every rank in every step). Outside ZeRO-3 both are plain calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from parity.config import TextConfig
from parity.kernels import get_kernels
from parity.kernels.linear import LoRA
from parity.model import K3Forward, K3Weights
from parity.weights import WeightSpec, is_indexer, text_names, text_specs
from parity.kernels.logprobs import Sampling
from parity.vision import ImageRows
from trainer.logprobs import padded_logprobs

LOGITS = "logits"  # scope key of the final norm + lm_head


class Projection(nn.Linear):
    """Holds one official projection weight [out_features, in_features] (no bias) where PEFT can target it.

    Invariant: never called. The K3 forward reads `.weight` (and the PEFT wrapper's adapter) and runs the parity
    linear; `nn.Linear.forward` would run `F.linear` and break the bit-identity with the rollout engine."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype):
        super().__init__(in_features, out_features, bias=False, device="meta")
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("K3 projections are not called; DeepSpeedK3Model.forward runs the shared parity forward")


class Block(nn.Module):
    """A container of official tensors. Its forward runs `fn(*args)`, a step of the shared forward that reads only
    this subtree's parameters, so ZeRO-3's hooks gather them around the call (and again for its backward)."""

    def forward(self, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        return fn(*args)


class Scope(Block):
    """A parameterless `Block` for a step whose tensors lie in several subtrees: `DeepSpeedK3Model.bind_zero3` registers
    them on it as ZeRO-3 external parameters."""


def _holder(name: str) -> str:
    """The module path holding official tensor `name` (the name without its last component)."""
    return name.rsplit(".", 1)[0]


def block_paths(c: TextConfig) -> list[str]:
    """The attention and MLP / MoE block of every layer (module paths, = the prefixes `_kda`/`_mla`/`_mlp`/`_moe`
    receive): each is one ZeRO-3 leaf module."""
    names = text_names(c)
    blocks = []
    for layer in range(c.num_hidden_layers):
        p = names.layer(layer)
        blocks += [f"{p}.self_attn", f"{p}.block_sparse_moe" if c.is_moe(layer) else f"{p}.mlp"]
    return blocks


def scope_groups(c: TextConfig) -> dict[str, tuple[str, ...]]:
    """Scope key -> module paths of the tensors that step reads. Keys are what `ScopedK3Forward` looks up: the
    embedding's name, the first tensor name of a top-level `_norm` / `_attn_res` call, or `LOGITS`. Calls with
    other keys (norms inside a block, the final norm inside `logits`) run inside their caller's block or scope."""
    names = text_names(c)
    groups: dict[str, tuple[str, ...]] = {names.embed: (_holder(names.embed),)}
    for layer in range(c.num_hidden_layers):
        p = names.layer(layer)
        if c.attn_res_block_size is None:
            groups[f"{p}.input_layernorm.weight"] = (f"{p}.input_layernorm",)
            groups[f"{p}.post_attention_layernorm.weight"] = (f"{p}.post_attention_layernorm",)
        else:
            groups[f"{p}.self_attention_res_norm.weight"] = (
                f"{p}.self_attention_res_norm", f"{p}.self_attention_res_proj", f"{p}.input_layernorm")
            groups[f"{p}.mlp_res_norm.weight"] = (
                f"{p}.mlp_res_norm", f"{p}.mlp_res_proj", f"{p}.post_attention_layernorm")
    if c.attn_res_block_size is not None:
        groups[names.output_res_norm] = (_holder(names.output_res_norm), _holder(names.output_res_proj))
    groups[LOGITS] = (_holder(names.norm), _holder(names.lm_head))
    return groups


class ScopedK3Forward(K3Forward):
    """`K3Forward` whose top-level steps run as the forward of their `Block` or `Scope` (`DeepSpeedK3Model.runners`);
    the arithmetic is `K3Forward`'s.

    A ZeRO-3 leaf block reduces its gradients in a full backward hook, which PyTorch fires once the gradient
    w.r.t. the block's inputs exists, or, when no input requires grad, as soon as the gradient w.r.t. its output
    exists: before the parameter gradients it reduces (DeepSpeed then zero-fills them, and the real ones reach the
    reduction only through an in-place accumulation into its bucket). So the input of a block in `grad_inputs`
    (a leaf with trainable parameters; with LoRA, the first adapted block's input has no grad) is given
    `requires_grad`; values and parameter gradients are unchanged."""

    def __init__(self, weights: K3Weights, kernels: Any, runners: dict[str, Block], grad_inputs: set[str]):
        super().__init__(weights, kernels)
        self.runners = runners
        self.grad_inputs = grad_inputs

    def _run(self, key: str, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        runner = self.runners.get(key)
        return fn(*args) if runner is None else runner(fn, *args)

    def _block(self, p: str, fn: Callable[..., torch.Tensor], x: torch.Tensor, *rest: Any) -> torch.Tensor:
        if p in self.grad_inputs and torch.is_grad_enabled() and not x.requires_grad:
            x = x.detach().requires_grad_()
        return self._run(p, fn, x, *rest)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._run(self.names.embed, super().embed, ids)

    def _norm(self, x: torch.Tensor, name: str, eps: float | None = None) -> torch.Tensor:
        return self._run(name, super()._norm, x, name, eps)

    def _attn_res(self, blocks: list[torch.Tensor], prefix: torch.Tensor, norm: str, proj: str,
                  out_norm: str | None) -> torch.Tensor:
        return self._run(norm, super()._attn_res, blocks, prefix, norm, proj, out_norm)

    def _kda(self, x: torch.Tensor, p: str, cache: Any, lens: torch.Tensor) -> torch.Tensor:
        return self._block(p, super()._kda, x, p, cache, lens)

    def _mla(self, x: torch.Tensor, p: str, cache: Any, pos: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return self._block(p, super()._mla, x, p, cache, pos, lens)

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        return self._block(p, super()._mlp, x, p)

    def _moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        return self._block(p, super()._moe, x, p)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._run(LOGITS, super().logits, hidden)


def _is_projection(spec: WeightSpec, attr: str) -> bool:
    return attr == "weight" and spec.init == "linear" and len(spec.shape) == 2


class DeepSpeedK3Model(nn.Module):
    """The K3 text model: official-name parameter tree + `forward(input_ids, lens, temperature)` -> [B, T]
    next-token log-probs (`trainer.logprobs.padded_logprobs` over the shared forward).

    Parameters are fp32 masters (`dtype`), left uninitialised: fill them with `load_official`
    (`trainer.deepspeed.io`). `kernels` names the parity kernel set. Invariant: `named_parameters()` of an unwrapped
    module are exactly `text_specs(cfg)`'s names, in module-tree order (the `model.` group first, then the layers,
    then lm_head: the order of the Megatron `MegatronK3Model`)."""

    def __init__(self, cfg: TextConfig, kernels: str = "invariant", dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels
        self.specs = text_specs(cfg)
        get_kernels(kernels)  # fail early on an unknown kernel set name
        for name, spec in self.specs.items():
            path, attr = name.rsplit(".", 1)
            module = self._container(path, _is_projection(spec, attr), spec.shape, dtype)
            if not isinstance(module, Projection) or attr != "weight":
                module.register_parameter(attr, nn.Parameter(torch.empty(spec.shape, dtype=dtype)))
        for name, param in self.named_parameters():
            if is_indexer(name):
                param.requires_grad_(False)
        self.blocks = block_paths(cfg)
        self.scope_paths = scope_groups(cfg)
        self.scope_keys = {key: str(i) for i, key in enumerate(self.scope_paths)}
        self.zero3_scopes = nn.ModuleDict({str(i): Scope() for i in range(len(self.scope_paths))})
        self.leaf_blocks_with_grads: set[str] = set()  # set by bind_zero3

    def _container(self, path: str, projection: bool, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Module:
        """The module at `path`, creating containers (and the `Projection` itself) on the way."""
        module: nn.Module = self
        parts = path.split(".")
        for i, part in enumerate(parts):
            child = module._modules.get(part)
            if child is None:
                child = Projection(*shape, dtype=dtype) if projection and i == len(parts) - 1 else Block()
                module.add_module(part, child)
            module = child
        if projection and not isinstance(module, Projection):
            raise ValueError(f"{path}: a projection weight listed after other tensors of its module")
        return module

    # --- parameters by official name -----------------------------------------------------------------
    def _base(self, path: str) -> nn.Module:
        module = self.get_submodule(path)
        return module.get_base_layer() if isinstance(module, LoraLayer) else module

    def official_parameters(self) -> dict[str, nn.Parameter]:
        """Official tensor name -> base parameter (through PEFT's `base_layer` where a projection is wrapped)."""
        out = {}
        for name in self.specs:
            path, attr = name.rsplit(".", 1)
            out[name] = getattr(self._base(path), attr)
        return out

    def lora_layers(self) -> Iterator[tuple[str, LoraLayer]]:
        """(module path, PEFT LoRA layer) for every wrapped projection, in module order."""
        for path, module in self.named_modules():
            if isinstance(module, LoraLayer):
                yield path, module

    def lora_terms(self) -> dict[str, LoRA]:
        """`K3Weights.lora`: official base weight name -> LoRA(A, B, scale) of each wrapped projection's active
        adapter (live parameters). Empty while PEFT's adapters are disabled (`PeftModel.disable_adapter()`).

        Refuses what the parity linear cannot compute: several active adapters, merged weights, DoRA, LoRA bias."""
        terms: dict[str, LoRA] = {}
        for path, layer in self.lora_layers():
            if layer.disable_adapters:
                continue
            if layer.merged:
                raise ValueError(f"{path}: merged LoRA weights; unmerge them (the parity linear adds the LoRA term)")
            if len(layer.active_adapters) != 1:
                raise ValueError(f"{path}: {len(layer.active_adapters)} active adapters; zerokl runs exactly one")
            name = layer.active_adapters[0]
            if layer.use_dora.get(name) or getattr(layer, "lora_bias", {}).get(name):
                raise ValueError(f"{path}: DoRA / LoRA bias are not supported by the parity linear")
            terms[f"{path}.weight"] = LoRA(layer.lora_A[name].weight, layer.lora_B[name].weight,
                                           float(layer.scaling[name]))
        return terms

    # --- ZeRO-3 --------------------------------------------------------------------------------------
    def runners(self) -> dict[str, Block]:
        """Key `ScopedK3Forward` looks up -> the module whose forward runs that step."""
        out: dict[str, Block] = {p: self.get_submodule(p) for p in self.blocks}
        out.update({key: self.zero3_scopes[i] for key, i in self.scope_keys.items()})
        return out

    def bind_zero3(self) -> None:
        """Before `deepspeed.initialize` at stage 3, after PEFT wrapping: flag each block as a z3 leaf module and
        register each scope's tensors (adapters included) as its external parameters. Fails if a parameter would
        never be gathered."""
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter
        from deepspeed.utils import set_z3_leaf_module

        covered: set[int] = set()
        for path in self.blocks:
            block = self.get_submodule(path)
            set_z3_leaf_module(block, True)
            covered.update(id(p) for p in block.parameters())
            if any(p.requires_grad for p in block.parameters()):
                self.leaf_blocks_with_grads.add(path)
        for key, i in self.scope_keys.items():
            for path in self.scope_paths[key]:
                for p in self.get_submodule(path).parameters():
                    register_external_parameter(self.zero3_scopes[i], p)
                    covered.add(id(p))
        missed = [n for n, p in self.named_parameters() if id(p) not in covered]
        if missed:
            raise RuntimeError(f"no ZeRO-3 block or scope gathers {missed[0]}")

    # --- forward -------------------------------------------------------------------------------------
    def forward_fn(self) -> K3Forward:
        """The shared forward over the live parameters and adapters (scoped for ZeRO-3); its GEMMs save the parameters,
        not their gathered data, for the backward (`parity.kernels.linear.gemm`)."""
        weights = K3Weights(self.cfg, self.official_parameters(), self.lora_terms())
        return ScopedK3Forward(weights, get_kernels(self.kernels), self.runners(), self.leaf_blocks_with_grads)

    def forward(self, input_ids: torch.Tensor, lens: torch.Tensor, temperature: float | Sampling,
                entropy: bool = False, raw: bool = False,
                images: ImageRows | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """input_ids: [B, T] right-padded int64, lens: [B] -> lp: [B, T] fp32 (next-token aligned, zeros past
        each row's last scored token), differentiable; with `raw` and / or `entropy`, (lp, [raw,] [entropy])
        (`padded_logprobs`)."""
        return padded_logprobs(self.forward_fn(), input_ids, lens, temperature, entropy, raw=raw, images=images)
