"""The Triton parity kernels: the CPU suite's invariance properties (bits, `torch.equal`) and agreement
with the CPU kernels / float64 references (tolerances), on two platforms:

- `interp`: the Triton interpreter on CPU tensors at small shapes (runs in CI, no GPU needed), in a
  child process started with `TRITON_INTERPRET=1` (`test_interpreter_suite`), so the rest of the test
  session never sees the variable.
- `cuda`: the compiled kernels on the GPU (`pytest -m gpu`; skipped cleanly without CUDA), plus bf16
  shapes and the whole K3 forward scored in one pass vs generated token by token through a paged cache.

Bits are compared within one platform only (CPU bits need not equal GPU bits).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import assert_bits
from parity.kernels import FAST, INVARIANT, Kernels
from parity.kernels.attention import gather_paged
from parity.kernels.linear import LoRA
from parity.kernels.moe import experts_combine, experts_stacked
from parity.kernels.primitives import sigmoid

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)

CUDA = torch.cuda.is_available()
# Triton decides interpreter vs compiler when it is first imported (its own library functions are
# decorated then), so the interpreter suite runs in a child process started with TRITON_INTERPRET=1.
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
SETTINGS = settings(max_examples=6, deadline=None, derandomize=True)
FEW = settings(max_examples=4, deadline=None, derandomize=True)  # KDA / MoE: several launches per example


@dataclass(frozen=True)
class Platform:
    name: str
    mod: ModuleType  # the parity.kernels.triton package
    dev: str

    @property
    def k(self) -> Kernels:
        return self.mod.TRITON

    def t(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dev)


def _platform(name: str) -> Platform:
    import parity.kernels.triton as mod

    assert mod.linear.INTERPRET is (name == "interp")
    return Platform(name, mod, "cpu" if name == "interp" else "cuda")


@pytest.fixture(scope="module", params=[
    pytest.param("interp", id="interp", marks=pytest.mark.skipif(
        not INTERP, reason="runs in the interpreter child process (test_interpreter_suite)")),
    pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA")]),
])
def p(request: pytest.FixtureRequest) -> Platform:
    return _platform(request.param)


@pytest.fixture(scope="module")
def gpu() -> Platform:
    if not CUDA or INTERP:
        pytest.skip("needs CUDA")
    return _platform("cuda")


@pytest.mark.skipif(INTERP or CUDA, reason="the interpreter suite runs on machines without CUDA")
def test_interpreter_suite() -> None:
    """Every `[interp]` test of this file, in a child process with TRITON_INTERPRET=1 (CPU tensors)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-k", "interp",
                          "-p", "no:cacheprovider"], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-3000:]


