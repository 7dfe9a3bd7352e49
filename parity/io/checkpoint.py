"""Official-format K3 checkpoints: seeded random initialisation, sharded safetensors I/O.

A checkpoint directory holds `config.json`, `generation_config.json`, `model-0000i-of-0000n.safetensors`
shards with `model.safetensors.index.json`, and a locally built tokenizer (`parity.io.tokenizer`).
Tensor names and shapes come from `parity.weights` (text) and `parity.io.vision` (vision tower).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parity import dspark
from parity.config import COMPUTE_DTYPES, ConfigError, ModelConfig, load_model_config, read_config
from parity.dspark import DSparkConfig, dspark_specs, parse_dspark_config
from parity.quant import mxfp4
from parity.weights import (WeightSpec, is_quantized, mtp_specs, official_name, pack_quantized, packed_names,
                            stored_mtp_specs, stored_specs, text_specs, written_name)
from parity.io.atomic import atomic_dir
from parity.io.tokenizer import build_tokenizer
from parity.io.vision import vision_specs

INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                      "F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32,
                      "I64": torch.int64, "BOOL": torch.bool}  # a header's dtype names
DTYPES = COMPUTE_DTYPES  # a checkpoint's torch_dtype is its compute dtype


class CheckpointError(ValueError):
    """A checkpoint directory that is missing files or tensors; the message names what."""


def all_specs(cfg: ModelConfig) -> dict[str, WeightSpec]:
    """Every tensor of the checkpoint as stored: text model (`stored_specs`: MXFP4 experts packed), its MTP draft
    layers (`stored_mtp_specs`, when the config has them), then vision tower and projector (K3 only)."""
    specs = stored_specs(cfg.text) | stored_mtp_specs(cfg.text)
    if cfg.vision is not None:
        specs.update(vision_specs(cfg.vision, cfg.text.hidden_size))
    return specs


def _init_tensor(spec: WeightSpec, gen: torch.Generator) -> torch.Tensor:
    """Draw one tensor in float32 with a per-kind scale chosen so activations stay O(1) through depth."""
    shape = spec.shape
    if spec.init == "linear":
        return torch.randn(shape, generator=gen) / math.sqrt(spec.fan_in)
    if spec.init == "embed":
        return torch.randn(shape, generator=gen)
    if spec.init == "norm":
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if spec.init == "bias":
        return 0.01 * torch.randn(shape, generator=gen)
    if spec.init == "res_proj":
        return torch.randn(shape, generator=gen) / math.sqrt(spec.fan_in)
    if spec.init == "a_log":
        return torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
    if spec.init == "dt_bias":
        dt = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if spec.init == "conv":
        bound = 1.0 / math.sqrt(spec.fan_in)
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    raise ConfigError(f"unknown init kind {spec.init!r}")


def random_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Seeded random weights for every tensor of `all_specs(cfg)`; fp32 specs stay fp32, the rest in `dtype`, MXFP4
    experts quantised from their fp32 draw (`parity.quant.mxfp4.quantize`, stored packed).

    Invariant: the same (config, seed, dtype) gives the same bits, independent of tensor order elsewhere,
    because each tensor draws from its own generator seeded by (seed, name) (the logical name for a packed one).
    """
    logical = text_specs(cfg.text) | mtp_specs(cfg.text)
    if cfg.vision is not None:
        logical.update(vision_specs(cfg.vision, cfg.text.hidden_size))
    out: dict[str, torch.Tensor] = {}
    for name, spec in logical.items():
        gen = torch.Generator().manual_seed(_name_seed(seed, name))
        t = _init_tensor(spec, gen)
        if is_quantized(cfg.text, name):
            q = mxfp4.quantize(t, name)
            packed, scale = packed_names(name)
            out[packed], out[scale] = q.packed, q.scale
        else:
            out[name] = t if spec.fp32 else t.to(dtype)
    return out


