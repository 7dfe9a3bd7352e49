"""Invariance properties of the parity kernels (bits, `torch.equal`), their agreement with float64
references (tolerances), and negative controls showing the same properties fail on plain torch ops."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import assert_bits, first_mismatch
from parity.kernels import FAST, INVARIANT, get_kernels
from parity.kernels.attention import gather_paged
from parity.kernels.kda import kda_chunked
from parity.kernels.linear import LoRA, k_segments, pairwise_sum, tiled_matmul
from parity.kernels.moe import experts_combine
from parity.kernels.primitives import sigmoid, silu, softplus, tree_sum

SETTINGS = settings(max_examples=15, deadline=None, derandomize=True)


def _embed_row(row: torch.Tensor, batch: int, pos: int, seed: int) -> torch.Tensor:
    """A random batch of `batch` rows (in `row`'s dtype) with `row` at index `pos`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *row.shape, generator=g).to(row.dtype)
    x[pos] = row
    return x


# --- primitives -----------------------------------------------------------------------------------

def test_primitives_are_layout_invariant() -> None:
    """exp/log/... and the derived sigmoid/silu/softplus: an element alone equals it inside a big tensor."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=g) * 10, torch.randn(4096, generator=g) * 0.01])
    fns = {"exp": torch.exp, "tanh": torch.tanh, "log1p": lambda t: torch.log1p(t.abs()),
           "rsqrt": lambda t: torch.rsqrt(t.abs() + 1e-20), "sigmoid": sigmoid, "silu": silu, "softplus": softplus}
    for name, f in fns.items():
        whole = f(x)
        alone = torch.cat([f(x[i : i + 3]) for i in range(0, 1200, 3)])
        assert torch.equal(alone, whole[:1200]), f"{name}: {first_mismatch(alone, whole[:1200])}"


def test_torch_sigmoid_is_not_layout_invariant() -> None:
    """Negative control: torch.sigmoid's scalar tail loop differs from its SIMD loop (why we rebuild it)."""
    x = torch.randn(8192, generator=torch.Generator().manual_seed(0)) * 4
    whole = torch.sigmoid(x)
    alone = torch.cat([torch.sigmoid(x[i : i + 3]) for i in range(0, 3000, 3)])
    assert not torch.equal(alone, whole[:3000])


def test_tree_sum_matches_float64() -> None:
    x = torch.randn(7, 1000)
    torch.testing.assert_close(tree_sum(x), x.double().sum(-1).float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape,dim", [((7, 1000), -1), ((3, 5, 6, 4), -2), ((3, 5, 6, 4), 1), ((2, 1), 0)])
def test_tree_sum_gradient_is_the_row_gradient_broadcast(shape: tuple[int, ...], dim: int) -> None:
    """The one-view backward equals autograd through the halvings bit for bit (up to the sign of a zero), and leaves
    the forward's bits as they are."""
    from parity.kernels.primitives import _tree_sum

    g = torch.Generator().manual_seed(len(shape) + dim)
    x = torch.randn(shape, generator=g).requires_grad_()
    cot = torch.randn(_tree_sum(x.detach(), dim).shape, generator=g)
    cot.view(-1)[0] = -0.0
    out = tree_sum(x, dim)
    assert torch.equal(out, _tree_sum(x.detach(), dim))
    (got,) = torch.autograd.grad(out, x, cot)
    (ref,) = torch.autograd.grad(_tree_sum(x, dim), x, cot)
    assert torch.equal(got + 0.0, ref + 0.0)
    assert torch.equal(got, cot.unsqueeze(dim).expand(shape))


# --- linear ---------------------------------------------------------------------------------------

@SETTINGS
@given(batch=st.integers(1, 70), data=st.data(), k=st.sampled_from([24, 64, 256]), n=st.sampled_from([8, 96, 512]))
def test_linear_row_invariant(batch: int, data: st.DataObject, k: int, n: int) -> None:
    pos = data.draw(st.integers(0, batch - 1))
    w = torch.randn(n, k)
    row = torch.randn(k)
    alone = INVARIANT.linear(row.unsqueeze(0), w)[0]
    inside = INVARIANT.linear(_embed_row(row, batch, pos, batch * 7 + pos), w)[pos]
    assert_bits(alone, inside)


def test_linear_thread_count_invariant() -> None:
    x, w = torch.randn(37, 256), torch.randn(512, 256)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = INVARIANT.linear(x, w)
        torch.set_num_threads(2)
        two = INVARIANT.linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert_bits(one, two)


def test_linear_row_at_every_tile_position() -> None:
    """A row alone (tile position 0) equals the same row at each of the 16 positions of a full tile,
    beside random rows: the one property of the tiled GEMM that rests on the BLAS micro-kernel."""
    torch.manual_seed(1)
    from parity.kernels.linear import TILE_ROWS

    for k, n in ((24, 8), (96, 200), (384, 384), (1024, 64)):
        w, row = torch.randn(n, k), torch.randn(k)
        alone = INVARIANT.linear(row.unsqueeze(0), w)[0]
        for pos in range(TILE_ROWS):
            assert_bits(alone, INVARIANT.linear(_embed_row(row, TILE_ROWS, pos, k + pos), w)[pos])


def test_linear_lora_row_invariant() -> None:
    from parity.kernels.linear import LoRA

    w, lora = torch.randn(96, 64), LoRA(torch.randn(4, 64), torch.randn(96, 4), 0.5)
    x = torch.randn(23, 64)
    full = INVARIANT.linear(x, w, lora)
    for i in (0, 5, 22):
        assert_bits(INVARIANT.linear(x[i : i + 1], w, lora)[0], full[i])
    ref = x.double() @ w.double().t() + 0.5 * (x.double() @ lora.a.double().t()) @ lora.b.double().t()
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-4)


def test_plain_linear_is_not_row_invariant() -> None:
    """Negative control: F.linear changes the trailing rows for small M (MKL), so the property can fail."""
    torch.manual_seed(0)
    w, x = torch.randn(512, 256), torch.randn(11, 256)
    full = F.linear(torch.cat([x, torch.randn(53, 256)]), w)
    assert any(not torch.equal(F.linear(x[:m], w)[m - 1], full[m - 1]) for m in range(1, 12))


# --- row-wise ops ---------------------------------------------------------------------------------

@SETTINGS
@given(batch=st.integers(1, 40), data=st.data(), d=st.sampled_from([32, 100, 256]))
def test_rowwise_ops_row_invariant(batch: int, data: st.DataObject, d: int) -> None:
    pos = data.draw(st.integers(0, batch - 1))
    w = torch.randn(d)
    row, gate = torch.randn(d), torch.randn(d)
    xs, gs = _embed_row(row, batch, pos, 1 + pos), _embed_row(gate, batch, pos, 2 + pos)
    k = INVARIANT
    assert_bits(k.rmsnorm(row[None], w, 1e-6)[0], k.rmsnorm(xs, w, 1e-6)[pos])
    assert_bits(k.gated_rmsnorm(row[None], gate[None], w, 1e-6)[0], k.gated_rmsnorm(xs, gs, w, 1e-6)[pos])
    assert_bits(k.l2norm(row[None])[0], k.l2norm(xs)[pos])
    assert_bits(k.situ_glu(row[None], gate[None], 4.0, 25.0)[0], k.situ_glu(xs, gs, 4.0, 25.0)[pos])
    assert_bits(k.silu_glu(row[None], gate[None])[0], k.silu_glu(xs, gs)[pos])
    logits = xs * 3
    tokens = torch.randint(0, d, (batch,))
    assert_bits(k.token_logprobs(logits[pos : pos + 1], tokens[pos : pos + 1], 0.7)[0],
                k.token_logprobs(logits, tokens, 0.7)[pos])


def test_rowwise_ops_match_float64() -> None:
    x, g, w = torch.randn(9, 200), torch.randn(9, 200), torch.randn(200)
    xd, gd, wd = x.double(), g.double(), w.double()
    rms = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
    for kern in (INVARIANT, FAST):
        torch.testing.assert_close(kern.rmsnorm(x, w, 1e-6).double(), rms, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kern.gated_rmsnorm(x, g, w, 1e-6).double(), rms * torch.sigmoid(gd), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kern.l2norm(x).double(), xd / torch.sqrt(xd.pow(2).sum(-1, keepdim=True) + 1e-6),
                                   rtol=1e-5, atol=1e-6)
        situ = 4 * torch.tanh(xd / 4) * torch.sigmoid(xd) * 25 * torch.tanh(gd / 25)
        torch.testing.assert_close(kern.situ_glu(x, g, 4.0, 25.0).double(), situ, rtol=1e-5, atol=1e-5)
        toks = torch.randint(0, 200, (9,))
        ref = torch.log_softmax(xd / 0.7, -1).gather(1, toks[:, None])[:, 0]
        torch.testing.assert_close(kern.token_logprobs(x, toks, 0.7).double(), ref, rtol=1e-5, atol=1e-5)


# --- short conv -----------------------------------------------------------------------------------

@SETTINGS
@given(t=st.integers(1, 40), data=st.data())
def test_short_conv_any_split(t: int, data: st.DataObject) -> None:
    """Any split of a sequence into pieces with carried state equals one pass (bits)."""
    d, width = 24, 4
    w = torch.randn(d, width)
    x = torch.randn(1, t, d)
    zero = torch.zeros(1, width - 1, d)
    full, full_state = INVARIANT.short_conv(x, w, zero)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(t - 1, 1)), max_size=5)))) if t > 1 else []
    outs, state, start = [], zero, 0
    for end in cuts + [t]:
        y, state = INVARIANT.short_conv(x[:, start:end], w, state)
        outs.append(y)
        start = end
    assert_bits(torch.cat(outs, 1), full)
    assert_bits(state, full_state)
    ref = F.silu(F.conv1d(F.pad(x.double().transpose(1, 2), (width - 1, 0)), w.double().unsqueeze(1), groups=d)).transpose(1, 2)
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5)