def close(a: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(a.double().cpu(), ref.double().cpu(), rtol=tol, atol=tol)


def _embed_row(row: torch.Tensor, batch: int, pos: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *row.shape, generator=g, dtype=row.dtype)
    x[pos] = row
    return x


def test_interpreted_dots_never_call_the_host_blas(p: Platform, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter every dot of every kernel is an explicit fp32 product and sum: numpy's
    `matmul` (the host BLAS, whose row bits depend on the row's place in the matrix and on the CPU) is
    never called, so the invariances below hold on any CPU."""
    if p.name != "interp":
        pytest.skip("interpreter only")
    import numpy as np

    def host_blas(*args, **kwargs):
        raise AssertionError("an interpreted kernel called numpy.matmul")

    monkeypatch.setattr(np, "matmul", host_blas)
    x, w = torch.randn(5, 64), torch.randn(40, 64)
    p.k.linear(x, w, LoRA(torch.randn(4, 64), torch.randn(40, 4), 0.5))
    q, k, v = torch.randn(1, 20, 2, 32), torch.randn(1, 20, 2, 32), torch.randn(1, 20, 2, 32)
    p.k.attention(q, k, v, torch.arange(20).view(1, 20), torch.tensor([20]), 0.2)
    _run_kda(p, _kda_inputs(1, 70), slice(0, 70), torch.zeros(1, 2, 16, 16))
    e, lat = 16, 32
    w1, w3, w2 = _experts(e, lat, 24)
    _moe(p, torch.randn(6, lat), torch.randn(6, e), torch.zeros(e), w1, w3, w2)


# --- linear ---------------------------------------------------------------------------------------

@SETTINGS
@given(batch=st.integers(1, 150), data=st.data(), k=st.sampled_from([24, 96, 256]), n=st.sampled_from([8, 96, 200]))
def test_linear_row_invariant(p: Platform, batch: int, data: st.DataObject, k: int, n: int) -> None:
    pos = data.draw(st.integers(0, batch - 1))
    w = p.t(torch.randn(n, k))
    row = torch.randn(k)
    alone = p.k.linear(p.t(row.unsqueeze(0)), w)[0]
    inside = p.k.linear(p.t(_embed_row(row, batch, pos, batch * 7 + pos)), w)[pos]
    assert_bits(alone, inside)


def test_linear_lora_row_invariant_and_reference(p: Platform) -> None:
    w, lora = torch.randn(96, 64), LoRA(torch.randn(4, 64), torch.randn(96, 4), 0.5)
    x = torch.randn(70, 64)
    lora_d = LoRA(p.t(lora.a), p.t(lora.b), lora.scale)
    full = p.k.linear(p.t(x), p.t(w), lora_d)
    for i in (0, 5, 69):
        assert_bits(p.k.linear(p.t(x[i : i + 1]), p.t(w), lora_d)[0], full[i])
    ref = x.double() @ w.double().t() + 0.5 * (x.double() @ lora.a.double().t()) @ lora.b.double().t()
    close(full, ref, 1e-4)


def test_linear_both_code_paths_row_invariant(p: Platform) -> None:
    """Pointer and TMA-descriptor loads, one or three K segments (bf16, small tiles): a row alone (the
    split path: one program per K segment, the last to arrive adds the segment sums in order) equals the same row
    of a 200-row product (the fused path), call after call, and every call leaves the arrival counters at zero."""
    lin = p.mod.linear
    x, w = torch.randn(200, 192).bfloat16(), torch.randn(48, 192).bfloat16()
    assert 200 > lin.SPLIT_MAX_M
    for tma in (False, True):
        for n_seg in (1, 3):
            cfg = lin.GemmConfig(32, 32, 32, 4, 4, 2, tma=tma, k_segments=n_seg)
            assert lin.segment_layout(192, cfg) == (n_seg, 192 // n_seg)
            full = lin.matmul(p.t(x), p.t(w), config=cfg)
            for i in (0, 31, 32, 199):
                assert_bits(lin.matmul(p.t(x[i : i + 1]), p.t(w), config=cfg)[0], full[i])
            for _ in range(5):  # the arrival order of the segments changes from call to call, the bits may not
                assert_bits(lin.matmul(p.t(x[:70]), p.t(w), config=cfg), full[:70])
            close(full.float(), x.double() @ w.double().t(), 0.1)
    assert not lin.arrival_counters(full.device, 1).any()
    lora = LoRA(p.t(torch.randn(4, 192).bfloat16()), p.t(torch.randn(48, 4).bfloat16()), 0.5)
    cfg = lin.GemmConfig(32, 32, 32, 4, 4, 2, k_segments=3)
    t = lin.matmul(p.t(x), lora.a, config=cfg)
    full = lin.matmul(p.t(x), p.t(w), t, lora.b, 0.5, config=cfg)
    assert_bits(lin.matmul(p.t(x[7:8]), p.t(w), t[7:8].clone(), lora.b, 0.5, config=cfg)[0], full[7])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_segments_formed_on_k_shards_have_the_whole_gemms_bits(p: Platform, dtype: torch.dtype) -> None:
    """A row-parallel projection's S segments (`linear(..., segments=S)`): each TP shard of K / TP columns forms its
    segments' sums (`segment_sums`), and all S added in order with the LoRA epilogue (`combine_segments`) give the
    one-process result bit for bit, for TP = 1 ... S, split (few rows) and fused (many rows) paths, and segments of
    8 columns (one masked block) as well as of several blocks."""
    lin = p.mod.linear
    for m, k, n, r in ((5, 64, 24, 4), (200, 1024, 40, 8)):
        x, w, a, b = (p.t(torch.randn(*shape).to(dtype)) for shape in ((m, k), (n, k), (r, k), (n, r)))
        whole = lin.linear(x, w, LoRA(a, b, 0.5), segments=8)
        cfg, cfg_a = lin.gemm_config(n, k, dtype, m), lin.gemm_config(r, k, dtype, m)
        for tp in (1, 2, 4, 8):
            cols = [slice(i * k // tp, (i + 1) * k // tp) for i in range(tp)]
            t = lin.combine_segments(torch.cat([lin.segment_sums(x[:, c].contiguous(), a[:, c].contiguous(), k // 8,
                                                                 cfg_a) for c in cols]), dtype, cfg_a)
            parts = torch.cat([lin.segment_sums(x[:, c].contiguous(), w[:, c].contiguous(), k // 8, cfg)
                               for c in cols])
            assert parts.shape == (8, m, n)
            assert_bits(lin.combine_segments(parts, dtype, cfg, t, b, 0.5), whole)
        # against float64 on the kernel's t (rounded to dtype as stored): one rounding of the output (relative error
        # u: bf16's 2^-8, or 2^-7 where the interpreter's cast truncates) and fp32 sums of k + r terms, each
        # addition off by at most 2^-24 of the sum of the terms' magnitudes
        x64, w64, t64, b64 = (v.double().cpu() for v in (x, w, t, b))
        ref = x64 @ w64.t() + 0.5 * t64 @ b64.t()
        magnitude = x64.abs() @ w64.abs().t() + 0.5 * t64.abs() @ b64.abs().t()
        u = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -24
        bound = u * ref.abs() + (k + r) * 2.0 ** -24 * magnitude * (1 + u)
        assert ((whole.double().cpu() - ref).abs() <= bound).all()


# --- row-wise ops ---------------------------------------------------------------------------------

@SETTINGS
@given(batch=st.integers(1, 70), data=st.data(), d=st.sampled_from([32, 100, 256]))
def test_rowwise_ops_row_invariant(p: Platform, batch: int, data: st.DataObject, d: int) -> None:
    pos = data.draw(st.integers(0, batch - 1))
    k = p.k
    w = p.t(torch.randn(d))
    row, gate = torch.randn(d), torch.randn(d)
    xs, gs = p.t(_embed_row(row, batch, pos, 1 + pos)), p.t(_embed_row(gate, batch, pos, 2 + pos))
    r1, g1 = xs[pos : pos + 1].clone(), gs[pos : pos + 1].clone()
    assert_bits(k.rmsnorm(r1, w, 1e-6)[0], k.rmsnorm(xs, w, 1e-6)[pos])
    assert_bits(k.gated_rmsnorm(r1, g1, w, 1e-6)[0], k.gated_rmsnorm(xs, gs, w, 1e-6)[pos])
    assert_bits(k.l2norm(r1)[0], k.l2norm(xs)[pos])
    assert_bits(k.situ_glu(r1, g1, 4.0, 25.0)[0], k.situ_glu(xs, gs, 4.0, 25.0)[pos])
    assert_bits(k.silu_glu(r1, g1)[0], k.silu_glu(xs, gs)[pos])
    assert_bits(k.sigmoid(r1)[0], k.sigmoid(xs)[pos])
    logits = xs * 3
    tokens = p.t(torch.randint(0, d, (batch,)))
    assert_bits(k.token_logprobs(logits[pos : pos + 1].clone(), tokens[pos : pos + 1], 0.7)[0],
                k.token_logprobs(logits, tokens, 0.7)[pos])


def test_rowwise_ops_match_float64(p: Platform) -> None:
    x, g, w = torch.randn(9, 200), torch.randn(9, 200), torch.randn(200)
    xd, gd, wd = x.double(), g.double(), w.double()
    k = p.k
    rms = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
    close(k.rmsnorm(p.t(x), p.t(w), 1e-6), rms, 1e-5)
    close(k.gated_rmsnorm(p.t(x), p.t(g), p.t(w), 1e-6), rms * torch.sigmoid(gd), 1e-5)
    close(k.l2norm(p.t(x)), xd / torch.sqrt(xd.pow(2).sum(-1, keepdim=True) + 1e-6), 1e-5)
    for scale in (0.01, 1.0, 10.0):  # tanh's small-argument polynomial and its exp form
        a, b = xd * scale, gd * scale * 10
        situ = 4 * torch.tanh(a / 4) * torch.sigmoid(a) * 25 * torch.tanh(b / 25)
        close(k.situ_glu(p.t(a.float()), p.t(b.float()), 4.0, 25.0), situ, 1e-5)
        close(k.situ_glu(p.t(a.float()), p.t(b.float()), 4.0, None), 4 * torch.tanh(a / 4) * torch.sigmoid(a) * b, 1e-5)
    close(k.silu_glu(p.t(x), p.t(g)), F.silu(xd) * gd, 1e-5)
    toks = torch.randint(0, 200, (9,))
    ref = torch.log_softmax(xd * 5 / 0.7, -1).gather(1, toks[:, None])[:, 0]
    close(k.token_logprobs(p.t(x * 5), p.t(toks), 0.7), ref, 1e-5)
    f, a_log, dt = torch.randn(3, 4, 8) * 5, torch.randn(4), torch.randn(4, 8)
    for lb in (None, -5.0):
        close(k.kda_gate(p.t(f), p.t(a_log), p.t(dt), lb), INVARIANT.kda_gate(f.double(), a_log.double(), dt.double(), lb),
              1e-5)


def test_rowwise_gradients_within_fp32_rounding_of_float64(p: Platform) -> None:
    """Every row-wise Triton op's gradient (from the invariant reading's torch op, on CUDA the fast set's reading of
    the same function) against float64 autograd: norm-wise within the rounding of fp32 sums of D terms
    (gamma = D 2^-24), times 8 for the longest chain (attn_res_mix: norm, scores, softmax, mix); deterministic."""
    d = 200
    g = torch.Generator().manual_seed(23)
    x, y, w = torch.randn(9, d, generator=g), torch.randn(9, d, generator=g), torch.randn(d, generator=g)
    cands, proj = torch.randn(9, 5, d, generator=g), torch.randn(d, generator=g) / 8
    f, a_log, dt = torch.randn(3, 4, 8, generator=g) * 3, torch.randn(4, generator=g), torch.randn(4, 8, generator=g)
    cases = [
        ("sigmoid", lambda kk, x: kk.sigmoid(x), (x,)),
        ("rmsnorm", lambda kk, x, w: kk.rmsnorm(x, w, 1e-6), (x, w)),
        ("gated_rmsnorm", lambda kk, x, y, w: kk.gated_rmsnorm(x, y, w, 1e-6), (x, y, w)),
        ("l2norm", lambda kk, x: kk.l2norm(x), (x,)),
        ("situ_glu", lambda kk, x, y: kk.situ_glu(x, y, 4.0, 25.0), (x, y)),
        ("silu_glu", lambda kk, x, y: kk.silu_glu(x, y), (x, y)),
        ("kda_gate", lambda kk, f, a, dt: kk.kda_gate(f, a, dt, -5.0), (f, a_log, dt)),
        ("kda_gate unbounded", lambda kk, f, a, dt: kk.kda_gate(f, a, dt, None), (f, a_log, dt)),
        ("attn_res_mix", lambda kk, c, w, pw: kk.attn_res_mix(c, w, pw, 1e-6), (cands, w, proj)),
    ]
    for name, op, inputs in cases:
        cot = torch.randn(op(INVARIANT, *inputs).shape, generator=g)

        def grads() -> tuple[torch.Tensor, ...]:
            leaves = [p.t(t).requires_grad_() for t in inputs]
            return torch.autograd.grad(op(p.k, *leaves), leaves, p.t(cot))

        got = grads()
        for a, b in zip(got, grads()):
            assert_bits(a, b)
        leaves = [t.double().requires_grad_() for t in inputs]
        ref = torch.autograd.grad(op(FAST, *leaves), leaves, cot.double())
        for i, (a, r) in enumerate(zip(got, ref)):
            err = (a.double().cpu() - r).norm() / r.norm()
            assert err <= 8 * d * 2.0**-24, f"{name} input {i}: norm-wise relative error {err:.3g}"


def test_logprobs_large_vocab_and_bf16(p: Platform) -> None:
    """Several vocabulary blocks (V > 4096), fp32 and bf16 logits, one row alone vs in the batch."""
    x = torch.randn(3, 9000) * 4
    toks = torch.tensor([0, 4500, 8999])
    for dt in (torch.float32, torch.bfloat16):
        xs = p.t(x.to(dt))
        full = p.k.token_logprobs(xs, p.t(toks), 1.3)
        assert_bits(p.k.token_logprobs(xs[2:3].clone(), p.t(toks[2:3]), 1.3)[0], full[2])
        ref = torch.log_softmax(x.to(dt).double() / 1.3, -1).gather(1, toks[:, None])[:, 0]
        close(full, ref, 1e-5)


def test_checksum_word_mix_equals_the_torch_form(p: Platform) -> None:
    """The weight-sync checksum's one-pass kernel gives the torch form's sum mod 2^64 for any length (one and
    several blocks, a partial last block), and `checksum` on the platform's tensor equals the CPU one."""
    from parity.kernels.triton.checksum import BLOCK, word_mix_sum
    from parity.sync import checksum as ck

    g = torch.Generator().manual_seed(3)
    for n in (0, 1, BLOCK - 1, BLOCK, 2 * BLOCK + 5):
        w = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, generator=g)
        want = ck._mix_sum(w, 0) & (2**64 - 1)
        assert word_mix_sum(p.t(w), ck._C1, ck._C2, ck._C3, ck._C4) == want
    for t in (torch.randn(37, 11, generator=g).bfloat16(), torch.randint(0, 255, (4099,), dtype=torch.uint8)):
        assert ck.checksum(p.t(t)) == ck.checksum(t)


def test_checksum_batches_equal_one_tensor_at_a_time(p: Platform, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many tensors in batched launches (tiny batches here, so a batch boundary falls between and after tensors):
    each sum is the torch form's, empty and partial-block tensors included; `checksums` on the platform's tensors
    equals `checksum` of each on the CPU."""
    from parity.kernels.triton import checksum as kernel
    from parity.sync import checksum as ck

    monkeypatch.setattr(kernel, "BATCH_BYTES", 3 * kernel.BLOCK * 8)
    g = torch.Generator().manual_seed(4)
    sizes = (5, 0, kernel.BLOCK + 3, 1, 2 * kernel.BLOCK, 7, 0, kernel.BLOCK - 1)
    words = [torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, generator=g) for n in sizes]
    want = [ck._mix_sum(w, 0) & (2**64 - 1) for w in words]
    assert kernel.word_mix_sums([p.t(w) for w in words], ck._C1, ck._C2, ck._C3, ck._C4) == want
    tensors = {f"t{i}": t for i, t in enumerate((torch.randn(37, 11, generator=g).bfloat16(), torch.zeros(0),
                                                  torch.randint(0, 255, (4099,), dtype=torch.uint8),
                                                  torch.randn(3, kernel.BLOCK + 1, generator=g)))}
    assert ck.checksums({n: p.t(t) for n, t in tensors.items()}) == {n: ck.checksum(t) for n, t in tensors.items()}


def test_flat_segment_sums_are_each_tensors_checksum(p: Platform) -> None:
    """A flat buffer's segment sums (one launch over every tensor, padding to the next word included) give the
    checksums of its tensors: odd byte counts, an empty tensor, several blocks."""
    from parity.kernels.triton.checksum import BLOCK, segment_sums, segment_table
    from parity.sync import checksum as ck
    from parity.sync.flat import FlatLayout

    g = torch.Generator().manual_seed(5)
    tensors = {"a": torch.randn(37, 11, generator=g).bfloat16(), "b": torch.zeros(0),
               "c": torch.randint(0, 255, (8 * BLOCK + 13,), dtype=torch.uint8, generator=g),
               "d": torch.randn(3, BLOCK + 1, generator=g)}
    layout = FlatLayout.of((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
    buffer = layout.empty("cpu")
    for name, view in layout.views(buffer).items():
        view.copy_(tensors[name])
    counts = [-(-layout.nbytes(i) // 8) for i in range(len(tensors))]
    plan = segment_table(counts, [o // 8 for o in layout.offsets], torch.device(p.dev))
    sums = segment_sums(p.t(buffer).view(torch.int64), plan, ck._C1, ck._C2, ck._C3, ck._C4)
    assert layout.digests(sums) == ck.checksums(tensors)
    assert torch.equal(layout.word_sums(p.t(buffer)).cpu(), sums.cpu())


def _rounding_cases(g: torch.Generator) -> torch.Tensor:
    """fp32 values bf16 rounds in every way: halfway ties (even and odd kept bit), just off them, subnormals, the
    largest finite values (rounding to inf), inf, signed zeros."""
    kept = torch.randint(0, 1 << 16, (512,), generator=g, dtype=torch.int64) << 16
    low = torch.tensor([0x8000, 0x7FFF, 0x8001, 0x0001, 0xFFFF], dtype=torch.int64)
    bits = (kept[:, None] | low[None, :]).flatten()
    special = torch.tensor([0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x0, 0x80000000, 0x00000001, 0x807FFFFF,
                            0x7F7F8000, 0x3F808000, 0x3F818000], dtype=torch.int64)
    bits = torch.cat([bits, special])
    bits = torch.where(((bits >> 23) & 0xFF) == 0xFF, bits & ~0x7FFFFF, bits)  # no NaN: CPU and CUDA spell it apart
    return (bits - ((bits & 0x80000000) << 1)).to(torch.int32).view(torch.float32)


def test_serving_cast_rounds_as_torch(p: Platform) -> None:
    """fp32 -> bf16 into a flat buffer at any offset gives torch's round to nearest even, ties and overflow
    included (several sources of many blocks in one launch); same-dtype sources are copied."""
    from parity.kernels.triton.serving import CAST_BLOCK, cast_into

    g = torch.Generator().manual_seed(6)
    sources = [_rounding_cases(g), torch.randn(CAST_BLOCK + 3, generator=g) * 1e3, torch.zeros(0),
               torch.randn(7, 5, generator=g)]
    offsets = [16, 16 + 2 * 8192, 16 + 2 * 8192 + 2 * (CAST_BLOCK + 3), 64 + 2 * 8192 + 2 * (CAST_BLOCK + 3)]
    out = torch.zeros(offsets[-1] + 2 * 35 + 6, dtype=torch.uint8)
    dev_out = p.t(out)
    cast_into(dev_out, [p.t(s) for s in sources], offsets, torch.bfloat16)
    for s, o in zip(sources, offsets):
        got = dev_out[o : o + 2 * s.numel()].view(torch.bfloat16).cpu()
        assert torch.equal(got.view(torch.int16), p.t(s).flatten().bfloat16().cpu().view(torch.int16))
    assert not dev_out[:16].any() and not dev_out[-6:].any()  # nothing written outside the tensors
    same = [torch.randn(9, generator=g), torch.randn(CAST_BLOCK + 1, generator=g)]
    out32 = p.t(torch.zeros(4 * (9 + 3 + CAST_BLOCK + 1), dtype=torch.uint8))
    cast_into(out32, [p.t(s) for s in same], [0, 48], torch.float32)
    assert torch.equal(out32[:36].view(torch.float32).cpu(), same[0])
    assert torch.equal(out32[48 : 48 + 4 * (CAST_BLOCK + 1)].view(torch.float32).cpu(), same[1])


def _mxfp4_cases(g: torch.Generator, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Weights whose groups hit the quantiser's edges: ties on every E2M1 bound at several scales, signed zeros,
    all-zero and tiny groups, groups spanning the exponent range."""
    from parity.quant.mxfp4 import GROUP

    w = torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-20, 20, (n, k // GROUP, 1), generator=g)
                                                     .float()).repeat_interleave(GROUP, -1).view(n, k)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 4.0, -0.25, -0.75, -5.0, 0.0, -0.0, 3.0, 1.0])
    w[0, :32] = torch.cat([ties, ties * 0.5]) * 4.0
    w[1 % n, :32] = 0.0
    w[1 % n, 32 % k : 32 % k + 32] = -0.0
    w[n - 1, -32:] = torch.randn(32, generator=g) * 1e-40
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_serving_mxfp4_equals_quantize(p: Platform, dtype: torch.dtype) -> None:
    """MXFP4 packing of several weights in one launch gives `quantize`'s codes and scale bytes, at their offsets of
    one buffer; a weight `quantize` refuses (NaN, inf, a scale above the largest) is flagged, the others are not."""
    from parity.kernels.triton.serving import GROUPS_BLOCK, mxfp4_into
    from parity.quant import mxfp4

    g = torch.Generator().manual_seed(7)
    shapes = [(3, 64), (GROUPS_BLOCK + 1, 32), (5, 96)]
    weights = [_mxfp4_cases(g, n, k, dtype) for n, k in shapes]
    weights += [weights[0].clone(), weights[2].clone(), weights[0].clone()]
    weights[3][2, 7] = float("nan")
    weights[4][4, 95] = float("-inf")
    weights[5][1, 40] = 3e38 if dtype == torch.float32 else 3.3e38
    packed, scales, at = [], [], 32
    for w in weights:
        packed.append(at)
        at += w.numel() // 2
        scales.append(at)
        at += w.numel() // 32 + 5
    out = p.t(torch.zeros(at + 32, dtype=torch.uint8))
    bad = mxfp4_into(out, [p.t(w) for w in weights], packed, scales).cpu()
    assert bad.tolist() == [0, 0, 0, 1, 1, 1]
    for w, o, s in list(zip(weights, packed, scales))[:3]:
        q = mxfp4.quantize(p.t(w))
        assert torch.equal(out[o : o + w.numel() // 2].cpu(), q.packed.flatten().cpu())
        assert torch.equal(out[s : s + w.numel() // 32].cpu(), q.scale.flatten().cpu())
    assert not out[:32].any() and not out[-32:].any()


def test_gpu_serving_buffer_is_serving_weights(gpu: Platform) -> None:
    """On CUDA the flat bundle of k3-tiny-mxfp4's masters (fp32, with a bf16 extra) holds `serving_weights`' bytes
    and checksums, and a store of the same layout takes it whole."""
    from parity.config import load_model_config
    from parity.io.checkpoint import random_weights
    from parity.sync.bundle import TensorStore, checksums
    from parity.sync.serving import ServingBuffer
    from parity.sync.transports import Memory, WeightSync
    from parity.weights import master_weights, serving_weights

    cfg = load_model_config(Path(__file__).resolve().parents[2] / "configs" / "k3-tiny-mxfp4.yaml")
    masters = {n: gpu.t(t) for n, t in master_weights(cfg.text, random_weights(cfg, seed=0)).items()}
    extra = {"vision.w": gpu.t(torch.randn(3, 5).bfloat16())}
    want = {**serving_weights(cfg.text, masters), **extra}
    bundle = ServingBuffer(cfg.text).bundle(1, masters, extra)
    assert list(bundle.tensors) == list(want)
    assert all(torch.equal(bundle.tensors[n].view(torch.uint8), t.view(torch.uint8)) for n, t in want.items())
    assert dict(bundle.checksums) == checksums(want)
    store = TensorStore({n: torch.zeros_like(t) for n, t in want.items()})
    WeightSync(Memory(), store)(bundle)
    assert store.version == 1 and all(torch.equal(store.tensors[n], t) for n, t in want.items())


# --- short conv -----------------------------------------------------------------------------------

@SETTINGS
@given(t=st.integers(1, 40), data=st.data())
def test_short_conv_any_split(p: Platform, t: int, data: st.DataObject) -> None:
    d, width = 24, 4
    w = torch.randn(d, width)
    x = torch.randn(1, t, d)
    zero = torch.zeros(1, width - 1, d)
    full, full_state = p.k.short_conv(p.t(x), p.t(w), p.t(zero))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(t - 1, 1)), max_size=5)))) if t > 1 else []
    outs, state, start = [], p.t(zero), 0
    for end in cuts + [t]:
        y, state = p.k.short_conv(p.t(x[:, start:end]), p.t(w), state)
        outs.append(y)
        start = end
    assert_bits(torch.cat(outs, 1), full)
    assert_bits(state, full_state)
    ref = F.silu(F.conv1d(F.pad(x.double().transpose(1, 2), (width - 1, 0)), w.double().unsqueeze(1), groups=d)).transpose(1, 2)
    close(full, ref, 1e-5)