def _name_seed(seed: int, name: str) -> int:
    h = 1469598103934665603
    for ch in f"{seed}:{name}".encode():
        h = ((h ^ ch) * 1099511628211) % (1 << 63)
    return h


def check_new_dir(out: Path) -> None:
    """A checkpoint is written only into a new or empty directory: CheckpointError naming `out` otherwise."""
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out} exists and is not empty; choose a new --out directory")


def save_checkpoint(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    out: str | Path,
    shard_bytes: int = 2 << 20,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write config, generation config, tokenizer and sharded safetensors with an index.

    Writes into a temporary sibling directory and renames it into place, so a failure never
    leaves a half-written checkpoint at `out`. Refuses to overwrite a non-empty directory. MXFP4 weights given
    unpacked (a trainer's export) are quantised first (`parity.weights.pack_quantized`).
    """
    out = Path(out)
    weights = pack_quantized(cfg.text, weights)
    check_new_dir(out)
    with atomic_dir(out) as tmp:
        expected = all_specs(cfg)
        missing = sorted(set(expected) - set(weights))
        extra = sorted(set(weights) - set(expected))
        if missing or extra:
            raise CheckpointError(f"weights do not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
        write_tensors(tmp, {written_name(cfg.text, n): t for n, t in weights.items()}, shard_bytes, progress)
        (tmp / "config.json").write_text(json.dumps(cfg.raw, indent=2))
        t = cfg.text
        gen_cfg = {"bos_token_id": t.bos_token_id, "eos_token_id": t.eos_token_id, "pad_token_id": t.pad_token_id,
                   "do_sample": True, "temperature": 1.0}
        (tmp / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
        build_tokenizer(t.vocab_size, tmp)
        if cfg.vision is not None:
            (tmp / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(cfg.vision.raw), indent=2))
    return out


def preprocessor_config(vision: dict) -> dict:
    """K3's image-processor config (`KimiK25FusedVisionProcessor`); vLLM builds the processor while it
    validates a K3 model config, so a checkpoint without this file cannot be opened. Values shape
    image preprocessing only, never weights."""
    merge = vision.get("merge_kernel_size", [2, 2])
    side = vision.get("init_pos_emb_height", 64)
    media_proc_cfg = {
        "patch_size": vision.get("patch_size", 14),
        "merge_kernel_size": merge[0] if isinstance(merge, list) else merge,
        "temporal_merge_kernel_size": vision.get("init_pos_emb_time", 4),
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "in_patch_limit": side * vision.get("init_pos_emb_width", 64),
        "patch_limit_on_one_side": side,
        "fixed_output_tokens": None,
        "in_patch_limit_each_frame": None,
        "in_patch_limit_video": None,
    }
    return {"image_processor_type": "KimiK25FusedVisionProcessor", "media_proc_cfg": media_proc_cfg}


def write_tensors(tmp: Path, tensors: dict[str, torch.Tensor], shard_bytes: int,
                  progress: Callable[[str], None] | None) -> None:
    """`model-0000i-of-0000n.safetensors` shards of at most about `shard_bytes` each, in the given order, and their
    index, into the directory `tmp`."""
    shards = _plan_shards(tensors, shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # a view (one expert's packed bytes of a batched quantisation) is written from a copy of its own: safetensors
        # refuses tensors that share storage
        save_file({n: tensors[n].clone() if tensors[n]._base is not None else tensors[n].contiguous() for n in names},
                  str(tmp / fname), metadata={"format": "pt"})
        for n in names:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
        if progress:
            progress(f"wrote {fname} ({len(names)} tensors)")
    (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _plan_shards(weights: dict[str, torch.Tensor], shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def load_checkpoint(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config and every tensor under its official name (`parity.weights.official_name`: either spelling vLLM's
    K3 loader reads). Fails (`CheckpointError`, naming the file or tensor and what to do) on an unreadable or missing
    shard, an index and shards that disagree either way, a missing, unexpected, doubly stored or misshapen tensor,
    and a tensor holding NaN or inf."""
    reader = open_checkpoint(path)
    return reader.cfg, {name: reader.read(name) for name in reader.names}


def open_checkpoint(path: str | Path) -> CheckpointReader:
    """A model checkpoint directory opened without reading its tensors (`CheckpointReader`), checked as
    `load_checkpoint` checks it but for the values, which are checked as they are read."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path} is not a checkpoint directory (no config.json)")
    cfg = load_model_config(path)
    return CheckpointReader(path, all_specs(cfg), official_name, cfg)


class CheckpointReader:
    """A checkpoint directory's tensors by name, from the headers of the shards its index lists (or of every
    *.safetensors without one): exactly the `expected` tensors under `rename(stored name)`, each stored once and of its
    shape; data read only when asked, whole or a contiguous part along one dim (a safetensors slice), and refused when
    it holds NaN or inf. `bytes_read` counts the bytes read so far."""

    def __init__(self, path: Path, expected: dict[str, WeightSpec], rename: Callable[[str], str],
                 cfg: ModelConfig | None = None):
        self.path, self.cfg, self.bytes_read = path, cfg, 0
        index = _read_index(path)
        files = sorted(set(index.values())) if index is not None else sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path} has no *.safetensors files")
        self._where: dict[str, tuple[Any, str]] = {}
        for fname in files:
            shard, stored = _open_shard(path, fname, index)
            for s in stored:
                name = rename(s)
                if name in self._where:
                    raise CheckpointError(f"{path}: {name} is stored twice (once as {s})")
                self._where[name] = (shard, s)
        missing = sorted(set(expected) - set(self._where))
        extra = sorted(set(self._where) - set(expected))
        if missing:
            raise CheckpointError(f"{path}: {len(missing)} tensors missing, first: {missing[0]}")
        if extra:
            raise CheckpointError(f"{path}: {len(extra)} unexpected tensors, first: {extra[0]}")
        for name, spec in expected.items():
            shape = self.shape(name)
            if shape != spec.shape:
                raise CheckpointError(f"{path}: {name} has shape {shape}, config says {spec.shape}")
        self.names = list(self._where)  # in the order the shards store them

    def shape(self, name: str) -> tuple[int, ...]:
        shard, stored = self._where[name]
        return tuple(shard.get_slice(stored).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        shard, stored = self._where[name]
        return SAFETENSORS_DTYPES[shard.get_slice(stored).get_dtype()]

    def read(self, name: str, dim: int | None = None, start: int = 0, length: int = 0) -> torch.Tensor:
        """Tensor `name`, or its `length` entries from `start` along `dim`."""
        from safetensors import SafetensorError

        shard, stored = self._where[name]
        try:
            if dim is None:
                t = shard.get_tensor(stored)
            else:
                t = shard.get_slice(stored)[(slice(None),) * dim + (slice(start, start + length),)]
        except SafetensorError as e:
            raise CheckpointError(f"{self.path}: {name} cannot be read, the shard is truncated or corrupt ({e})") \
                from None
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{self.path}: {name} holds NaN or inf values; a checkpoint to roll out and train "
                                  "must be finite")
        self.bytes_read += t.numel() * t.element_size()
        return t


def _read_index(path: Path) -> dict[str, str] | None:
    """The index's tensor -> shard map, or None without an index."""
    index_path = path / INDEX_FILE
    if not index_path.exists():
        return None
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: not a safetensors index with a weight_map ({e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_path}: weight_map must map tensor names to shard file names")
    return weight_map


def _open_shard(path: Path, fname: str, index: dict[str, str] | None) -> tuple[Any, list[str]]:
    """One shard opened (its header read) and its stored names; it must exist, be readable and hold exactly the
    tensors the index assigns to it."""
    from safetensors import SafetensorError

    file = path / fname
    if not file.is_file():
        raise CheckpointError(f"{file}: the index names this shard but it is not on disk (an incomplete copy?)")
    try:
        shard = safe_open(str(file), framework="pt")
        stored = list(shard.keys())
    except SafetensorError as e:
        raise CheckpointError(f"{file}: not a readable safetensors file, truncated or corrupt ({e})") from None
    if index is not None:
        listed = {n for n, name in index.items() if name == fname}
        unlisted, absent = sorted(set(stored) - listed), sorted(listed - set(stored))
        if unlisted:
            raise CheckpointError(f"{file}: holds {unlisted[0]} (and {len(unlisted) - 1} more), which the "
                                  f"index {INDEX_FILE} does not list; the two disagree")
        if absent:
            raise CheckpointError(f"{path / INDEX_FILE}: lists {absent[0]} (and {len(absent) - 1} more) in "
                                  f"{fname}, which does not hold it; the two disagree")
    return shard, stored


def init_checkpoint(config_path: str | Path, out: str | Path, seed: int, dtype: str | None = None,
                    progress: Callable[[str], None] | None = None) -> Path:
    """`zerokl init-checkpoint`: a seeded random-weight checkpoint in the official format, stored (and so
    computed) in `dtype`, by default the config's `torch_dtype`: a K3 / Kimi Linear model, or (`model_type:
    k3_dspark`) a DSpark draft checkpoint."""
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    raw = read_config(config_path)
    if raw.get("model_type") == dspark.MODEL_TYPE:
        draft = parse_dspark_config(dict(raw, torch_dtype=dtype or raw.get("torch_dtype", "float32")))
        return save_dspark_checkpoint(draft, dspark_weights(draft, seed), out, progress=progress)
    cfg = load_model_config(config_path)
    dtype = dtype or cfg.text.torch_dtype
    raw = dict(cfg.raw)
    raw["torch_dtype"] = dtype
    cfg = ModelConfig(cfg.model_type, cfg.text, cfg.vision, raw)
    weights = random_weights(cfg, seed, DTYPES[dtype])
    if progress:
        progress(f"initialised {len(weights)} tensors ({sum(t.numel() for t in weights.values()) / 1e6:.2f}M params)")
    return save_checkpoint(cfg, weights, out, progress=progress)


# --- DSpark drafts --------------------------------------------------------------------------------

def dspark_weights(cfg: DSparkConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random draft weights in the draft's dtype, one generator per (seed, name), as `random_weights`."""
    return {name: _init_tensor(spec, torch.Generator().manual_seed(_name_seed(seed, name))).to(cfg.dtype)
            for name, spec in dspark_specs(cfg).items()}


def save_dspark_checkpoint(cfg: DSparkConfig, weights: dict[str, torch.Tensor], out: str | Path,
                           shard_bytes: int = 2 << 20, progress: Callable[[str], None] | None = None) -> Path:
    """A DSpark draft checkpoint directory: its config.json (with `architectures` set to vLLM's name) and sharded
    safetensors under the names vLLM's `K3DSparkForCausalLM` loads; written atomically, never over a non-empty
    directory. The draft has no embedding, lm_head or tokenizer of its own: vLLM shares the target's."""
    out = Path(out)
    check_new_dir(out)
    expected = dspark_specs(cfg)
    if set(weights) != set(expected):
        raise CheckpointError(f"draft weights do not match the config: missing {sorted(set(expected) - set(weights))[:5]}"
                              f", unexpected {sorted(set(weights) - set(expected))[:5]}")
    with atomic_dir(out) as tmp:
        write_tensors(tmp, {n: weights[n] for n in expected}, shard_bytes, progress)
        (tmp / "config.json").write_text(json.dumps(dict(cfg.raw, architectures=[dspark.ARCHITECTURE]), indent=2))
    return out


def load_dspark_checkpoint(path: str | Path) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    """A DSpark draft's config and tensors, checked as `load_checkpoint` checks a model's."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path} is not a checkpoint directory (no config.json)")
    cfg = parse_dspark_config(read_config(path), str(path / "config.json"))
    reader = CheckpointReader(path, dspark_specs(cfg), lambda name: name)
    return cfg, {name: reader.read(name) for name in reader.names}
