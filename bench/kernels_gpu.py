"""Invariant Triton kernels vs the fastest non-invariant baselines on one GPU, measured in the same run.

Baselines: cuBLAS (torch.matmul), torch RMSNorm (F.rms_norm), SDPA, fla chunk_kda / fused_recurrent_kda
(if fla-core is importable), torch.log_softmax, torch.topk, F.conv1d, torch._grouped_mm (or a per-expert
matmul loop). Shapes: M = 1, 64, 4096 tokens at K3-small and K3-full layer widths, bf16.

Method (the device's METHOD.md): the two ceilings are measured first (device-to-device copy bandwidth,
bf16 8192^3 cuBLAS rate) and each case prints its floor max(bytes / BW, flops / peak) from the bytes
each input and output must move once; inputs rotate over enough copies to exceed 3x the L2; each
timing is the median of many runs, replayed from a CUDA graph when the op can be captured (so Python
launch cost is not counted for either side), else timed eagerly with CUDA events.

Usage: python bench/kernels_gpu.py [--sweep] [--only OPS] [--out FILE]
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
    from parity.kernels.linear import LoRA

    n = k = 7168
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


def kda_cases(tk) -> list[Case]:
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as e:  # noqa: BLE001
        print(f"# fla not importable ({e!r}); KDA baselines skipped")
        chunk_kda = fused_recurrent_kda = None
    out = []
    for name, h, d in (("k3-small", 6, 64), ("goal H=16 d=128", 16, 128)):
        for t in (1, 64, 4096):
            q = F.normalize(rnd(1, t, h, d, dtype=torch.float32), dim=-1).to(BF16)
            k = F.normalize(rnd(1, t, h, d, dtype=torch.float32), dim=-1).to(BF16)
            v = rnd(1, t, h, d)
            g = -5.0 * torch.sigmoid(rnd(1, t, h, d, dtype=torch.float32))
            beta = torch.sigmoid(rnd(1, t, h, dtype=torch.float32)).to(BF16)
            s0 = torch.zeros(1, h, d, d, device=DEV)
            st = s0
            if t == 1:  # decode: the pending chunk holds 40 earlier tokens
                pre = [x.repeat(1, 40, *([1] * (x.dim() - 2))) for x in (q, k, v, g, beta)]
                _, st = tk.TRITON.kda(*pre, d**-0.5, s0)
            base = None
            bname = "fla (n/a)"
            if t > 1 and chunk_kda is not None:
                base = lambda i, q=q, k=k, v=v, g=g, beta=beta, s0=s0: chunk_kda(q, k, v, g, beta, scale=d**-0.5, initial_state=s0, output_final_state=True)  # noqa: E731,E501
                bname = "fla chunk_kda"
            elif chunk_kda is not None:
                base = lambda i, q=q, k=k, v=v, g=g, beta=beta, s0=s0: fused_recurrent_kda(q, k, v, g, beta, scale=d**-0.5, initial_state=s0, output_final_state=True)  # noqa: E731,E501
                bname = "fla fused_recurrent_kda"
            nb = 2 * (3 * t * h * d + t * h) + 4 * t * h * d + 2 * 4 * h * d * d
            fl = 4.0 * t * h * d * d
            out.append(Case("kda", f"{name} T={t}", lambda i, q=q, k=k, v=v, g=g, beta=beta, st=st: tk.TRITON.kda(q, k, v, g, beta, d**-0.5, st),
                            base, bname, fl, nb, 1, graph=False, kernel_time=True))
    return out


def attention_cases(tk) -> list[Case]:
    out = []
    h, d, dv = 16, 192, 128
    for name, b, tq, s_len in (("prefill", 1, 4096, 4096), ("chunk 64", 1, 64, 4096), ("decode B=8", 8, 1, 4096),
                               ("decode B=64", 64, 1, 4096)):
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
    return out


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


ALL = {"linear": linear_cases, "kda": kda_cases, "attention": attention_cases, "rowwise": rowwise_cases,
       "conv": conv_cases, "misc": misc_cases, "moe": moe_cases}


# --- GEMM config sweep ----------------------------------------------------------------------------

def sweep(tk) -> None:
    """Time candidate tile configs (each one fixed for all M) at M = 1, 64, 4096 per weight shape."""
    cfg = tk.linear.GemmConfig
    cands = [cfg(128, 128, 64, 8, 8, 4, True), cfg(128, 128, 64, 8, 4, 4, True), cfg(128, 128, 64, 16, 8, 5, True),
             cfg(128, 256, 64, 8, 8, 4, True), cfg(128, 128, 128, 8, 8, 3, True), cfg(64, 128, 64, 8, 4, 4, True),
             cfg(128, 64, 64, 8, 4, 4, True), cfg(128, 128, 64, 8, 8, 4, True, k_segments=1)]
    shapes = {nm: nk for nm, nk in GEMM_SHAPES.items() if "12288" not in nm and "down" not in nm}
    print("\n## GEMM tile sweep (bf16; ms, and ratio to cuBLAS in parentheses)")
    for name, (n, k) in shapes.items():
        print(f"\n### {name}\n| config | " + " | ".join(f"M={m}" for m in TOKENS) + " | worst ratio |\n|---|---|---|---|---|")
        base = {}
        data = {}
        for m in TOKENS:
            s = _sets(2 * (m * k + n * k + m * n))
            data[m] = ([rnd(m, k) for _ in range(s)], [rnd(n, k, scale=k**-0.5) for _ in range(s)])
            xs, ws = data[m]
            base[m] = time_ms(lambda i, xs=xs, ws=ws: torch.matmul(xs[i], ws[i].t()), s, True)
        print("| cuBLAS | " + " | ".join(f"{base[m]:.4f}" for m in TOKENS) + " | 1.00 |")
        best = None
        for c in cands:
            try:
                ts = {}
                for m in TOKENS:
                    xs, ws = data[m]
                    ts[m] = time_ms(lambda i, xs=xs, ws=ws, c=c: tk.linear.matmul(xs[i], ws[i], config=c), len(xs), True)
                worst = max(ts[m] / base[m] for m in TOKENS)
                print(f"| {c} | " + " | ".join(f"{ts[m]:.4f} ({ts[m] / base[m]:.2f})" for m in TOKENS) + f" | {worst:.2f} |")
                if best is None or worst < best[0]:
                    best = (worst, c)
            except Exception as e:  # noqa: BLE001
                print(f"| {c} | failed: {type(e).__name__}: {str(e)[:80]} |")
        print(f"\nbest for {(n, k)}: {best}")
        sys.stdout.flush()
    print("\n## KDA state-walk V block (T=4096, H=16, d=128, bf16)")
    h, d, t = 16, 128, 4096
    q = F.normalize(rnd(1, t, h, d, dtype=torch.float32), dim=-1).to(BF16)
    k = F.normalize(rnd(1, t, h, d, dtype=torch.float32), dim=-1).to(BF16)
    v, g = rnd(1, t, h, d), -5.0 * torch.sigmoid(rnd(1, t, h, d, dtype=torch.float32))
    beta = torch.sigmoid(rnd(1, t, h, dtype=torch.float32)).to(BF16)
    s0 = torch.zeros(1, h, d, d, device=DEV)
    default = tk.kda.STATE_BV
    for bv in (16, 32, 64):
        tk.kda.STATE_BV = bv
        try:
            fn = lambda i: tk.TRITON.kda(q, k, v, g, beta, d**-0.5, s0)  # noqa: E731
            print(f"STATE_BV={bv}: {time_ms(fn, 1, False):.4f} ms eager, {kernel_ms(fn):.4f} ms GPU kernel time")
        except Exception as e:  # noqa: BLE001
            print(f"STATE_BV={bv}: failed {type(e).__name__}: {str(e)[:100]}")
    tk.kda.STATE_BV = default
    print("\n## attention tiles (prefill T=4096 and decode B=8, H=16, d=192/128, bf16)")
    for b, tq in ((1, 4096), (8, 1)):
        qq, kk, vv = rnd(b, tq, 16, 192), rnd(b, 4096, 16, 192), rnd(b, 4096, 16, 128)
        pos = torch.arange(4096 - tq, 4096, device=DEV).expand(b, tq).contiguous()
        lens = torch.full((b,), 4096, device=DEV)
        dq, dkv = tk.attention.BLOCK_Q, tk.attention.BLOCK_KV
        for bq, bkv in ((128, 64), (128, 128), (64, 64)):
            tk.attention.BLOCK_Q, tk.attention.BLOCK_KV = bq, bkv
            try:
                ms = time_ms(lambda i: tk.TRITON.attention(qq, kk, vv, pos, lens, 0.07), 1, True)
                print(f"B={b} Tq={tq} BLOCK_Q={bq} BLOCK_KV={bkv}: {ms:.4f} ms")
            except Exception as e:  # noqa: BLE001
                print(f"B={b} Tq={tq} BLOCK_Q={bq} BLOCK_KV={bkv}: failed {type(e).__name__}: {str(e)[:100]}")
        tk.attention.BLOCK_Q, tk.attention.BLOCK_KV = dq, dkv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also sweep GEMM tile configs")
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
    print("\n| op | shape | floor ms | invariant ms | rate | baseline | baseline ms | invariant / baseline |")
    print("|---|---|---|---|---|---|---|---|")
    for group in filter(None, args.only.split(",")):
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
    if args.sweep:
        sweep(tk)


if __name__ == "__main__":
    main()