# --- KDA ------------------------------------------------------------------------------------------

def _kda_inputs(b: int, t: int, h: int = 2, dk: int = 16, dv: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = INVARIANT.l2norm(torch.randn(b, t, h, dk, generator=g))
    k = INVARIANT.l2norm(torch.randn(b, t, h, dk, generator=g))
    v = torch.randn(b, t, h, dv, generator=g)
    gate = INVARIANT.kda_gate(torch.randn(b, t, h, dk, generator=g), torch.zeros(h), torch.zeros(h, dk), -5.0)
    beta = sigmoid(torch.randn(b, t, h, generator=g))
    return q, k, v, gate, beta


@SETTINGS
@given(t=st.integers(2, 48), data=st.data())
def test_kda_any_schedule_and_resume(t: int, data: st.DataObject) -> None:
    """Prefill chunks + decode steps at random split points (and resuming from a saved state) = one pass."""
    q, k, v, g, beta = _kda_inputs(1, t, seed=t)
    s0 = torch.zeros(1, 2, 16, 16)
    full, s_full = INVARIANT.kda(q, k, v, g, beta, 0.25, s0)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, t - 1), min_size=1, max_size=6))))
    outs, s, start, saved = [], s0, 0, {}
    for end in cuts + [t]:
        o, s = INVARIANT.kda(q[:, start:end], k[:, start:end], v[:, start:end], g[:, start:end], beta[:, start:end], 0.25, s)
        outs.append(o)
        saved[end] = s.clone()
        start = end
    assert_bits(torch.cat(outs, 1), full)
    assert_bits(s, s_full)
    mid = cuts[0]
    o_resume, s_resume = INVARIANT.kda(q[:, mid:], k[:, mid:], v[:, mid:], g[:, mid:], beta[:, mid:], 0.25, saved[mid])
    assert_bits(o_resume, full[:, mid:])
    assert_bits(s_resume, s_full)


