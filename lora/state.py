"""The trainer's adapter state on disk: one safetensors file per tensor-parallel rank, reassembled offline.

Each TP rank of the first data-parallel replica writes its own shard of every adapter tensor (no collective
during training), under the PEFT tensor names, to `adapter_state-tpRR-of-TT.safetensors`. The files describe
themselves in their metadata: the adapter config (`adapter_config`, as adapter_config.json) and, for every
tensor split over TP, the dim it is split along (`tp_dims`); other tensors are whole on every rank.
`read_state` concatenates the shards in rank order (exact) and returns the whole adapter, which
`zerokl lora export` writes in PEFT format and the trainer can load back at any TP size.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parity.io.atomic import atomic_file
from lora.adapter import Adapter, validate
from lora.spec import AdapterError, LoraSpec
from lora.targets import parse_tensor_name
from parity.config import TextConfig

_SHARD = re.compile(r"^adapter_state-tp(\d+)-of-(\d+)\.safetensors$")


def shard_file(tp_rank: int, tp: int) -> str:
    return f"adapter_state-tp{tp_rank:02d}-of-{tp:02d}.safetensors"


def write_shard(out: str | Path, spec: LoraSpec, tensors: dict[str, torch.Tensor], tp_dims: dict[str, int],
                tp_rank: int, tp: int) -> Path:
    """Write one TP rank's shard: `tensors` (PEFT names, this rank's part), `tp_dims` (name -> split dim).
    Written to a `.partial` file and renamed into place, so a crash never leaves a torn shard."""
    path = Path(out) / shard_file(tp_rank, tp)
    meta = {"adapter_config": json.dumps(spec.to_peft()), "tp_dims": json.dumps(tp_dims)}
    with atomic_file(path) as tmp:
        save_file({n: t.detach().to(torch.float32).contiguous() for n, t in tensors.items()}, str(tmp), metadata=meta)
    return path


def read_state(path: str | Path, cfg: TextConfig) -> Adapter:
    """Reassemble the adapter of a state directory (all TP shards must be present and agree), validated
    against the model config `cfg`."""
    path = Path(path)
    found = sorted((int(m.group(1)), int(m.group(2)), p) for p in path.glob("*.safetensors")
                   if (m := _SHARD.match(p.name))) if path.is_dir() else []
    if not found:
        raise AdapterError(f"{path} holds no adapter_state-tpRR-of-TT.safetensors files")
    tp = found[0][1]
    if [(r, t) for r, t, _ in found] != [(r, tp) for r in range(tp)]:
        raise AdapterError(f"{path}: expected the {tp} shards adapter_state-tp00..{tp - 1:02d}-of-{tp:02d}, "
                           f"found {[p.name for _, _, p in found]}")
    parts: list[dict[str, torch.Tensor]] = []
    metas: list[dict[str, str]] = []
    for _, _, file in found:
        with safe_open(str(file), framework="pt") as f:
            metas.append(f.metadata() or {})
            parts.append({n: f.get_tensor(n) for n in f.keys()})
    if any(m != metas[0] for m in metas) or not {"adapter_config", "tp_dims"} <= metas[0].keys():
        raise AdapterError(f"{path}: the shards' metadata (adapter_config, tp_dims) is missing or differs")
    if any(p.keys() != parts[0].keys() for p in parts):
        raise AdapterError(f"{path}: the shards hold different tensor names")
    spec = LoraSpec.from_peft(json.loads(metas[0]["adapter_config"]))
    tp_dims: dict[str, int] = json.loads(metas[0]["tp_dims"])
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name in parts[0]:
        parsed = parse_tensor_name(name)
        if parsed is None:
            raise AdapterError(f"{path}: unexpected tensor {name!r}")
        whole = torch.cat([p[name] for p in parts], dim=tp_dims[name]) if name in tp_dims else parts[0][name]
        halves.setdefault(parsed[0], {})[parsed[1]] = whole.to(torch.float32)
    if any(set(h) != {"A", "B"} for h in halves.values()):
        raise AdapterError(f"{path}: a module lacks its lora_A or lora_B tensor")
    return validate(Adapter(spec, {m: (h["A"], h["B"]) for m, h in halves.items()}), cfg)
