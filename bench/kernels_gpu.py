"""Invariant Triton kernels vs the fastest non-invariant baselines on one GPU, measured in the same run.

Baselines: cuBLAS (torch.matmul), torch RMSNorm (F.rms_norm), SDPA, fla chunk_kda / fused_recurrent_kda
(if fla-core is importable), torch.log_softmax, torch.topk, F.conv1d, torch._grouped_mm (or a per-expert
matmul loop). Shapes: M = 1, 64, 4096 tokens at K3-small and K3-full layer widths, bf16. DSA (K3.1 Pro): sparse
MLA (index scores, top-k, sparse attention) against the dense invariant attention at 16k and 64k contexts.

Method (the device's METHOD.md): the two ceilings are measured first (device-to-device copy bandwidth,
bf16 8192^3 cuBLAS rate) and each case prints its floor max(bytes / BW, flops / peak) from the bytes
each input and output must move once; inputs rotate over enough copies to exceed 3x the L2; each
timing is the median of many runs, replayed from a CUDA graph when the op can be captured (so Python
launch cost is not counted for either side), else timed eagerly with CUDA events.

Usage: python bench/kernels_gpu.py [--sweep] [--profile] [--goals] [--host] [--no-table] [--only OPS]
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BF16 = torch.bfloat16
DEV = "cuda"
L2_BYTES = 60 << 20
LAST_MODE = ""


@dataclass
class Case:
    op: str
    shape: str
    inv: Callable[[int], object]  # runs the invariant kernel on input set i
    base: Callable[[int], object] | None
    base_name: str
    flops: float
    bytes: float
    sets: int
    graph: bool = True
    kernel_time: bool = False  # also report summed GPU kernel time from the profiler (host-bound ops)


def _sets(nbytes: float) -> int:
    """Input copies needed so that rotating through them exceeds 3x the L2."""
    return max(1, min(64, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


def time_ms(fn: Callable[[int], object], sets: int, graph: bool, reps: int = 40) -> float:
    """Median ms per call; calls rotate over `sets` input sets. `LAST_MODE` says how it was timed."""
    global LAST_MODE
    for i in range(sets):
        fn(i)
    torch.cuda.synchronize()
    per = max(sets, 8)
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                with torch.cuda.graph(g):
                    for i in range(per):
                        fn(i % sets)
            torch.cuda.current_stream().wait_stream(s)
            g.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / per)
            LAST_MODE = "graph"
            return statistics.median(times)
        except Exception:  # not capturable (host syncs, autotuning): eager below
            torch.cuda.synchronize()
    times = []
    for r in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(r % sets)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    LAST_MODE = "eager"
    return statistics.median(times)


def kernel_ms(fn: Callable[[int], object], reps: int = 10) -> float:
    """Summed device time of all kernels one call launches (torch profiler), ms per call; excludes the
    host's launch gaps, which dominate eager timings of multi-kernel ops at small shapes."""
    from torch.profiler import ProfilerActivity, profile

    fn(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn(0)
        torch.cuda.synchronize()
    total = sum(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) for e in prof.key_averages())
    return total / reps / 1e3