@SETTINGS
@given(batch=st.integers(1, 6), data=st.data())
def test_kda_batch_invariant_with_padding(batch: int, data: st.DataObject) -> None:
    pos = data.draw(st.integers(0, batch - 1))
    t = 20
    q, k, v, g, beta = _kda_inputs(batch, t, seed=batch)
    lens = torch.tensor(data.draw(st.lists(st.integers(1, t), min_size=batch, max_size=batch)))
    valid = torch.arange(t)[None] < lens[:, None]
    s0 = torch.randn(batch, 2, 16, 16)
    o, s = INVARIANT.kda(q, k, v, g, beta, 0.25, s0, valid)
    n = int(lens[pos])
    sl = slice(pos, pos + 1)
    o1, s1 = INVARIANT.kda(q[sl, :n], k[sl, :n], v[sl, :n], g[sl, :n], beta[sl, :n], 0.25, s0[sl])
    assert_bits(o[sl, :n], o1)
    assert_bits(s[sl], s1)


def test_kda_matches_float64_and_fast() -> None:
    q, k, v, g, beta = _kda_inputs(2, 33)
    s0 = torch.zeros(2, 2, 16, 16, dtype=torch.float64)
    o_ref, s_ref = FAST.kda(q.double(), k.double(), v.double(), g.double(), beta.double(), 0.25, s0)
    for kern in (INVARIANT, FAST):
        o, s = kern.kda(q, k, v, g, beta, 0.25, s0.float())
        torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s.double(), s_ref, rtol=1e-4, atol=1e-5)


def test_kda_chunked_form_equals_the_recurrence_with_its_gradients() -> None:
    """`kda_chunked` (the GPU trainer's KDA backward) is the invariant recurrence in float64 to round-off, outputs,
    final state and every input's gradient, across chunk boundaries, from a non-zero state, with padding."""
    q, k, v, g, beta = (x.double() for x in _kda_inputs(2, 150, seed=9))
    s0 = torch.randn(2, 2, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    valid = torch.ones(2, 150, dtype=torch.bool)
    valid[0, :5], valid[1, 100:] = False, False
    grads, outs = [], []
    for op in (kda_chunked, INVARIANT.kda):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, s0)]
        o, s = op(*leaves[:5], 0.25, leaves[5], valid)
        cot = torch.Generator().manual_seed(2)
        loss = (o * torch.randn(o.shape, generator=cot, dtype=o.dtype)).sum() + (
            s * torch.randn(s.shape, generator=cot, dtype=s.dtype)).sum()
        outs.append((o, s))
        grads.append(torch.autograd.grad(loss, leaves))
    for a, b in [*zip(outs[0], outs[1]), *zip(*grads)]:
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# --- attention ------------------------------------------------------------------------------------