# --- KDA ------------------------------------------------------------------------------------------

def _kda_inputs(b: int, t: int, h: int = 2, dk: int = 16, dv: int = 16, seed: int = 0,
                lower_bound: float | None = -5.0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = INVARIANT.l2norm(torch.randn(b, t, h, dk, generator=g))
    k = INVARIANT.l2norm(torch.randn(b, t, h, dk, generator=g))
    v = torch.randn(b, t, h, dv, generator=g)
    gate = INVARIANT.kda_gate(torch.randn(b, t, h, dk, generator=g), torch.zeros(h), torch.zeros(h, dk), lower_bound)
    beta = sigmoid(torch.randn(b, t, h, generator=g))
    return q, k, v, gate, beta


def _run_kda(p: Platform, ins: tuple[torch.Tensor, ...], sl: slice, state, valid: torch.Tensor | None = None):
    q, k, v, g, beta = (p.t(x[:, sl]) for x in ins)
    return p.k.kda(q, k, v, g, beta, 0.25, state, None if valid is None else p.t(valid))


@FEW
@given(t=st.integers(2, 130), data=st.data())
def test_kda_any_schedule_and_resume(p: Platform, t: int, data: st.DataObject) -> None:
    """Prefill chunks + decode steps at random split points (mid-chunk included), and resuming from a
    saved state, give the one-pass bits (outputs and the boundary state)."""
    ins = _kda_inputs(1, t, seed=t)
    s0 = p.t(torch.zeros(1, 2, 16, 16))
    full, s_full = _run_kda(p, ins, slice(0, t), s0)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, t - 1), min_size=1, max_size=4))))
    outs, s, start, saved = [], s0, 0, {}
    for end in cuts + [t]:
        o, s = _run_kda(p, ins, slice(start, end), s)
        outs.append(o)
        saved[end] = s.clone()
        start = end
    assert_bits(torch.cat(outs, 1), full)
    assert_bits(s.state, s_full.state)
    assert_bits(s.n, s_full.n)
    mid = cuts[0]
    o_resume, s_resume = _run_kda(p, ins, slice(mid, t), saved[mid])
    assert_bits(o_resume, full[:, mid:])
    assert_bits(s_resume.state, s_full.state)


