"""K3's vision path against references nobody here wrote the numerics of: `parity.vision.VisionTower` (invariant
kernels, fp32) against the float64 reference `parity.reference.vision` (written from vLLM's `kimi_k25_vit.py`), that
reference against transformers' MoonViT of Kimi K2.5 (`Kimi_K25VisionModel` + `Kimi_K25MultimodalProjection`, its own
rotate-half RoPE fed through its own checkpoint permutation `PermuteForRope`), and `parity.image` against vLLM's
`KimiK25FusedVisionProcessor` and `convert_image_mode` bit for bit. Nothing here starts an engine.

transformers' MoonViT cannot take K3's variant (LayerNorm, biases, bicubic position resize, `patchmerger` v1 and
head_dim = hidden / heads are hard-coded), so it is compared on a K2.5-style `vision_config` (`K25_VISION`) that
`parity.io.vision` and `parity.vision` also support. vLLM's own `MoonViT3dPretrainedModel` is not run: its layers
(`QKVParallelLinear`, `MMEncoderAttention`, `is_vit_use_data_parallel`) need vLLM's tensor-parallel group, i.e. a
distributed init, to be built at all.

Bounds (fp32 tower vs float64, stated once; outputs have max |y| ~ 3..8):
  F32_ATOL = F32_RTOL = 2e-5   fp32 round-off (u = 6e-8) through the patch GEMM (K = 588), 2 blocks, the merger and
                               the projector's RMSNorm, plus the RoPE angles, fp32 products x * f of up to ~15 rad
                               (|err| <= 15 u ~ 1e-6 rad); measured max |Δ| <= 3.6e-6 (K3 config, vs the reference)
                               and <= 1.7e-6 (K2.5 config, vs transformers); each semantic slip tried moves the output
                               >= 50x the bound (`test_comparison_is_sensitive`: the GELU variants ~1.2e-3, the rest
                               >= 0.07).
  HF_ATOL = HF_RTOL = 1e-5     transformers in float64 still rotates q / k in fp32 (`apply_rotary_pos_emb_vision` casts
                               to float, fp32 inverse frequencies); measured max |Δ| <= 9.7e-7 vs the reference.
  BF16: atol 0.1, rtol 0.05    bf16 (u = 2^-8) through the same path; the bf16 tower is within 0.04 of the reference
                               run with the eps the tower uses (max |y| ~ 4).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

import parity.reference.vision as refvision
from parity.config import VisionConfig, load_model_config
from parity.image import ImageProcessing, open_image, to_rgb
from parity.io.checkpoint import load_checkpoint, preprocessor_config
from parity.io.vision import vision_specs
from parity.kernels import get_kernels
from parity.reference.vision import interpolation_matrix, torch_rmsnorm_eps, vision_forward
from parity.vision import ImagePatches, TowerShape, VisionTower

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny float64 ops (conftest.py)

F64 = torch.float64
F32_ATOL = F32_RTOL = 2e-5
HF_ATOL = HF_RTOL = 1e-5
BF16_ATOL, BF16_RTOL = 0.1, 0.05
ROPE_SIDE = 32  # the towers' RoPE table side: >= every grid side below
REPO = Path(__file__).resolve().parents[2]

# Kimi K2.5's tower at k3-tiny's sizes: what transformers' MoonViT implements (and vLLM's Kimi_K25VisionConfig path).
K25_VISION = {
    "patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8, "init_pos_emb_time": 4,
    "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "vt_hidden_size": 64, "vt_intermediate_size": 128,
    "qkv_hidden_size": 64, "merge_kernel_size": [2, 2], "norm_type": "layernorm", "attn_bias": True,
    "linear_bias": True, "patch_embed_proj_bias": True, "mm_projector_type": "patchmerger",
    "pos_emb_interpolation_mode": "bicubic",
}
K25_TEXT_HIDDEN = 96

# (width, height) of noise images fed through the checkpoint's preprocessing (k3-tiny: 8 x 8 patches at most):
IMAGE_SIZES = [
    (112, 112),  # exactly the 8 x 8 position table: vLLM skips the resize there
    (100, 40),   # non-square, padded to 112 x 56 -> grid 4 x 8
    (29, 57),    # tiny, padded -> grid 6 x 4
    (1000, 700), # scaled down to the 64-patch limit, padded -> grid 6 x 8
]
# grids beyond what that preprocessing makes: upsampling the table (past 8), and an extreme aspect ratio
PATCH_GRIDS = [(12, 10), (2, 16)]



def vision_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {n: t for n, t in tensors.items() if n.startswith(("vision_tower.", "mm_projector."))}


def with_random_norms(weights: dict[str, Tensor], seed: int) -> dict[str, Tensor]:
    """The init draws norm weights as 1 + 0.1 N(0, 1), close to the identity; 1 + 0.5 N(0, 1) makes a norm weight that
    is skipped, misplaced or applied twice show. (Linear weights are N(0, 1/fan_in), the position table N(0, 1): both
    already far from trivial.)"""
    gen = torch.Generator().manual_seed(seed)
    out = dict(weights)
    for name, t in weights.items():
        if name.endswith(("norm0.weight", "norm1.weight", "final_layernorm.weight", "post_norm.weight")):
            out[name] = (1.0 + 0.5 * torch.randn(t.shape, generator=gen)).to(t.dtype)
    return out


def tower(vision: VisionConfig, weights: dict[str, Tensor], dtype: torch.dtype) -> VisionTower:
    return VisionTower(TowerShape.from_config(vision, ROPE_SIDE), {n: t.to(dtype) for n, t in weights.items()},
                       get_kernels("invariant"), dtype)


def report_close(actual: Tensor, expected: Tensor, rtol: float, atol: float, what: str) -> None:
    """torch.testing.assert_close in float64, the measured max |Δ| and max |Δ| / max |expected| in the message."""
    diff = (actual.to(F64) - expected.to(F64)).abs()
    worst = float(diff.max())
    measured = f"{what}: max |Δ| {worst:.2e}, max |Δ| / max |y| {worst / float(expected.abs().max()):.2e}"
    print(measured)
    torch.testing.assert_close(actual.to(F64), expected.to(F64), rtol=rtol, atol=atol, msg=lambda m: f"{measured}\n{m}")


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def random_patches(h: int, w: int, seed: int, patch: int = 14) -> ImagePatches:
    gen = torch.Generator().manual_seed(seed)
    return ImagePatches(torch.randn(h * w, 3, patch, patch, generator=gen), (1, h, w), (2, 2))


# --- K3's tower: parity.vision vs the float64 reference --------------------------------------------------------------


@pytest.fixture(scope="module")
def k3(k3_tiny: Path) -> SimpleNamespace:
    """k3-tiny (fp32) vision tensors with random norm weights, its config and its preprocessing."""
    cfg, tensors = load_checkpoint(k3_tiny)
    weights = with_random_norms(vision_tensors(tensors), seed=11)
    return SimpleNamespace(vision=cfg.vision, weights=weights, processing=ImageProcessing.from_checkpoint(k3_tiny),
                           tower=tower(cfg.vision, weights, torch.float32))


def k3_images(k3: SimpleNamespace) -> list[tuple[str, ImagePatches]]:
    cases = [(f"image {w}x{h}", k3.processing(noise_image(w, h, seed=w * 7 + h))) for w, h in IMAGE_SIZES]
    return cases + [(f"grid {h}x{w}", random_patches(h, w, seed=h * 31 + w)) for h, w in PATCH_GRIDS]


def test_reference_interpolation_is_torch_interpolate() -> None:
    """The reference's hand-written resize (`interpolation_matrix`) equals `F.interpolate` (what vLLM calls) in
    float64, up and down, square or not, both modes."""
    table = torch.randn(8, 6, 5, dtype=F64, generator=torch.Generator().manual_seed(0))
    for mode in ("bilinear", "bicubic"):
        for h, w in [(1, 1), (2, 2), (4, 9), (8, 6), (12, 10), (3, 17), (16, 2)]:
            want = F.interpolate(table.permute(2, 0, 1)[None], size=(h, w), mode=mode)[0].permute(1, 2, 0)
            got = torch.einsum("ia,jb,abd->ijd", interpolation_matrix(h, 8, mode), interpolation_matrix(w, 6, mode),
                               table)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-13)


def test_tower_matches_reference(k3: SimpleNamespace) -> None:
    """`VisionTower` (invariant kernels, fp32) = the float64 reference, within F32 bounds, on padded, non-square,
    scaled-down and table-sized images and on grids that upsample the position table."""
    eps = torch_rmsnorm_eps(torch.float32)
    for what, image in k3_images(k3):
        ours = k3.tower(image)
        ref = vision_forward(k3.weights, k3.vision, image.pixel_values, image.grid, eps)
        assert ours.dtype == torch.float32 and ours.shape == (image.num_tokens, 256)
        report_close(ours, ref, F32_RTOL, F32_ATOL, f"K3 fp32 tower vs reference, {what}")


def _neox_rotate(x: Tensor, angles: Tensor) -> Tensor:
    """RoPE in the rotate-half layout: pair j = (x[j], x[j + d/2])."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