def test_attention_decode_equals_prefill_and_paged() -> None:
    torch.manual_seed(0)
    b, t, h, d = 2, 150, 2, 48
    q, k, v = torch.randn(b, t, h, d), torch.randn(b, t, h, d), torch.randn(b, t, h, 32)
    pos = torch.arange(t).expand(b, t)
    lens = torch.tensor([t, 97])
    full = INVARIANT.attention(q, k, v, pos, lens, 0.2)
    for p in (0, 1, 63, 64, 96, 149):
        if p >= int(lens[1]):
            continue
        one = INVARIANT.attention(q[1:2, p : p + 1], k[1:2, : p + 1], v[1:2, : p + 1], pos[1:2, p : p + 1],
                                  torch.tensor([p + 1]), 0.2)
        assert_bits(one[0, 0], full[1, p])
    # paged: scatter keys of sequence 0 into shuffled blocks with NaN garbage elsewhere
    block = 16
    nblk = -(-t // block)
    perm = torch.randperm(nblk + 3)[:nblk]
    cache_k = torch.full((nblk + 3, block, h, d), float("nan"))
    cache_v = torch.full((nblk + 3, block, h, 32), float("nan"))
    kp = F.pad(k[0], (0, 0, 0, 0, 0, nblk * block - t)).view(nblk, block, h, d)
    vp = F.pad(v[0], (0, 0, 0, 0, 0, nblk * block - t)).view(nblk, block, h, 32)
    cache_k[perm], cache_v[perm] = kp, vp
    cache_k[perm[-1], t % block :] = float("nan")
    cache_v[perm[-1], t % block :] = float("nan")
    table = perm.view(1, -1)
    paged = INVARIANT.attention(q[:1], gather_paged(cache_k, table), gather_paged(cache_v, table),
                                pos[:1], lens[:1], 0.2)
    assert_bits(paged, full[:1])
    ref = FAST.attention(q.double(), k.double(), v.double(), pos, lens, 0.2)
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(batch=st.integers(1, 5), data=st.data())
def test_attention_batch_invariant(batch: int, data: st.DataObject) -> None:
    pos_in_batch = data.draw(st.integers(0, batch - 1))
    t = data.draw(st.integers(1, 80))
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(batch, 80, 2, 32, generator=g) for _ in range(3))
    lens = torch.tensor(data.draw(st.lists(st.integers(1, 80), min_size=batch, max_size=batch)))
    lens[pos_in_batch] = t
    pos = torch.arange(80).expand(batch, 80).clamp(max=lens[:, None] - 1)
    full = INVARIANT.attention(q, k, v, pos, lens, 0.3)
    i = pos_in_batch
    alone = INVARIANT.attention(q[i : i + 1, :t], k[i : i + 1, :t], v[i : i + 1, :t], pos[i : i + 1, :t], lens[i : i + 1], 0.3)
    assert_bits(alone[0], full[i, :t])


# --- AttnRes --------------------------------------------------------------------------------------

def test_attn_res_mix_row_invariant_and_reference() -> None:
    c = torch.randn(13, 4, 64)
    nw, pw = torch.randn(64), torch.randn(64)
    full = INVARIANT.attn_res_mix(c, nw, pw, 1e-6)
    for i in (0, 7, 12):
        assert_bits(INVARIANT.attn_res_mix(c[i : i + 1], nw, pw, 1e-6)[0], full[i])
    cd = c.double()
    s = (cd * torch.rsqrt(cd.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()) @ pw.double()
    ref = (torch.softmax(s, -1).unsqueeze(-1) * cd).sum(1)
    torch.testing.assert_close(full.double(), ref, rtol=1e-5, atol=1e-5)


def test_attn_res_mix_gradient_within_fp32_rounding_of_float64() -> None:
    """The invariant mix's gradient (candidates and both weights) against float64 autograd of the same formula,
    norm-wise within the rounding of fp32 sums of at most D + n terms (gamma = (D + n) 2^-24), times 4 for the chain
    (norm, scores, softmax, mix); deterministic."""
    n_tok, n, d = 13, 5, 64
    g = torch.Generator().manual_seed(3)
    c, nw, pw = torch.randn(n_tok, n, d, generator=g), torch.randn(d, generator=g), torch.randn(d, generator=g) / 8
    cot = torch.randn(n_tok, d, generator=g)

    def grads(fn, *xs):
        leaves = [x.clone().requires_grad_() for x in xs]
        return torch.autograd.grad(fn(*leaves, 1e-6), leaves, cot.to(xs[0].dtype))

    got = grads(INVARIANT.attn_res_mix, c, nw, pw)
    for a, b in zip(got, grads(INVARIANT.attn_res_mix, c, nw, pw)):
        assert_bits(a, b)
    ref = grads(FAST.attn_res_mix, c.double(), nw.double(), pw.double())
    for name, a, r in zip(("cands", "norm_w", "proj_w"), got, ref):
        err = (a.double() - r).norm() / r.norm()
        assert err <= 4 * (d + n) * 2.0**-24, f"d {name}: {err:.3g}"


# --- MoE ------------------------------------------------------------------------------------------

def _experts(e: int, lat: int, inter: int) -> tuple[list[torch.Tensor], ...]:
    g = torch.Generator().manual_seed(5)
    return ([torch.randn(inter, lat, generator=g) / 8 for _ in range(e)],
            [torch.randn(inter, lat, generator=g) / 8 for _ in range(e)],
            [torch.randn(lat, inter, generator=g) / 8 for _ in range(e)])


def _moe(kern, x, logits, bias, w1, w3, w2):
    ids, w = kern.route(logits, bias, 4, True, 2.5, "sigmoid")
    act = lambda a, b: kern.situ_glu(a, b, 4.0, 25.0)  # noqa: E731
    return ids, experts_combine(x, ids, w, w1, w3, w2, kern.linear, act)


@SETTINGS
@given(batch=st.integers(1, 40), data=st.data())
def test_moe_token_invariant_with_ties(batch: int, data: st.DataObject) -> None:
    """A token's routing and output are the same whatever other tokens share the batch, ties included."""
    pos = data.draw(st.integers(0, batch - 1))
    e, lat = 16, 32
    w1, w3, w2 = _experts(e, lat, 24)
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, lat, generator=g)
    logits = torch.randn(batch, e, generator=g)
    logits[pos, :8] = 0.5  # eight-way tie across the top-k boundary
    logits[pos, 8:] = -1.0 - logits[pos, 8:].abs()
    bias = torch.zeros(e)
    ids, out = _moe(INVARIANT, x, logits, bias, w1, w3, w2)
    ids1, out1 = _moe(INVARIANT, x[pos : pos + 1], logits[pos : pos + 1], bias, w1, w3, w2)
    assert_bits(ids[pos], ids1[0])
    assert ids1[0].tolist() == [0, 1, 2, 3]  # fixed tie-break: lowest expert index first
    assert_bits(out[pos], out1[0])


