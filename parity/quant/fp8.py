"""FP8 e4m3 MLA latents, as vLLM's K3 caches them with `kv_cache_dtype="fp8"` (576 bytes per token at K3 size).

Per-tensor scale: vLLM's K3 MLA layer keeps its `k_scale` at 1.0 (its MXFP4 quant config gives the attention layers
no KV-cache scales to load), so a latent is stored as e4m3(x / 1.0): round to nearest even, saturating at +-448
(vLLM's `scaled_convert` with `__NV_SATFINITE`; on CPU its `QuantFP8.forward_native`). Dequantisation is exact.
"""

from __future__ import annotations

import torch

from parity.kernels.primitives import wide
from parity.quant.ste import straight_through

E4M3_MAX = 448.0
LATENT_SCALE = 1.0  # vLLM's K3 k_scale
STORAGE_DTYPE = torch.float8_e4m3fn


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x (bf16 / fp32) -> e4m3 codes of x / LATENT_SCALE, saturating, round to nearest even."""
    return (wide(x) / LATENT_SCALE).clamp(-E4M3_MAX, E4M3_MAX).to(STORAGE_DTYPE)


def dequantize(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 codes -> values * LATENT_SCALE in `dtype` (exact in bf16 and fp32)."""
    return (q.float() * LATENT_SCALE).to(dtype)


SCALE_BYTES = 4  # a row scale's fp32 bytes beside its codes (`pack_scaled`)


def _row_scale(xf: torch.Tensor) -> torch.Tensor:
    """The power-of-two scale of each row of fp32 `xf` [..., D]: 2^ceil(log2(amax / 448)) (a UE8M0 scale) [..., 1]."""
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))


def quantize_scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (e4m3 codes of x / s [..., D], s [..., 1] fp32) with one power-of-two scale per row,
    s = 2^ceil(log2(amax / 448)) (a UE8M0 scale, as vLLM quantises the DSA index keys and queries)."""
    xf = wide(x)
    scale = _row_scale(xf)
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(STORAGE_DTYPE), scale


def round_trip_scaled(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as an FP8 cache with one power-of-two scale per row holds it (`quantize_scaled`), in x's dtype: exact
    in bf16 and fp32 (an e4m3 value times a power of two). Not differentiable (the indexer's output is a selection)."""
    codes, scale = quantize_scaled(x)
    return (codes.float() * scale).to(x.dtype)


def pack_scaled(values: torch.Tensor) -> torch.Tensor:
    """`round_trip_scaled` values [..., D] -> their cache entry [..., D + SCALE_BYTES] in e4m3 storage: the codes, then
    the row's fp32 scale as raw bytes (K3.1's index key: 128 + 4 = 132 bytes). Re-quantising such values with their
    own row scale is exact (each is an e4m3 code times a power of two no larger than the scale found), so
    `unpack_scaled` gives `values` back bit for bit."""
    codes, scale = quantize_scaled(values)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1).view(STORAGE_DTYPE)


def unpack_scaled(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A `pack_scaled` entry [..., D + SCALE_BYTES] -> the values [..., D] in `dtype` (exact)."""
    raw = packed.view(torch.uint8)
    codes, scale = raw[..., :-SCALE_BYTES], raw[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (codes.view(STORAGE_DTYPE).float() * scale).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x as an FP8 latent cache stores and returns it, in x's dtype; differentiable (straight-through), so a trainer
    attends over the same quantised latents as the rollout and still back-propagates into the latent projection."""
    return straight_through(x, lambda t: dequantize(quantize(t), t.dtype))