def kernel_breakdown(fn: Callable[[int], object], reps: int = 10) -> list[tuple[str, int, float]]:
    """(kernel, launches per call, device ms per call) for every kernel one call of `fn` runs, largest
    first, from the torch profiler over `reps` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn(0)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((e.key, e.count // reps, t / reps / 1e3))
    return sorted(rows, key=lambda r: -r[2])


def print_breakdown(label: str, fn: Callable[[int], object]) -> None:
    """One markdown table of `kernel_breakdown`, kernel names cut to 70 characters."""
    rows = kernel_breakdown(fn)
    total = sum(r[2] for r in rows)
    print(f"\n#### {label}: {total:.4f} ms GPU time per call\n| kernel | launches | ms | share |\n|---|---|---|---|")
    for name, count, ms in rows:
        print(f"| `{name[:70]}` | {count} | {ms:.4f} | {ms / total:.0%} |")
    sys.stdout.flush()


PROFILED = {  # op group -> shapes whose kernels are listed one by one (`--profile`)
    "linear": ("4096x4096 M=4096", "k3-full 7168x7168 M=1", "k3-full 7168x7168 M=64"),
    "kda": ("goal H=16 d=128 T=4096", "goal H=16 d=128 T=16384", "goal H=16 d=128 fp32 q,k T=4096",
            "k3-1b decode B=64 H=12 d=128 fp32 q,k T=1"),
    "attention": ("prefill Tq=4096 S=4096 H=16 d=192/128", "decode B=64 Tq=1 S=4096 H=16 d=192/128"),
    "moe": ("E=64 L=3584 I=3072 k=16 N=64",),
}


GOALS = {  # op group -> the goal shapes, timed alternately with their baselines (`--goals`)
    "linear": ("4096x4096 M=4096", "k3-full 7168x7168 M=8192", "4096x4096 M=1", "4096x4096 M=64",
               "k3-full 7168x7168 M=1", "k3-full 7168x7168 M=64"),
    "kda": ("goal H=16 d=128 T=4096", "goal H=16 d=128 T=16384", "goal H=16 d=128 T=65536"),
    "attention": ("prefill Tq=4096 S=4096 H=16 d=192/128", "prefill Tq=16384 S=16384 H=16 d=192/128",
                  "decode B=64 Tq=1 S=4096 H=16 d=192/128"),
    "moe": ("E=64 L=3584 I=3072 k=16 N=1", "E=64 L=3584 I=3072 k=16 N=64", "E=64 L=3584 I=3072 k=16 N=4096"),
}
HOST = {  # op group -> shapes whose host time per eager call is measured (`--host`): decode-sized, GPU time small
    "linear": ("4096x4096 M=1", "4096x4096 M=64"),
    "rowwise": ("D=7168 M=1", "I=3072 M=1"),
    "conv": ("k3-full D=36864 T=1",),
    "kda": ("goal H=16 d=128 T=1", "goal H=16 d=128 T=64"),
    "attention": ("decode B=8 Tq=1 S=4096 H=16 d=192/128",),
    "misc": ("n=8 D=7168 N=1", "E=896 k=16 N=1", "V=163840 fp32 N=1"),
    "moe": ("E=64 L=3584 I=3072 k=16 N=1",),
}


def _selected(tk, table: dict[str, tuple[str, ...]], groups: list[str]) -> list[Case]:
    """The cases of `table` whose op group is in `groups`."""
    out = []
    for group in groups:
        out += [c for c in ALL[group](tk) if c.shape in table.get(group, ())]
    return out


def profile_kernels(tk, groups: list[str]) -> None:
    """Per-kernel device time of the invariant op and its baseline for the shapes in `PROFILED`."""
    print("\n## Per-kernel GPU time (torch.profiler, 10 calls, ms per call)")
    for c in _selected(tk, PROFILED, groups):
        print_breakdown(f"{c.op} {c.shape}: invariant", c.inv)
        if c.base is not None:
            print_breakdown(f"{c.op} {c.shape}: {c.base_name}", c.base)
    torch.cuda.empty_cache()


def goal_rounds(tk, groups: list[str], rounds: int = 7) -> None:
    """The `GOALS` shapes: invariant and baseline timed one after the other, `rounds` times (clock and
    power drift hit both sides of a round alike); the median of the per-round ratios."""
    print(f"\n## Goal shapes: invariant and baseline alternately, {rounds} rounds (ms; median of round ratios)")
    print("| op | shape | invariant ms (min / median / max) | baseline ms (min / median / max) | median ratio |")
    print("|---|---|---|---|---|")
    for c in _selected(tk, GOALS, groups):
        ti, tb = [], []
        for _ in range(rounds):
            ti.append(time_ms(c.inv, c.sets, c.graph))
            tb.append(time_ms(c.base, c.sets, c.graph))
        spread = lambda xs: f"{min(xs):.4f} / {statistics.median(xs):.4f} / {max(xs):.4f}"  # noqa: E731
        ratio = statistics.median(a / b for a, b in zip(ti, tb))
        print(f"| {c.op} | {c.shape} | {spread(ti)} | {spread(tb)} | {ratio:.3f}x |")
        sys.stdout.flush()
    torch.cuda.empty_cache()


def host_us(fn: Callable[[int], object], reps: int = 50) -> float:
    """Median host time of one eager call in microseconds: the device idle before each call (synchronised, not
    counted), the clock read when the call returns (argument handling, descriptors, launches; not the kernels)."""
    import time

    for _ in range(3):
        fn(0)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(0)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def host_times(tk, groups: list[str]) -> None:
    """The `HOST` shapes: host microseconds per eager call, invariant and baseline."""
    print("\n## Host time per eager call (us; median of 50, device idle before each call)")
    print("| op | shape | invariant us | baseline | baseline us | invariant / baseline |\n|---|---|---|---|---|---|")
    for c in _selected(tk, HOST, groups):
        hi = host_us(c.inv)
        hb = host_us(c.base) if c.base is not None else float("nan")
        print(f"| {c.op} | {c.shape} | {hi:.1f} | {c.base_name} | {hb:.1f} | {hi / hb:.2f}x |")
        sys.stdout.flush()
    torch.cuda.empty_cache()


def ceilings() -> tuple[float, float]:
    """(copy bandwidth bytes/s counting read + write, bf16 matmul FLOP/s) measured here."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    t = time_ms(lambda i: y.copy_(x), 1, graph=False, reps=20)
    bw = 2 * x.numel() / (t * 1e-3)
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    t = time_ms(lambda i: a @ b, 1, graph=False, reps=20)
    del x, y
    return bw, 2 * 8192**3 / (t * 1e-3)


def rnd(*shape, dtype=BF16, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=DEV, dtype=torch.float32).mul_(scale).to(dtype)


# --- cases ----------------------------------------------------------------------------------------

GEMM_SHAPES = {  # (N, K): where it occurs
    "k3-small up (1024x384)": (1024, 384),
    "k3-small down (384x1024)": (384, 1024),
    "4096x4096": (4096, 4096),
    "k3-full 7168x7168": (7168, 7168),
    "k3-full kda qkv (12288x7168)": (12288, 7168),
}
TOKENS = (1, 64, 4096)