def test_moe_matches_bruteforce_float64() -> None:
    e, lat = 16, 32
    w1, w3, w2 = _experts(e, lat, 24)
    x, logits, bias = torch.randn(9, lat), torch.randn(9, e), torch.randn(e) * 0.1
    ids, out = _moe(INVARIANT, x, logits, bias, w1, w3, w2)
    sc = torch.sigmoid(logits.double())
    for n in range(9):
        chosen = sorted(torch.argsort(sc[n] + bias.double(), descending=True)[:4].tolist())
        assert ids[n].tolist() == chosen
        ws = sc[n, chosen] / sc[n, chosen].sum() * 2.5
        ref = sum(
            ws[j] * (w2[c].double() @ (4 * torch.tanh((w1[c].double() @ x[n].double()) / 4)
                                       * torch.sigmoid(w1[c].double() @ x[n].double())
                                       * 25 * torch.tanh((w3[c].double() @ x[n].double()) / 25)))
            for j, c in enumerate(chosen)
        )
        torch.testing.assert_close(out[n].double(), ref, rtol=1e-5, atol=1e-5)


# --- bf16: the same invariances at the bf16 model's cast points -----------------------------------

BF16 = torch.bfloat16


def test_bf16_linear_and_rowwise_rows_invariant() -> None:
    """bf16 rows (and fp32 router rows on a bf16 weight): a row alone equals the row at every tile position and
    inside larger batches, with LoRA; bf16 outputs of the row-wise ops and the fp32 log-probs of bf16 logits too."""
    from parity.kernels.linear import TILE_ROWS, LoRA

    g = torch.Generator().manual_seed(11)
    w = torch.randn(96, 128, generator=g).to(BF16)
    lora = LoRA(torch.randn(4, 128, generator=g).to(BF16), torch.randn(96, 4, generator=g).to(BF16), 0.5)
    row = torch.randn(128, generator=g).to(BF16)
    for x_row, lo in ((row, None), (row, lora), (row.float(), None)):
        alone = INVARIANT.linear(x_row[None], w, lo)[0]
        assert alone.dtype == x_row.dtype
        for pos in range(TILE_ROWS):
            assert_bits(alone, INVARIANT.linear(_embed_row(x_row, TILE_ROWS, pos, pos), w, lo)[pos])
        assert_bits(alone, INVARIANT.linear(_embed_row(x_row, 37, 30, 3), w, lo)[30])
    d = 100
    nw = torch.randn(d, generator=g).to(BF16)
    r, gate = torch.randn(d, generator=g).to(BF16), torch.randn(d, generator=g).to(BF16)
    xs, gs = _embed_row(r, 29, 17, 5), _embed_row(gate, 29, 17, 6)
    for op in (lambda a, b: INVARIANT.rmsnorm(a, nw, 1e-6), lambda a, b: INVARIANT.gated_rmsnorm(a, b, nw, 1e-5),
               lambda a, b: INVARIANT.situ_glu(a, b, 4.0, 25.0), lambda a, b: INVARIANT.silu_glu(a, b),
               lambda a, b: INVARIANT.l2norm(a)):
        one = op(r[None], gate[None])[0]
        assert one.dtype == BF16
        assert_bits(one, op(xs, gs)[17])
    tokens = torch.randint(0, d, (29,), generator=g)
    assert_bits(INVARIANT.token_logprobs(xs[17:18] * 3, tokens[17:18], 0.7)[0],
                INVARIANT.token_logprobs(xs * 3, tokens, 0.7)[17])


