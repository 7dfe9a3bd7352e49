"""Float64 reference of K3's vision tower and projector, for one image; the spec, never a hot path.

Written from vLLM's code (`vllm/model_executor/models/kimi_k25_vit.py`, as `vllm/models/kimi_k3/nvidia/model.py`
builds it for K3), not from `parity.vision`:

- `MoonVision3dPatchEmbed.forward`: the stride = kernel conv, one dot product per patch, plus
  `Learnable2DInterpPosEmbDivided_fixed.get_pos_embeds` (the learned (H0, W0, D) table, `F.interpolate`d to the
  image's (h, w) with `pos_emb_interpolation_mode` unless the sizes are equal; images add no time term);
- `Rope2DPosEmbRepeated._precompute_freqs_cis` / `get_freqs_cis`: pair j of a head rotates by x * f_{j//2} (j even)
  or y * f_{j//2} (j odd), x = column, y = row, f_i = 10000^(-4i / head_dim); `ApplyRotaryEmb(is_neox_style=False)`
  rotates the interleaved pairs (q[2j], q[2j+1]);
- `MoonViTEncoderLayer.forward`: x += wo(attn(rope(wqkv(norm0 x)))), x += fc1(act(fc0(norm1 x))), full attention
  among the image's patches, scale head_dim^-0.5; `MoonViT3dEncoder`: `final_layernorm` after the blocks;
  norms from `_make_vision_norm`: `nn.RMSNorm(dim)` (eps=None) or `nn.LayerNorm(dim)` (eps 1e-5); activation
  `get_act_fn("gelu_pytorch_tanh")` = tanh-approximated GELU;
- `tpool_patch_merger`: kh x kw windows in row-major order, (ky, kx) inside a window, mean over frames;
- `KimiK25MultiModalProjector.forward`: `patchmergerv2` = post_norm(linear_2(GELU(linear_1(window)))), RMSNorm with
  eps `projector_ln_eps`, no biases; `patchmerger` = linear_2(GELU(linear_1(LayerNorm_1e-5(patch rows) as a
  window))), with biases. `GELUActivation` is the exact (erf) GELU. The checkpoint calls linear_1 / linear_2
  `mm_projector.proj.0` / `mm_projector.proj.2` (K3's `hf_to_vllm_mapper`).

`nn.RMSNorm(dim)` leaves eps to torch: the machine epsilon of the computation (opmath) type, which is
`torch.finfo(torch.float32).eps` for fp32, bf16 and fp16 inputs (`torch_rmsnorm_eps`); the reference takes it as
`norm_eps` so a test can pass the one the compared model's dtype gets. Shapes: N = patches (h * w), D = tower width;
all tensors float64 unless stated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from parity.config import VisionConfig
from parity.io.vision import vision_settings
from parity.reference.ops import linear, rms_norm

F64 = torch.float64
ROPE_THETA = 10000.0
LAYERNORM_EPS = 1e-5  # nn.LayerNorm's default: tower norms when norm_type is layernorm; vLLM's v1 pre_norm (explicit)
CUBIC_A = -0.75  # ATen's bicubic (Keys) coefficient


def torch_rmsnorm_eps(dtype: torch.dtype) -> float:
    """The eps `nn.RMSNorm(dim)` (eps=None) uses on a `dtype` input: the machine epsilon of its opmath type
    (fp32 for fp32 / bf16 / fp16, fp64 for fp64), per torch's `nn.RMSNorm` documentation."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def settings(vision: VisionConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The vision config with KimiK3VisionConfig's defaults for absent keys (`parity.io.vision.vision_settings`)."""
    return vision_settings(vision if isinstance(vision, VisionConfig) else VisionConfig(dict(vision)))


# --- position embedding ---------------------------------------------------------------------------------------


def _cubic_near(t: float) -> float:
    """Keys kernel for |t| <= 1 (ATen `cubic_convolution1`)."""
    return ((CUBIC_A + 2) * t - (CUBIC_A + 3)) * t * t + 1


def _cubic_far(t: float) -> float:
    """Keys kernel for 1 < |t| < 2 (ATen `cubic_convolution2`)."""
    return ((CUBIC_A * t - 5 * CUBIC_A) * t + 8 * CUBIC_A) * t - 4 * CUBIC_A


def interpolation_matrix(out_size: int, in_size: int, mode: str) -> Tensor:
    """[out, in] f64: output sample i = sum_j M[i, j] * input j along one axis, as `F.interpolate(mode,
    align_corners=False)` without antialias does it (ATen `upsample_bilinear2d` / `upsample_bicubic2d`).

    Source position s = (i + 0.5) * in / out - 0.5 (half-pixel centres). Bilinear clamps s at 0 and mixes taps
    floor(s), floor(s) + 1 (the upper one clamped to the edge); bicubic mixes taps floor(s) - 1 .. floor(s) + 2 with
    the Keys kernel (a = -0.75), taps outside the input read the edge value. Downsampling uses the same kernels
    (no widening)."""
    m = torch.zeros(out_size, in_size, dtype=F64)
    scale = in_size / out_size
    for i in range(out_size):
        s = (i + 0.5) * scale - 0.5
        if mode == "bilinear":
            s = max(s, 0.0)
            i0 = int(math.floor(s))
            frac = s - i0
            m[i, min(i0, in_size - 1)] += 1.0 - frac
            m[i, min(i0 + 1, in_size - 1)] += frac
        elif mode == "bicubic":
            i0 = int(math.floor(s))
            t = s - i0
            weights = (_cubic_far(t + 1), _cubic_near(t), _cubic_near(1 - t), _cubic_far(2 - t))
            for k, wk in zip(range(i0 - 1, i0 + 3), weights):
                m[i, min(max(k, 0), in_size - 1)] += wk
        else:
            raise ValueError(f"interpolation mode must be 'bilinear' or 'bicubic', got {mode!r}")
    return m


def position_embedding(table: Tensor, h: int, w: int, mode: str) -> Tensor:
    """The learned table [H0, W0, D] resized to an h x w grid, row-major: [h * w, D]. Equal sizes use the table as
    is (vLLM skips the interpolation there); otherwise the separable resize of `interpolation_matrix` per axis."""
    t = table.to(F64)
    if (h, w) == tuple(t.shape[:2]):
        return t.reshape(h * w, -1)
    rows = interpolation_matrix(h, t.shape[0], mode)  # [h, H0]
    cols = interpolation_matrix(w, t.shape[1], mode)  # [w, W0]
    return torch.einsum("ia,jb,abd->ijd", rows, cols, t).reshape(h * w, -1)


# --- 2D RoPE ------------------------------------------------------------------------------------------------------


def rope2d_angles(head_dim: int, h: int, w: int) -> Tensor:
    """[h * w, head_dim // 2] f64: the angle of pair j at patch (y, x) (row-major): x * f_{j//2} for even j,
    y * f_{j//2} for odd j, f_i = theta^(-4i / head_dim), i < head_dim / 4."""
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs head_dim % 4 == 0, got {head_dim}")
    angles = torch.zeros(h * w, head_dim // 2, dtype=F64)
    for y in range(h):
        for x in range(w):
            for j in range(head_dim // 2):
                freq = ROPE_THETA ** (-4.0 * (j // 2) / head_dim)
                angles[y * w + x, j] = (x if j % 2 == 0 else y) * freq
    return angles


def rotate_pairs(x: Tensor, angles: Tensor) -> Tensor:
    """Rotate each interleaved pair (x[2j], x[2j+1]) of every head by angles[:, j] (GPT-J / non-neox layout).
    x: [N, heads, head_dim], angles: [N, head_dim // 2] -> [N, heads, head_dim]."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


# --- elementwise pieces -------------------------------------------------------------------------------------------


def gelu_tanh(x: Tensor) -> Tensor:
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) (`nn.GELU(approximate="tanh")`)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def gelu_erf(x: Tensor) -> Tensor:
    """0.5 x (1 + erf(x / sqrt(2))) (transformers' `GELUActivation` = `F.gelu`)."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """(x - mean) / sqrt(var + eps) * w + b over the last dim, biased variance (`nn.LayerNorm`)."""
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


# --- the tower ------------------------------------------------------------------------------------------------------


class _Weights:
    """The checkpoint tensors by official name, read as float64."""

    def __init__(self, tensors: Mapping[str, Tensor]):
        self.tensors = tensors

    def __call__(self, name: str) -> Tensor:
        return self.tensors[name].to(F64)

    def dense(self, x: Tensor, name: str, bias: bool) -> Tensor:
        """x W^T (+ b): a linear layer `name` (weight [out, in])."""
        y = linear(x, self(f"{name}.weight"))
        return y + self(f"{name}.bias") if bias else y

    def norm(self, x: Tensor, name: str, kind: str, rms_eps: float) -> Tensor:
        """`nn.RMSNorm` (weight, eps `rms_eps`) or `nn.LayerNorm` (weight, bias, eps 1e-5)."""
        if kind == "rmsnorm":
            return rms_norm(x, self(f"{name}.weight"), rms_eps)
        if kind == "layernorm":
            return layer_norm(x, self(f"{name}.weight"), self(f"{name}.bias"), LAYERNORM_EPS)
        raise ValueError(f"norm_type must be 'rmsnorm' or 'layernorm', got {kind!r}")


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Full (non-causal) softmax attention per head. q, k, v: [N, heads, head_dim] -> [N, heads, head_dim]."""
    out = torch.empty_like(q)
    for head in range(q.shape[1]):
        scores = scale * q[:, head] @ k[:, head].T  # [N, N]
        out[:, head] = torch.softmax(scores, dim=-1) @ v[:, head]
    return out


def encoder_block(x: Tensor, w: _Weights, prefix: str, s: Mapping[str, Any], angles: Tensor, norm_eps: float) -> Tensor:
    """One `MoonViTEncoderLayer`: pre-norm attention with 2D RoPE on q and k, then the pre-norm GELU-tanh MLP.
    x: [N, D] -> [N, D]."""
    heads = int(s["vt_num_attention_heads"])
    head_dim = int(s["qkv_hidden_size"]) // heads
    n = x.shape[0]
    qkv = w.dense(w.norm(x, f"{prefix}.norm0", s["norm_type"], norm_eps), f"{prefix}.wqkv", bool(s["attn_bias"]))
    qkv = qkv.view(n, 3, heads, head_dim)  # output rows: [q heads | k heads | v heads]
    q, k, v = rotate_pairs(qkv[:, 0], angles), rotate_pairs(qkv[:, 1], angles), qkv[:, 2]
    o = attention(q, k, v, head_dim**-0.5).reshape(n, heads * head_dim)
    x = x + w.dense(o, f"{prefix}.wo", bool(s["attn_bias"]))
    hid = gelu_tanh(w.dense(w.norm(x, f"{prefix}.norm1", s["norm_type"], norm_eps), f"{prefix}.mlp.fc0",
                            bool(s["linear_bias"])))
    return x + w.dense(hid, f"{prefix}.mlp.fc1", bool(s["linear_bias"]))


def merge_windows(x: Tensor, h: int, w: int, merge: tuple[int, int]) -> Tensor:
    """`tpool_patch_merger` for one frame: [h * w, D] -> [(h / kh) * (w / kw), kh * kw, D], windows row-major,
    the window's patches (ky, kx) row-major inside it."""
    kh, kw = merge
    if h % kh or w % kw:
        raise ValueError(f"a {h} x {w} grid does not split into {kh} x {kw} windows")
    windows = []
    for wy in range(h // kh):
        for wx in range(w // kw):
            windows.append(torch.stack([x[(wy * kh + ky) * w + wx * kw + kx] for ky in range(kh) for kx in range(kw)]))
    return torch.stack(windows)


def project(windows: Tensor, w: _Weights, s: Mapping[str, Any]) -> Tensor:
    """`KimiK25MultiModalProjector`: [M, kh * kw, D] -> [M, text_hidden]."""
    kind = s["mm_projector_type"]
    if kind == "patchmergerv2":
        hid = gelu_erf(w.dense(windows.flatten(1), "mm_projector.proj.0", False))
        return rms_norm(w.dense(hid, "mm_projector.proj.2", False), w("mm_projector.post_norm.weight"),
                        float(s["projector_ln_eps"]))
    if kind == "patchmerger":
        rows = layer_norm(windows, w("mm_projector.pre_norm.weight"), w("mm_projector.pre_norm.bias"), LAYERNORM_EPS)
        hid = gelu_erf(w.dense(rows.flatten(1), "mm_projector.proj.0", True))
        return w.dense(hid, "mm_projector.proj.2", True)
    raise ValueError(f"mm_projector_type must be 'patchmergerv2' or 'patchmerger', got {kind!r}")


def vision_forward(tensors: Mapping[str, Tensor], vision: VisionConfig | Mapping[str, Any], pixel_values: Tensor,
                   grid: tuple[int, int, int], norm_eps: float, *, project_out: bool = True) -> Tensor:
    """One image through the tower and projector (vLLM's `vision_tower_forward` for a single image).

    tensors: the checkpoint's `vision_tower.*` / `mm_projector.*` tensors (any dtype, read as f64);
    vision: the `vision_config` (defaults filled in by `settings`); pixel_values: [h * w, 3, p, p] normalised
    patches, row-major; grid: (1, h, w); norm_eps: the tower RMSNorms' eps (`torch_rmsnorm_eps` of the compared
    model's dtype; unused for layernorm towers). Returns [(h / kh) * (w / kw), text_hidden] f64, or, with
    project_out=False, the merged windows [(h / kh) * (w / kw), kh * kw, D] the projector takes.
    """
    s = settings(vision)
    t, h, w = (int(v) for v in grid)
    if t != 1:
        raise ValueError(f"the reference takes one image (t == 1), got grid {grid}")
    if pixel_values.shape[0] != h * w:
        raise ValueError(f"{pixel_values.shape[0]} patches for a {h} x {w} grid")
    wt = _Weights(tensors)
    v = "vision_tower"
    # conv with kernel = stride = patch: each patch's dot product with each filter over (channel, y, x)
    x = torch.einsum("ncyx,dcyx->nd", pixel_values.to(F64), wt(f"{v}.patch_embed.proj.weight"))
    if s["patch_embed_proj_bias"]:
        x = x + wt(f"{v}.patch_embed.proj.bias")
    x = x + position_embedding(wt(f"{v}.patch_embed.pos_emb.weight"), h, w, str(s["pos_emb_interpolation_mode"]))
    heads = int(s["vt_num_attention_heads"])
    angles = rope2d_angles(int(s["qkv_hidden_size"]) // heads, h, w)
    for i in range(int(s["vt_num_hidden_layers"])):
        x = encoder_block(x, wt, f"{v}.encoder.blocks.{i}", s, angles, norm_eps)
    x = wt.norm(x, f"{v}.encoder.final_layernorm", s["norm_type"], norm_eps)
    merge = (int(s["merge_kernel_size"][0]), int(s["merge_kernel_size"][1]))
    windows = merge_windows(x, h, w, merge)
    return project(windows, wt, s) if project_out else windows
