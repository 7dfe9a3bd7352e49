"""K3's vision tower (MoonViT-V2: patch embedding, ViT blocks with 2D RoPE, 2x2 patch merger, projector), written once
on the parity kernels; both engines call it, and both take an image's patches from `parity.image.preprocess`.

Semantics are vLLM's (`vllm/model_executor/models/kimi_k25_vit.py`, `MoonViT3dPretrainedModel` and
`KimiK25MultiModalProjector`, as `vllm/models/kimi_k3/nvidia/model.py` builds them for K3):

    x = patches W_patch^T + pos_emb(h, w)             (the conv with stride = kernel is one GEMM over c, y, x)
    per block: x += wo(attn(rope2d(wqkv(norm0(x)))))  (full attention among one image's patches)
               x += fc1(gelu_tanh(fc0(norm1(x))))
    x = final_layernorm(x); merge each 2x2 patch window into one row (row-major windows, (ky, kx) inside)
    out = post_norm(linear_2(gelu(linear_1(x))))       (K3's `patchmergerv2`; `patchmerger`: pre-norm, biases)

Invariance: every image runs alone through invariant kernels (GEMMs, norms, attention with all keys visible), and the
tables it reads (positional embedding resized to the image's grid, the 2D RoPE angles) are functions of the grid and
the weights only, the RoPE table computed once at one fixed shape; so an image's embeddings are the same bits
whatever else is in the batch, in the engine's encoder or in the trainer. The tower runs in the model's compute dtype
(vLLM casts it there); RoPE and GELU compute in fp32 and round once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from parity.config import ModelConfig, VisionConfig
from parity.io.vision import PROJECTOR_PREFIX, VISION_PREFIX, vision_settings, vision_specs
from parity.kernels import Kernels
from parity.kernels.linear import k_segments
from parity.kernels.norms import layernorm_invariant
from parity.kernels.primitives import wide

ROPE_THETA = 10000.0
LAYERNORM_EPS = 1e-5  # nn.LayerNorm's default: the tower's norms when `norm_type` is layernorm, the v1 pre-norm


@dataclass(frozen=True)
class ImagePatches:
    """One preprocessed image: pixel_values [t * h * w, 3, p, p] fp32 (normalised, row-major patches), grid (t, h, w)
    in patches. Its merged-token count is the number of placeholder rows it fills in a prompt."""

    pixel_values: torch.Tensor
    grid: tuple[int, int, int]
    merge: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        _, h, w = self.grid
        return (h // self.merge[0]) * (w // self.merge[1])


@dataclass(frozen=True)
class TowerShape:
    """What the forward needs from `vision_config` (KimiK3VisionConfig's defaults for absent keys)."""

    heads: int
    head_dim: int
    layers: int
    merge: tuple[int, int]
    norm_type: str
    projector: str
    projector_eps: float
    interpolation: str
    rope_side: int  # the fixed grid side the RoPE table is built at (>= any image's grid side)

    @classmethod
    def from_config(cls, vision: VisionConfig, max_grid_side: int) -> TowerShape:
        s: dict[str, Any] = vision_settings(vision)
        heads = int(s["vt_num_attention_heads"])
        return cls(heads=heads, head_dim=int(s["qkv_hidden_size"]) // heads, layers=int(s["vt_num_hidden_layers"]),
                   merge=(int(s["merge_kernel_size"][0]), int(s["merge_kernel_size"][1])),
                   norm_type=str(s["norm_type"]), projector=str(s["mm_projector_type"]),
                   projector_eps=float(s["projector_ln_eps"]), interpolation=str(s["pos_emb_interpolation_mode"]),
                   rope_side=max_grid_side)


def rope_angles(head_dim: int, side: int) -> torch.Tensor:
    """The 2D RoPE angles of every position of a side x side grid: [side, side, head_dim // 2] fp32; pair j of a head
    rotates by x * f_{j//2} (j even) or y * f_{j//2} (j odd), f_i = theta^(-4i / head_dim) (vLLM's
    `Rope2DPosEmbRepeated`). Computed on the CPU wherever the tower runs, so both engines rotate by the same bits."""
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 4, device="cpu")[: head_dim // 4].float() / head_dim))
    pos = torch.arange(side * side, device="cpu").float()
    x_ang, y_ang = torch.outer(pos % side, freqs), torch.outer(torch.div(pos, side, rounding_mode="floor"), freqs)
    return torch.stack([x_ang, y_ang], dim=-1).reshape(side, side, head_dim // 2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2j], x[2j+1]) of x [N, H, d] by the per-position angles (cos, sin [N, 1, d/2]) in
    fp32 (vLLM's `enable_fp32_compute`); rounded once to x's dtype."""
    xf = wide(x).unflatten(-1, (-1, 2))
    re, im = xf[..., 0], xf[..., 1]
    return torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) in fp32, rounded once (element-wise, layout-invariant ops)."""
    xf = wide(x)
    return (0.5 * xf * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (xf + 0.044715 * xf * xf * xf)))).to(x.dtype)


def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + erf(x / sqrt(2))) in fp32, rounded once."""
    xf = wide(x)
    return (0.5 * xf * (1.0 + torch.erf(xf * (1.0 / math.sqrt(2.0))))).to(x.dtype)


class VisionTower:
    """The tower and projector over one checkpoint's `vision_tower.*` / `mm_projector.*` tensors (official names), on
    a kernel set. Weights are used as given (the caller holds them in the compute dtype)."""

    def __init__(self, shape: TowerShape, weights: dict[str, torch.Tensor], kernels: Kernels, dtype: torch.dtype):
        self.shape = shape
        self.w = weights
        self.k = kernels
        self.dtype = dtype
        device = next(iter(weights.values())).device
        self._angles = rope_angles(shape.head_dim, shape.rope_side)  # one fixed shape: each angle's bits are fixed
        self._cos, self._sin = torch.cos(self._angles).to(device), torch.sin(self._angles).to(device)

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        w = self.w[f"{name}.weight"]
        y = self.k.linear(x, w.reshape(w.shape[0], -1), None, segments=k_segments(x.shape[-1]))
        bias = self.w.get(f"{name}.bias")
        return y if bias is None else (wide(y) + wide(bias)).to(y.dtype)

    def _norm(self, x: torch.Tensor, name: str, kind: str, eps: float | None = None) -> torch.Tensor:
        """RMSNorm (eps unless given: `nn.RMSNorm(eps=None)`'s, the machine epsilon of the dtype it computes in, fp32
        for bf16 inputs) or LayerNorm."""
        if kind == "layernorm":
            return layernorm_invariant(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"],
                                       LAYERNORM_EPS if eps is None else eps).to(x.dtype)
        return self.k.rmsnorm(x, self.w[f"{name}.weight"], torch.finfo(wide(x).dtype).eps if eps is None else eps)

    def pos_embedding(self, h: int, w: int) -> torch.Tensor:
        """The learned position table resized to an h x w grid (unchanged at its own size): [h * w, D]."""
        table = self.w[f"{VISION_PREFIX}.patch_embed.pos_emb.weight"]
        if (h, w) == tuple(table.shape[:2]):
            return table.flatten(0, 1)
        resized = F.interpolate(wide(table).permute(2, 0, 1).unsqueeze(0), size=(h, w), mode=self.shape.interpolation)
        return resized.squeeze(0).permute(1, 2, 0).flatten(0, 1).to(table.dtype)

    def _block(self, x: torch.Tensor, i: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s = self.shape
        b = f"{VISION_PREFIX}.encoder.blocks.{i}"
        n = x.shape[0]
        qkv = self._lin(self._norm(x, f"{b}.norm0", s.norm_type), f"{b}.wqkv").view(n, 3, s.heads, s.head_dim)
        q, k, v = (_rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2])
        everything = torch.full((1, n), n - 1, device=x.device)  # every patch sees every patch of its image
        o = self.k.attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), everything,
                             torch.tensor([n], device=x.device), s.head_dim ** -0.5)
        x = x + self._lin(o.reshape(n, s.heads * s.head_dim), f"{b}.wo")
        h = gelu_tanh(self._lin(self._norm(x, f"{b}.norm1", s.norm_type), f"{b}.mlp.fc0"))
        return x + self._lin(h, f"{b}.mlp.fc1")

    def _merge(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """[t*h*w, D] -> [(h/kh)*(w/kw), kh*kw*D]: the mean over frames, then each kh x kw window as one row."""
        t, h, w = grid
        kh, kw = self.shape.merge
        v = x.view(t, h // kh, kh, w // kw, kw, -1)
        v = v[0] if t == 1 else (wide(v).sum(0) / t).to(x.dtype)
        return v.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), -1)

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        p = PROJECTOR_PREFIX
        if self.shape.projector == "patchmergerv2":
            h = gelu_erf(self._lin(x, f"{p}.proj.0"))
            return self._norm(self._lin(h, f"{p}.proj.2"), f"{p}.post_norm", "rmsnorm", self.shape.projector_eps)
        kh, kw = self.shape.merge
        rows = self._norm(x.view(x.shape[0] * kh * kw, -1), f"{p}.pre_norm", "layernorm").view(x.shape[0], -1)
        return self._lin(gelu_erf(self._lin(rows, f"{p}.proj.0")), f"{p}.proj.2")

    def __call__(self, image: ImagePatches) -> torch.Tensor:
        """One image -> its merged-token embeddings [num_tokens, text hidden] in the compute dtype."""
        t, h, w = image.grid
        if t != 1:
            raise ValueError("the vision tower takes images (one frame), not video")
        side = self.shape.rope_side
        if h > side or w > side:
            raise ValueError(f"an image grid of {h} x {w} patches exceeds the tower's {side} x {side}")
        x = self._lin(image.pixel_values.to(self.dtype).flatten(1), f"{VISION_PREFIX}.patch_embed.proj")
        x = (wide(x) + wide(self.pos_embedding(h, w))).to(self.dtype)
        cos = self._cos[:h, :w].reshape(h * w, 1, -1)
        sin = self._sin[:h, :w].reshape(h * w, 1, -1)
        for i in range(self.shape.layers):
            x = self._block(x, i, cos, sin)
        x = self._norm(x, f"{VISION_PREFIX}.encoder.final_layernorm", self.shape.norm_type)
        return self._project(self._merge(x, image.grid))


def vision_tower(cfg: ModelConfig, tensors: dict[str, torch.Tensor], kernels: Kernels,
                 max_grid_side: int) -> VisionTower:
    """The tower over a checkpoint's vision tensors (cast to the compute dtype, frozen), on `kernels`;
    `max_grid_side`: the preprocessor's patch limit on one side (`parity.image.ImageProcessing.side_limit`)."""
    if cfg.vision is None:
        raise ValueError("this checkpoint has no vision tower (no vision_config): it takes no images")
    dtype = cfg.text.compute_dtype
    weights = {n: tensors[n].to(dtype) for n in vision_specs(cfg.vision, cfg.text.hidden_size)}
    return VisionTower(TowerShape.from_config(cfg.vision, max_grid_side), weights, kernels, dtype)