def linear_cases(tk) -> list[Case]:
    out = []
    for name, (n, k) in GEMM_SHAPES.items():
        for m in TOKENS:
            nb = 2 * (m * k + n * k + m * n)
            s = _sets(nb)
            xs = [rnd(m, k) for _ in range(s)]
            ws = [rnd(n, k, scale=k**-0.5) for _ in range(s)]
            out.append(Case("linear", f"{name} M={m}", lambda i, xs=xs, ws=ws: tk.TRITON.linear(xs[i], ws[i]),
                            lambda i, xs=xs, ws=ws: torch.matmul(xs[i], ws[i].t()), "cuBLAS", 2.0 * m * n * k, nb, s))
    n = k = 7168
    m = 8192  # the prefill goal shape
    x, w = rnd(m, k), rnd(n, k, scale=k**-0.5)
    out.append(Case("linear", f"k3-full 7168x7168 M={m}", lambda i, x=x, w=w: tk.TRITON.linear(x, w),
                    lambda i, x=x, w=w: torch.matmul(x, w.t()), "cuBLAS", 2.0 * m * n * k, 2 * (m * k + n * k + m * n), 1))
    from parity.kernels.linear import LoRA

    for m in (1, 4096):
        x, w = rnd(m, k), rnd(n, k, scale=k**-0.5)
        lo = LoRA(rnd(16, k, scale=k**-0.5), rnd(n, 16, scale=0.25), 0.5)
        out.append(Case("linear+lora r16", f"7168x7168 M={m}", lambda i, x=x, w=w, lo=lo: tk.TRITON.linear(x, w, lo),
                        lambda i, x=x, w=w, lo=lo: torch.matmul(x, w.t()) + torch.matmul(torch.matmul(x, lo.a.t()), lo.b.t()) * lo.scale,
                        "cuBLAS x3", 2.0 * m * n * k, 2 * (m * k + n * k + m * n), 1))
    return out


def rowwise_cases(tk) -> list[Case]:
    out = []
    for d in (384, 7168):
        for m in TOKENS:
            nb = 2 * 2 * m * d
            s = _sets(nb)
            xs = [rnd(m, d) for _ in range(s)]
            w = rnd(d)
            out.append(Case("rmsnorm", f"D={d} M={m}", lambda i, xs=xs, w=w: tk.TRITON.rmsnorm(xs[i], w, 1e-6),
                            lambda i, xs=xs, w=w: F.rms_norm(xs[i], (xs[i].shape[-1],), w, 1e-6), "F.rms_norm", 0, nb, s))
    for inter in (1024, 3072):
        for m in TOKENS:
            nb = 2 * 3 * m * inter
            s = _sets(nb)
            gs = [rnd(m, inter) for _ in range(s)]
            us = [rnd(m, inter) for _ in range(s)]

            def situ_torch(i, gs=gs, us=us):
                g, u = gs[i].float(), us[i].float()
                return (4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))).to(BF16)

            out.append(Case("situ_glu", f"I={inter} M={m}", lambda i, gs=gs, us=us: tk.TRITON.situ_glu(gs[i], us[i], 4.0, 25.0),
                            situ_torch, "torch eager", 0, nb, s))
    return out


def conv_cases(tk) -> list[Case]:
    out = []
    for name, d in (("k3-small", 3 * 384), ("k3-full", 3 * 12288)):
        for t in TOKENS:
            nb = 2 * 2 * t * d
            s = _sets(nb)
            xs = [rnd(1, t, d) for _ in range(s)]
            w = rnd(d, 4)
            st = rnd(1, 3, d)

            def base(i, xs=xs, w=w, st=st):
                xx = torch.cat([st, xs[i]], 1).transpose(1, 2)
                return F.silu(F.conv1d(xx, w.unsqueeze(1), groups=w.shape[0])).transpose(1, 2)

            out.append(Case("short_conv", f"{name} D={d} T={t}", lambda i, xs=xs, w=w, st=st: tk.TRITON.short_conv(xs[i], w, st),
                            base, "F.conv1d", 0, nb, s))
    return out


