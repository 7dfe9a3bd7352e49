"""MXFP4 (OCP microscaling FP4) weights as K3 checkpoints store their routed experts.

Format (compressed-tensors `mxfp4-pack-quantized`, as vLLM's K3 loader reads it): a weight of logical shape
[N, K] is `weight_packed` uint8 [N, K/2] (E2M1 codes, element 2j in the low nibble, 2j+1 in the high one: the layout
of compressed-tensors' `pack_fp4_to_uint8`, written here from the codes the quantiser picks, tested byte-equal to it)
and `weight_scale` uint8 [N, K/32] (E8M0: scale = 2^(byte - 127), one per 32 consecutive values along K). The E2M1
magnitudes are compressed-tensors' table.

Quantiser (one function for the checkpoint writer, the weight sync and the trainer's fake quantisation, so all three
give the same bytes): per group of 32, amax is rounded at E2M1 precision (its fp32 bits + 0x200000, mantissa
dropped) and the scale exponent is floor(log2(that)) - 2, clamped to [-127, 127] (the "even" rule of vLLM's
`_compute_quant_and_scale` and compressed-tensors' `round_to_power_2`); each value is divided by the scale (exact)
and rounded to the nearest E2M1 value, ties to even, saturating at +-6, keeping its sign (-0 for small negatives).
The trainer's fake quantisation takes the dequantised values of those codes without packing them, and reads nothing
back to the host (its E2M1 table made once per device).

Dequantisation is exact in bf16 and fp32 (an E2M1 value times a power of two). Quantising dequantised values gives
the same bytes back (a quantised group's largest code is 4 or 6, so its scale is found again): a checkpoint loaded
into fp32 masters and re-quantised by the sync is the checkpoint.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from parity.patching import require
from parity.quant.bf16 import mark_bf16_valued
from parity.quant.ste import straight_through

GROUP = 32
E2M1_MAX = 6.0
MAX_EXPONENT = 125  # 6 * 2^125 is the largest dequantised value that fp32 and bf16 hold; a larger scale overflows
# Rounding boundaries between consecutive E2M1 magnitudes and whether a value exactly on one rounds up (to the
# even code): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


COMPRESSED_TENSORS = ("0.17.0",)  # the release whose helpers file `_fp4_helpers` loads by path


@functools.cache
def _fp4_helpers() -> ModuleType:
    """compressed-tensors' E2M1 pack / unpack helpers (`compressors/nvfp4/helpers.py`, which imports torch only),
    loaded from the installed package without running the package's `__init__`, which imports transformers (10 s,
    and absent where only the kernels run)."""
    spec = importlib.util.find_spec("compressed_tensors")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("MXFP4 needs compressed-tensors (pip install compressed-tensors==0.17.0)")
    require("compressed-tensors", importlib.metadata.version("compressed-tensors"), COMPRESSED_TENSORS,
            "parity.quant.mxfp4's reading of compressors/nvfp4/helpers.py")
    path = Path(next(iter(spec.submodule_search_locations))) / "compressors" / "nvfp4" / "helpers.py"
    module_spec = importlib.util.spec_from_file_location("zerokl_compressed_tensors_fp4_helpers", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@functools.cache
def _e2m1_table(device: torch.device) -> torch.Tensor:
    """compressed-tensors' E2M1 magnitudes by code (0..7) on `device`, made once per device (so a dequantise inside
    a CUDA graph capture copies nothing from the host)."""
    return _fp4_helpers().kE2M1ToFloat.to(device)


class QuantError(ValueError):
    """A tensor that cannot be quantised (non-finite values, K not a multiple of 32); the message says which."""


@dataclass(frozen=True)
class MXFP4Weight:
    """A weight held packed: `packed` uint8 [..., N, K/2], `scale` uint8 [..., N, K/32]; logical shape [..., N, K]
    (leading dims: experts stacked for a grouped GEMM)."""

    packed: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], 2 * self.packed.shape[-1]))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return dequantize(self.packed, self.scale, dtype)

    @staticmethod
    def stack(weights: list[MXFP4Weight]) -> MXFP4Weight:
        """Experts' packed weights stacked along a new leading dim."""
        return MXFP4Weight(torch.stack([w.packed for w in weights]), torch.stack([w.scale for w in weights]))


