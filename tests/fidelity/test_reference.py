"""Tests of the float64 K3 reference (`parity.reference`): every block against an independent formulation,
then whole-model properties on a k3-tiny random checkpoint. Tolerances only against other formulations."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from parity.config import TextConfig, load_model_config
from parity.reference import ReferenceK3, ReferenceWeightsError
from parity.reference.attn_res import AttnResStream
from parity.reference.kda import kda_chunked, kda_gate, kda_recurrent
from parity.reference.mla import mla_layer
from parity.reference.moe import moe_layer, route
from parity.reference.ops import causal_conv_silu, glu_activation, l2_norm, situ
from parity.kernels import INVARIANT
from parity.caches import MLACache
from parity.model import K3Forward, K3Weights
from parity.weights import layer_prefix
from parity.io.checkpoint import random_weights, save_checkpoint

F64 = torch.float64
TINY = Path(__file__).resolve().parents[2] / "configs" / "k3-tiny.yaml"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The reference runs thousands of tiny float64 ops: intra-op threads only add overhead, and stall badly when
    other processes load the cores. Restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_close(actual: Tensor, expected: Tensor, atol: float, what: str) -> None:
    """Fail with the first mismatching index and the max |Δ| when |actual - expected| > atol anywhere."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    diff = (actual.to(F64) - expected.to(F64)).abs()
    bad = ~(diff <= atol)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        pytest.fail(f"{what}: {int(bad.sum())} of {diff.numel()} values off by > {atol:g}; first at {first} "
                    f"({float(actual[first]):.17g} vs {float(expected[first]):.17g}); max |Δ| {float(diff.max()):.3e}")


def randn(gen: torch.Generator, *shape: int) -> Tensor:
    return torch.randn(*shape, generator=gen, dtype=F64)


def rmsnorm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


@pytest.fixture(scope="module")
def tiny() -> tuple[TextConfig, dict[str, Tensor]]:
    """k3-tiny text config and its seed-0 random weights (bf16 / fp32 as stored)."""
    cfg = load_model_config(TINY)
    return cfg.text, random_weights(cfg, seed=0)


def layer_weights(weights: dict[str, Tensor], layer: int, sub: str) -> dict[str, Tensor]:
    prefix = f"{layer_prefix(layer)}.{sub}."
    return {n[len(prefix):]: t.to(F64) for n, t in weights.items() if n.startswith(prefix)}


# ---------------------------------------------------------------- KDA