def test_kda_token_by_token_across_chunks(p: Platform) -> None:
    """Decode one token at a time across two chunk boundaries (64, 128), chunked prefill between."""
    t = 140
    ins = _kda_inputs(1, t, seed=3)
    s0 = p.t(torch.randn(1, 2, 16, 16) * 0.1)
    full, s_full = _run_kda(p, ins, slice(0, t), s0)
    o, s = _run_kda(p, ins, slice(0, 59), s0)
    outs = [o]
    steps = [*range(60, 70), 125, *range(126, 132), t]
    start = 59
    for end in steps:
        o, s = _run_kda(p, ins, slice(start, end), s)
        outs.append(o)
        start = end
    assert_bits(torch.cat(outs, 1), full)
    assert_bits(s.state, s_full.state)


@FEW
@given(batch=st.integers(1, 4), data=st.data())
def test_kda_batch_invariant_with_padding(p: Platform, batch: int, data: st.DataObject) -> None:
    pos = data.draw(st.integers(0, batch - 1))
    t = 70
    ins = _kda_inputs(batch, t, seed=batch)
    lens = torch.tensor(data.draw(st.lists(st.integers(1, t), min_size=batch, max_size=batch)))
    valid = torch.arange(t)[None] < lens[:, None]
    s0 = torch.randn(batch, 2, 16, 16)
    o, s = _run_kda(p, ins, slice(0, t), p.t(s0), valid)
    n = int(lens[pos])
    one = tuple(x[pos : pos + 1, :n] for x in ins)
    o1, s1 = _run_kda(p, one, slice(0, n), p.t(s0[pos : pos + 1]))
    assert_bits(o[pos : pos + 1, :n], o1)
    assert_bits(s.state[pos : pos + 1], s1.state)
    assert not o[pos, n:].any()


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_matches_float64_recurrence(p: Platform, lower_bound: float | None) -> None:
    """Chunked outputs and state vs the float64 per-token recurrence; None: unbounded gates (strong decay
    inside the 16-token diagonal blocks, handled element-wise)."""
    t = 100
    q, k, v, g, beta = _kda_inputs(2, t, dk=32, dv=16, lower_bound=lower_bound, seed=7)
    if lower_bound is None:
        g = g * 8  # decays down to exp(-40) per token
    s0 = torch.randn(2, 2, 32, 16) * 0.1
    o_ref, s_ref = FAST.kda(q.double(), k.double(), v.double(), g.double(), beta.double(), 0.25, s0.double())
    o, s = p.k.kda(p.t(q), p.t(k), p.t(v), p.t(g), p.t(beta), 0.25, p.t(s0))
    close(o, o_ref, 1e-4)
    # the boundary state is the state after token 64
    _, s64 = FAST.kda(q[:, :64].double(), k[:, :64].double(), v[:, :64].double(), g[:, :64].double(),
                      beta[:, :64].double(), 0.25, s0.double())
    close(s.state, s64, 1e-4)
    assert s.n.tolist() == [t - 64, t - 64]


# --- gradients ------------------------------------------------------------------------------------

