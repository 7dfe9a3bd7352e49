"""Official-format checkpoints (Kimi K3 or Kimi Linear) in and out of the Megatron K3 model, at any TP/EP split
the config allows.

Load: every rank reads the whole official checkpoint (what `zerokl init-checkpoint` writes and vLLM loads) and
copies its shard (`trainer.megatron.sharding`) into the fp32 master parameters. Export: shards are all-gathered over TP
(concatenation along the split dim) and experts over EP, then cast back to each tensor's checkpoint dtype. A
load followed by an export returns the checkpoint bit for bit (bf16 -> fp32 -> bf16 is exact), whatever the split.

LoRA adapters (`lora.adapter.Adapter`, PEFT format) go the same way: `load_adapter` attaches them and copies
this rank's shard (`trainer.megatron.sharding.lora_splits`), `export_adapter` gathers them whole; load -> export is
bitwise (fp32 both ways).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file

from lora.adapter import Adapter, validate
from lora.spec import AdapterError
from lora.adapter import save_adapter as write_adapter
from lora.state import write_shard
from lora.targets import tensor_name
from parity.config import TextConfig
from trainer.megatron.modules import MegatronK3Model, local_experts
from trainer.megatron.sharding import Split, lora_splits, shard, shard_range, split_of, split_roles
from parity.io.checkpoint import CheckpointError, CheckpointReader, open_checkpoint, save_checkpoint
from parity.quant import mxfp4
from parity.weights import is_mtp, is_quantized, packed_names

_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def load_official(model: MegatronK3Model, weights: dict[str, torch.Tensor]) -> list[str]:
    """Copy this rank's shard of every official text tensor into `model`; returns the names loaded here.

    Fails naming the first missing text tensor, unexpected text tensor, or shape mismatch; the vision tower goes
    into its parameters when the model trains it (`MegatronK3Model.add_vision_tower`); other tensors outside the
    text model (a frozen vision tower) and the MTP draft layers (frozen: the policy loss does not reach them) are kept
    verbatim in `model.passthrough` for export.
    """
    roles = split_roles(model.config.k3.text)
    missing = [n for n in roles if n not in weights]
    if missing:
        raise CheckpointError(f"{len(missing)} text tensors missing, first: {missing[0]}")
    extra = [n for n in weights if n.startswith(model.root) and n not in roles and not is_mtp(model.config.k3.text, n)]
    if extra:
        raise CheckpointError(f"{len(extra)} unexpected text tensors, first: {extra[0]}")
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()

    def whole(name: str) -> torch.Tensor:
        if name not in weights:
            raise CheckpointError(f"vision tensor {name} missing")
        return weights[name]

    loaded = _fill(model, roles, lambda name: shard(name, weights[name], roles[name], tp_rank, tp), whole)
    vision = model.vision_parameters()
    model.storage_dtypes = {n: weights[n].dtype for n in [*roles, *vision]}
    model.passthrough = {n: t for n, t in weights.items() if n not in roles and n not in vision}
    return loaded


def load_rank_shards(model: MegatronK3Model, reader: CheckpointReader) -> list[str]:
    """`load_official` reading from an opened checkpoint (`parity.io.checkpoint.open_checkpoint`, which checked its
    names and shapes) only what this rank holds: its TP slice of each split text tensor, the routed experts of its EP
    rank (MXFP4 ones dequantised to fp32 masters), every other tensor whole."""
    cfg = model.config.k3.text
    roles = split_roles(cfg)
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()

    def part(name: str) -> torch.Tensor:
        if is_quantized(cfg, name):
            return mxfp4.dequantize(*(reader.read(n) for n in packed_names(name)), torch.float32)
        try:
            part = shard_range(name, reader.shape(name), roles[name], tp_rank, tp)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        return reader.read(name) if part is None else reader.read(name, *part)

    loaded = _fill(model, roles, part, reader.read)
    vision = model.vision_parameters()
    model.storage_dtypes = {n: torch.float32 if is_quantized(cfg, n) else reader.dtype(n) for n in [*roles, *vision]}
    stored_text = {s for n in roles for s in (packed_names(n) if is_quantized(cfg, n) else (n,))}
    model.passthrough = {n: reader.read(n) for n in reader.names if n not in stored_text and n not in vision}
    return loaded


def _fill(model: MegatronK3Model, roles: dict[str, Split], part: Callable[[str], torch.Tensor],
          whole: Callable[[str], torch.Tensor]) -> list[str]:
    """Copy `part(name)` (this rank's shard) into each text parameter and `whole(name)` into each trained vision
    parameter; the names loaded. Fails on a shard that does not fit, or a text tensor with no parameter here (other
    EP ranks' experts aside)."""
    loaded = []
    with torch.no_grad():
        for name, param in model.official_parameters().items():
            piece = part(name)
            if piece.shape != param.shape:
                raise CheckpointError(f"{name}: shard {tuple(piece.shape)} does not fit parameter {tuple(param.shape)}")
            param.copy_(piece)
            loaded.append(name)
        for name, param in model.vision_parameters().items():
            tensor = whole(name)
            if tensor.shape != param.shape:
                raise CheckpointError(f"{name}: {tuple(tensor.shape)} does not fit parameter {tuple(param.shape)}")
            param.copy_(tensor)
            loaded.append(name)
    unplaced = sorted(n for n in set(roles) - set(loaded) if roles[n] is not Split.EXPERT)  # experts: other EP ranks
    if unplaced:
        raise CheckpointError(f"model has no parameter for {unplaced[0]}")
    return loaded


RANK_WEIGHTS_FILE = "weights-rank{rank}.safetensors"  # in a state saved on several processes: what rank r writes


def save_rank_weights(model: MegatronK3Model, path: str | Path) -> Path:
    """This rank's part of a saved state on several processes, with no communication: every tensor exactly once over
    the ranks' files (RANK_WEIGHTS_FILE, rank r's file always written, possibly with no tensor), each as its holder keeps
    it - a TP-split tensor's slice from the DP rank 0 of each TP rank, routed experts from expert-DP rank 0 of each EP
    rank, the tensors every rank holds whole (the rest of the text model, a trained vision tower, the frozen tensors
    kept for export) from the rank at TP rank 0 and DP rank 0. The file's metadata names its TP and EP ranks."""
    roles = split_roles(model.config.k3.text)
    tp_rank, dp_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank()
    expert_dp_rank = parallel_state.get_expert_data_parallel_rank()
    whole_here = tp_rank == 0 and dp_rank == 0

    def writes(split: Split) -> bool:
        if split is Split.EXPERT:
            return expert_dp_rank == 0
        return dp_rank == 0 if split.tp_dim is not None else whole_here

    mine = {n: p.detach() for n, p in model.official_parameters().items() if writes(roles[n])}
    if whole_here:
        mine.update({n: p.detach() for n, p in model.vision_parameters().items()})
        mine.update(model.passthrough)
    layout = {"tp": parallel_state.get_tensor_model_parallel_world_size(), "tp_rank": tp_rank,
              "ep": parallel_state.get_expert_model_parallel_world_size(),
              "ep_rank": parallel_state.get_expert_model_parallel_rank()}
    out = Path(path) / RANK_WEIGHTS_FILE.format(rank=dist.get_rank())
    save_file({n: t.contiguous() for n, t in mine.items()}, str(out), metadata={k: str(v) for k, v in layout.items()})
    return out


def _index_rank_files(stack: contextlib.ExitStack, files: list[Path],
                      layout: dict[str, int] | None = None) -> dict[str, list[tuple[int, Any]]]:
    """Each tensor name in the rank files `save_rank_weights` wrote -> [(its writer's TP rank, the open file)], the
    files opened in `stack`; with `layout` ({"tp": T, "ep": E}), CheckpointError for a file saved at another."""
    where: dict[str, list[tuple[int, Any]]] = {}
    for f in files:
        handle = stack.enter_context(safe_open(str(f), framework="pt"))
        meta = handle.metadata() or {}
        if layout is not None and any(meta.get(k) != str(v) for k, v in layout.items()):
            raise CheckpointError(f"{f}: saved at tp {meta.get('tp')} x ep {meta.get('ep')}; this run is at "
                                  f"tp {layout['tp']} x ep {layout['ep']}")
        for name in handle.keys():
            where.setdefault(name, []).append((int(meta["tp_rank"]), handle))
    return where


def load_rank_weights(model: MegatronK3Model, path: str | Path) -> list[str]:
    """Restore `save_rank_weights` at the layout that wrote it: each rank reads only its own TP slices, its EP rank's
    experts and the whole tensors it trains (safetensors reads by name, from every rank file's header; the frozen
    tensors stay as the build loaded them). CheckpointError for files of another process count or layout, or a tensor
    missing or shaped differently."""
    path = Path(path)
    world = dist.get_world_size()
    files = [path / RANK_WEIGHTS_FILE.format(rank=r) for r in range(world)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: no {missing[0]} - not a state saved by {world} Megatron processes")
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    here = {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "ep": parallel_state.get_expert_model_parallel_world_size()}
    roles = split_roles(model.config.k3.text)
    with contextlib.ExitStack() as stack:
        where = _index_rank_files(stack, files, here)

        def read(name: str, tp_split: bool) -> torch.Tensor:
            holders = [h for r, h in where.get(name, ()) if not tp_split or r == tp_rank]
            if not holders:
                raise CheckpointError(f"{path}: {name} missing" + (f" for TP rank {tp_rank}" if tp_split else ""))
            return holders[0].get_tensor(name)

        return _fill(model, roles, lambda n: read(n, roles[n].tp_dim is not None), lambda n: read(n, False))


def load_official_dir(model: MegatronK3Model, path: str | Path) -> list[str]:
    """`load_rank_shards` from a checkpoint directory (`parity.io.checkpoint.open_checkpoint` validates it)."""
    return load_rank_shards(model, open_checkpoint(path))


def _gather(t: torch.Tensor, dim: int, group: dist.ProcessGroup, onto_rank0: bool) -> torch.Tensor | None:
    """The group's parts of a tensor concatenated along `dim` in group-rank order: on every member, or with
    `onto_rank0` (a group holding global rank 0) on rank 0 alone (None on the others)."""
    if group.size() == 1:  # its only member holds it whole (with `onto_rank0`: rank 0 itself)
        return t
    parts = [torch.empty_like(t) for _ in range(group.size())]
    if not onto_rank0:
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=dim)
    rank0 = dist.get_rank() == 0
    dist.gather(t.contiguous(), parts if rank0 else None, dst=0, group=group)
    return torch.cat(parts, dim=dim) if rank0 else None


def _holds_rank0(group: dist.ProcessGroup) -> bool:
    """Whether global rank 0 is a member of `group`."""
    return 0 in dist.get_process_group_ranks(group)


def export_official(model: MegatronK3Model, compute_dtype: bool = False,
                    onto_rank0: bool = False) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor, whole and in its checkpoint dtype, on every rank (collective: all ranks call); with
    `onto_rank0`, on global rank 0 alone ({} on the others): each TP or EP group that holds rank 0 gathers onto it,
    the other groups send nothing, so no other rank holds a whole tensor it does not own (the same bits on rank 0).

    compute_dtype: keep the trained tensors (text, and a trained vision tower) in the parameters' dtype (fp32 master
    weights) instead of casting to the checkpoint's storage dtype; weight sync into a rollout engine needs the exact
    bits the trainer computes with. What no TP or EP group gathers (everything on one rank) is the live parameter
    itself, not a copy: clone what must outlive the next optimizer step."""
    roles = split_roles(model.config.k3.text)
    params = {n: p.detach() for n, p in model.official_parameters().items()}
    tp_group = parallel_state.get_tensor_model_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    if onto_rank0 and not (_holds_rank0(tp_group) or _holds_rank0(ep_group)):
        return {}
    owned = local_experts(model.config)
    full: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for name, split in roles.items():
        if split is Split.EXPERT:
            if name in done or (onto_rank0 and not _holds_rank0(ep_group)):
                continue
            template = _EXPERT_INDEX.sub(".experts.{}.", name)
            mine = [params[template.format(e)] for e in owned]
            # EP ranks own consecutive ranges, in rank order; one EP rank holds them all (no copy)
            gathered = mine if ep_group.size() == 1 else _gather(torch.stack(mine), 0, ep_group, onto_rank0)
            done.update(template.format(e) for e in range(len(mine) * ep_group.size()))
            for e, t in enumerate([] if gathered is None else gathered):
                full[template.format(e)] = t
        elif split.tp_dim is not None:
            if not onto_rank0 or _holds_rank0(tp_group):
                gathered = _gather(params[name], split.tp_dim, tp_group, onto_rank0)
                if gathered is not None:
                    full[name] = gathered
        else:
            full[name] = params[name]
    if onto_rank0 and dist.get_rank() != 0:
        return {}
    full.update({n: p.detach() for n, p in model.vision_parameters().items()})
    out = {n: full[n] if compute_dtype else full[n].to(model.storage_dtypes[n]) for n in [*roles, *model.vision_parameters()]}
    out.update(model.passthrough)
    return out


def save_official(model: MegatronK3Model, out: str | Path) -> Path:
    """Export and write an official checkpoint directory from rank 0 (collective: all ranks call)."""
    weights = export_official(model, onto_rank0=True)
    path = Path(out)
    if dist.get_rank() == 0:
        save_checkpoint(model.config.k3, weights, path)
    dist.barrier()
    return path


def load_adapter(model: MegatronK3Model, adapter: Adapter) -> list[str]:
    """Attach a LoRA for every module of `adapter` (freezing the base, `MegatronK3Model.add_lora`) and copy this rank's
    shard of A and B into it; returns the official base weight names adapted. Validates `adapter` first."""
    validate(adapter, model.config.k3.text)
    spec = adapter.spec
    model.add_lora({f"{m}.weight": (spec.rank(m), spec.scale(m)) for m in adapter.weights})
    model.lora_spec = spec
    copy_adapter(model, adapter)
    return list(model.lora_scales)


def copy_adapter(model: MegatronK3Model, adapter: Adapter) -> None:
    """Copy this rank's TP shard of `adapter`'s A and B into the model's attached LoRA modules (the same modules:
    AdapterError otherwise)."""
    if {f"{m}.weight" for m in adapter.weights} != set(model.lora_scales):
        raise AdapterError("the adapter adapts other modules than this trainer's")
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for module, (a, b) in adapter.weights.items():
            base = f"{module}.weight"
            target = model.lora_module(base)
            a_split, b_split = lora_splits(split_of(base))
            target.lora_A.weight.copy_(shard(f"{module}.lora_A", a, a_split, tp_rank, tp))
            target.lora_B.weight.copy_(shard(f"{module}.lora_B", b, b_split, tp_rank, tp))


def export_adapter(model: MegatronK3Model) -> Adapter:
    """The model's LoRA adapter, whole and fp32, on every rank (collective: all ranks call)."""
    if model.lora_spec is None:
        raise ValueError("the model carries no LoRA adapter (attach one with load_adapter)")
    tp_group = parallel_state.get_tensor_model_parallel_group()
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for base in model.lora_scales:
        target = model.lora_module(base)
        a, b = (p.detach() if split.tp_dim is None else _gather(p.detach(), split.tp_dim, tp_group, False)
                for split, p in zip(lora_splits(split_of(base)), (target.lora_A.weight, target.lora_B.weight)))
        weights[base.removesuffix(".weight")] = (a.to(torch.float32).clone(), b.to(torch.float32).clone())
    return Adapter(model.lora_spec, weights)