def kda_inputs(n_tokens: int, lower_bound: float | None, seed: int = 0, n_heads: int = 3, dk: int = 8, dv: int = 6):
    """Random KDA inputs: unit q and k, decays from `kda_gate`, beta in (0, 1), a random initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_norm(randn(gen, n_tokens, n_heads, dk))
    k = l2_norm(randn(gen, n_tokens, n_heads, dk))
    v = randn(gen, n_tokens, n_heads, dv)
    a_log = 0.5 * randn(gen, n_heads) - 1.0
    g = kda_gate(randn(gen, n_tokens, n_heads, dk), a_log, 0.5 * randn(gen, n_heads, dk), lower_bound)
    beta = torch.sigmoid(randn(gen, n_tokens, n_heads))
    state = randn(gen, n_heads, dk, dv)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower_bound", "softplus"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("n_tokens,chunk_size", [(37, 16), (32, 16), (1, 16), (37, 5)])
def test_kda_recurrent_matches_chunked(n_tokens: int, chunk_size: int, with_state: bool, lower_bound: float | None):
    q, k, v, g, beta, state = kda_inputs(n_tokens, lower_bound)
    init = state if with_state else None
    o_rec, s_rec = kda_recurrent(q, k, v, g, beta, scale=8**-0.5, initial_state=init)
    o_chk, s_chk = kda_chunked(q, k, v, g, beta, scale=8**-0.5, initial_state=init, chunk_size=chunk_size)
    assert_close(o_chk, o_rec, 1e-11, "output")
    assert_close(s_chk, s_rec, 1e-11, "final state")


def test_kda_gate_formulas():
    gen = torch.Generator().manual_seed(1)
    raw, a_log, dt_bias = randn(gen, 5, 2, 4), randn(gen, 2), randn(gen, 2, 4)
    a = a_log.exp()[:, None]
    assert_close(kda_gate(raw, a_log, dt_bias, None), -a * torch.log1p(torch.exp(raw + dt_bias)), 1e-14, "softplus")
    bounded = kda_gate(raw, a_log, dt_bias, -5.0)
    assert_close(bounded, -5.0 / (1.0 + torch.exp(-a * (raw + dt_bias))), 1e-14, "lower bound")
    assert bool((bounded > -5.0).all() and (bounded < 0.0).all())


def test_kda_resume_from_state_matches_full_run():
    """Running 0..36 at once equals running 0..19, then 20..36 from the state at 20."""
    q, k, v, g, beta, _ = kda_inputs(37, -5.0, seed=3)
    o_full, s_full = kda_recurrent(q, k, v, g, beta, 0.3)
    o_a, s_a = kda_recurrent(q[:20], k[:20], v[:20], g[:20], beta[:20], 0.3)
    o_b, s_b = kda_recurrent(q[20:], k[20:], v[20:], g[20:], beta[20:], 0.3, initial_state=s_a)
    assert_close(torch.cat([o_a, o_b]), o_full, 1e-13, "output")
    assert_close(s_b, s_full, 1e-13, "final state")


def test_kda_matches_transformers_naive():
    """transformers' torch fallbacks of fla's KDA kernels (computed in fp32) agree with the float64 reference."""
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta, state = kda_inputs(37, -5.0, seed=2, dk=8, dv=8)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, scale=8**-0.5, initial_state=state)
    args = [x[None] for x in (q, k, v, g, beta)]  # add the batch dim: [1, T, H, ...]
    for fn in (modeling.recurrent_kimi_delta_attention, modeling.chunk_kimi_delta_attention):
        o, s = fn(*args, initial_state=state[None], output_final_state=True)
        assert_close(o[0], o_ref, 1e-4, f"{fn.__name__} output")
        assert_close(s[0], s_ref, 1e-4, f"{fn.__name__} final state")


def test_kda_matches_fla_naive():
    naive = pytest.importorskip(
        "fla.ops.kda.naive",
        reason="fla (fla-core) is not installed in this environment; kda_chunked and transformers' port of fla's "
               "naive KDA are the independent checks",
    )
    q, k, v, g, beta, state = kda_inputs(37, -5.0, seed=2, dk=8, dv=8)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, scale=8**-0.5, initial_state=state)
    o, s = naive.naive_recurrent_kda(*[x[None] for x in (q, k, v, g, beta)], scale=8**-0.5,
                                     initial_state=state[None], output_final_state=True)
    assert_close(o[0], o_ref, 1e-4, "output")
    assert_close(s[0], s_ref, 1e-4, "final state")


def test_causal_conv_matches_torch_conv1d():
    gen = torch.Generator().manual_seed(4)
    x, w = randn(gen, 11, 6), randn(gen, 6, 1, 4)
    expected = F.silu(F.conv1d(x.T[None], w, padding=3, groups=6)[0, :, :11].T)  # left-pad 3, keep the first T
    assert_close(causal_conv_silu(x, w), expected, 1e-14, "conv")


# ---------------------------------------------------------------- MLA

def mla_direct(x: Tensor, w: dict[str, Tensor], cfg: TextConfig) -> Tensor:
    """Full-key MLA: decompress k_nope and v per head, append the shared unrotated k_pe, causal SDPA."""
    n_tokens, n_heads = x.shape[0], cfg.num_attention_heads
    nope, rope, dv, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    eps = cfg.rms_norm_eps
    q = rmsnorm(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"], eps) @ w["q_b_proj.weight"].T
    q = q.view(n_tokens, n_heads, nope + rope)
    kv_a = x @ w["kv_a_proj_with_mqa.weight"].T
    kv = rmsnorm(kv_a[:, :lat], w["kv_a_layernorm.weight"], eps) @ w["kv_b_proj.weight"].T
    kv = kv.view(n_tokens, n_heads, nope + dv)  # per head: [k_nope ; v]
    k = torch.cat([kv[..., :nope], kv_a[:, None, lat:].expand(n_tokens, n_heads, rope)], dim=-1)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), kv[..., nope:].transpose(0, 1),
                                       is_causal=True, scale=(nope + rope) ** -0.5)
    o = o.transpose(0, 1).reshape(n_tokens, n_heads * dv) * torch.sigmoid(x @ w["g_proj.weight"].T)
    return o @ w["o_proj.weight"].T


def test_mla_latent_matches_direct(tiny):
    cfg, weights = tiny
    layer = cfg.full_attn_layers[0]
    w = layer_weights(weights, layer, "self_attn")
    x = randn(torch.Generator().manual_seed(5), 13, cfg.hidden_size)
    assert_close(mla_layer(x, w, cfg), mla_direct(x, w, cfg), 1e-12, "MLA")


def test_parity_mla_absorbed_form_matches_direct(tiny):
    """The parity model's MLA (`parity.model.K3Forward._mla`: the absorbed form on every schedule, fp32 invariant
    kernels) against the expanded full-key form, one pass and token by token through the cache: within 1e-5 of the
    output's scale (measured 2.6e-7)."""
    cfg, weights = tiny
    fwd = K3Forward(K3Weights.from_official(dataclasses.replace(cfg, torch_dtype="float32"), weights), INVARIANT)
    layer = cfg.full_attn_layers[0]
    p = f"{layer_prefix(layer)}.self_attn"
    x = randn(torch.Generator().manual_seed(5), 13, cfg.hidden_size)
    want = mla_direct(x, layer_weights(weights, layer, "self_attn"), cfg)

    def cache() -> MLACache:
        return MLACache(torch.zeros(1, 0, cfg.mla_latent_size), torch.zeros(1, dtype=torch.long))

    one_pass = fwd._mla(x.float()[None], p, cache(), torch.arange(13)[None], torch.tensor([13]))[0]
    c = cache()
    steps = torch.cat([fwd._mla(x.float()[None, t : t + 1], p, c, torch.tensor([[t]]), torch.tensor([1]))[0]
                       for t in range(13)])
    assert torch.equal(steps, one_pass)
    assert_close(one_pass.double(), want, 1e-5 * float(want.abs().max()), "absorbed MLA vs expanded")