def test_bf16_conv_kda_attention_any_schedule() -> None:
    """bf16 activations with fp32 conv weights, fp32 q / k / gate / beta with bf16 v, bf16 attention inputs: any
    split into chunks (and resuming from the carried state) equals one pass, and a decode query equals its prefill
    row; outputs in bf16, the KDA state fp32."""
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(1, 30, 24, generator=g).to(BF16), torch.randn(24, 4, generator=g)
    zero = torch.zeros(1, 3, 24, dtype=BF16)
    full, full_state = INVARIANT.short_conv(x, w, zero)
    y1, st = INVARIANT.short_conv(x[:, :11], w, zero)
    y2, st = INVARIANT.short_conv(x[:, 11:], w, st)
    assert full.dtype == st.dtype == BF16
    assert_bits(torch.cat([y1, y2], 1), full)
    assert_bits(st, full_state)
    q, k, v, gate, beta = _kda_inputs(1, 40, seed=12)
    v = v.to(BF16)
    s0 = torch.zeros(1, 2, 16, 16)
    o, s = INVARIANT.kda(q, k, v, gate, beta, 0.25, s0)
    assert o.dtype == BF16 and s.dtype == torch.float32
    outs, state = [], s0
    for a, b in ((0, 13), (13, 14), (14, 40)):
        oi, state = INVARIANT.kda(q[:, a:b], k[:, a:b], v[:, a:b], gate[:, a:b], beta[:, a:b], 0.25, state)
        outs.append(oi)
    assert_bits(torch.cat(outs, 1), o)
    assert_bits(state, s)
    t = 90
    qa, ka, va = (torch.randn(1, t, 2, 32, generator=g).to(BF16) for _ in range(3))
    pos = torch.arange(t).view(1, t)
    prefill = INVARIANT.attention(qa, ka, va, pos, torch.tensor([t]), 0.2)
    assert prefill.dtype == BF16
    for p in (0, 63, 64, 89):
        one = INVARIANT.attention(qa[:, p : p + 1], ka[:, : p + 1], va[:, : p + 1], pos[:, p : p + 1],
                                  torch.tensor([p + 1]), 0.2)
        assert_bits(one[0, 0], prefill[0, p])


def test_bf16_attn_res_and_moe_token_invariant() -> None:
    g = torch.Generator().manual_seed(13)
    c = torch.randn(13, 4, 64, generator=g).to(BF16)
    nw, pw = torch.randn(64, generator=g).to(BF16), torch.randn(64, generator=g).to(BF16)
    full = INVARIANT.attn_res_mix(c, nw, pw, 1e-6)
    assert full.dtype == BF16
    assert_bits(INVARIANT.attn_res_mix(c[7:8], nw, pw, 1e-6)[0], full[7])
    w1, w3, w2 = ([t.to(BF16) for t in ws] for ws in _experts(16, 32, 24))
    x = torch.randn(21, 32, generator=g).to(BF16)
    logits = torch.randn(21, 16, generator=g)
    logits[9, :8] = 0.5  # ties
    ids, out = _moe(INVARIANT, x, logits, torch.zeros(16), w1, w3, w2)
    ids1, out1 = _moe(INVARIANT, x[9:10], logits[9:10], torch.zeros(16), w1, w3, w2)
    assert out.dtype == torch.float32  # the combine is fp32; the model rounds it
    assert_bits(ids[9], ids1[0])
    assert_bits(out[9], out1[0])


# --- tensor-parallel segments and fast backwards ------------------------------------------------------

