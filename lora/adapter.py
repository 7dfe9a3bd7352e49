"""PEFT adapter directories in and out: `adapter_config.json` + `adapter_model.safetensors`, fully validated.

`load_adapter(path, cfg)` is the one reader (trainer, rollout engine, merge, CLI): it returns an `Adapter`
whose tensors are fp32 and whose every target, shape, rank and value has been checked against the model
config; `load_lora(path, cfg)` gives the same as `K3Weights.lora` wants it (official base weight name ->
`parity.kernels.linear.LoRA`). Only safetensors are read (`adapter_model.bin` / `.pt` are pickles: refused).

Tensors are written as fp32, the trainer's master precision, so an adapter exported by the trainer and read
by the rollout engine gives both sides the same bits; bf16 / fp16 files are read and upcast (exact).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from parity.io.atomic import atomic_dir
from lora.spec import AdapterError, LoraSpec
from lora.targets import lora_targets, model_modules, parse_tensor_name, tensor_name, unsupported_reason
from parity.config import TextConfig
from parity.kernels.linear import LoRA

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter: its config and, per target module path, (A: [r, in] fp32, B: [out, r] fp32).

    Invariant (once `validate`d against a config): every module is a supported target the spec selects, every
    selected target has both tensors, shapes match the base weight and the module's rank, values are finite."""

    spec: LoraSpec
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def lora(self) -> dict[str, LoRA]:
        """Official base weight name -> `LoRA(a, b, scale)`, what `K3Weights.lora` holds."""
        return {f"{m}.weight": LoRA(a, b, self.spec.scale(m)) for m, (a, b) in self.weights.items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """PEFT tensor name -> tensor (the content of adapter_model.safetensors)."""
        out: dict[str, torch.Tensor] = {}
        for m, (a, b) in self.weights.items():
            out[tensor_name(m, "A")] = a
            out[tensor_name(m, "B")] = b
        return out


def validate(adapter: Adapter, cfg: TextConfig) -> Adapter:
    """Check `adapter` against the model config (see `Adapter`); returns it, or raises `AdapterError` naming
    the first offending module or tensor."""
    spec, supported, known = adapter.spec, lora_targets(cfg), model_modules(cfg)
    if not adapter.weights:
        raise AdapterError("the adapter has no LoRA tensors")
    for module, (a, b) in adapter.weights.items():
        if module not in known:
            raise AdapterError(f"unknown target module {module!r}: the model has no weight {module}.weight")
        if module not in supported:
            raise AdapterError(f"unsupported target module {module!r}: {unsupported_reason(module)}")
        if not spec.targets(module):
            raise AdapterError(f"tensors for {module!r}, which target_modules {spec.target_modules!r} does not select")
        t, r = supported[module], spec.rank(module)
        for which, x, want in (("A", a, (r, t.in_features)), ("B", b, (t.out_features, r))):
            if tuple(x.shape) != want:
                raise AdapterError(f"{tensor_name(module, which)} has shape {tuple(x.shape)}, expected {want} "
                                   f"(r = {r}, base weight {t.out_features}x{t.in_features})")
            if x.dtype != torch.float32:
                raise AdapterError(f"{tensor_name(module, which)} is {x.dtype}; adapters compute in float32")
            if not torch.isfinite(x).all():
                raise AdapterError(f"{tensor_name(module, which)} has non-finite values (NaN or inf)")
    missing = [m for m in supported if spec.targets(m) and m not in adapter.weights]
    if missing:
        raise AdapterError(f"target_modules selects {len(missing)} modules without LoRA tensors, first: {missing[0]}")
    unsupported = [m for m in known if m not in supported and spec.targets(m)]
    if unsupported:
        raise AdapterError(f"target_modules selects {unsupported[0]!r}: {unsupported_reason(unsupported[0])}")
    return adapter


def pair_tensors(named: Mapping[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT tensor name -> tensor, paired by module as (A, B) fp32; fails naming a bad name, dtype or a
    missing half (`where` says whose tensors, for the message)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named.items():
        parsed = parse_tensor_name(name)
        if parsed is None:
            raise AdapterError(f"{where}: unexpected tensor {name!r} (want "
                               f"'base_model.model.<module>.lora_A.weight' / '.lora_B.weight')")
        if t.dtype not in FLOAT_DTYPES:
            raise AdapterError(f"{where}: {name} has dtype {t.dtype}; expected float32, bfloat16 or float16")
        halves.setdefault(parsed[0], {})[parsed[1]] = t.to(torch.float32)
    for module, pair in halves.items():
        for which in "AB":
            if which not in pair:
                raise AdapterError(f"{where}: {tensor_name(module, which)} is missing")
    return {m: (p["A"], p["B"]) for m, p in halves.items()}


def _read_tensors(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Pair the PEFT tensors of one safetensors file by module, upcast to fp32."""
    try:
        with safe_open(str(path), framework="pt") as f:
            named = {name: f.get_tensor(name) for name in f.keys()}
    except SafetensorError as e:
        raise AdapterError(f"{path}: not a readable safetensors file ({e})") from e
    return pair_tensors(named, path.name)


def read_config(path: str | Path) -> LoraSpec:
    """The `LoraSpec` of an adapter directory's adapter_config.json."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{path} is not a PEFT adapter directory (no {CONFIG_FILE})")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise AdapterError(f"{file}: expected a JSON object")
    return LoraSpec.from_peft(raw)


def load_adapter(path: str | Path, cfg: TextConfig) -> Adapter:
    """Read and validate a PEFT adapter directory against the model config `cfg`."""
    path = Path(path)
    spec = read_config(path)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        pickles = [p for p in PICKLE_FILES if (path / p).exists()]
        if pickles:
            raise AdapterError(f"{path}: {pickles[0]} is a pickle; zerokl reads only {WEIGHTS_FILE} "
                               "(convert with safetensors.torch.save_file)")
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}")
    return validate(Adapter(spec, _read_tensors(weights)), cfg)


def load_lora(path: str | Path, cfg: TextConfig) -> dict[str, LoRA]:
    """`K3Weights.lora` for the adapter at `path`: official base weight name -> LoRA (fp32), validated."""
    return load_adapter(path, cfg).lora()


def save_adapter(adapter: Adapter, out: str | Path, progress: Callable[[str], None] | None = None) -> Path:
    """Write adapter_config.json and adapter_model.safetensors (fp32) into a new directory `out`.

    Written into a sibling `.partial` directory and renamed into place; refuses a non-empty `out`."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AdapterError(f"{out} exists and is not an empty directory; choose a new --out")
    with atomic_dir(out) as tmp:
        tensors = {n: t.detach().to(torch.float32).contiguous() for n, t in adapter.tensors().items()}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(adapter.spec.to_peft(), indent=2))
    if progress:
        progress(f"wrote {out} ({len(adapter.weights)} modules, {sum(t.numel() for t in tensors.values())} params)")
    return out