def test_mla_is_causal(tiny):
    cfg, weights = tiny
    w = layer_weights(weights, cfg.full_attn_layers[0], "self_attn")
    x = randn(torch.Generator().manual_seed(6), 9, cfg.hidden_size)
    x2 = x.clone()
    x2[5] += 1.0
    y, y2 = mla_layer(x, w, cfg), mla_layer(x2, w, cfg)
    assert_close(y2[:5], y[:5], 1e-13, "positions before the change")
    assert float((y2[5:] - y[5:]).abs().min()) > 0.0


# ---------------------------------------------------------------- LatentMoE and SiTU

def moe_brute_force(x: Tensor, w: dict[str, Tensor], cfg: TextConfig) -> Tensor:
    """Token by token: score all experts, pick top-k by (biased score desc, index asc), run the chosen ones."""
    beta, lin = cfg.situ_beta, cfg.situ_linear_beta

    def act(gate: Tensor, up: Tensor) -> Tensor:
        return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * lin * torch.tanh(up / lin)

    rows = []
    for t in range(x.shape[0]):
        xt = x[t]
        scores = [1.0 / (1.0 + math.exp(-float(w["gate.weight"][e] @ xt))) for e in range(cfg.num_experts)]
        biased = [s + float(b) for s, b in zip(scores, w["gate.e_score_correction_bias"])]
        chosen = sorted(range(cfg.num_experts), key=lambda e: (-biased[e], e))[: cfg.num_experts_per_token]
        total = sum(scores[e] for e in chosen)
        z = w["routed_expert_down_proj.weight"] @ xt
        acc = torch.zeros_like(z)
        for e in chosen:
            h = act(w[f"experts.{e}.w1.weight"] @ z, w[f"experts.{e}.w3.weight"] @ z)
            acc = acc + (scores[e] / total * cfg.routed_scaling_factor) * (w[f"experts.{e}.w2.weight"] @ h)
        y = w["routed_expert_up_proj.weight"] @ rmsnorm(acc, w["routed_expert_norm.weight"], cfg.rms_norm_eps)
        shared = act(w["shared_experts.gate_proj.weight"] @ xt, w["shared_experts.up_proj.weight"] @ xt)
        rows.append(y + w["shared_experts.down_proj.weight"] @ shared)
    return torch.stack(rows)


@pytest.mark.parametrize("bias_scale", [0.0, 1.0], ids=["stored_bias", "large_bias"])
def test_moe_matches_brute_force(tiny, bias_scale: float):
    cfg, weights = tiny
    w = layer_weights(weights, 1, "block_sparse_moe")
    gen = torch.Generator().manual_seed(7)
    if bias_scale:
        w["gate.e_score_correction_bias"] = bias_scale * randn(gen, cfg.num_experts)
    x = randn(gen, 17, cfg.hidden_size)
    assert_close(moe_layer(x, w, cfg, glu_activation(cfg)), moe_brute_force(x, w, cfg), 1e-12, "MoE")


def test_router_bias_selects_but_does_not_weight(tiny):
    cfg, weights = tiny
    w = layer_weights(weights, 1, "block_sparse_moe")
    x = randn(torch.Generator().manual_seed(8), 17, cfg.hidden_size)
    bias = torch.zeros(cfg.num_experts, dtype=F64)
    bias[cfg.num_experts - 1] = 10.0  # always selected
    ids, weights_biased = route(x, w["gate.weight"], bias, cfg)
    assert bool((ids[:, 0] == cfg.num_experts - 1).all())
    scores = torch.sigmoid(x @ w["gate.weight"].T).gather(1, ids)
    assert_close(weights_biased, scores / scores.sum(-1, keepdim=True) * cfg.routed_scaling_factor, 1e-14, "weights")