_ROPE_ANGLES = refvision.rope2d_angles


def _yx_angles(head_dim: int, h: int, w: int) -> Tensor:
    """The 2D RoPE angles with x and y swapped (pair 2i rotated by the row, 2i + 1 by the column)."""
    a = _ROPE_ANGLES(head_dim, h, w)
    return a.view(h * w, -1, 2).flip(-1).reshape(h * w, -1)


@pytest.mark.parametrize("variant", ["bicubic", "rope_neox", "rope_yx", "mlp_gelu_erf", "projector_gelu_tanh",
                                     "bf16_dtype_eps", "merge_column_major"])
def test_comparison_is_sensitive(k3: SimpleNamespace, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference with one semantic detail changed lies >= 50x the F32 bound away from the tower: the comparison
    above would catch that slip. (The interpolation mode only matters on a resized grid, the RoPE x/y order only on a
    non-square one: the case is 6 x 8 patches.)"""
    image = k3.processing(noise_image(1000, 700, seed=1))
    vision, eps = k3.vision, torch_rmsnorm_eps(torch.float32)
    if variant == "bicubic":
        vision = VisionConfig({**k3.vision.raw, "pos_emb_interpolation_mode": "bicubic"})
    elif variant == "rope_neox":
        monkeypatch.setattr(refvision, "rotate_pairs", _neox_rotate)
    elif variant == "rope_yx":
        monkeypatch.setattr(refvision, "rope2d_angles", _yx_angles)
    elif variant == "mlp_gelu_erf":
        monkeypatch.setattr(refvision, "gelu_tanh", refvision.gelu_erf)
    elif variant == "projector_gelu_tanh":
        monkeypatch.setattr(refvision, "gelu_erf", refvision.gelu_tanh)
    elif variant == "bf16_dtype_eps":
        eps = torch.finfo(torch.bfloat16).eps
    elif variant == "merge_column_major":
        real = refvision.merge_windows
        monkeypatch.setattr(refvision, "merge_windows",
                            lambda x, h, w, merge: real(x, h, w, merge)[:, [0, 2, 1, 3]])
    ref = vision_forward(k3.weights, vision, image.pixel_values, image.grid, eps)
    diff = float((k3.tower(image).to(F64) - ref).abs().max())
    print(f"variant {variant}: max |Δ| {diff:.2e}")
    assert diff > 50 * F32_ATOL, f"{variant}: the tower is within {diff:.2e} of the changed reference"


def test_rmsnorm_eps_is_torch_default() -> None:
    """`torch_rmsnorm_eps` is what `nn.RMSNorm(dim)` (eps=None, vLLM's tower norms) adds: fp32's machine epsilon for
    fp32 and bf16 inputs alike (the opmath type's), not bf16's. Rows of mean square ~1e-4 make the two visible."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (1e-2 * torch.randn(8, 64, generator=gen)).to(dtype)
        with torch.no_grad():
            got = torch.nn.RMSNorm(64).to(dtype)(x).to(F64)
        xd = x.to(F64)
        for eps, same in ((torch_rmsnorm_eps(dtype), True), (torch.finfo(dtype).eps, dtype == torch.float32)):
            want = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
            assert (float((got - want).abs().max()) < 2e-2) == same, (dtype, eps)


def test_bf16_tower_matches_reference_on_small_activations(k3_tiny_mxfp4: Path) -> None:
    """The bf16 tower against the reference with the eps vLLM's `nn.RMSNorm(dim)` uses in bf16, on activations of
    RMS ~0.03 (patch and position weights scaled down), where an eps of 2^-7 instead of 2^-23 changes every norm."""
    cfg, tensors = load_checkpoint(k3_tiny_mxfp4)
    weights = vision_tensors(tensors)
    for name in ("vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight"):
        weights[name] = (weights[name].float() * 0.03).to(torch.bfloat16)
    image = random_patches(6, 8, seed=5)
    ours = tower(cfg.vision, weights, torch.bfloat16)(image)
    ref = vision_forward(weights, cfg.vision, image.pixel_values, image.grid, torch_rmsnorm_eps(torch.bfloat16))
    report_close(ours, ref, BF16_RTOL, BF16_ATOL, "K3 bf16 tower vs reference (small activations)")


# --- K2.5's tower: the reference and parity.vision vs transformers' MoonViT ------------------------------------------


@pytest.fixture(scope="module")
def k25() -> SimpleNamespace:
    """A K2.5-style tower: random weights for every `vision_specs` tensor (biases N(0, 0.3^2), norms 1 + 0.5 N(0, 1),
    linears N(0, 1/fan_in), position table N(0, 1)), loaded into transformers' model by its own conversion rules
    (`conversion_mapping` "kimi_k25": renames, wqkv chunked into q / k / v, q and k permuted by `PermuteForRope`)."""
    modeling = pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
    from transformers.core_model_loading import PermuteForRope
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig

    vision = VisionConfig(dict(K25_VISION))
    gen = torch.Generator().manual_seed(3)
    weights: dict[str, Tensor] = {}
    for name, spec in vision_specs(vision, K25_TEXT_HIDDEN).items():
        draw = torch.randn(spec.shape, generator=gen)
        weights[name] = {"linear": draw / math.sqrt(spec.fan_in), "norm": 1.0 + 0.5 * draw,
                         "bias": 0.3 * draw}.get(spec.init, draw)

    hf_cfg = Kimi_K25VisionConfig(
        patch_size=14, pos_emb_height=8, pos_emb_width=8, pos_emb_time=4, num_attention_heads=2, num_hidden_layers=2,
        hidden_size=64, intermediate_size=128, hidden_act="gelu_pytorch_tanh", merge_kernel_size=(2, 2),
        rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    hf_cfg._attn_implementation = "sdpa"
    model = modeling.Kimi_K25VisionModel(hf_cfg)
    projector = modeling.Kimi_K25MultimodalProjection(SimpleNamespace(
        vision_config=hf_cfg, projection_hidden_size=64, projection_layer_norm_eps=1e-5,
        text_config=SimpleNamespace(hidden_size=K25_TEXT_HIDDEN)))

    v = "vision_tower"
    state = {"patch_embed.proj.weight": weights[f"{v}.patch_embed.proj.weight"],
             "patch_embed.proj.bias": weights[f"{v}.patch_embed.proj.bias"],
             "patch_embed.pos_emb.position_embeddings": weights[f"{v}.patch_embed.pos_emb.weight"]}
    renames = {"norm0": "norm1", "norm1": "norm2", "mlp.fc0": "mlp.fc1", "mlp.fc1": "mlp.fc2", "wo": "attn.proj"}
    permute = PermuteForRope(permute_layer_names=["q_proj", "k_proj"])
    for i in range(2):
        ours, theirs = f"{v}.encoder.blocks.{i}", f"layers.{i}"
        for kind in ("weight", "bias"):
            for a, b in renames.items():
                state[f"{theirs}.{b}.{kind}"] = weights[f"{ours}.{a}.{kind}"]
            q, k, val = weights[f"{ours}.wqkv.{kind}"].chunk(3, dim=0)
            state.update(permute.convert({f"{theirs}.attn.q_proj.{kind}": q, f"{theirs}.attn.k_proj.{kind}": k,
                                          f"{theirs}.attn.v_proj.{kind}": val}, [], [], config=hf_cfg))
    for kind in ("weight", "bias"):
        state[f"final_layernorm.{kind}"] = weights[f"{v}.encoder.final_layernorm.{kind}"]
    model.load_state_dict(state, strict=True)
    projector_names = {"pre_norm": "pre_norm", "proj.0": "in_proj", "proj.2": "out_proj"}
    projector.load_state_dict({f"{theirs}.{kind}": weights[f"mm_projector.{ours}.{kind}"]
                               for ours, theirs in projector_names.items() for kind in ("weight", "bias")}, strict=True)
    model, projector = model.double().eval(), projector.double().eval()

    def transformers_forward(image: ImagePatches) -> Tensor:
        with torch.no_grad():
            pooled = model(image.pixel_values.to(F64), grid_thw=torch.tensor([image.grid])).pooler_output
            return projector(pooled).squeeze(1)

    return SimpleNamespace(vision=vision, weights=weights, transformers=transformers_forward,
                           tower=tower(vision, weights, torch.float32))


K25_GRIDS = [(8, 8), (4, 6), (6, 4), (12, 10), (2, 16)]


def test_reference_matches_transformers(k25: SimpleNamespace) -> None:
    """The float64 reference on a K2.5-style config = transformers' MoonViT + projector in float64 (within HF bounds):
    the reference's RoPE layout and x/y order, bicubic resize, merger order and v1 projector agree with an
    implementation written by others."""
    for h, w in K25_GRIDS:
        image = random_patches(h, w, seed=100 + h * w)
        ref = vision_forward(k25.weights, k25.vision, image.pixel_values, image.grid, 0.0)
        report_close(ref, k25.transformers(image), HF_RTOL, HF_ATOL, f"K2.5 reference vs transformers, grid {h}x{w}")


def test_tower_matches_transformers(k25: SimpleNamespace) -> None:
    """`VisionTower` (invariant kernels, fp32) on the K2.5-style config = transformers' MoonViT in float64 (within F32
    bounds): the LayerNorm, bias and `patchmerger` paths of `parity.vision`."""
    for h, w in K25_GRIDS:
        image = random_patches(h, w, seed=200 + h * w)
        report_close(k25.tower(image), k25.transformers(image), F32_RTOL, F32_ATOL,
                     f"K2.5 fp32 tower vs transformers, grid {h}x{w}")


# --- preprocessing: parity.image vs vLLM, bit for bit ----------------------------------------------------------------


def _processor_configs() -> dict[str, dict]:
    tiny = load_model_config(REPO / "configs" / "k3-tiny.yaml").vision.raw
    clip = preprocessor_config({**tiny, "init_pos_emb_height": 20, "init_pos_emb_width": 15})
    clip["media_proc_cfg"].update(image_mean=[0.48145466, 0.4578275, 0.40821073],
                                  image_std=[0.26862954, 0.26130258, 0.27577711])
    return {"k3-tiny": preprocessor_config(tiny), "k3-defaults": preprocessor_config({}), "clip-norm-20x15": clip}


# (width, height): tiny, odd, non-square, exact multiples, large ones scaled down, extreme aspect ratios
PREPROCESS_SIZES = [(1, 1), (2, 3), (13, 5), (29, 57), (333, 77), (113, 112), (28, 28), (1000, 700), (2400, 1800),
                    (15, 2000), (3001, 9)]


@pytest.mark.parametrize("setting", ["k3-tiny", "k3-defaults", "clip-norm-20x15"])
def test_preprocess_equals_vllm(setting: str) -> None:
    """`ImageProcessing` = vLLM's `KimiK25FusedVisionProcessor.preprocess`: the same pixel_values bits, grid and
    token count (`media_tokens_calculator`), for every size above."""
    vllm_fused = pytest.importorskip("vllm.transformers_utils.processors.kimi_k25_vision_fused")
    raw = _processor_configs()[setting]
    theirs = vllm_fused.KimiK25FusedVisionProcessor(raw["media_proc_cfg"])
    ours = ImageProcessing.from_dict(raw)
    for w, h in PREPROCESS_SIZES:
        image = noise_image(w, h, seed=w * 13 + h)
        want = theirs.preprocess([{"type": "image", "image": image}])
        got = ours(image)
        assert torch.equal(got.pixel_values, want["pixel_values"]), f"{setting}, {w}x{h}: pixel_values differ"
        assert list(got.grid) == want["grid_thws"][0].tolist(), f"{setting}, {w}x{h}"
        tokens = theirs.media_tokens_calculator({"type": "image", "image": image})
        assert got.num_tokens == ours.num_tokens(image) == tokens, f"{setting}, {w}x{h}"


def _mode_images() -> dict[str, Image.Image]:
    rng = np.random.default_rng(7)
    size = (23, 17)
    images = {
        "RGBA": Image.fromarray(rng.integers(0, 256, (17, 23, 4), dtype=np.uint8), "RGBA"),
        "LA": Image.fromarray(rng.integers(0, 256, (17, 23, 2), dtype=np.uint8), "LA"),
        "L": Image.fromarray(rng.integers(0, 256, size[::-1], dtype=np.uint8), "L"),
        "CMYK": Image.frombytes("CMYK", size, rng.integers(0, 256, 4 * 23 * 17, dtype=np.uint8).tobytes()),
        "YCbCr": Image.frombytes("YCbCr", size, rng.integers(0, 256, 3 * 23 * 17, dtype=np.uint8).tobytes()),
        "1": Image.fromarray(rng.integers(0, 2, size[::-1], dtype=np.uint8) * 255, "L").convert("1"),
    }
    for name, transparency in (("P", None), ("P-transparent-index", 5),
                               ("P-transparent-bytes", bytes(rng.integers(0, 256, 256, dtype=np.uint8)))):
        p = Image.fromarray(rng.integers(0, 256, size[::-1], dtype=np.uint8), "L").convert("P")
        p.putpalette(rng.integers(0, 256, 768, dtype=np.uint8).tobytes())
        if transparency is not None:
            p.info["transparency"] = transparency
        images[name] = p
    l_t = images["L"].copy()
    l_t.info["transparency"] = 100
    images["L-transparent"] = l_t
    rgb_t = Image.fromarray(rng.integers(0, 256, (17, 23, 3), dtype=np.uint8), "RGB")
    rgb_t.info["transparency"] = (1, 2, 3)
    images["RGB-transparent"] = rgb_t
    return images


@pytest.mark.parametrize("mode", list(_mode_images()))
def test_to_rgb_equals_vllm(mode: str) -> None:
    """`to_rgb` = vLLM's `convert_image_mode(image, "RGB")` pixel for pixel: transparency composited on white
    (RGBA, LA, P / L with a tRNS entry), plain `convert` otherwise, an RGB image returned as is."""
    vllm_image = pytest.importorskip("vllm.multimodal.image")
    image = _mode_images()[mode]
    got, want = to_rgb(image), vllm_image.convert_image_mode(image, "RGB")
    assert got.mode == want.mode == "RGB" and got.size == want.size
    assert np.array_equal(np.asarray(got), np.asarray(want)), mode


def test_open_image_equals_vllm_loader(tmp_path: Path) -> None:
    """`open_image` = vLLM's image loader (`ImageMediaIO(image_mode="RGB").load_file`) on a file whose EXIF says
    "rotate 90°" (orientation 6), as phone photos do."""
    media = pytest.importorskip("vllm.multimodal.media.image")
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "rotated.png"
    noise_image(30, 20, seed=3).save(path, exif=exif.tobytes())
    got, want = open_image(path), media.ImageMediaIO(image_mode="RGB").load_file(path).media
    assert got.size == want.size and np.array_equal(np.asarray(got), np.asarray(want))
