"""A weight update as one flat byte buffer: every tensor at a fixed, aligned offset, so a sync writes, checksums,
copies and verifies one buffer in a few launches instead of a few per tensor.

Invariant: a `FlatLayout` places tensor i at byte `offsets[i]` (a multiple of `ALIGN`), in a fixed order, and the
bytes between tensors are zero in every buffer it makes (`empty`). `word_sums(buffer)[i]` is then the word-mix total
`parity.sync.checksum.checksum` computes for tensor i: its bytes read as 64-bit words from its offset, the zero padding
up to the next word being the checksum's zero-padded last word. So a flat bundle's digests (`FlatChecksums`) are
exactly `checksums` of its tensors, and a receiver holding the same layout verifies a copy with one launch and one
comparison on the device.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from parity.sync.checksum import _C1, _C2, _C3, _C4, _mix_sum, digest

ALIGN = 16  # bytes: every tensor starts here (a view of any dtype is aligned; int64 words need 8)
_VIEWS_KEPT = 4  # buffers whose views a layout keeps (a sender's, a receiver's two, one spare)


@dataclass(frozen=True, eq=False)
class FlatLayout:
    """Where each tensor lies in a flat uint8 buffer of `total` bytes."""

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    total: int
    _cache: dict = field(default_factory=dict, repr=False)  # per device: the checksum table; per buffer: views

    @classmethod
    def of(cls, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> FlatLayout:
        """The layout of (name, shape, dtype) in the given order, each tensor `ALIGN`ed."""
        names, dtypes, shapes, offsets, offset = [], [], [], [], 0
        for name, shape, dtype in specs:
            names.append(name)
            dtypes.append(dtype)
            shapes.append(tuple(int(s) for s in shape))
            offsets.append(offset)
            offset = -(-(offset + math.prod(shape) * dtype.itemsize) // ALIGN) * ALIGN
        return cls(tuple(names), tuple(dtypes), tuple(shapes), tuple(offsets), max(offset, ALIGN))

    def nbytes(self, i: int) -> int:
        return math.prod(self.shapes[i]) * self.dtypes[i].itemsize

    def tensor_bytes(self) -> int:
        """The tensors' bytes (without the padding)."""
        return sum(self.nbytes(i) for i in range(len(self.names)))

    def matches(self, other: FlatLayout) -> bool:
        """The same tensors, shapes, dtypes and offsets."""
        return self is other or (self.names, self.dtypes, self.shapes, self.offsets) == (
            other.names, other.dtypes, other.shapes, other.offsets)

    def expected(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {n: (s, d) for n, s, d in zip(self.names, self.shapes, self.dtypes)}

    def empty(self, device: torch.device | str) -> torch.Tensor:
        """A zeroed buffer of this layout (the padding must stay zero: writers touch only the tensors' bytes)."""
        return torch.zeros(self.total, dtype=torch.uint8, device=device)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every tensor as a view of `buffer` (the views of the last few buffers are kept: a sync reuses its
        buffers, and thousands of views cost milliseconds to make)."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != self.total:
            raise ValueError(f"a flat weight buffer of this layout is uint8 [{self.total}], got {buffer.dtype} "
                            f"{tuple(buffer.shape)}")
        kept: OrderedDict = self._cache.setdefault("views", OrderedDict())
        key = (buffer.device, buffer.data_ptr())
        if key not in kept:  # a kept view holds its buffer's memory: no other buffer can start at this address
            kept[key] = {n: buffer[o : o + math.prod(s) * d.itemsize].view(d).view(s)
                         for n, d, s, o in zip(self.names, self.dtypes, self.shapes, self.offsets)}
            while len(kept) > _VIEWS_KEPT:
                kept.popitem(last=False)
        kept.move_to_end(key)
        return dict(kept[key])

    def word_sums(self, buffer: torch.Tensor) -> torch.Tensor:
        """Each tensor's word-mix total (int64, mod 2^64), on the buffer's device: on CUDA one launch
        (`parity.kernels.triton.checksum.segment_sums`), nothing read back to the host."""
        words = buffer.view(torch.int64)
        if not buffer.is_cuda:
            first = [o // 8 for o in self.offsets]
            return torch.tensor([_mix_sum(words[f : f + c], 0) for f, c in zip(first, self._words())],
                                dtype=torch.int64)
        from parity.kernels.triton.checksum import segment_sums, segment_table

        key = ("table", buffer.device)
        if key not in self._cache:
            self._cache[key] = segment_table(self._words(), [o // 8 for o in self.offsets], buffer.device)
        return segment_sums(words, self._cache[key], _C1, _C2, _C3, _C4)

    def _words(self) -> list[int]:
        """Each tensor's 64-bit words, the last zero-padded."""
        return [-(-self.nbytes(i) // 8) for i in range(len(self.names))]

    def digests(self, sums: torch.Tensor) -> dict[str, str]:
        """`parity.sync.checksum.checksums`' strings from `word_sums` (one read back)."""
        return {n: digest(d, s, self.nbytes(i), total)
                for i, (n, d, s, total) in enumerate(zip(self.names, self.dtypes, self.shapes, sums.tolist()))}


@dataclass(frozen=True)
class Flat:
    """A bundle's tensors as one buffer: `buffer` laid out by `layout`, `sums` its `word_sums` as the sender
    computed them."""

    buffer: torch.Tensor
    layout: FlatLayout
    sums: torch.Tensor


class FlatChecksums(Mapping):
    """A flat bundle's checksums, made from its word sums only when read (a sync within one process compares the sums
    on the device and never needs the strings)."""

    def __init__(self, flat: Flat):
        self.flat = flat
        self._digests: dict[str, str] | None = None

    def _all(self) -> dict[str, str]:
        if self._digests is None:
            self._digests = self.flat.layout.digests(self.flat.sums)
        return self._digests

    def __getitem__(self, name: str) -> str:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.flat.layout.names)

    def __len__(self) -> int:
        return len(self.flat.layout.names)