def test_router_ties_go_to_lowest_index(tiny):
    cfg, _ = tiny
    x = torch.ones(3, cfg.hidden_size, dtype=F64)
    gate = torch.zeros(cfg.num_experts, cfg.hidden_size, dtype=F64)  # every score is sigmoid(0)
    ids, weights = route(x, gate, torch.zeros(cfg.num_experts, dtype=F64), cfg)
    assert ids.tolist() == [list(range(cfg.num_experts_per_token))] * 3
    assert_close(weights, torch.full_like(weights, cfg.routed_scaling_factor / cfg.num_experts_per_token), 1e-15,
                 "weights")


@pytest.mark.parametrize("linear_beta", [25.0, None], ids=["clipped_up", "plain_up"])
def test_situ_matches_vllm(linear_beta: float | None):
    activation = pytest.importorskip("vllm.model_executor.layers.activation")
    vllm_config = pytest.importorskip("vllm.config")
    with vllm_config.set_current_vllm_config(vllm_config.VllmConfig()):
        op = activation.SituAndMul(beta=4.0, linear_beta=linear_beta)
    x = 30.0 * torch.randn(64, 2 * 40, generator=torch.Generator().manual_seed(9))  # fp32, reaches both clips
    expected = op.forward_native(x)  # computes in fp32
    gate, up = x.to(F64).chunk(2, dim=-1)
    assert_close(situ(gate, up, 4.0, linear_beta), expected, 1e-6 * float(expected.abs().max()), "SiTU")


def test_situ_formula():
    """Element by element: b tanh(g / b) sigmoid(g) * c tanh(u / c)."""
    gen = torch.Generator().manual_seed(10)
    gate, up = 20.0 * randn(gen, 50), 60.0 * randn(gen, 50)
    expected = torch.tensor([4.0 * math.tanh(g / 4.0) / (1.0 + math.exp(-g)) * 25.0 * math.tanh(u / 25.0)
                             for g, u in zip(gate.tolist(), up.tolist())], dtype=F64)
    assert_close(situ(gate, up, 4.0, 25.0), expected, 1e-12, "SiTU")


# ---------------------------------------------------------------- AttnRes

