"""The invariances of the CPU kernels that rest on this host's libraries, checked on this host.

Most of `kernels/` is invariant by construction: IEEE `+ - * /` element-wise, `tree_sum` reductions in
one fixed order, top-k with a fixed tie-break. These properties are observed instead, because they
depend on kernels the host's libraries pick for its CPU:

- `linear` / `attention`: every GEMM has one fixed tile shape, so a row's bits cannot depend on the
  batch's row count; that a row's bits do not depend on its *position inside* a tile (or on the thread
  count) is a property of the BLAS micro-kernel (MKL's sgemm here), not of zerokl's code.
- `linear` columns: the Megatron trainer at TP > 1 computes each rank's share of a column-split weight
  as its own GEMM; that a column's bits do not depend on how many other columns the weight has (the GEMM
  pads outputs narrower than `parity.kernels.linear.MIN_COLUMNS`, below which MKL takes another path) is
  again the BLAS's property.
- `elementwise`: `exp`, `log1p`, `tanh`, `rsqrt`, `sqrt` give the same bits in ATen's SIMD body and in
  its tail (an element alone vs inside a long tensor).

`run()` checks each on this machine in a few seconds (`zerokl parity kernels`); the end-to-end proof on
a machine remains `zerokl parity check`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from parity.kernels.attention import Q_TILE, attention_invariant
from parity.kernels.linear import TILE_ROWS, linear_invariant

# (K, N) pairs: odd and power-of-two widths, both below and above typical register-block sizes.
LINEAR_SHAPES = ((24, 8), (96, 200), (384, 384), (1024, 64), (256, 1000))


@dataclass(frozen=True)
class HostCheck:
    name: str
    ok: bool
    detail: str


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    """'' when bit-equal, else the first differing index and the max |difference|."""
    if torch.equal(a, b):
        return ""
    idx = tuple((a != b).nonzero()[0].tolist())
    return f"first mismatch at {idx}, max |d| {(a.double() - b.double()).abs().max().item():.3e}"


def _linear_tile_positions(g: torch.Generator) -> str:
    for k, n in LINEAR_SHAPES:
        w, row = torch.randn(n, k, generator=g), torch.randn(k, generator=g)
        alone = linear_invariant(row.unsqueeze(0), w)[0]
        for pos in range(TILE_ROWS):
            tile = torch.randn(TILE_ROWS, k, generator=g)
            tile[pos] = row
            bad = _mismatch(alone, linear_invariant(tile, w)[pos])
            if bad:
                return f"K={k} N={n}, row at tile position {pos}: {bad}"
    return ""


def _linear_column_shards(g: torch.Generator) -> str:
    x = torch.randn(37, 256, generator=g)
    for n in (4, 8, 24, 64, 200, 1024):
        w = torch.randn(n, 256, generator=g)
        whole = linear_invariant(x, w)
        for parts in (2, 4):
            for i, (part, cols) in enumerate(zip(w.chunk(parts), whole.chunk(parts, dim=1))):
                bad = _mismatch(linear_invariant(x, part), cols)
                if bad:
                    return f"N={n} in {parts} column shards, shard {i}: {bad}"
    return ""


def _linear_threads(g: torch.Generator) -> str:
    x, w = torch.randn(37, 512, generator=g), torch.randn(768, 512, generator=g)
    before = torch.get_num_threads()
    try:
        outs = {}
        for n in sorted({1, 2, before}):
            torch.set_num_threads(n)
            outs[n] = linear_invariant(x, w)
    finally:
        torch.set_num_threads(before)
    for n, y in outs.items():
        bad = _mismatch(outs[1], y)
        if bad:
            return f"1 vs {n} threads: {bad}"
    return ""


def _attention_decode_vs_prefill(g: torch.Generator) -> str:
    t, h, d = 2 * Q_TILE + 3, 2, 64
    q, k, v = (torch.randn(1, t, h, d, generator=g) for _ in range(3))
    pos = torch.arange(t).view(1, t)
    full = attention_invariant(q, k, v, pos, torch.tensor([t]), 0.125)
    for i in range(t):
        one = attention_invariant(q[:, i : i + 1], k[:, : i + 1], v[:, : i + 1], pos[:, i : i + 1],
                                  torch.tensor([i + 1]), 0.125)
        bad = _mismatch(one[0, 0], full[0, i])
        if bad:
            return f"query {i} (tile position {i % Q_TILE}) decoded alone vs prefilled: {bad}"
    return ""


def _elementwise_layout(g: torch.Generator) -> str:
    x = torch.cat([torch.randn(4096, generator=g) * 10, torch.randn(4096, generator=g) * 0.01])
    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "exp": torch.exp, "tanh": torch.tanh, "log1p": lambda t: torch.log1p(t.abs()),
        "rsqrt": lambda t: torch.rsqrt(t.abs() + 1e-20), "sqrt": lambda t: torch.sqrt(t.abs())}
    for name, f in fns.items():
        whole = f(x)[:1200]
        alone = torch.cat([f(x[i : i + 3]) for i in range(0, 1200, 3)])
        bad = _mismatch(alone, whole)
        if bad:
            return f"{name}, elements alone vs inside a long tensor: {bad}"
    return ""


CHECKS: dict[str, Callable[[torch.Generator], str]] = {
    "linear: a row's bits at every position of a GEMM tile": _linear_tile_positions,
    "linear: a column's bits in a column shard of the weight (TP)": _linear_column_shards,
    "linear: thread count": _linear_threads,
    "attention: each query decoded alone vs prefilled in its tile": _attention_decode_vs_prefill,
    "elementwise: SIMD body vs tail (exp, tanh, log1p, rsqrt, sqrt)": _elementwise_layout,
}


def run(seed: int = 0) -> list[HostCheck]:
    """Every check of `CHECKS` on this host, in order; fp32, CPU."""
    out = []
    for name, check in CHECKS.items():
        detail = check(torch.Generator().manual_seed(seed))
        out.append(HostCheck(name, not detail, detail or "bit-equal"))
    return out


def host_description() -> str:
    """The facts that decide which library kernels run: CPU model, ATen's SIMD level, BLAS, threads."""
    import platform

    cpu = platform.machine()
    info = Path("/proc/cpuinfo")
    if info.is_file():
        names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    blas = "MKL" if torch.backends.mkl.is_available() else "no MKL"
    return f"{cpu}, ATen {torch.backends.cpu.get_cpu_capability()}, {blas}, {torch.get_num_threads()} threads"
