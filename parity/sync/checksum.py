"""The weight sync's checksum: a 64-bit word mix of a tensor's bytes, the same value on every device.

Invariant: `checksum(t)` depends only on t's dtype, shape and bytes (not on the device, the reduction order or how many
tensors are checksummed together); `checksums` and the flat buffers' one-launch sums (`parity.sync.flat`) give the
same strings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

# Odd 64-bit multipliers and offsets (as signed int64) of the word mix below.
_C1, _C2, _C3, _C4 = -7046029254386353131, -4658895280553007687, 1609587929392839161, -7723592293110705685


def _mix_sum(words: torch.Tensor, first: int) -> int:
    """sum_i mix(w_i, first + i) mod 2^64 (the torch form: element-wise int64 passes, wrapping)."""
    idx = torch.arange(first, first + words.numel(), dtype=torch.int64, device=words.device)
    return int((((words + idx * _C1) * _C2 ^ (idx * _C3)) * _C4).sum().item())


def checksum(t: torch.Tensor) -> str:
    """A 64-bit checksum of the tensor's bytes, with its dtype and shape, computed on the tensor's own device.

    The bytes are read as 64-bit words w_i (the last one zero-padded); each is mixed with its index by a bijection
    (add, xor, multiply by odd constants, mod 2^64), and the mixes are added mod 2^64. Integer addition is exact and
    order-free, so the value does not depend on the device, the reduction order or the thread count: the same values
    give the same checksum on the trainer's GPU (Triton, `parity.kernels.triton.checksum`), the engine's GPU and the
    CPU. Any change of one word changes it; a word moved to another index changes it. Not cryptographic: it detects
    corruption in flight, not tampering."""
    return checksums({"": t})[""]


def checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """`checksum` of every tensor; the word sums of CUDA tensors in a few batched launches per device
    (`parity.kernels.triton.checksum.word_mix_sums`) rather than a launch and a read-back each."""
    data = {n: _bytes(t) for n, t in tensors.items()}
    words = {n: d[: 8 * (d.numel() // 8)].view(torch.int64) for n, d in data.items()}
    totals: dict[str, int] = {}
    on_gpu: dict[torch.device, list[str]] = {}
    for n, w in words.items():
        if w.is_cuda:
            on_gpu.setdefault(w.device, []).append(n)
        else:
            totals[n] = _mix_sum(w, 0)
    if on_gpu:
        from parity.kernels.triton.checksum import word_mix_sums  # Triton only where there is a GPU

        for names in on_gpu.values():
            totals.update(zip(names, word_mix_sums([words[n] for n in names], _C1, _C2, _C3, _C4)))
    return {n: _digest(t, data[n], totals[n]) for n, t in tensors.items()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, contiguous, starting 8-byte aligned (int64 words need it)."""
    data = t.detach().contiguous().view(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)
    return data.clone() if data.storage_offset() % 8 else data


def _digest(t: torch.Tensor, data: torch.Tensor, total: int) -> str:
    """The checksum string from the whole words' mix sum `total`: the zero-padded last word added, then `digest`."""
    whole = data.numel() // 8
    if data.numel() % 8:
        tail = torch.cat([data[8 * whole :], data.new_zeros(8 - data.numel() % 8)]).view(torch.int64)
        total += _mix_sum(tail, whole)
    return digest(t.dtype, tuple(t.shape), t.numel() * t.element_size(), total)


def digest(dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, total: int) -> str:
    """The checksum string of a tensor whose words (the last zero-padded) mix to `total`: the sum mod 2^64 with the
    dtype, shape and byte count hashed."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{dtype}:{tuple(shape)}:{nbytes}:{total & (2**64 - 1):016x}".encode())
    return h.hexdigest()


def weights_checksum(checksums: Mapping[str, str]) -> str:
    """One checksum for a whole set of tensors from their `checksum`s (names included, order-free): what a rollout
    server reports for the weights it serves (`GET /zerokl/weights`) and a trainer computes for what it sent."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(checksums):
        h.update(f"{name}={checksums[name]};".encode())
    return h.hexdigest()