@pytest.mark.parametrize("num_layers,block_size", [(8, 2), (7, 2), (6, 3), (5, 1), (4, 4)])
def test_attn_res_stream_matches_snapshot_list(num_layers: int, block_size: int):
    """vLLM's prefix/delta/blocks state machine equals the direct form: sources = [embedding, one sum per finished
    block, the current block's partial sum], mixed before every sub-layer and at the output."""
    n_tokens, dim, eps = 5, 16, 1e-6
    gen = torch.Generator().manual_seed(num_layers * 10 + block_size)
    embed = randn(gen, n_tokens, dim)
    sub_w = [[randn(gen, dim, dim) / 4.0 for _ in range(2)] for _ in range(num_layers)]  # attn, mlp stand-ins
    # per sub-layer: (res_norm, res_proj, layer_norm); the output mix has no layer norm
    mix_w = [[(1 + 0.1 * randn(gen, dim), randn(gen, dim), 1 + 0.1 * randn(gen, dim)) for _ in range(2)]
             for _ in range(num_layers)]
    out_w = (1 + 0.1 * randn(gen, dim), randn(gen, dim))

    def sub_layer(layer: int, which: int, h: Tensor) -> Tensor:
        return torch.tanh(h @ sub_w[layer][which])

    stream = AttnResStream(embed, block_size, -(-num_layers // block_size), eps)
    got, labels = [], []
    for i in range(num_layers):
        h = stream.before_attn(i, *mix_w[i][0])
        got.append(h)
        h = stream.before_mlp(i, sub_layer(i, 0, h), *mix_w[i][1])
        got.append(h)
        stream.after_mlp(sub_layer(i, 1, h))
        labels += [f"layer {i} attention input", f"layer {i} MLP input"]
    got.append(stream.output(*out_w))
    labels.append("output mix")

    def mix(sources: list[Tensor], norm_w: Tensor, proj_w: Tensor) -> Tensor:
        scores = torch.stack([(rmsnorm(s, norm_w, eps) * proj_w).sum(-1) for s in sources])  # [S, T]
        p = torch.exp(scores - scores.max(0).values)
        p = p / p.sum(0)
        return sum(p[j][:, None] * s for j, s in enumerate(sources))

    finished, partial, want = [embed], [], []
    for i in range(num_layers):
        for which in range(2):
            res_norm, res_proj, layer_norm = mix_w[i][which]
            sources = finished + ([sum(partial)] if partial else [])
            h = rmsnorm(mix(sources, res_norm, res_proj), layer_norm, eps)
            want.append(h)
            partial.append(sub_layer(i, which, h))
        if (i + 1) % block_size == 0:
            finished.append(sum(partial))
            partial = []
    want.append(mix(finished + ([sum(partial)] if partial else []), *out_w))
    for g, e, label in zip(got, want, labels, strict=True):
        assert_close(g, e, 1e-12, label)


# ---------------------------------------------------------------- whole model on k3-tiny

@pytest.fixture(scope="module")
def model(tiny) -> ReferenceK3:
    cfg, weights = tiny
    return ReferenceK3(cfg, weights)


@pytest.fixture(scope="module")
def tokens() -> Tensor:
    return torch.randint(4, 1024, (20,), generator=torch.Generator().manual_seed(11))


def test_logprobs_finite_and_tempered(model: ReferenceK3, tokens: Tensor):
    lp = model.logprobs(tokens)
    assert lp.shape == (len(tokens) - 1,) and lp.dtype == F64
    assert bool(torch.isfinite(lp).all() and (lp < 0).all())
    logits = model.forward(tokens)
    hot = model.logprobs(tokens, temperature=0.7)
    expected = torch.log_softmax(logits[:-1] / 0.7, -1).gather(1, tokens[1:, None])[:, 0]
    assert_close(hot, expected, 1e-13, "temperature 0.7")


def test_logprobs_depend_on_context(model: ReferenceK3, tokens: Tensor):
    """Changing token 2 changes every lp[t], t >= 2, through the context alone (lp[1] has it as target)."""
    changed = tokens.clone()
    changed[2] = (tokens[2] + 1) % 1024
    lp, lp2 = model.logprobs(tokens), model.logprobs(changed)
    assert float((lp2[2:] - lp[2:]).abs().min()) > 1e-9


@pytest.mark.parametrize("position", [3, 12, 19])
def test_logprobs_are_causal(model: ReferenceK3, tokens: Tensor, position: int):
    """Changing token t changes no log-prob of positions < t (the target of lp[t-1] is token t itself)."""
    changed = tokens.clone()
    changed[position] = (tokens[position] + 7) % 1024
    lp, lp2 = model.logprobs(tokens), model.logprobs(changed)
    assert_close(lp2[: position - 1], lp[: position - 1], 1e-12, "earlier positions")
    assert float((lp2[position - 1 :] - lp[position - 1 :]).abs().min()) > 1e-9


def test_logprobs_change_with_weights(tiny, model: ReferenceK3, tokens: Tensor):
    cfg, _ = tiny
    other = ReferenceK3(cfg, random_weights(load_model_config(TINY), seed=1))
    assert float((other.logprobs(tokens) - model.logprobs(tokens)).abs().max()) > 1e-3


def test_hidden_states_capture_every_block(tiny, model: ReferenceK3, tokens: Tensor):
    cfg, _ = tiny
    states = model.hidden_states(tokens)
    for i in range(cfg.num_hidden_layers):
        for part in ("attn_in", "attn", "mlp_in", "mlp"):
            assert states[f"layer{i}.{part}"].shape == (len(tokens), cfg.hidden_size)
    assert_close(states["final_norm"], rmsnorm(states["final"], model.weights["language_model.model.norm.weight"],
                                               cfg.rms_norm_eps), 1e-14, "final norm")


def test_loads_from_checkpoint(tiny, model: ReferenceK3, tokens: Tensor, tmp_path: Path):
    full_cfg = load_model_config(TINY)
    save_checkpoint(full_cfg, random_weights(full_cfg, seed=0), tmp_path / "ckpt")
    loaded = ReferenceK3.from_checkpoint(tmp_path / "ckpt")
    assert torch.equal(loaded.forward(tokens), model.forward(tokens))


def test_rejects_missing_and_unexpected_tensors(tiny):
    cfg, weights = tiny
    missing = dict(weights)
    del missing["language_model.model.norm.weight"]
    with pytest.raises(ReferenceWeightsError, match="language_model.model.norm.weight"):
        ReferenceK3(cfg, missing)
    extra = dict(weights, **{"language_model.layers.0.bogus.weight": torch.zeros(1)})
    with pytest.raises(ReferenceWeightsError, match="bogus"):
        ReferenceK3(cfg, extra)