def scale_exponents(w: torch.Tensor) -> torch.Tensor:
    """w: [N, K] -> each group's scale exponent e (scale 2^e): int32 [N, K/32] (the even rule, module docstring)."""
    n, k = w.shape
    amax = w.float().reshape(n, k // GROUP, GROUP).abs().amax(-1)
    field = ((amax.view(torch.int32) + 0x200000) >> 23) & 0xFF  # exponent field of amax rounded at E2M1 precision
    return (field - 129).clamp(-127, 127)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """The E2M1 code (uint8: magnitude index 0..7, sign bit 3) of the nearest E2M1 value to fp32 `v`, ties to even,
    saturating at +-6, the sign kept (-0 for small negatives)."""
    a = v.abs().nan_to_num_(0.0)  # NaN: code 0, as no bound lies below it
    code = torch.bucketize(a, _strict_bounds(a.device), out_int32=True).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


@functools.cache
def _strict_bounds(device: torch.device) -> torch.Tensor:
    """`_BOUNDS` as fp32 bounds to count strictly below a magnitude (one `bucketize`): a bound a value on which rounds
    up moved to the fp32 value just below it (a >= b is a > prev(b) for fp32 a); made once per device."""
    bounds = torch.tensor([b for b, _ in _BOUNDS], dtype=torch.float32)
    up = torch.tensor([tie_up for _, tie_up in _BOUNDS])
    return torch.where(up, bounds.nextafter(torch.zeros(())), bounds).to(device)


def _grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] -> (E2M1 codes uint8 [N, K], scale exponents int32 [N, K/32]): the quantiser's choices."""
    n, k = w.shape
    e = scale_exponents(w)
    groups = w.detach().float().reshape(n, k // GROUP, GROUP) * torch.exp2(-e.float()).unsqueeze(-1)  # exact
    return _e2m1_codes(groups).reshape(n, k), e


def _values(codes: torch.Tensor, e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dequantised values of E2M1 codes [..., N, K] (uint8, unpacked) with scale exponents e [..., N, K/32]
    (`dequantize`'s arithmetic: exact)."""
    lead, k = codes.shape[:-1], codes.shape[-1]
    n = codes[..., 0].numel()
    values = _e2m1_table(codes.device)[(codes & 0x07).long()] * (1 - 2 * (codes >> 3).float())
    values = values.reshape(n, k // GROUP, GROUP) * torch.exp2(e.reshape(n, -1).float()).unsqueeze(-1)
    return values.reshape(*lead, k).to(dtype)


def check_quantisable(w: torch.Tensor, name: str = "weight", values: bool = True) -> None:
    """Refuse what MXFP4 cannot hold: a non-2-D tensor, K not a multiple of 32 and (`values`: two reads back to the
    host) NaN or inf, or a group so large that its dequantised values would overflow (|w| above about 2.6e38)."""
    if w.dim() != 2 or w.shape[1] % GROUP:
        raise QuantError(f"{name}: MXFP4 needs a 2-D weight whose input dim is a multiple of {GROUP}, got {tuple(w.shape)}")
    if not values:
        return
    if not bool(torch.isfinite(w).all()):
        raise QuantError(f"{name}: holds NaN or inf values; MXFP4 cannot represent them (refused before any sync)")
    if bool((scale_exponents(w) > MAX_EXPONENT).any()):
        raise QuantError(f"{name}: values above {E2M1_MAX * 2.0 ** MAX_EXPONENT:.3g} would dequantise to inf; refused")


def quantize(w: torch.Tensor, name: str = "weight", check_values: bool = True) -> MXFP4Weight:
    """w: [N, K] fp32 or bf16 -> its MXFP4 form (the module docstring's quantiser); `check_values=False` skips the
    value checks' host reads (`check_quantisable`), for values that a checked quantisation meets later."""
    check_quantisable(w, name, check_values)
    codes, e = _grid(w)
    return MXFP4Weight(codes[:, 0::2] | (codes[:, 1::2] << 4), (e + 127).to(torch.uint8))  # low nibble first


STACK_ELEMENTS = 1 << 25  # values quantised together by `quantize_many` (its transient memory: ~20 bytes a value)


def quantize_many(tensors: Mapping[str, torch.Tensor]) -> dict[str, MXFP4Weight]:
    """`quantize` of every tensor, the same bytes, in a few launches: tensors of one shape, dtype and device are
    stacked (up to `STACK_ELEMENTS` values a stack) and quantised as one (a group of 32 lies within a row, so each row's
    bytes are its own), and the value checks of all of them are one read back to the host; a failed check names the
    first offender in order, as `quantize` one by one would."""
    groups: dict[tuple, list[list[str]]] = {}
    for name, t in tensors.items():
        check_quantisable(t, name, values=False)
        chunks = groups.setdefault((tuple(t.shape), t.dtype, t.device), [[]])
        if chunks[-1] and (len(chunks[-1]) + 1) * t.numel() > STACK_ELEMENTS:
            chunks.append([])
        chunks[-1].append(name)
    out: dict[str, MXFP4Weight] = {}
    bad = []
    for (shape, _, _), names in ((key, c) for key, chunks in groups.items() for c in chunks):
        flat = torch.stack([tensors[n].detach() for n in names]).reshape(-1, shape[-1])
        q = quantize(flat, check_values=False)
        bad.append(~torch.isfinite(flat).all() | (q.scale > MAX_EXPONENT + 127).any())  # the scale byte is e + 127
        for n, packed, scale in zip(names, q.packed.view(len(names), shape[0], -1), q.scale.view(len(names), shape[0], -1)):
            out[n] = MXFP4Weight(packed, scale)
    if bad and bool(torch.stack(bad).any()):
        for name, t in tensors.items():
            check_quantisable(t, name)  # raises, naming the first
    return {n: out[n] for n in tensors}


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """packed uint8 [..., N, K/2], scale uint8 [..., N, K/32] -> [..., N, K] in `dtype` (exact)."""
    lead, k = packed.shape[:-1], 2 * packed.shape[-1]
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*lead, k)  # low nibble first, as packed
    return _values(codes, scale.to(torch.int32) - 127, dtype)


def fake_quantize(w: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """The values the rollout engine computes with after a sync of master weight `w` (in w's dtype; the kernels
    upcast bf16 operands, so these give the packed weights' bits), differentiable (straight-through) so the
    trainer's forward is quantisation-aware. Nothing is read back to the host: a master MXFP4 cannot hold (NaN, inf,
    overflow) is refused by the checked quantisation of the next weight sync, before any engine gets it."""
    check_quantisable(w, name, values=False)
    return mark_bf16_valued(straight_through(w, lambda t: _values(*_grid(t), t.dtype)))  # no packing