def test_gradients_are_the_invariant_backward_at_the_triton_forward(p: Platform) -> None:
    """With a gradient needed, a Triton op returns its own forward bits and the gradient the CPU invariant op's
    backward gives at the same inputs (linear with LoRA, chunked KDA, attention, the grouped experts against
    `experts_stacked`, routing weights included): within fp32 round-off of the
    invariant set's gradient (KDA's on CUDA from the chunked form, `kda_for_gradients`)."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(5, 40, generator=g), torch.randn(24, 40, generator=g)
    a, b = torch.randn(4, 40, generator=g), torch.randn(24, 4, generator=g)
    q, k, v, gate, beta = _kda_inputs(2, 70, seed=3)
    qa, ka, va = (torch.randn(2, 30, 2, 16, generator=g) for _ in range(3))
    pos, lens = torch.arange(30).expand(2, 30), torch.tensor([30, 17])
    xe, (w1, w3, w2) = torch.randn(9, 32, generator=g), _experts(8, 32, 24)
    ids = torch.stack([torch.randperm(8, generator=g)[:3].sort().values for _ in range(9)])
    wts = torch.rand(9, 3, generator=g)
    cases = [
        ("linear", lambda kk, x, w, a, b: kk.linear(x, w, LoRA(a, b, 0.5)), (x, w, a, b)),
        ("kda", lambda kk, q, k, v, gate, beta: kk.kda(q, k, v, gate, beta, 0.25, torch.zeros_like(q[:, 0, :, :, None]
                                                                                     * v[:, 0, :, None, :]))[0],
         (q, k, v, gate, beta)),
        ("attention", lambda kk, q, k, v: kk.attention(q, k, v, pos.to(q.device), lens.to(q.device), 0.3), (qa, ka, va)),
        ("experts", lambda kk, x, wt, w1, w3, w2: (kk.experts or experts_stacked)(x, ids.to(x.device), wt, w1, w3, w2,
                                                                                 "situ", 4.0, 25.0),
         (xe, wts, w1, w3, w2)),
    ]
    for name, op, inputs in cases:
        cot = torch.randn(op(INVARIANT, *inputs).shape, generator=g)
        leaves = [p.t(t).requires_grad_() for t in inputs]
        out = op(p.k, *leaves)
        assert_bits(out.detach(), op(p.k, *(t.detach() for t in leaves)))  # the Triton forward's bits
        got = torch.autograd.grad(out, leaves, p.t(cot))
        ref_leaves = [t.clone().requires_grad_() for t in inputs]
        ref = torch.autograd.grad(op(INVARIANT, *ref_leaves), ref_leaves, cot)
        for i, (gt, rt) in enumerate(zip(got, ref)):
            assert gt is not None, (name, i)
            close(gt, rt, 2e-4)


def _linear_reference(x, w, a, b, scale, g, magnitudes: bool = False) -> list[torch.Tensor]:
    """float64 (dX, dW, dA, dB) of y = x W^T + scale (x A^T) B^T for cotangent g; `magnitudes`: the same products
    over absolute values (the scale of each result's rounding error)."""
    x, w, a, b, g = (t.double().abs() if magnitudes else t.double() for t in (x, w, a, b, g))
    s = abs(scale) if magnitudes else scale
    dt = s * (g @ b)
    return [g @ w + dt @ a, g.t() @ x, dt.t() @ x, s * (g.t() @ (x @ a.t()))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_gradient_within_its_rounding_bound_of_float64(p: Platform, dtype: torch.dtype) -> None:
    """The Triton linear's backward (`linear_grad`: dX, dW and the LoRA factors' gradients as GEMMs of the forward's
    machinery) against float64, with and without LoRA, on a trainer's fp32 master of bf16 values too: within the
    bound its arithmetic allows (fp32 sums of at most N + M + R terms within gamma = m 2^-24, doubled for
    second-order terms; in bf16 two roundings on any path (t or dt, the stored gradient), each within 2^-8 compiled or
    2^-7 interpreted (the interpreter's cast truncates)); deterministic; gradients in their inputs' dtypes."""
    from parity.quant.bf16 import mark_bf16_valued

    m, k, n, r = 37, 96, 80, 4
    g = torch.Generator().manual_seed(21)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    a, b = torch.randn(r, k, generator=g).to(dtype) / k ** 0.5, torch.randn(n, r, generator=g).to(dtype)
    cot = torch.randn(m, n, generator=g).to(dtype)
    bf16_unit = 2.0 ** -7 if INTERP else 2.0 ** -8
    c = 2 * (n + m + r + 8) * 2.0 ** -24 + (2 * bf16_unit if dtype == torch.bfloat16 else 0.0)
    master = mark_bf16_valued(w.float()) if dtype == torch.bfloat16 else w
    for lora in (True, False):
        def grads() -> list[torch.Tensor]:
            leaves = [p.t(t).requires_grad_() for t in ((x, master, a, b) if lora else (x, master))]
            if dtype == torch.bfloat16:
                mark_bf16_valued(leaves[1])
            out = p.k.linear(leaves[0], leaves[1], LoRA(leaves[2], leaves[3], 0.5) if lora else None)
            return list(torch.autograd.grad(out, leaves, p.t(cot)))

        got = grads()
        assert [t.dtype for t in got] == [x.dtype, master.dtype, *([dtype] * 2 * lora)]
        ref = _linear_reference(x, w, a if lora else 0 * a, b, 0.5, cot)
        mag = _linear_reference(x, w, a if lora else 0 * a, b, 0.5, cot, magnitudes=True)
        for name, gt, rt, mt in zip(("x", "w", "a", "b"), got, ref, mag):
            err = (gt.double().cpu() - rt).abs()
            assert bool((err <= c * mt).all()), f"d {name} (lora {lora}): {(err / (c * mt)).max().item():.3g} x the bound"
        for u, v in zip(got, grads()):
            assert_bits(u, v)


def _experts_case(n: int, e: int, k: int, lat: int, inter: int, dtype: torch.dtype, seed: int) -> tuple:
    """Random grouped-experts inputs (x, routing weights fp32, w1, w3, w2 in `dtype`), ids (expert e - 1 never
    chosen) and a cotangent."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, lat, generator=g).to(dtype)
    w1, w3 = ((torch.randn(e, inter, lat, generator=g) / lat ** 0.5).to(dtype) for _ in range(2))
    w2 = (torch.randn(e, lat, inter, generator=g) / inter ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:k].sort().values for _ in range(n)])
    wts = torch.rand(n, k, generator=g)
    return (x, wts, w1, w3, w2), ids, torch.randn(n, lat, generator=g).to(dtype)


def _experts_grads(p: Platform, inputs: tuple, ids: torch.Tensor, cot: torch.Tensor, act: str,
                   linear_beta: float | None) -> list[torch.Tensor]:
    """The Triton grouped experts' gradients (x, weights, w1, w3, w2) for inputs already on the platform."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = p.k.experts(leaves[0], ids, leaves[1], *leaves[2:], act, 4.0, linear_beta)
    return list(torch.autograd.grad(out, leaves, cot))


def _assert_within_rounding(got: list[torch.Tensor], ref: tuple, mag: tuple, dtype: torch.dtype, n: int, k: int,
                            lat: int, inter: int) -> None:
    """|got - ref| <= c * magnitude, element by element, with c from the arithmetic (first-order error analysis:
    each rounding of a quantity q adds at most u |q|, carried to a result by the sums of absolute values that
    `magnitudes` computes): fp32 sums of at most 2 lat (a1 in the forward, gh) + 2 inter (dx's two products per K
    block) + n k (a weight gradient's rows, the slot sum) terms, plus 32 for the activation's transcendental
    functions and its derivative's few operations, each within gamma = m 2^-24 (doubled for second-order terms);
    in bf16 at most three roundings to bf16 on any path (gy, ga1 / ga3 or h, the stored gradient), each within
    2^-8 (round to nearest even, compiled) or 2^-7 (the interpreter's fp32 -> bf16 cast truncates)."""
    bf16_unit = 2.0 ** -7 if INTERP else 2.0 ** -8
    c = 2 * (2 * lat + 2 * inter + n * k + 32) * 2.0 ** -24 + (3 * bf16_unit if dtype == torch.bfloat16 else 0.0)
    for name, gt, rt, mt in zip(("x", "weights", "w1", "w3", "w2"), got, ref, mag):
        err = (gt.detach().double().cpu() - rt).abs()
        worst = (err / (c * mt).clamp(min=1e-300)).max().item()
        assert bool((err <= c * mt).all()), f"d {name}: {worst:.3g} x the bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act,linear_beta", [("situ", 25.0), ("situ", None), ("silu", None)])
def test_experts_gradient_within_its_rounding_bound_of_float64(p: Platform, dtype: torch.dtype, act: str,
                                                               linear_beta: float | None) -> None:
    """The grouped experts' Triton backward (`moe_grad`) against its float64 reading, every gradient (x, routing
    weights, w1, w3, w2) within the bound its arithmetic allows; an expert no token chose gets exact zeros; and the
    gradient is deterministic (two backward passes, the same bits)."""
    from parity.kernels.triton.moe_grad import experts_grad_reference

    n, e, k, lat, inter = 9, 8, 3, 64, 48
    inputs, ids, cot = _experts_case(n, e, k, lat, inter, dtype, seed=3)
    args = (inputs[0], ids, *inputs[1:], cot, act, 4.0, linear_beta)
    on = [p.t(t) for t in inputs]
    got = _experts_grads(p, on, p.t(ids), p.t(cot), act, linear_beta)
    _assert_within_rounding(got, experts_grad_reference(*args), experts_grad_reference(*args, magnitudes=True),
                            dtype, n, k, lat, inter)
    for w in got[2:]:
        assert not bool(w[e - 1].any())
    for a, b in zip(got, _experts_grads(p, on, p.t(ids), p.t(cot), act, linear_beta)):
        assert_bits(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_experts_split_over_owners_have_the_grouped_ops_bits(p: Platform, dtype: torch.dtype) -> None:
    """Expert parallelism's pieces in one process: each of two owners runs `expert_outputs` on the (token, slot) rows
    of the experts it owns (grouped by owner, slot order kept, as the all-to-all delivers them), and `combine_slots`
    weights and adds a token's slots: the output, the routing weights' and the experts' gradients equal the grouped
    `experts` call's bit for bit; x's gradient (each row's rounded, then summed over its slots) within the bound of
    its arithmetic against float64 (fp32)."""
    from parity.kernels.triton.moe_grad import combine_slots, experts_grad_reference, expert_outputs

    n, e, k, lat, inter = 9, 8, 3, 64, 48
    inputs, ids, cot = _experts_case(n, e, k, lat, inter, dtype, seed=4)
    on, p_ids, p_cot = [p.t(t) for t in inputs], p.t(ids), p.t(cot)
    whole = _experts_grads(p, on, p_ids, p_cot, "situ", 25.0)
    leaves = [t.detach().requires_grad_() for t in on]
    x, wts, w1, w3, w2 = leaves
    slots = p_ids.reshape(-1)
    per_owner = e // 2
    order = torch.argsort(slots // per_owner, stable=True)
    rows, local = x[order // k], (slots[order] % per_owner).unsqueeze(1)
    mine = [slots[order] // per_owner == r for r in range(2)]
    y = torch.cat([expert_outputs(rows[m], local[m], w1[r * per_owner:(r + 1) * per_owner],
                                  w3[r * per_owner:(r + 1) * per_owner], w2[r * per_owner:(r + 1) * per_owner],
                                  "situ", 4.0, 25.0) for r, m in enumerate(mine)])
    out = combine_slots(y[torch.argsort(order)], wts, dtype)
    assert_bits(out, p.k.experts(*on[:1], p_ids, *on[1:], "situ", 4.0, 25.0))
    split = list(torch.autograd.grad(out, leaves, p_cot))
    for a, b in zip(split[1:], whole[1:]):
        assert_bits(a, b)
    if dtype == torch.float32:
        args = (inputs[0], ids, *inputs[1:], cot, "situ", 4.0, 25.0)
        _assert_within_rounding(split, experts_grad_reference(*args),
                                experts_grad_reference(*args, magnitudes=True), dtype, n, k, lat, inter)


@pytest.mark.parametrize("n", [256, 1000])
def test_gpu_experts_gradient_at_k3_1b_shapes(gpu: Platform, n: int) -> None:
    """At k3-1b's routed-expert shapes (64 experts, top 8, latent 768, intermediate 512), bf16: the Triton backward
    within its rounding bound of float64 (on 40 sampled tokens' rows, whose reference is computed one slot at a time),
    deterministic, and free of host synchronisation (CUDA's sync-debug mode raises on any device-to-host read)."""
    from parity.kernels.triton.moe_grad import experts_grad_reference

    e, k, lat, inter = 64, 8, 768, 512
    inputs, ids, cot = _experts_case(n, e, k, lat, inter, torch.bfloat16, seed=4)
    on, ids_on, cot_on = [gpu.t(t) for t in inputs], gpu.t(ids), gpu.t(cot)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _experts_grads(gpu, on, ids_on, cot_on, "situ", 25.0)
        again = _experts_grads(gpu, on, ids_on, cot_on, "situ", 25.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(got, again):
        assert_bits(a, b)
    x, wts, w1, w3, w2 = inputs
    rows = torch.arange(0, n, max(1, n // 40))
    args = (x[rows], ids[rows], wts[rows], w1, w3, w2, cot[rows], "situ", 4.0, 25.0)
    sub = [got[0][rows.cuda()], got[1][rows.cuda()]]  # the rows' own input gradients (weight gradients sum over all)
    _assert_within_rounding(sub, experts_grad_reference(*args)[:2], experts_grad_reference(*args, magnitudes=True)[:2],
                            torch.bfloat16, n, k, lat, inter)


# --- attention ------------------------------------------------------------------------------------

@pytest.mark.parametrize("d,dv", [(48, 32), (288, 272)], ids=["narrow", "wide"])
def test_attention_decode_equals_prefill_and_paged(p: Platform, d: int, dv: int) -> None:
    """Decode = prefill, paged = gathered = contiguous, close to float64; wide: heads over 256 (K3's absorbed MLA,
    576 / 512 at full size) take the D-chunked kernel."""
    torch.manual_seed(0)
    b, t, h = 2, 150, 2
    q, k, v = torch.randn(b, t, h, d), torch.randn(b, t, h, d), torch.randn(b, t, h, dv)
    pos = torch.arange(t).expand(b, t)
    lens = torch.tensor([t, 97])
    full = p.k.attention(p.t(q), p.t(k), p.t(v), p.t(pos), p.t(lens), 0.2)
    for i in (0, 1, 63, 64, 96, 149):
        if i >= int(lens[1]):
            continue
        one = p.k.attention(p.t(q[1:2, i : i + 1]), p.t(k[1:2, : i + 1]), p.t(v[1:2, : i + 1]),
                            p.t(pos[1:2, i : i + 1]), p.t(torch.tensor([i + 1])), 0.2)
        assert_bits(one[0, 0], full[1, i])
    block = 16
    nblk = -(-t // block)
    perm = torch.randperm(nblk + 3)[:nblk]
    cache_k = torch.full((nblk + 3, block, h, d), float("nan"))
    cache_v = torch.full((nblk + 3, block, h, dv), float("nan"))
    cache_k[perm] = F.pad(k[0], (0, 0, 0, 0, 0, nblk * block - t)).view(nblk, block, h, d)
    cache_v[perm] = F.pad(v[0], (0, 0, 0, 0, 0, nblk * block - t)).view(nblk, block, h, dv)
    cache_k[perm[-1], t % block :] = float("nan")
    cache_v[perm[-1], t % block :] = float("nan")
    table = perm.view(1, -1)
    gathered = p.k.attention(p.t(q[:1]), p.t(gather_paged(cache_k, table)),
                             p.t(gather_paged(cache_v, table)), p.t(pos[:1]), p.t(lens[:1]), 0.2)
    assert_bits(gathered, full[:1])
    paged = p.mod.attention_paged(p.t(q[:1]), p.t(cache_k), p.t(cache_v), p.t(table), p.t(pos[:1]), p.t(lens[:1]), 0.2)
    assert_bits(paged, full[:1])
    ref = FAST.attention(q.double(), k.double(), v.double(), pos, lens, 0.2)
    close(full, ref, 1e-5)


@SETTINGS
@given(batch=st.integers(1, 5), data=st.data())
def test_attention_batch_invariant(p: Platform, batch: int, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, batch - 1))
    t = data.draw(st.integers(1, 80))
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(batch, 80, 2, 32, generator=g) for _ in range(3))
    lens = torch.tensor(data.draw(st.lists(st.integers(1, 80), min_size=batch, max_size=batch)))
    lens[i] = t
    pos = torch.arange(80).expand(batch, 80).clamp(max=lens[:, None] - 1)
    full = p.k.attention(p.t(q), p.t(k), p.t(v), p.t(pos), p.t(lens), 0.3)
    alone = p.k.attention(p.t(q[i : i + 1, :t]), p.t(k[i : i + 1, :t]), p.t(v[i : i + 1, :t]), p.t(pos[i : i + 1, :t]),
                          p.t(lens[i : i + 1]), 0.3)
    assert_bits(alone[0], full[i, :t])


# --- DSA indexer: scores and sparse attention -------------------------------------------------------

def _fp8_rounded(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    from parity.quant import fp8

    return fp8.round_trip_scaled(torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_index_scores_any_schedule_and_close_to_cpu(p: Platform, dtype: torch.dtype) -> None:
    """A query's scores are the same bits scored with its whole batch (3 rows of 24 queries at positions 116-139 over
    up to 140 keys, across the 128-key tile), alone as decode (one query, its own cache length) and with fewer
    queries; -inf exactly where a key is not visible; close to the CPU invariant op."""
    b, t, s, nh, d = 3, 24, 140, 4, 32
    q, keys = _fp8_rounded(b, t, nh, d, seed=1, dtype=dtype), _fp8_rounded(b, s, d, seed=2, dtype=dtype)
    w = torch.randn(b, t, nh, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(s - t, s).expand(b, t)
    lens = torch.tensor([s, 130, 125])
    full = p.k.index_scores(p.t(q), p.t(w), p.t(keys), p.t(pos), p.t(lens)).cpu()
    key_pos = torch.arange(s).view(1, 1, s)
    assert torch.equal(torch.isinf(full), ~((key_pos <= pos.unsqueeze(-1)) & (key_pos < lens.view(b, 1, 1))))
    for row, i in ((0, 23), (0, 12), (1, 11), (2, 0)):
        n = int(min(int(pos[row, i]) + 1, lens[row]))
        one = p.k.index_scores(p.t(q[row : row + 1, i : i + 1]), p.t(w[row : row + 1, i : i + 1]),
                               p.t(keys[row : row + 1, :n]), p.t(pos[row : row + 1, i : i + 1]), p.t(torch.tensor([n])))
        assert_bits(one[0, 0].cpu(), full[row, i, :n])
    few = p.k.index_scores(p.t(q[1:2, 10:14]), p.t(w[1:2, 10:14]), p.t(keys[1:2]), p.t(pos[1:2, 10:14]), p.t(lens[1:2]))
    assert_bits(few[0].cpu(), full[1, 10:14])
    ref = INVARIANT.index_scores(q, w, keys, pos, lens)
    finite = torch.isfinite(ref)
    close(full[finite], ref[finite], 1e-5)


def _selection(t: int, count_cap: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query t of one row: `count_cap` random positions of 0..t ascending (all of them when t < count_cap),
    padded with 0 -> (selected [1, T, K], count [1, T])."""
    g = torch.Generator().manual_seed(seed)
    sel = torch.zeros(1, t, count_cap, dtype=torch.long)
    count = torch.zeros(1, t, dtype=torch.long)
    for i in range(t):
        keep = torch.arange(i + 1) if i < count_cap else torch.randperm(i + 1, generator=g)[:count_cap].sort().values
        sel[0, i, : len(keep)] = keep
        count[0, i] = len(keep)
    return sel, count


@pytest.mark.parametrize("l,values", [(96, 64), (288, 256)], ids=["narrow", "wide"])
def test_sparse_attention_is_dense_when_all_selected_and_paged_in_place(p: Platform, l: int, values: int) -> None:
    """Sparse MLA attention, for queries on both sides of the 64- and 128-key tile edges of a 150-token row: with
    every visible position selected, the dense attention's bits (the model's layout: rows (token, head), one latent key
    head); over a selection of 70, paged latents (shuffled blocks, NaN elsewhere) read in place give the contiguous
    bits, a token alone gives its batch's bits, and the result is close to the CPU invariant op's."""
    torch.manual_seed(0)
    t, h, cap = 150, 4, 70
    q, lat = torch.randn(1, t, h, l), torch.randn(1, t, 1, l)
    pos = torch.arange(t).view(1, t)
    some = torch.tensor([0, 63, 64, 69, 70, 127, 128, 149])  # the queries checked (the kernel runs one per token)
    everything = torch.arange(t).expand(1, t, t).clamp(max=pos.unsqueeze(-1))[:, some].contiguous()
    sparse_all = p.k.sparse_attention(p.t(q[:, some]), p.t(lat), p.t(everything), p.t(some.view(1, -1) + 1), values,
                                      0.1)
    dense = p.k.attention(p.t(q.reshape(1, t * h, 1, l)), p.t(lat), p.t(lat[..., :values]),
                          p.t(pos.repeat_interleave(h, dim=1)), p.t(torch.tensor([t])), 0.1).view(1, t, h, values)
    assert_bits(sparse_all, dense[:, some])
    sel, count = _selection(t, cap, seed=1)
    sel, count = sel[:, some].contiguous(), count[:, some].contiguous()
    got = p.k.sparse_attention(p.t(q[:, some]), p.t(lat), p.t(sel), p.t(count), values, 0.1)
    block = 16
    nblk = -(-t // block)
    perm = torch.randperm(nblk + 3)[:nblk]
    pages = torch.full((nblk + 3, block, 1, l), float("nan"))
    pages[perm] = F.pad(lat[0], (0, 0, 0, 0, 0, nblk * block - t)).view(nblk, block, 1, l)
    pages[perm[-1], t % block :] = float("nan")
    paged = p.k.sparse_attention_paged(p.t(q[:, some]), p.t(pages), p.t(perm.view(1, -1)), p.t(sel), p.t(count),
                                       values, 0.1)
    assert_bits(paged, got)
    for j in (0, 4, 7):
        one = p.k.sparse_attention(p.t(q[:, some[j] : some[j] + 1]), p.t(lat), p.t(sel[:, j : j + 1]),
                                   p.t(count[:, j : j + 1]), values, 0.1)
        assert_bits(one[0, 0], got[0, j])
    close(got, INVARIANT.sparse_attention(q[:, some], lat, sel, count, values, 0.1), 1e-5)


# --- AttnRes --------------------------------------------------------------------------------------

def test_attn_res_mix_row_invariant_and_reference(p: Platform) -> None:
    """A token's mix is the same alone and at any place in a batch of several programs' rows."""
    c = torch.randn(131, 4, 64)
    nw, pw = torch.randn(64), torch.randn(64)
    full = p.k.attn_res_mix(p.t(c), p.t(nw), p.t(pw), 1e-6)
    for i in (0, 7, 63, 64, 130):
        assert_bits(p.k.attn_res_mix(p.t(c[i : i + 1]), p.t(nw), p.t(pw), 1e-6)[0], full[i])
    cd = c.double()
    s = (cd * torch.rsqrt(cd.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()) @ pw.double()
    close(full, (torch.softmax(s, -1).unsqueeze(-1) * cd).sum(1), 1e-5)


# --- MoE ------------------------------------------------------------------------------------------

def _experts(e: int, lat: int, inter: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(5)
    return (torch.randn(e, inter, lat, generator=g) / 8, torch.randn(e, inter, lat, generator=g) / 8,
            torch.randn(e, lat, inter, generator=g) / 8)


def _moe(p: Platform, x, logits, bias, w1, w3, w2):
    ids, w = p.k.route(p.t(logits), p.t(bias), 4, True, 2.5, "sigmoid")
    return ids, p.mod.experts(p.t(x), ids, w, p.t(w1), p.t(w3), p.t(w2), "situ", 4.0, 25.0)


@FEW
@given(batch=st.integers(1, 70), data=st.data())
def test_moe_token_invariant_with_ties(p: Platform, batch: int, data: st.DataObject) -> None:
    """A token's routing and output are the same whatever other tokens share the batch, ties included."""
    pos = data.draw(st.integers(0, batch - 1))
    e, lat = 16, 32
    w1, w3, w2 = _experts(e, lat, 24)
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, lat, generator=g)
    logits = torch.randn(batch, e, generator=g)
    logits[pos, :8] = 0.5
    logits[pos, 8:] = -1.0 - logits[pos, 8:].abs()
    bias = torch.zeros(e)
    ids, out = _moe(p, x, logits, bias, w1, w3, w2)
    ids1, out1 = _moe(p, x[pos : pos + 1], logits[pos : pos + 1], bias, w1, w3, w2)
    assert_bits(ids[pos], ids1[0])
    assert ids1[0].tolist() == [0, 1, 2, 3]
    assert_bits(out[pos], out1[0])


def test_moe_matches_cpu_kernels(p: Platform) -> None:
    e, lat = 16, 32
    w1, w3, w2 = _experts(e, lat, 24)
    x, logits, bias = torch.randn(9, lat), torch.randn(9, e), torch.randn(e) * 0.1
    ids, out = _moe(p, x, logits, bias, w1, w3, w2)
    ids_c, w_c = INVARIANT.route(logits, bias, 4, True, 2.5, "sigmoid")
    assert torch.equal(ids.cpu(), ids_c)
    act = lambda a, b: INVARIANT.situ_glu(a, b, 4.0, 25.0)  # noqa: E731
    ref = experts_combine(x, ids_c, w_c, list(w1), list(w3), list(w2), INVARIANT.linear, act)
    close(out, ref, 1e-5)


def test_moe_mxfp4_experts_have_the_bits_of_their_bf16_values(p: Platform) -> None:
    """The grouped expert GEMMs on packed MXFP4 experts (dequantised inside both GEMM kernels) equal, bit for bit, the
    same op on the bf16 values of those weights; a token's output does not depend on the other tokens; with fp32
    activations, the op on the weights' fp32 values."""
    from parity.quant import mxfp4
    from parity.quant.mxfp4 import MXFP4Weight

    e, lat, inter = 8, 64, 96
    g = torch.Generator().manual_seed(5)
    packed = [[mxfp4.quantize(torch.randn(*shape, generator=g) * shape[1] ** -0.5) for _ in range(e)]
              for shape in ((inter, lat), (inter, lat), (lat, inter))]
    stacked = [MXFP4Weight(p.t(w.packed), p.t(w.scale)) for w in map(MXFP4Weight.stack, packed)]
    dense = [w.dequantize(torch.bfloat16) for w in stacked]
    x = torch.randn(37, lat, generator=g).bfloat16()
    ids, w = p.k.route(p.t(torch.randn(37, e, generator=g)), p.t(torch.zeros(e)), 4, True, 2.5, "sigmoid")
    out = p.mod.experts(p.t(x), ids, w, *stacked)
    assert_bits(out, p.mod.experts(p.t(x), ids, w, *dense))
    assert_bits(out[20:21], p.mod.experts(p.t(x[20:21]), ids[20:21], w[20:21], *stacked))
    x32 = p.t(x.float())  # fp32 activations (an fp32 model with MXFP4 experts): the fp32 values of the weights
    assert_bits(p.mod.experts(x32, ids, w, *stacked), p.mod.experts(x32, ids, w, *(d.float() for d in dense)))


# --- GPU only: bf16 at model widths ---------------------------------------------------------------

def _mxfp4_weight(n: int, k: int, seed: int):
    from parity.quant import mxfp4

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (2.0 ** torch.randint(-8, 8, (n, 1), generator=g))
    w[0] = 0.0  # a zero group: scale byte 0 (2^-127)
    return mxfp4.quantize(w)


def test_linear_mxfp4_has_the_bits_of_bf16_on_its_dequantised_weight(p: Platform) -> None:
    """Packed MXFP4 weights dequantised inside the GEMM kernel: every row's bits equal the bf16 GEMM on the
    dequantised weight (same tiles, K order and MMAs), on both launch paths (decode split and fused), with LoRA, and
    rows stay batch-invariant. Tiny E8M0 scales (bf16 subnormal values) included."""
    from parity.quant.mxfp4 import MXFP4Weight

    for n, k, seed in ((48, 96, 1), (40, 64, 2)) if p.name == "interp" else ((1024, 384, 1), (384, 1024, 2)):
        q = _mxfp4_weight(n, k, seed)
        q = MXFP4Weight(p.t(q.packed), p.t(torch.cat([q.scale[:, :1].clamp(max=3), q.scale[:, 1:]], dim=1)))
        dense = q.dequantize(torch.bfloat16)
        lora = LoRA(p.t(torch.randn(4, k).bfloat16()), p.t(torch.randn(n, 4).bfloat16()), 0.5)
        for m in ((1, 5, 17, 130) if p.name == "interp" else (1, 7, 64, 129, 700)):
            x = p.t(torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16())
            assert_bits(p.k.linear(x, q), p.k.linear(x, dense))
            assert_bits(p.k.linear(x, q, lora), p.k.linear(x, dense, lora))
            assert_bits(p.k.linear(x[-1:], q), p.k.linear(x, q)[-1:])


def test_mixed_dtype_operands_follow_the_cpu_contract(p: Platform) -> None:
    """The bf16 model's cast points on the Triton kernels: fp32 activations on a bf16 weight (router), bf16
    activations on fp32 conv weights and a bf16 gate input with fp32 parameters (KDA), bf16 v with fp32 q / k: the
    narrower operand is upcast exactly and the output has the CPU kernel's dtype (bf16 outputs within one bf16
    rounding of the fp32 run: the interpreter's float-to-bf16 conversion is not torch's)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 64, generator=g).bfloat16()
    x = torch.randn(9, 64, generator=g)
    assert_bits(p.k.linear(p.t(x), p.t(w)), p.k.linear(p.t(x), p.t(w.float())))
    xc = torch.randn(2, 11, 48, generator=g).bfloat16()
    wc, state = torch.randn(48, 4, generator=g), torch.zeros(2, 3, 48).bfloat16()
    y, new = p.k.short_conv(p.t(xc), p.t(wc), p.t(state))
    y32, _ = p.k.short_conv(p.t(xc.float()), p.t(wc), p.t(state.float()))
    assert y.dtype == new.dtype == torch.bfloat16 and torch.equal(new, p.t(torch.cat([state, xc], 1)[:, -3:]))
    close(y, y32, 2**-7)
    f = torch.randn(2, 5, 2, 16, generator=g).bfloat16()
    gate = p.k.kda_gate(p.t(f), p.t(torch.randn(2, generator=g)), p.t(torch.randn(2, 16, generator=g)), -5.0)
    assert gate.dtype == torch.float32
    q, k = (F.normalize(torch.randn(1, 20, 2, 32, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(1, 20, 2, 32, generator=g).bfloat16()
    beta = torch.rand(1, 20, 2, generator=g)
    lg = -torch.rand(1, 20, 2, 32, generator=g)
    o, _ = p.k.kda(p.t(q), p.t(k), p.t(v), p.t(lg), p.t(beta), 0.2, p.t(torch.zeros(1, 2, 32, 32)))
    o32, _ = p.k.kda(p.t(q), p.t(k), p.t(v.float()), p.t(lg), p.t(beta), 0.2, p.t(torch.zeros(1, 2, 32, 32)))
    assert o.dtype == torch.bfloat16
    close(o, o32, 2**-7)


@pytest.mark.gpu
def test_gpu_linear_bf16_rows_equal_at_every_m(gpu: Platform) -> None:
    """bf16 GEMM at K3 widths: rows of M = 1 .. 4096 (64-row tile on the split-K-segment path up to
    SPLIT_MAX_M rows, 128-row tile fused above) equal the same rows of the M = 4096 product; with a LoRA
    term too; (200, 100) runs the pointer-load path."""
    for n, k in ((7168, 7168), (4096, 4096), (1024, 384), (200, 100)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
        full = gpu.k.linear(x, w)
        for m in (1, 3, 16, 33, 64, 128, 129, 1000):
            assert_bits(gpu.k.linear(x[-m:].clone(), w), full[-m:])
        close(full[:64].float(), x[:64].double() @ w.double().t(), 0.1 * k**0.5 / 8)
        lora = LoRA(torch.randn(16, k, device="cuda", dtype=torch.bfloat16) / k**0.5,
                    torch.randn(n, 16, device="cuda", dtype=torch.bfloat16), 0.5)
        full = gpu.k.linear(x, w, lora)
        for m in (1, 64, 1000):
            assert_bits(gpu.k.linear(x[-m:].clone(), w, lora), full[-m:])


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(7168, 7168), (4096, 4096), (12288, 7168), (1024, 384), (384, 1024), (200, 100)])
def test_gpu_linear_decode_and_prefill_tiles_bit_equal(gpu: Platform, n: int, k: int) -> None:
    """The tile `gemm_config` picks for M <= SPLIT_MAX_M (64 rows) and the one it picks above (128 rows)
    give the same bits on all 4096 rows of one product (both on the fused path), so choosing by M cannot
    move a row; (200, 100) has unaligned rows and runs the pointer-load path."""
    lin = gpu.mod.linear
    dec = lin.gemm_config(n, k, torch.bfloat16, 1)
    pre = lin.gemm_config(n, k, torch.bfloat16, 4096)
    assert dec.block_m != pre.block_m and dec.block_k == pre.block_k and dec.k_segments == pre.k_segments
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
    assert_bits(lin.matmul(x, w, config=dec), lin.matmul(x, w, config=pre))


@pytest.mark.gpu
def test_gpu_linear_split_path_repeatable(gpu: Platform) -> None:
    """The decode shapes' split path (one program per tile and K segment, the last arriver adds the sums in order)
    at K3 width, called back to back: every call has the bits of the fused path's rows (M = 4096), whichever
    segment arrives last, and the arrival counters are back at zero after each launch."""
    lin = gpu.mod.linear
    n = k = 7168
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
    full = lin.matmul(x, w)
    for m in (1, 64, 128):
        assert lin.segment_layout(k, lin.gemm_config(n, k, torch.bfloat16, m))[0] > 1 and m <= lin.SPLIT_MAX_M
        outs = [lin.matmul(x[:m], w) for _ in range(50)]
        for y in outs:
            assert_bits(y, full[:m])
    assert not lin.arrival_counters(x.device, 1).any()


@pytest.mark.gpu
def test_gpu_kda_bf16_prefill_equals_decode(gpu: Platform) -> None:
    """bf16 KDA at K3 head size (d = 128): one pass = prefill 1000 + decode; and close to float64."""
    t, h, d = 1100, 4, 128
    q, k, v, g, beta = _kda_inputs(1, t, h=h, dk=d, dv=d, seed=11)
    ins = tuple(x.cuda().bfloat16() if x is not g else x.cuda() for x in (q, k, v, g, beta))
    s0 = torch.zeros(1, h, d, d, device="cuda")
    full, s_full = gpu.k.kda(*ins, d**-0.5, s0)
    o1, s = gpu.k.kda(*(x[:, :1000] for x in ins), d**-0.5, s0)
    outs = [o1]
    for i in range(1000, 1040):
        o, s = gpu.k.kda(*(x[:, i : i + 1] for x in ins), d**-0.5, s)
        outs.append(o)
    assert_bits(torch.cat(outs, 1), full[:, :1040])
    ref, _ = FAST.kda(*(x.double().cpu() for x in ins[:4]), ins[4].double().cpu(), d**-0.5, s0.double().cpu())
    assert (full.double().cpu() - ref).abs().max() < 0.05


@pytest.mark.gpu
def test_gpu_kda_gradient_of_a_bf16_layer(gpu: Platform) -> None:
    """A bf16 KDA layer's gradient at K3's head size (d = 128; q, k, g, beta fp32 and v bf16, as the model feeds the op)
    comes from fla's chunked kernels pinned to one configuration: the same bits on every run, and within the rounding
    of TF32 products (unit 2^-11; fla chains at most 8 products into a gradient, each operand rounded once: 16 units,
    norm-wise; dv, a bf16 gradient, one rounding to bf16 more, 2^-8) of the float64 gradient of the same recurrence
    (`kda_chunked` in float64)."""
    from parity.kernels.kda import kda_chunked

    t, h, d = 300, 4, 128
    q, k, v, g, beta = _kda_inputs(2, t, h=h, dk=d, dv=d, seed=13)
    v = v.bfloat16()
    cot = torch.randn(2, t, h, d, generator=torch.Generator().manual_seed(14)).bfloat16()
    valid = torch.arange(t)[None] < torch.tensor([[t], [t - 37]])

    def grads() -> list[torch.Tensor]:
        leaves = [x.cuda().requires_grad_() for x in (q, k, v, g, beta)]
        o, _ = gpu.k.kda(*leaves, d**-0.5, torch.zeros(2, h, d, d, device="cuda"), valid.cuda())
        return list(torch.autograd.grad(o, leaves, cot.cuda()))

    got = grads()
    for a, b in zip(got, grads()):
        assert_bits(a, b)
    leaves = [x.double().requires_grad_() for x in (q, k, v, g, beta)]
    o, _ = kda_chunked(*leaves, d**-0.5, torch.zeros(2, h, d, d, dtype=torch.float64), valid)
    ref = torch.autograd.grad(o, leaves, cot.double())
    for name, a, r in zip("qkvgb", got, ref):
        assert a.dtype == (torch.bfloat16 if name == "v" else torch.float32), name
        err = (a.double().cpu() - r).norm() / r.norm()
        assert err <= 16 * 2.0**-11 + (2.0**-8 if name == "v" else 0.0), f"d{name}: norm-wise relative error {err:.3g}"
        print(f"d{name}: norm-wise relative error {err:.3g}")


@pytest.mark.gpu
def test_gpu_attention_bf16_decode_equals_prefill(gpu: Platform) -> None:
    b, t, h, d, dv = 1, 1000, 8, 192, 128
    q, k = (torch.randn(b, t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(b, t, h, dv, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(t, device="cuda").view(1, -1)
    lens = torch.tensor([t], device="cuda")
    full = gpu.k.attention(q, k, v, pos, lens, d**-0.5)
    for i in (0, 63, 64, 500, 999):
        one = gpu.k.attention(q[:, i : i + 1], k[:, : i + 1], v[:, : i + 1], pos[:, i : i + 1],
                              torch.tensor([i + 1], device="cuda"), d**-0.5)
        assert_bits(one[0, 0], full[0, i])


# --- GPU only: the whole K3 forward ---------------------------------------------------------------

def _k3_tiny_model(config: str) -> tuple:
    """(config, random official weights, seed 0) of k3-tiny in fp32 ('k3-tiny'), or a config in its bf16 numerics."""
    import dataclasses

    from parity.config import load_model_config
    from parity.io.checkpoint import random_weights

    cfg = load_model_config(f"configs/{config}.yaml")
    if config == "k3-tiny":
        cfg = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, torch_dtype="float32"))
    return cfg, random_weights(cfg, seed=0)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["k3-tiny", "k3-tiny-mxfp4", "k3.1-tiny"])
def test_gpu_k3_forward_one_pass_equals_paged_decode(gpu: Platform, config: str) -> None:
    """k3-tiny on the GPU kernels, in fp32 and in K3's numerics (k3-tiny-mxfp4: bf16, MXFP4 experts dequantised
    inside the GEMM, an FP8 paged latent pool; k3.1-tiny: that with the DSA indexer, its FP8 index keys in the pool
    beside the latents, each query attending its 16 best positions of up to 150): sequences scored in one batched
    pass equal, bit for bit, the same sequences generated token by token (prefill split, then decode) through a paged
    MLA cache and the chunked KDA state; in fp32 they agree with the CPU invariant forward within fp32 round-off."""
    from parity.caches import MLACache, new_cache
    from parity.model import K3Forward, K3Weights, score_sequences
    from rollout.generate.paged_pool import PagedLatentPool

    cfg, official = _k3_tiny_model(config)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(4, 1024, (n,), generator=g).tolist() for n in (150, 97, 40)]
    cpu_lp = score_sequences(K3Forward(K3Weights.from_official(cfg.text, official), INVARIANT), seqs[2:])[0]
    with torch.device("cuda"):
        fwd = K3Forward(K3Weights.from_official(cfg.text, {n: t.cuda() for n, t in official.items()}), gpu.k)
        batched = score_sequences(fwd, seqs)
        for seq, split in ((seqs[0], 37), (seqs[1], 70)):
            caches = [PagedLatentPool.for_config(cfg.text, 1, 16, 24, "cuda") if isinstance(c, MLACache) else c
                      for c in new_cache(cfg.text, 1)]
            out, start = [], 0
            for end in [split, *range(split + 1, len(seq) + 1)]:
                ids = torch.tensor([seq[start:end]])
                pos = torch.arange(start, end).view(1, -1)
                hidden = fwd.hidden(ids, pos, torch.tensor([end - start]), caches)
                n_lp = end - start if end < len(seq) else end - start - 1
                logits = fwd.logits(hidden[0, :n_lp])
                out.append(fwd.token_logprobs(logits, torch.tensor(seq[start + 1 : start + 1 + n_lp]), 1.0))
                start = end
            assert_bits(torch.cat(out), batched[seqs.index(seq)])
    if cfg.text.compute_dtype == torch.float32:  # bf16 rounding, amplified by a random model, has no such bound
        close(batched[2], cpu_lp, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["k3-tiny", "k3-tiny-mxfp4", "k3.1-tiny"])
def test_gpu_graphed_decode_equals_eager(gpu: Platform, config: str) -> None:
    """Batched decode captured in a CUDA graph (`rollout.generate.decode_graph`) gives the eager step's logits bit for bit,
    step after step, over a paged latent pool and the chunked KDA state (rows of different lengths; decode crosses a
    64-token KDA chunk boundary), in fp32 and in K3's numerics (bf16, MXFP4 experts, FP8 latents; k3.1-tiny: with
    the DSA indexer, contexts past its top-k)."""
    from parity.caches import MLACache, new_cache
    from parity.model import K3Forward, K3Weights
    from rollout.generate.decode_graph import GraphedDecode
    from rollout.generate.paged_pool import PagedLatentPool

    cfg, official = _k3_tiny_model(config)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 1024, (n,), generator=g).tolist() for n in (60, 33, 5)]
    steps = 8
    with torch.device("cuda"):
        fwd = K3Forward(K3Weights.from_official(cfg.text, {n: t.cuda() for n, t in official.items()}), gpu.k)

        def prefilled() -> tuple[list, torch.Tensor]:
            caches = [PagedLatentPool.for_config(cfg.text, 3, 16, 6, "cuda") if isinstance(c, MLACache) else c
                      for c in new_cache(cfg.text, 3)]
            lens = torch.tensor([len(p) for p in prompts])
            ids = torch.tensor([p + [0] * (60 - len(p)) for p in prompts])
            hidden = fwd.hidden(ids, torch.arange(60).expand(3, -1), lens, caches)
            return caches, fwd.logits(hidden[torch.arange(3), lens - 1])

        tokens = torch.randint(4, 1024, (steps, 3, 1), generator=torch.Generator().manual_seed(5), device="cpu")
        caches, first = prefilled()
        eager = [first]
        for i in range(steps):
            pos = torch.tensor([[len(p) + i] for p in prompts])
            eager.append(fwd.logits(fwd.hidden(tokens[i].cuda(), pos, torch.ones(3, dtype=torch.long), caches)[:, 0]))
        caches, first = prefilled()
        graph = GraphedDecode(fwd, caches, 3)
        replayed = [first] + [graph.step(tokens[i].cuda(), torch.tensor([[len(p) + i] for p in prompts])).clone()
                              for i in range(steps)]
    for a, b in zip(eager, replayed):
        assert_bits(b, a)