def test_linear_row_parallel_partials_combine_to_the_whole_gemm_bits() -> None:
    """Row-parallel TP: each of TP ranks' K / TP features are whole segments of the invariant GEMM; its partial
    (`tiled_matmul` with segments / TP) added by `pairwise_sum` in rank order is the whole GEMM, bit for bit
    (TP = 2, 4, 8; fp32 and bf16 operands; narrow outputs padded)."""
    g = torch.Generator().manual_seed(3)
    for k, n in ((64, 256), (128, 5), (512, 256), (1024, 33)):
        assert k_segments(k) == 8
        x, w = torch.randn(37, k, generator=g), torch.randn(n, k, generator=g)
        for dtype in (torch.float32, torch.bfloat16):
            xd, wd = x.to(dtype).float(), w.to(dtype).float()
            whole = tiled_matmul(xd, wd, 8)
            for tp in (2, 4, 8):
                parts = [tiled_matmul(xs, ws, 8 // tp) for xs, ws in zip(xd.chunk(tp, 1), wd.chunk(tp, 1))]
                assert torch.equal(pairwise_sum(parts), whole), (k, n, dtype, tp)
    assert k_segments(96) == 8 and k_segments(32) == 1 and k_segments(100) == 1


def _grads(fn, inputs: list[torch.Tensor], dtype: torch.dtype, threads: int | None = None) -> list[torch.Tensor]:
    """(output, every input's gradient) of sum(fn(*inputs) * fixed weights) with the inputs cast to `dtype`, on
    `threads` torch threads (default: as set)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        (out * torch.sin(torch.arange(out.numel(), dtype=dtype)).view_as(out)).sum().backward()
        return [out.detach(), *(t.grad for t in leaves)]
    finally:
        torch.set_num_threads(before)


def _same_bits_on_another_thread_count(fn, inputs: list[torch.Tensor]) -> bool:
    return all(torch.equal(u, v) for u, v in zip(_grads(fn, inputs, torch.float32, 2),
                                                    _grads(fn, inputs, torch.float32, 1)))


def _assert_grads_close(fast: list[torch.Tensor], ref: list[torch.Tensor], rtol: float, what: str) -> None:
    for i, (a, b) in enumerate(zip(fast, ref)):
        err = (a.double() - b).abs().max() / b.abs().max()
        assert err < rtol, f"{what}: output/grad {i} off by {err:.2e} of its largest value"


def test_fast_backwards_match_float64_autograd_and_rerun_bitwise() -> None:
    """Linear (+ LoRA, bf16 activations), KDA (chunk boundaries crossed, padding), attention (MHA and one shared
    latent head), the norms and the gated activations: outputs and gradients of the invariant kernels'
    `autograd.Function`s against float64 autograd through plain ops, within 1e-5 of the largest value (2e-2 for
    bf16-rounded outputs); a rerun on another thread count gives the same bits."""
    from parity.kernels.attention import _visible, attention_for_gradients
    from parity.kernels.kda import kda_chunked, CHUNK, _recurrence

    g = torch.Generator().manual_seed(4)
    x, w, a, b = (torch.randn(*s, generator=g) for s in ((3, 21, 96), (40, 96), (4, 96), (40, 4)))

    def lin(x, w, a, b):  # the segmented form of a row-parallel projection
        return INVARIANT.linear(x, w, LoRA(a, b, 0.5), segments=k_segments(96))

    def lin_ref(x, w, a, b):
        return x @ w.t() + (x @ a.t()) @ b.t() * 0.5

    ref = _grads(lin_ref, [x, w, a, b], torch.float64)
    _assert_grads_close(_grads(lin, [x, w, a, b], torch.float32), ref, 1e-5, "linear")
    bf16 = _grads(lambda x, *ws: lin(x.to(torch.bfloat16), *ws), [x, w, a, b], torch.float32)
    _assert_grads_close(bf16, ref, 2e-2, "linear, bf16 activations")
    assert _same_bits_on_another_thread_count(lin, [x, w, a, b])

    t = CHUNK * 2 + 7
    q, k = (F.normalize(torch.randn(2, t, 2, 8, generator=g), dim=-1) for _ in range(2))
    v, gate, beta = torch.randn(2, t, 2, 8, generator=g), -torch.rand(2, t, 2, 8, generator=g), torch.rand(2, t, 2, generator=g)
    s0 = torch.randn(2, 2, 8, 8, generator=g) * 0.1
    valid = torch.ones(2, t, dtype=torch.bool)
    valid[1, t - 40:] = False
    kda_inputs = [q, k, v, gate, beta, s0]

    def kda(q, k, v, gate, beta, s0):
        return INVARIANT.kda(q, k, v, gate, beta, 0.3, s0, valid)

    def kda_ref(q, k, v, gate, beta, s0):
        return _recurrence(q, k, v, gate, beta, 0.3, s0, valid)

    _assert_grads_close(_grads(kda, kda_inputs, torch.float32), _grads(kda_ref, kda_inputs, torch.float64), 1e-5, "kda")
    assert _same_bits_on_another_thread_count(kda, kda_inputs)

    pos = torch.stack([torch.arange(30, 70), torch.arange(10, 50).clamp(max=44)])
    kv_len = torch.tensor([70, 45])
    for kv_heads in (3, 1):
        att_inputs = [torch.randn(2, 40, 3, 24, generator=g), torch.randn(2, 70, kv_heads, 24, generator=g),
                      torch.randn(2, 70, kv_heads, 16, generator=g)]

        def att(q, k, v):
            return INVARIANT.attention(q, k, v, pos, kv_len, 0.2)

        def att_ref(q, k, v):
            k, v = k.expand(2, 70, 3, 24), v.expand(2, 70, 3, 16)
            s = torch.einsum("bthd,bshd->bhts", q, k) * 0.2
            p = torch.softmax(s.masked_fill(~_visible(pos, kv_len, 70), float("-inf")), -1)
            return torch.einsum("bhts,bshd->bthd", p, v)

        att_ref_grads = _grads(att_ref, att_inputs, torch.float64)
        _assert_grads_close(_grads(att, att_inputs, torch.float32), att_ref_grads, 1e-5, f"attention, {kv_heads} kv heads")
        assert _same_bits_on_another_thread_count(att, att_inputs)

        def att_untiled(q, k, v):  # the Triton set's gradient reading: the same function, its forward untiled
            return attention_for_gradients(q, k, v, pos, kv_len, 0.2)

        untiled = _grads(att_untiled, att_inputs, torch.float32)
        _assert_grads_close(untiled, att_ref_grads, 1e-5, f"attention untiled, {kv_heads} kv heads")
        assert all(torch.equal(a, b) for a, b in zip(untiled, _grads(att_untiled, att_inputs, torch.float32)))

    x, gate, w_norm = torch.randn(5, 64, generator=g) * 3, torch.randn(5, 64, generator=g) * 3, torch.rand(64, generator=g)
    rowwise = {  # op: (invariant kernel, float64 formula, inputs)
        "rmsnorm": (lambda x, w: INVARIANT.rmsnorm(x, w, 1e-6),
                    lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, [x, w_norm]),
        "gated_rmsnorm": (lambda x, z, w: INVARIANT.gated_rmsnorm(x, z, w, 1e-6),
                          lambda x, z, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w * torch.sigmoid(z),
                          [x, gate, w_norm]),
        "situ_glu": (lambda a, b: INVARIANT.situ_glu(a, b, 4.0, 25.0),
                     lambda a, b: 4.0 * torch.tanh(a / 4.0) * torch.sigmoid(a) * 25.0 * torch.tanh(b / 25.0), [gate, x]),
        "silu_glu": (INVARIANT.silu_glu, lambda a, b: F.silu(a) * b, [gate, x]),
    }
    for op, (kernel, formula, inputs) in rowwise.items():
        _assert_grads_close(_grads(kernel, inputs, torch.float32), _grads(formula, inputs, torch.float64), 1e-5, op)
        bf16 = _grads(lambda *t: kernel(t[0].to(torch.bfloat16), *t[1:]), inputs, torch.float32)
        _assert_grads_close(bf16, _grads(formula, inputs, torch.float64), 2e-2, f"{op}, bf16 activations")
        assert _same_bits_on_another_thread_count(kernel, inputs), op


def test_unknown_backend_is_a_clear_error() -> None:
    import pytest

    with pytest.raises(ValueError, match="unknown kernel set 'auto'"):
        get_kernels("auto")


@pytest.mark.skipif(os.environ.get("ZEROKL_ISA_PATH") is not None,
                    reason="the host check is of this host's native path (on MKL_CBWR=COMPATIBLE the TP column-shard "
                           "property fails at some widths, and the check says so)")
def test_host_check_holds_here_and_catches_a_plain_gemm(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`zerokl parity kernels` passes on this host, and fails (exit 1, the check named) once the tiled GEMM
    is swapped for plain `F.linear`."""
    from parity import host_check
    from parity.kernels.linear import linear_fast
    from zerokl.cli import main

    assert main(["parity", "kernels"]) == 0
    assert "5/5 host-dependent invariances hold" in capsys.readouterr().out
    monkeypatch.setattr(host_check, "linear_invariant", linear_fast)
    assert main(["parity", "kernels"]) == 1
    assert "FAIL linear: a row's bits at every position" in capsys.readouterr().out

# --- the same properties on the CPU's other kernel paths ------------------------------------------

# (name, environment, the ATen capability the path needs). ATen picks its element-wise SIMD kernels by
# ATEN_CPU_CAPABILITY; MKL picks its GEMM kernels by MKL_ENABLE_INSTRUCTIONS on Intel CPUs (on AMD it takes
# one path whatever that says) and by MKL_CBWR=COMPATIBLE everywhere (its SSE2-level path). Both are read
# when the libraries load, so each path runs in a child process.
ISA_PATHS = [
    ("baseline", {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}, "DEFAULT"),
    ("avx2", {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}, "AVX2"),
    ("avx512", {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512"}, "AVX512"),
]
_RANK = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}
CHILD = os.environ.get("ZEROKL_ISA_PATH")


@pytest.mark.skipif(CHILD is not None or platform.machine() not in ("x86_64", "AMD64"),
                    reason="x86-64 parent run only")
@pytest.mark.parametrize("name,env,needs", ISA_PATHS, ids=[p[0] for p in ISA_PATHS])
def test_invariance_on_other_cpu_kernel_paths(name: str, env: dict[str, str], needs: str) -> None:
    """Every invariance property above (negative controls aside: whether plain torch breaks a property
    depends on the path) on the ATen / MKL kernel path `name`, where this CPU has it; the child first checks
    that ATen really took the path."""
    host = torch.backends.cpu.get_cpu_capability()
    if _RANK.get(host, 0) < _RANK[needs]:
        pytest.skip(f"this CPU's best ATen path is {host}")
    code = (f"import sys, torch, pytest; got = torch.backends.cpu.get_cpu_capability(); "
            f"sys.exit(f'ATen ran {{got}}, not {needs}') if got != {needs!r} else None; "
            f"sys.exit(pytest.main([{__file__!r}, '-q', '-p', 'no:cacheprovider', '-k', 'not is_not']))")
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, ZEROKL_ISA_PATH=name, **env),
                         cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
