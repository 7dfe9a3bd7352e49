"""MXFP4 experts and FP8 latents: zerokl's quantisers against the reference implementations, bit for bit.

References, named: compressed-tensors' MXFP4 quantiser (`calculate_qparams` for the E8M0 scales, then
`MXFP4PackedCompressor.compress`, the writer of `mxfp4-pack-quantized` checkpoints), vLLM's MXFP4 dequantiser
(`vllm.model_executor.layers.fused_moe.flashinfer_moe_ep._dequant_mxfp4_ue8m0_gran32`) and vLLM's FP8 quantiser
(`QuantFP8.forward_native`, per-tensor static scale 1.0, what K3's MLA layers use). Random tensors and edge values:
zeros, fp32 and bf16 subnormals, the largest finite values, every E2M1 rounding tie, negative zero.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity.config import ConfigError, load_model_config
from parity.quant import fp8, mxfp4


def _edge_rows() -> torch.Tensor:
    """[8, 64] fp32: rows of zeros, subnormals, huge values, E2M1 ties (at scale 1), tiny negatives, mixed signs."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # group max 6 -> scale 2^0
    rows = [
        torch.zeros(64),
        torch.full((64,), 1e-40) * torch.arange(1, 65),  # fp32 subnormals
        torch.full((64,), mxfp4.E2M1_MAX * 2.0 ** mxfp4.MAX_EXPONENT) * torch.linspace(-1, 1, 64),  # largest held
        torch.cat([ties, -ties]),
        torch.cat([torch.full((16,), -1e-3), torch.full((16,), 4.0)] * 2),  # negatives rounding to -0 beside 4.0
        torch.cat([torch.tensor([1.75] * 32), torch.tensor([7.0, -0.0] * 16)]),  # amax 1.75 bumps the exponent
        torch.full((64,), torch.finfo(torch.bfloat16).tiny / 8).float(),  # bf16 subnormal range
        torch.linspace(-448, 448, 64),
    ]
    return torch.stack(rows)


def _compressed_tensors(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
                            scale_dtype=torch.uint8)
    groups = w.reshape(w.shape[0], -1, 32)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    out = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale},
                                         QuantizationScheme(targets=["Linear"], weights=args))
    return out["weight_packed"], out["weight_scale"]