def kda_inputs(t: int, h: int, d: int) -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta, s0) for KDA at T = t: unit-norm bf16 q, k; fp32 log-decay in (-5, 0)."""
    q = F.normalize(rnd(1, t, h, d, dtype=torch.float32), dim=-1).to(BF16)
    k = F.normalize(rnd(1, t, h, d, dtype=torch.float32), dim=-1).to(BF16)
    v = rnd(1, t, h, d)
    g = -5.0 * torch.sigmoid(rnd(1, t, h, d, dtype=torch.float32))
    beta = torch.sigmoid(rnd(1, t, h, dtype=torch.float32)).to(BF16)
    return q, k, v, g, beta, torch.zeros(1, h, d, d, device=DEV)


def kda_cases(tk) -> list[Case]:
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as e:  # noqa: BLE001
        print(f"# fla not importable ({e!r}); KDA baselines skipped")
        chunk_kda = fused_recurrent_kda = None
    out = []
    shapes = [("k3-small", 6, 64, t, BF16) for t in (1, 64, 4096)]
    shapes += [("goal H=16 d=128", 16, 128, t, BF16) for t in (1, 64, 4096, 16384, 65536)]
    shapes += [("goal H=16 d=128 fp32 q,k", 16, 128, t, torch.float32) for t in (1, 4096)]  # the model's cast points
    for name, h, d, t, qk_dtype in shapes:
        q, k, v, g, beta, s0 = kda_inputs(t, h, d)
        q, k = q.to(qk_dtype), k.to(qk_dtype)
        fv, fbeta = v.to(qk_dtype), beta.to(qk_dtype)  # fla takes one dtype: its own upcast of v, beta (exact)
        st = s0
        if t == 1:  # decode: the pending chunk holds 40 earlier tokens
            pre = [x.repeat(1, 40, *([1] * (x.dim() - 2))) for x in (q, k, v, g, beta)]
            _, st = tk.TRITON.kda(*pre, d**-0.5, s0)
        base = None
        bname = "fla (n/a)"
        if t > 1 and chunk_kda is not None:
            base = lambda i, q=q, k=k, v=fv, g=g, beta=fbeta, s0=s0: chunk_kda(q, k, v, g, beta, scale=d**-0.5, initial_state=s0, output_final_state=True)  # noqa: E731,E501
            bname = "fla chunk_kda"
        elif chunk_kda is not None:
            base = lambda i, q=q, k=k, v=fv, g=g, beta=fbeta, s0=s0: fused_recurrent_kda(q, k, v, g, beta, scale=d**-0.5, initial_state=s0, output_final_state=True)  # noqa: E731,E501
            bname = "fla fused_recurrent_kda"
        nb = 2 * (3 * t * h * d + t * h) + 4 * t * h * d + 2 * 4 * h * d * d
        fl = 4.0 * t * h * d * d
        out.append(Case("kda", f"{name} T={t}", lambda i, q=q, k=k, v=v, g=g, beta=beta, st=st: tk.TRITON.kda(q, k, v, g, beta, d**-0.5, st),
                        base, bname, fl, nb, 1, graph=False, kernel_time=True))
    out += kda_decode_cases(tk, fused_recurrent_kda)
    return out


def kda_decode_cases(tk, fused_recurrent_kda) -> list[Case]:
    """One decode step of a batch of 64 sequences at k3-1b's KDA shape (12 heads x 128, fp32 q, k as the model
    passes them), each with 40 tokens pending in its chunk: the invariant op (the chunk recomputed) against fla's
    recurrent step."""
    b, h, d = 64, 12, 128
    q, k, v, g, beta, s0 = (x.expand(b, *x.shape[1:]).contiguous() for x in kda_inputs(1, h, d))
    q, k = q.float(), k.float()
    pre = [x.repeat(1, 40, *([1] * (x.dim() - 2))) for x in (q, k, v, g, beta)]
    _, st = tk.TRITON.kda(*pre, d**-0.5, s0)
    base = None
    if fused_recurrent_kda is not None:
        fv, fbeta = v.float(), beta.float()  # fla takes one dtype
        base = lambda i: fused_recurrent_kda(q, k, fv, g, fbeta, scale=d**-0.5, initial_state=s0, output_final_state=True)  # noqa: E731,E501
    return [Case("kda", f"k3-1b decode B={b} H={h} d={d} fp32 q,k T=1", lambda i: tk.TRITON.kda(q, k, v, g, beta, d**-0.5, st),
                 base, "fla fused_recurrent_kda", 4.0 * b * h * d * d, 4 * b * h * d * d * 2, 1, graph=False, kernel_time=True)]


def attention_cases(tk) -> list[Case]:
    out = []
    h, d, dv = 16, 192, 128
    for name, b, tq, s_len in (("prefill", 1, 4096, 4096), ("prefill", 1, 16384, 16384), ("chunk 64", 1, 64, 4096),
                               ("decode B=8", 8, 1, 4096), ("decode B=64", 64, 1, 4096)):
        q = rnd(b, tq, h, d)
        k, v = rnd(b, s_len, h, d), rnd(b, s_len, h, dv)
        pos = (torch.arange(s_len - tq, s_len, device=DEV)).expand(b, tq).contiguous()
        lens = torch.full((b,), s_len, device=DEV)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if tq == s_len:
            base = lambda i, qt=qt, kt=kt, vt=vt: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=d**-0.5)  # noqa: E731,E501
        elif tq == 1:
            base = lambda i, qt=qt, kt=kt, vt=vt: F.scaled_dot_product_attention(qt, kt, vt, scale=d**-0.5)  # noqa: E731
        else:
            from torch.nn.attention.bias import causal_lower_right

            bias = causal_lower_right(tq, s_len)
            base = lambda i, qt=qt, kt=kt, vt=vt, bias=bias: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias, scale=d**-0.5)  # noqa: E731,E501
        pairs = b * tq * (s_len - tq) + b * tq * (tq + 1) / 2
        fl = 2.0 * pairs * h * (d + dv)
        nb = 2 * (b * tq * h * (d + dv) + b * s_len * h * (d + dv))
        out.append(Case("attention", f"{name} Tq={tq} S={s_len} H={h} d={d}/{dv}",
                        lambda i, q=q, k=k, v=v, pos=pos, lens=lens: tk.TRITON.attention(q, k, v, pos, lens, d**-0.5),
                        base, "SDPA", fl, nb, 1))
        if name.startswith("decode B=64"):  # the same keys in a shuffled paged cache of 64-token pages
            page = 64
            nblk = b * s_len // page
            perm = torch.randperm(nblk, device=DEV)
            kc = torch.empty(nblk, page, h, d, device=DEV, dtype=BF16)
            vc = torch.empty(nblk, page, h, dv, device=DEV, dtype=BF16)
            kc[perm] = k.reshape(nblk, page, h, d)
            vc[perm] = v.reshape(nblk, page, h, dv)
            table = perm.view(b, s_len // page)
            out.append(Case("attention paged", f"{name} page={page} Tq={tq} S={s_len} H={h} d={d}/{dv}",
                            lambda i, q=q, kc=kc, vc=vc, table=table, pos=pos, lens=lens: tk.attention_paged(q, kc, vc, table, pos, lens, d**-0.5),
                            base, "SDPA (contiguous)", fl, nb, 1))
    return out + absorbed_mla_cases(tk)


def absorbed_mla_cases(tk) -> list[Case]:
    """MLA decode in the absorbed form (K3's latent attention: every query head reads one shared 512 + 64 latent per
    position, values the latent's first 512; heads folded into the query rows, as the model runs it) against the
    expanded form the `attention` rows time (16 heads of 192 / 128 per position), batch 64 at 4096 positions."""
    b, h, s_len, lat, dv, d, dve = 64, 16, 4096, 576, 512, 192, 128
    q = rnd(b, h, 1, lat)
    latents = rnd(b, s_len, 1, lat)
    rows = torch.full((b, h), s_len - 1, device=DEV)
    lens = torch.full((b,), s_len, device=DEV)
    qe, ke, ve = rnd(b, 1, h, d), rnd(b, s_len, h, d), rnd(b, s_len, h, dve)
    pos = torch.full((b, 1), s_len - 1, device=DEV)
    fl = 2.0 * b * h * s_len * (lat + dv)
    nb = 2.0 * b * s_len * lat
    return [Case("attention absorbed MLA", f"decode B={b} H={h} S={s_len} latent {lat}/{dv}",
                 lambda i: tk.TRITON.attention(q, latents, latents[..., :dv], rows, lens, lat**-0.5),
                 lambda i: tk.TRITON.attention(qe, ke, ve, pos, lens, d**-0.5), f"invariant expanded ({h} x {d}/{dve})",
                 fl, nb, 1)]


def misc_cases(tk) -> list[Case]:
    out = []
    n_c, d = 8, 7168
    for m in TOKENS:
        nb = 2 * (n_c * m * d + m * d)
        s = _sets(nb)
        cs = [rnd(m, n_c, d) for _ in range(s)]
        nw, pw = rnd(d), rnd(d, scale=d**-0.5)

        def base(i, cs=cs, nw=nw, pw=pw):
            c = cs[i].float()
            sc = (F.rms_norm(c, (d,), nw.float(), 1e-6) @ pw.float()).softmax(-1)
            return torch.einsum("nc,ncd->nd", sc, c).to(BF16)

        out.append(Case("attn_res_mix", f"n=8 D={d} N={m}", lambda i, cs=cs, nw=nw, pw=pw: tk.TRITON.attn_res_mix(cs[i], nw, pw, 1e-6),
                        base, "torch eager", 0, nb, s))
    for m in TOKENS:
        logits = rnd(m, 896, dtype=torch.float32)
        bias = rnd(896, dtype=torch.float32, scale=0.01)

        def base(i, logits=logits, bias=bias):
            sc = torch.sigmoid(logits)
            ids = torch.topk(sc + bias, 16, dim=-1).indices
            w = sc.gather(1, ids)
            return ids, w / w.sum(-1, keepdim=True) * 2.5

        out.append(Case("route", f"E=896 k=16 N={m}", lambda i, logits=logits, bias=bias: tk.TRITON.route(logits, bias, 16, True, 2.5, "sigmoid"),
                        base, "torch topk", 0, 4 * m * 896, 1))
    vocab = 163840
    for m in TOKENS:
        nb = 4 * m * vocab
        s = _sets(nb)
        ls = [rnd(m, vocab, dtype=torch.float32, scale=3.0) for _ in range(s)]
        toks = torch.randint(0, vocab, (m,), device=DEV)
        out.append(Case("token_logprobs", f"V={vocab} fp32 N={m}", lambda i, ls=ls, toks=toks: tk.TRITON.token_logprobs(ls[i], toks, 1.0),
                        lambda i, ls=ls, toks=toks: torch.log_softmax(ls[i] / 1.0, -1).gather(1, toks[:, None]), "torch log_softmax",
                        0, nb, s))
    from parity.kernels.triton.checksum import word_mix_sum
    from parity.sync import checksum as ck

    words = torch.randint(-(2**62), 2**62, (1 << 27,), dtype=torch.int64, device=DEV)  # 1 GiB of weights
    consts = (ck._C1, ck._C2, ck._C3, ck._C4)
    out.append(Case("sync checksum", "1 GiB", lambda i: word_mix_sum(words, *consts),
                    lambda i: ck._mix_sum(words, 0), "torch int64 passes", 0, words.numel() * 8, 1, graph=False))
    return out


def moe_cases(tk) -> list[Case]:
    out = []
    e, lat, inter, topk = 64, 3584, 3072, 16
    w1, w3 = rnd(e, inter, lat, scale=lat**-0.5), rnd(e, inter, lat, scale=lat**-0.5)
    w2 = rnd(e, lat, inter, scale=inter**-0.5)
    grouped = getattr(torch, "_grouped_mm", None)
    for m in TOKENS:
        x = rnd(m, lat)
        ids, wts = tk.TRITON.route(rnd(m, e, dtype=torch.float32), None, topk, True, 2.5, "sigmoid")

        def base(i, x=x, ids=ids, wts=wts, m=m):
            flat = ids.reshape(-1)
            order = torch.sort(flat, stable=True).indices
            rows = x[order // topk]
            counts = torch.bincount(flat, minlength=e)
            if grouped is not None:
                offs = torch.cumsum(counts, 0).to(torch.int32)
                a = grouped(rows, w1.transpose(1, 2), offs=offs)
                c = grouped(rows, w3.transpose(1, 2), offs=offs)
                hmid = (4.0 * torch.tanh(a.float() / 4) * torch.sigmoid(a.float()) * 25.0 * torch.tanh(c.float() / 25)).to(BF16)
                y = grouped(hmid, w2.transpose(1, 2), offs=offs)
            else:
                raise RuntimeError("no torch._grouped_mm")
            ys = torch.empty_like(y)
            ys[order] = y
            return (ys.view(m, topk, lat).float() * wts.unsqueeze(-1)).sum(1).to(BF16)

        touched = min(e, m * topk)
        nb = 2 * (3 * touched * lat * inter + 2 * m * lat)
        out.append(Case("moe experts", f"E={e} L={lat} I={inter} k={topk} N={m}",
                        lambda i, x=x, ids=ids, wts=wts: tk.experts(x, ids, wts, w1, w3, w2, "situ", 4.0, 25.0),
                        base, "torch._grouped_mm" if grouped else "n/a", 2.0 * 3 * m * topk * lat * inter, nb, 1, graph=False))
    return out


MXFP4_SHAPES = {  # (N, K) of one routed expert's GEMMs
    "k3-small expert w1/w3 (64x128)": (64, 128),
    "k3-full expert w1/w3 (3072x3584)": (3072, 3584),
    "k3-full expert w2 (3584x3072)": (3584, 3072),
}


def mxfp4_cases(tk) -> list[Case]:
    """The MXFP4 expert GEMM (packed weights dequantised in the kernel) against the invariant bf16 GEMM on the
    dequantised weight (the same MMAs: the bits it must equal) and against cuBLAS bf16."""
    from parity.quant import mxfp4

    out = []
    for name, (n, k) in MXFP4_SHAPES.items():
        for m in TOKENS:
            nb = 2 * (m * k + m * n) + n * k // 2 + n * k // 32
            s = _sets(nb)
            xs = [rnd(m, k) for _ in range(s)]
            qs = [mxfp4.quantize(rnd(n, k, dtype=torch.float32, scale=k**-0.5)) for _ in range(s)]
            ds = [q.dequantize(BF16) for q in qs]
            out.append(Case("linear mxfp4", f"{name} M={m}", lambda i, xs=xs, qs=qs: tk.TRITON.linear(xs[i], qs[i]),
                            lambda i, xs=xs, ds=ds: tk.TRITON.linear(xs[i], ds[i]), "invariant bf16",
                            2.0 * m * n * k, nb, s))
            out.append(Case("linear mxfp4", f"{name} M={m}", lambda i, xs=xs, qs=qs: tk.TRITON.linear(xs[i], qs[i]),
                            lambda i, xs=xs, ds=ds: torch.matmul(xs[i], ds[i].t()), "cuBLAS bf16",
                            2.0 * m * n * k, nb, s))
    e, lat, inter, topk = 64, 3584, 3072, 16
    quant = [mxfp4.MXFP4Weight.stack([mxfp4.quantize(rnd(*shape, dtype=torch.float32, scale=shape[1] ** -0.5))
                                      for _ in range(e)]) for shape in ((inter, lat), (inter, lat), (lat, inter))]
    dense = [q.dequantize(BF16) for q in quant]
    for m in TOKENS:
        x = rnd(m, lat)
        ids, wts = tk.TRITON.route(rnd(m, e, dtype=torch.float32), None, topk, True, 2.5, "sigmoid")
        touched = min(e, m * topk)
        nb = 3 * touched * lat * inter * 17 // 32 + 4 * m * lat
        out.append(Case("moe experts mxfp4", f"E={e} L={lat} I={inter} k={topk} N={m}",
                        lambda i, x=x, ids=ids, wts=wts: tk.experts(x, ids, wts, *quant, "situ", 4.0, 25.0),
                        lambda i, x=x, ids=ids, wts=wts: tk.experts(x, ids, wts, *dense, "situ", 4.0, 25.0),
                        "invariant bf16 experts", 2.0 * 3 * m * topk * lat * inter, nb, 1, graph=False))
    return out


def dsa_cases(tk) -> list[Case]:
    """K3.1 Pro's sparse MLA against dense MLA attention on the same latents: one layer at TP 8 (96 / 8 = 12 query
    heads, latents 512 + 64, values 512), index 32 heads x 128, top-k 2048; decode B = 8 and a 1024-token prefill
    chunk at the end of 16k and 64k contexts. Rows: the whole sparse path (index scores, the top-k positions, sparse
    attention), the sparse attention alone, the selection alone; the baseline is the dense invariant attention."""
    from parity.kernels.dsa import top_positions
    from parity.quant import fp8

    h, lat, dv, nh, di, topk = 12, 576, 512, 32, 128, 2048
    scale = 192 ** -0.5
    out = []
    for s_len in (16384, 65536):
        for name, b, tq in (("decode B=8", 8, 1), ("prefill chunk", 1, 1024)):
            latents = rnd(b, s_len, 1, lat)
            keys = fp8.round_trip_scaled(rnd(b, s_len, di))
            q = rnd(b, tq, h, lat)
            qi = fp8.round_trip_scaled(rnd(b, tq, nh, di))
            w = rnd(b, tq, nh, dtype=torch.float32)
            pos = torch.arange(s_len - tq, s_len, device=DEV).expand(b, tq).contiguous()
            lens = torch.full((b,), s_len, device=DEV)
            rows = pos.repeat_interleave(h, dim=1)

            def select(i, qi=qi, w=w, keys=keys, pos=pos, lens=lens):
                return top_positions(tk.TRITON.index_scores(qi, w, keys, pos, lens), topk)

            sel, count = select(0)

            def dense(i, q=q, latents=latents, rows=rows, lens=lens, b=b, tq=tq):
                return tk.TRITON.attention(q.view(b, tq * h, 1, lat), latents, latents[..., :dv], rows, lens, scale)

            def sparse(i, q=q, latents=latents, sel=sel, count=count):
                return tk.TRITON.sparse_attention(q, latents, sel, count, dv, scale)

            def whole(i, q=q, latents=latents, select=select):
                return tk.TRITON.sparse_attention(q, latents, *select(i), dv, scale)

            dense_fl = 2.0 * b * tq * h * s_len * (lat + dv)
            sparse_fl = 2.0 * b * tq * h * topk * (lat + dv)
            score_fl = 2.0 * b * tq * nh * di * s_len
            lat_bytes, key_bytes = 2.0 * b * s_len * lat, 2.0 * b * s_len * di
            shape = f"{name} Tq={tq} S={s_len} H={h} d={lat}/{dv} top-k={topk}"
            out += [Case("dsa: scores + top-k + sparse attention", shape, whole, dense, "dense invariant attention",
                         sparse_fl + score_fl, key_bytes + min(lat_bytes, 2.0 * b * tq * topk * lat), 1),
                    Case("dsa: sparse attention alone", shape, sparse, dense, "dense invariant attention", sparse_fl,
                         min(lat_bytes, 2.0 * b * tq * topk * lat), 1),
                    Case("dsa: index scores + top-k alone", shape, select, None, "-", score_fl, key_bytes, 1)]
    return out


ALL = {"linear": linear_cases, "kda": kda_cases, "attention": attention_cases, "rowwise": rowwise_cases,
       "conv": conv_cases, "misc": misc_cases, "moe": moe_cases, "mxfp4": mxfp4_cases, "dsa": dsa_cases}


# --- GEMM config sweep ----------------------------------------------------------------------------

SWEEP_SHAPES = {nm: nk for nm, nk in GEMM_SHAPES.items() if nk[0] >= 4096}


def _sweep_shape(tk, name: str, n: int, k: int, cands: list, tokens: tuple[int, ...]) -> None:
    """Times of each candidate at each M vs cuBLAS, and whether its 4096-row product has the bits of the
    tile `gemm_config` picks at M = 4096 (a candidate for the other side of SPLIT_MAX_M must)."""
    lin = tk.linear
    print(f"\n### {name}\n| config | " + " | ".join(f"M={m}" for m in tokens) + " | worst ratio | bits = M=4096 tile |")
    print("|---|" + "---|" * (len(tokens) + 2))
    base, data = {}, {}
    for m in tokens:
        s = _sets(2 * (m * k + n * k + m * n))
        data[m] = ([rnd(m, k) for _ in range(s)], [rnd(n, k, scale=k**-0.5) for _ in range(s)])
        xs, ws = data[m]
        base[m] = time_ms(lambda i, xs=xs, ws=ws: torch.matmul(xs[i], ws[i].t()), s, True)
    print("| cuBLAS | " + " | ".join(f"{base[m]:.4f}" for m in tokens) + " | 1.00 | - |")
    x4, w4 = rnd(4096, k), rnd(n, k, scale=k**-0.5)
    ref = lin.matmul(x4, w4, config=lin.gemm_config(n, k, BF16, 4096))
    for c in cands:
        try:
            ts = {}
            for m in tokens:
                xs, ws = data[m]
                ts[m] = time_ms(lambda i, xs=xs, ws=ws, c=c: lin.matmul(xs[i], ws[i], config=c), len(xs), True)
            worst = max(ts[m] / base[m] for m in tokens)
            same = torch.equal(lin.matmul(x4, w4, config=c), ref)
            print(f"| {c} | " + " | ".join(f"{ts[m]:.4f} ({ts[m] / base[m]:.2f})" for m in tokens)
                  + f" | {worst:.2f} | {same} |")
        except Exception as e:  # noqa: BLE001
            print(f"| {c} | failed: {type(e).__name__}: {str(e)[:80]} |")
        sys.stdout.flush()


def sweep(tk) -> None:
    """GEMM tiles: decode candidates (64-row tiles) at M = 1, 64 and prefill candidates (128-row tiles)
    at M = 4096, per weight shape of at least 4096 x 4096."""
    cfg = tk.linear.GemmConfig
    decode = [cfg(64, 128, 64, 8, 4, 4, True), cfg(64, 64, 64, 8, 4, 4, True), cfg(64, 128, 64, 8, 4, 6, True),
              cfg(64, 256, 64, 8, 4, 3, True)]
    prefill = [cfg(128, 256, 64, 8, 8, 4, True), cfg(128, 256, 64, 8, 8, 3, True), cfg(128, 128, 64, 8, 8, 4, True)]
    print("\n## GEMM tile sweep (bf16; ms, and ratio to cuBLAS in parentheses)")
    for name, (n, k) in SWEEP_SHAPES.items():
        _sweep_shape(tk, f"{name}: decode tiles", n, k, decode, (1, 64))
        _sweep_shape(tk, f"{name}: prefill tiles", n, k, prefill, (4096,))
        torch.cuda.empty_cache()


def main_table(tk, groups: list[str], bw: float, peak: float) -> None:
    """One row per case of each op group: floor, invariant and baseline times, their ratio (and for
    host-bound ops the summed GPU kernel times)."""
    print("\n| op | shape | floor ms | invariant ms | rate | baseline | baseline ms | invariant / baseline |")
    print("|---|---|---|---|---|---|---|---|")
    for group in groups:
        try:
            cases = ALL[group](tk)
        except Exception as e:  # noqa: BLE001
            print(f"| {group} | setup failed: {type(e).__name__}: {str(e)[:120]} |")
            continue
        for c in cases:
            floor = max(c.bytes / bw, c.flops / peak) * 1e3
            try:
                ti = time_ms(c.inv, c.sets, c.graph)
                mi = LAST_MODE
            except Exception as e:  # noqa: BLE001
                print(f"| {c.op} | {c.shape} | failed: {type(e).__name__}: {str(e)[:120]} |")
                continue
            rate = f"{c.flops / ti / 1e9:.0f} TFLOP/s" if c.flops and c.flops / peak > c.bytes / bw else f"{c.bytes / ti / 1e6:.0f} GB/s"
            tb, ratio = "-", "-"
            if c.base is not None:
                try:
                    tbv = time_ms(c.base, c.sets, c.graph)
                    tb, ratio = f"{tbv:.4f}{'' if LAST_MODE == 'graph' else ' (eager)'}", f"{ti / tbv:.2f}x"
                except Exception as e:  # noqa: BLE001
                    tb = f"failed: {type(e).__name__}: {str(e)[:60]}"
            print(f"| {c.op} | {c.shape} | {floor:.4f} | {ti:.4f}{'' if mi == 'graph' else ' (eager)'} | {rate} | {c.base_name} | {tb} | {ratio} |")
            if c.kernel_time:
                try:
                    ki = kernel_ms(c.inv)
                    kb = kernel_ms(c.base) if c.base is not None else float("nan")
                    print(f"| {c.op} (GPU kernel time) | {c.shape} | {floor:.4f} | {ki:.4f} | - | {c.base_name} | {kb:.4f} | {ki / kb:.2f}x |")
                except Exception as e:  # noqa: BLE001
                    print(f"| {c.op} (GPU kernel time) | {c.shape} | failed: {type(e).__name__}: {str(e)[:100]} |")
            sys.stdout.flush()
        del cases
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also sweep GEMM tile configs")
    ap.add_argument("--profile", action="store_true", help="also list per-kernel GPU times (PROFILED shapes)")
    ap.add_argument("--goals", action="store_true", help="also time the GOALS shapes alternately with baselines")
    ap.add_argument("--host", action="store_true", help="also time the host side of eager calls (HOST shapes)")
    ap.add_argument("--no-table", action="store_true", help="skip the main table (with --goals / --profile / --host)")
    ap.add_argument("--only", default=",".join(ALL), help=f"comma list of {','.join(ALL)}")
    args = ap.parse_args()
    import triton

    import parity.kernels.triton as tk

    props = torch.cuda.get_device_properties(0)
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {props.name}, {props.multi_processor_count} SMs; "
          f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}")
    torch.manual_seed(0)
    bw, peak = ceilings()
    print(f"# ceilings measured here: copy {bw / 1e12:.2f} TB/s (read + write), bf16 matmul 8192^3 {peak / 1e12:.0f} TFLOP/s")
    groups = [g for g in args.only.split(",") if g]
    if not args.no_table:
        main_table(tk, groups, bw, peak)
    if args.goals:
        goal_rounds(tk, groups)
    if args.host:
        host_times(tk, groups)
    if args.profile:
        profile_kernels(tk, groups)
    if args.sweep:
        sweep(tk)


if __name__ == "__main__":
    main()