def save_adapter(model: MegatronK3Model, out: str | Path) -> Path:
    """`export_adapter`, written as a PEFT adapter directory from rank 0 (collective: all ranks call)."""
    adapter = export_adapter(model)
    path = Path(out)
    if dist.get_rank() == 0:
        write_adapter(adapter, path)
    dist.barrier()
    return path


def save_adapter_state(model: MegatronK3Model, out: str | Path) -> Path:
    """The trainer's adapter checkpoint: each TP rank of data-parallel replica 0 writes its own shard of A and B
    (`lora.state`; no gather), then all ranks meet at a barrier. `zerokl lora export` reassembles the shards."""
    if model.lora_spec is None:
        raise ValueError("the model carries no LoRA adapter (attach one with load_adapter)")
    if parallel_state.get_data_parallel_rank() == 0:
        tensors: dict[str, torch.Tensor] = {}
        tp_dims: dict[str, int] = {}
        for base in model.lora_scales:
            target, module = model.lora_module(base), base.removesuffix(".weight")
            for which, split in zip("AB", lora_splits(split_of(base))):
                name = tensor_name(module, which)
                tensors[name] = getattr(target, f"lora_{which}").weight
                if split.tp_dim is not None:
                    tp_dims[name] = split.tp_dim
        write_shard(out, model.lora_spec, tensors, tp_dims, parallel_state.get_tensor_model_parallel_rank(),
                    parallel_state.get_tensor_model_parallel_world_size())
    dist.barrier()
    return Path(out)


def gather_rank_weights(path: str | Path, cfg: TextConfig) -> dict[str, torch.Tensor]:
    """In one process, without torch.distributed: the whole tensors of a state `save_rank_weights` wrote into `path`
    (each TP-split one concatenated along its split dim in TP-rank order, the rest as stored), by official name."""
    roles = split_roles(cfg)
    files = sorted(Path(path).glob(RANK_WEIGHTS_FILE.format(rank="*")))
    if not files:
        raise CheckpointError(f"{path}: no {RANK_WEIGHTS_FILE.format(rank='*')} - not a state saved by several "
                              "Megatron processes")
    out = {}
    with contextlib.ExitStack() as stack:
        for name, holders in _index_rank_files(stack, files).items():
            dim = roles[name].tp_dim if name in roles else None
            # a tensor held whole (routed experts among them) has one writer, whichever its TP rank
            out[name] = torch.cat([h.get_tensor(name) for _, h in sorted(holders, key=lambda rh: rh[0])], dim) \
                if dim is not None else holders[0][1].get_tensor(name)
    return out