def _unsigned_zeros(packed: torch.Tensor) -> torch.Tensor:
    """The E2M1 codes (one per value) with -0 (code 8) written as +0."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1)
    return torch.where(codes == 8, 0, codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_matches_compressed_tensors_and_vllm(dtype: torch.dtype) -> None:
    from vllm.model_executor.layers.fused_moe.flashinfer_moe_ep import _dequant_mxfp4_ue8m0_gran32

    g = torch.Generator().manual_seed(0)
    w = torch.cat([torch.randn(32, 128, generator=g) * s for s in (1.0, 1e-3, 1e3)]).to(dtype)
    edges = _edge_rows()
    if dtype == torch.bfloat16:
        edges = edges[[0, 3, 4, 5, 6, 7]]  # no fp32-only magnitudes
    w = torch.cat([w, torch.cat([edges, edges], dim=1).to(dtype)])
    q = mxfp4.quantize(w)
    packed, scale = _compressed_tensors(w)
    assert torch.equal(q.scale, scale)
    # compressed-tensors writes an exact -0.0 input as +0 (0x0), vLLM's quantiser and zerokl keep the sign (0x8):
    # compare codes with the sign of zeros dropped, and the values exactly.
    assert torch.equal(_unsigned_zeros(q.packed), _unsigned_zeros(packed))
    assert torch.equal(q.dequantize(torch.bfloat16), _dequant_mxfp4_ue8m0_gran32(q.packed, q.scale))
    assert torch.equal(q.dequantize(torch.bfloat16), _dequant_mxfp4_ue8m0_gran32(packed, scale))


def test_mxfp4_edges_round_to_nearest_even_and_saturate() -> None:
    q = mxfp4.quantize(_edge_rows())
    values = q.dequantize(torch.float32)
    ties = values[3, :8]
    assert ties.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]  # ties to the even code
    assert torch.equal(values[0], torch.zeros(64)) and int(q.scale[0, 0]) == 0  # zero group: scale byte 0 (2^-127)
    assert torch.signbit(values[4, :16]).all() and (values[4, :16] == 0).all()  # -1e-3 beside 4.0 rounds to -0
    assert int(q.scale[5, 0]) - 127 == -1  # amax 1.75 rounds up at E2M1 precision: 2^(1 - 2)
    assert torch.isfinite(values).all() and values[2].abs().max() == mxfp4.E2M1_MAX * 2.0 ** mxfp4.MAX_EXPONENT


def test_mxfp4_requantising_dequantised_values_gives_the_same_bytes() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.cat([torch.randn(64, 96, generator=g) * 10 ** torch.randint(-6, 6, (64, 1), generator=g),
                   torch.cat([_edge_rows(), _edge_rows()[:, :32]], dim=1)])
    q = mxfp4.quantize(w)
    for dtype in (torch.float32, torch.bfloat16):
        again = mxfp4.quantize(q.dequantize(dtype))
        assert torch.equal(again.packed, q.packed) and torch.equal(again.scale, q.scale)


def test_mxfp4_refuses_non_finite_and_ragged_weights() -> None:
    w = torch.randn(4, 64)
    w[1, 7] = float("nan")
    with pytest.raises(mxfp4.QuantError, match="experts.3.w1.weight: holds NaN or inf"):
        mxfp4.quantize(w, "experts.3.w1.weight")
    with pytest.raises(mxfp4.QuantError, match="multiple of 32"):
        mxfp4.quantize(torch.randn(4, 48))
    with pytest.raises(mxfp4.QuantError, match="would dequantise to inf"):
        mxfp4.quantize(torch.full((1, 32), torch.finfo(torch.float32).max))


def test_fake_quantize_is_the_synced_value_with_a_straight_through_gradient() -> None:
    w = torch.randn(8, 64, requires_grad=True)
    y = mxfp4.fake_quantize(w)
    assert y.dtype == torch.float32 and torch.equal(y, mxfp4.quantize(w.detach()).dequantize(torch.float32))
    (y * torch.arange(64.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(64.0).expand(8, 64))


def test_fake_quantize_reads_nothing_back_and_leaves_value_checks_to_the_sync() -> None:
    """The trainer's fake quantisation (every forward) skips the value checks' host reads: a NaN master trains on
    (the next sync's checked quantisation refuses it: tests/engines/test_ppo.py); a shape MXFP4 cannot hold is still
    refused at once."""
    w = torch.randn(4, 64)
    w[1, 7] = float("nan")
    mxfp4.fake_quantize(w, "experts.3.w1.weight")
    with pytest.raises(mxfp4.QuantError, match="holds NaN or inf"):
        mxfp4.quantize(w, "experts.3.w1.weight")
    with pytest.raises(mxfp4.QuantError, match="multiple of 32"):
        mxfp4.fake_quantize(torch.randn(4, 48))


def test_fp8_matches_vllm_quant_fp8() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    g = torch.Generator().manual_seed(2)
    e4m3 = torch.finfo(torch.float8_e4m3fn)
    edges = torch.tensor([0.0, -0.0, e4m3.max, -e4m3.max, 1e6, -1e6, 1.0625, 1.1875, e4m3.tiny / 2, e4m3.tiny / 16,
                          2.0 ** -10, 464.0, 0.5 * (416 + 448)])
    x = torch.cat([torch.randn(4000, generator=g) * s for s in (1.0, 30.0, 1e-3)] + [edges])
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        with set_current_vllm_config(VllmConfig()):
            ref, _ = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR).forward_native(
                xd.view(1, -1), torch.tensor([fp8.LATENT_SCALE]))
        got = fp8.quantize(xd)
        assert torch.equal(got.view(torch.uint8), ref.view(-1).view(torch.uint8)), dtype
        assert torch.equal(fp8.round_trip(xd), fp8.dequantize(got, dtype))


@pytest.mark.parametrize(("edit", "says"), [
    (("torch_dtype: bfloat16", "torch_dtype: float16"), "torch_dtype must be one of ['bfloat16', 'float32']"),
    (("format: mxfp4-pack-quantized\n  quantization_status", "format: nvfp4-pack-quantized\n  quantization_status"),
     "format 'mxfp4-pack-quantized'"),
    (("kv_cache_scheme: {num_bits: 8,", "kv_cache_scheme: {num_bits: 4,"), "only FP8"),
    (("moe_intermediate_size: 64", "moe_intermediate_size: 72"), "multiples of 32"),
])
def test_quantised_configs_are_checked(edit: tuple[str, str], says: str, tmp_path: Path) -> None:
    """A checkpoint config zerokl cannot compute in as written fails at load, naming the key."""
    text = (Path(__file__).resolve().parents[2] / "configs" / "k3-tiny-mxfp4.yaml").read_text()
    assert text.count(edit[0]) == 1
    (tmp_path / "c.yaml").write_text(text.replace(*edit))
    with pytest.raises(ConfigError) as err:
        load_model_config(tmp_path / "c.yaml")
    assert says in str(err.value)


def test_merge_into_an_mxfp4_checkpoint_keeps_its_experts_packed(tmp_path: Path) -> None:
    """`zerokl lora merge --dtype float32` on an MXFP4 checkpoint re-stores the bf16 tensors, not the uint8 codes and
    scales, which stay byte for byte."""
    from lora.adapter import save_adapter
    from lora.init import random_adapter
    from lora.merge import merge_checkpoint
    from parity.io.checkpoint import init_checkpoint, load_checkpoint

    repo = Path(__file__).resolve().parents[2]
    ckpt = init_checkpoint(repo / "configs" / "k3-tiny-mxfp4.yaml", tmp_path / "ckpt", seed=0)
    cfg, before = load_checkpoint(ckpt)
    adapter = save_adapter(random_adapter(cfg.text, 4, seed=1), tmp_path / "adapter")
    merged_cfg, after = load_checkpoint(merge_checkpoint(ckpt, adapter, tmp_path / "merged", dtype="float32"))
    assert merged_cfg.text.torch_dtype == "float32" and merged_cfg.text.expert_format == "mxfp4"
    packed = [n for n in before if n.endswith(("weight_packed", "weight_scale"))]
    assert packed and all(after[n].dtype == torch.uint8 and torch.equal(after[n], before[n]) for n in packed)


def test_quantize_many_gives_quantize_bytes_and_names_the_first_bad_tensor() -> None:
    """Batched quantisation (tensors of one shape stacked, one host read for the checks) gives every tensor the bytes
    `quantize` gives it alone, in the given order; a NaN or an overflow is refused naming the first offender."""
    g = torch.Generator().manual_seed(4)
    tensors = {f"e{i}": torch.randn(6, 64, generator=g) * 10.0 ** (i - 2) for i in range(5)}
    tensors["other"] = torch.randn(3, 96, generator=g).to(torch.bfloat16)
    many = mxfp4.quantize_many(tensors)
    assert list(many) == list(tensors)
    for name, t in tensors.items():
        one = mxfp4.quantize(t, name)
        assert torch.equal(many[name].packed, one.packed) and torch.equal(many[name].scale, one.scale), name
    bad = dict(tensors)
    bad["e3"] = bad["e3"].clone()
    bad["e3"][2, 5] = float("inf")
    bad["other"] = torch.full((3, 96), torch.finfo(torch.float32).max)
    with pytest.raises(mxfp4.QuantError, match="^e3: holds NaN or inf"):
        mxfp4.quantize_many(bad)
    with pytest.raises(mxfp4.QuantError, match="^other: values above .* would dequantise to inf"):
        mxfp4.quantize_many({**tensors, "other": bad["other"]})
    assert mxfp4.quantize_many({}) == {}


def test_packing_is_compressed_tensors_layout() -> None:
    """The packed bytes `quantize` writes from its codes equal compressed-tensors' `pack_fp4_to_uint8` of the same
    E2M1 values (every code, both nibbles, -0 included)."""
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(8)) * 3
    w[0, :16] = torch.tensor([0.0, -0.0, 0.2, -0.2, 0.5, -0.5, 1.0, -1.0, 1.5, -1.5, 2.0, -2.0, 3.0, -3.0, 4.0, -6.0])
    q = mxfp4.quantize(w)
    values = q.dequantize(torch.float32) / torch.exp2(q.scale.float() - 127).repeat_interleave(32, dim=1)
    assert torch.equal(q.packed, mxfp4._fp4_helpers().pack_fp4_to_uint8(values))


def test_quantize_many_stacks_at_most_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors of one shape beyond the stack budget are quantised in several stacks, with the same bytes."""
    monkeypatch.setattr(mxfp4, "STACK_ELEMENTS", 3 * 4 * 64)
    stacked: list[int] = []
    real = mxfp4.quantize
    monkeypatch.setattr(mxfp4, "quantize", lambda w, *a, **k: stacked.append(w.shape[0]) or real(w, *a, **k))
    tensors = {f"e{i}": torch.randn(4, 64, generator=torch.Generator().manual_seed(i)) for i in range(7)}
    many = mxfp4.quantize_many(tensors)
    assert stacked == [12, 12, 4]
    for name, t in tensors.items():
        assert torch.equal(many[name].packed, real(t).packed) and torch.equal(many[name].scale, real(t).scale)
