"""The trainer's text weights in their serving form written into one reused flat buffer: the bundle a weight sync
sends (`parity.sync.flat`).

Invariant: the tensors of `ServingBuffer.bundle(version, masters, extra)` hold the bytes of
`parity.weights.serving_weights(c, masters)` (then `extra` as given), in `stored_specs` order. On CUDA the casts and
the MXFP4 packing are the table-driven kernels of `parity.kernels.triton.serving` (a launch per source dtype and
kind, thousands of tensors each) and the checksums one more launch; elsewhere torch's own casts and `quantize_many`
fill the buffer's views. A master that cannot take its serving form (NaN or inf in an MXFP4 expert) raises
`QuantError`, naming the first, as `serving_weights` does.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from parity.config import TextConfig
from parity.quant import mxfp4
from parity.sync.bundle import WeightBundle
from parity.sync.flat import FlatLayout
from parity.weights import is_quantized, packed_names, serving_dtype, serving_weights, text_specs

_CAST_ON_GPU = {(torch.float32, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)}


class ServingBuffer:
    """One buffer per layout and device, reused: each `bundle` overwrites the previous bundle's tensors (a sync is
    over when `bundle` is called again; copy what must outlive it)."""

    def __init__(self, c: TextConfig):
        self.c = c
        self._plain: list[tuple[str, tuple[int, ...], torch.dtype]] = []  # (name, shape, serving dtype)
        self._quantized: list[tuple[str, tuple[int, ...]]] = []  # (master name, shape)
        stored: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        for name, spec in text_specs(c).items():
            if is_quantized(c, name):
                n, k = spec.shape
                packed, scale = packed_names(name)
                self._quantized.append((name, spec.shape))
                stored += [(packed, (n, k // 2), torch.uint8), (scale, (n, k // mxfp4.GROUP), torch.uint8)]
            else:
                self._plain.append((name, spec.shape, serving_dtype(c, spec)))
                stored.append(self._plain[-1])
        self._stored = stored
        self._packed = [packed_names(n) for n, _ in self._quantized]
        self._layout: FlatLayout | None = None
        self._offset: dict[str, int] = {}  # the layout's byte offsets by name
        self._buffer: torch.Tensor | None = None

    def _layout_for(self, extra: Mapping[str, torch.Tensor], device: torch.device) -> FlatLayout:
        specs = self._stored + [(n, tuple(t.shape), t.dtype) for n, t in extra.items()]
        if self._layout is None or list(zip(self._layout.names, self._layout.shapes, self._layout.dtypes)) != specs:
            self._layout, self._buffer = FlatLayout.of(specs), None
            self._offset = dict(zip(self._layout.names, self._layout.offsets))
        if self._buffer is None or self._buffer.device != device:
            self._buffer = self._layout.empty(device)
        return self._layout

    def bundle(self, version: int, masters: Mapping[str, torch.Tensor],
               extra: Mapping[str, torch.Tensor] | None = None) -> WeightBundle:
        """The serving weights of `masters` (one tensor per `text_specs` name) and `extra` (copied as they are) as a
        flat bundle on the masters' device; KeyError naming a missing or misshapen master."""
        extra = extra or {}
        for name, shape, *_ in [*self._plain, *self._quantized]:
            t = masters.get(name)
            if t is None or tuple(t.shape) != tuple(shape):
                raise KeyError(f"weights lack {name}" if t is None else
                               f"{name}: shape {tuple(t.shape)}, expected {tuple(shape)}")
        device = masters[self._plain[0][0]].device
        layout = self._layout_for(extra, device)
        assert self._buffer is not None
        if device.type == "cuda":
            self._write_gpu(masters, extra, layout)
        else:
            views = layout.views(self._buffer)
            for name, t in {**serving_weights(self.c, masters), **extra}.items():
                views[name].copy_(t)
        return WeightBundle.make_flat(version, self._buffer, layout)

    def _write_gpu(self, masters: Mapping[str, torch.Tensor], extra: Mapping[str, torch.Tensor],
                   layout: FlatLayout) -> None:
        """The serving form into the buffer with one launch per (source dtype, serving dtype) and per source dtype of
        the quantised masters; sources off the kernels' paths (another dtype pair, not contiguous, elsewhere) by
        torch's copy into their view."""
        from parity.kernels.triton.serving import cast_into, mxfp4_into

        buffer = self._buffer
        assert buffer is not None
        offset = self._offset
        casts: dict[tuple[torch.dtype, torch.dtype], list[tuple[torch.Tensor, int]]] = {}
        slow: list[tuple[str, torch.Tensor]] = []
        for name, t, dtype in [*((n, masters[n].detach(), d) for n, _, d in self._plain),
                               *((n, t.detach(), t.dtype) for n, t in extra.items())]:
            if (t.dtype, dtype) in _CAST_ON_GPU and t.is_contiguous() and t.device == buffer.device:
                casts.setdefault((t.dtype, dtype), []).append((t, offset[name]))
            else:
                slow.append((name, t))
        for (_, dtype), items in casts.items():
            cast_into(buffer, [t for t, _ in items], [o for _, o in items], dtype)
        if slow:
            views = layout.views(buffer)
            for name, t in slow:
                views[name].copy_(t)
        quantized: dict[torch.dtype, list[tuple[torch.Tensor, int, int]]] = {}
        elsewhere: dict[str, torch.Tensor] = {}
        for (name, _), (packed, scale) in zip(self._quantized, self._packed):
            t = masters[name].detach()
            if t.dtype in (torch.float32, torch.bfloat16) and t.device == buffer.device:
                quantized.setdefault(t.dtype, []).append((t.contiguous(), offset[packed], offset[scale]))
            else:
                elsewhere[name] = t
        flags = [mxfp4_into(buffer, *map(list, zip(*items))) for items in quantized.values()]
        if flags and bool(torch.cat(flags).any()):  # one read back: refuse as `quantize` would, naming the first
            for name, _ in self._quantized:
                mxfp4.check_quantisable(masters[name], name)
        if elsewhere:
            views = layout.views(buffer)
            for name, q in mxfp4.quantize_many(elsewhere).items():
                packed, scale = packed_names(name)
                views[packed].copy_(q.packed)
                views[scale].copy_(q.scale)