@dataclass(frozen=True)
class ImageRows:
    """The merged-token embeddings of each batch row's images, in prompt order, and the placeholder token whose rows
    they fill (`media_placeholder_token_id`)."""

    token_id: int
    rows: tuple[tuple[torch.Tensor, ...], ...]

    def merge(self, embeds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, T, D] with each row's placeholder rows replaced, in order, by its images' embeddings
        (what vLLM's `embed_input_ids` does with multimodal embeddings)."""
        return torch.stack([merge_image_rows(embeds[b], ids[b], self.token_id, list(images))
                            for b, images in enumerate(self.rows)])


@dataclass(frozen=True)
class ImageInputs:
    """Each batch row's images as preprocessed patches, in prompt order, and the placeholder token their rows fill:
    what a trainer whose tower trains takes (its forward runs the tower on its live weights, `embed`)."""

    token_id: int
    rows: tuple[tuple[ImagePatches, ...], ...]

    def embed(self, tower: VisionTower) -> ImageRows:
        """The rows `tower` gives these images (an image object held by several rows runs once)."""
        done: dict[int, torch.Tensor] = {}
        for row in self.rows:
            for image in row:
                if id(image) not in done:
                    done[id(image)] = tower(image)
        return ImageRows(self.token_id, tuple(tuple(done[id(image)] for image in row) for row in self.rows))


def merge_image_rows(embeds: torch.Tensor, ids: torch.Tensor, media_token_id: int,
                     images: list[torch.Tensor]) -> torch.Tensor:
    """Token embeddings with the image rows replaced, in order, by the images' merged-token embeddings (vLLM's
    `embed_input_ids` with multimodal embeddings): embeds [..., D], ids [...] -> [..., D]. The image rows are the
    first occurrences of `media_token_id`, as many as the images have tokens: the prompt's placeholders, which come
    before anything sampled (a sampled `media_token_id` is a text token, as in the engine)."""
    have = sum(int(t.shape[0]) for t in images)
    if have == 0:
        return embeds
    slots = (ids == media_token_id).nonzero().view(-1)
    if slots.numel() < have:
        raise ValueError(f"the tokens hold {slots.numel()} image placeholder rows, the images give {have} embeddings")
    out = embeds.clone()
    out[slots[:have]] = torch.cat(images).to(embeds.dtype)
    return out
