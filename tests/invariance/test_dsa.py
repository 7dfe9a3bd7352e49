"""K3.1's DSA lightning indexer in the shared forward (configs/k3.1-tiny.yaml: bf16, MXFP4 experts, FP8 latents and
index keys, each query attending its 16 best positions): the selection and the sparse attention keep every schedule's
bits (prefill then decode, one pass, alone or in a batch) with sparsity live; positions whose whole context fits in
top-k give dense attention's bits; the selection is the float64 reference's; the Megatron trainer gives the shared forward's
bits and train with the indexer frozen; the real vLLM engine (index keys in its paged FP8 cache beside the latents)
samples the shared forward's bits under chunked prefill, batching and prefix-cache hits."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from parity.config import ConfigError, load_model_config, parse_model_config
from parity.io.checkpoint import init_checkpoint, load_checkpoint
from parity.kernels import INVARIANT
from parity.kernels.dsa import top_positions
from parity.caches import MLACache, new_cache
from parity.model import K3Forward, K3Weights, decode_logprobs, score_sequences
from parity.reference.dsa import index_keys, index_scores, select
from parity.weights import is_indexer
from rollout.generate.paged_pool import PagedLatentPool

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "k3.1-tiny.yaml"
TOPK = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_checkpoint(CONFIG, tmp_path_factory.mktemp("k3.1-tiny") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def weights(checkpoint: Path) -> K3Weights:
    cfg, tensors = load_checkpoint(checkpoint)
    assert cfg.text.index_topk == TOPK
    return K3Weights.from_official(cfg.text, tensors)


def _seqs(*lengths: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 1000, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.slow
def test_vllm_engine_samples_the_shared_forwards_bits(checkpoint: Path, weights: K3Weights) -> None:
    """Prompts of 37-75 tokens (a 48-token shared prefix), 12 sampled tokens each, 24-token prefill chunks, in one
    batch, then again from a warm prefix cache (hits inside a cache block): every sampled log-prob equals the one-pass
    shared forward's bit for bit, with the index keys read back from vLLM's FP8 pages; the warm run samples the cold
    run's tokens."""
    from rollout.engine import RolloutEngine

    shared = _seqs(48)[0]
    prompts = [shared + tail for tail in _seqs(3, 27)] + _seqs(37, 60)
    fwd = K3Forward(weights, INVARIANT)
    with RolloutEngine(checkpoint, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=24,
                       enable_prefix_caching=True, prefix_match_unit=16) as eng:
        cold = eng.generate(prompts, n=2, temperature=0.9, max_tokens=12, seed=3)
        warm = eng.generate(prompts, n=2, temperature=0.9, max_tokens=12, seed=3)
    assert any(w.cached_tokens >= 32 for w in warm), [w.cached_tokens for w in warm]
    for c, w in zip(cold, warm):
        assert c.completion_ids == w.completion_ids and torch.equal(c.logprobs, w.logprobs)
        ref = score_sequences(fwd, [c.prompt_ids + c.completion_ids], 0.9)[0][len(c.prompt_ids) - 1 :]
        assert torch.equal(ref, c.logprobs)


def test_every_schedule_has_the_one_pass_bits_with_sparsity_live(weights: K3Weights) -> None:
    """Sequences of 23 to 70 tokens (up to 4x top-k): prefilling 10 tokens then decoding one at a time (contiguous
    caches, or paged FP8 entries of latent and index key as vLLM's cache holds them), or scoring each sequence alone,
    gives the batched one-pass log-probs bit for bit; and they differ from dense attention's
    past top-k (the indexer selects)."""
    fwd = K3Forward(weights, INVARIANT)
    seqs = _seqs(70, 23, 41)
    one = score_sequences(fwd, seqs)
    dense = score_sequences(K3Forward(_without_indexer(weights), INVARIANT), seqs)
    for s, lp, d in zip(seqs, one, dense):
        assert torch.equal(decode_logprobs(fwd, s[:10], s[10:]), lp[9:])
        paged = [PagedLatentPool.for_config(weights.cfg, 1, 8, 9) if isinstance(c, MLACache) else c
                 for c in new_cache(weights.cfg, 1)]  # FP8 latents and index keys in shuffled blocks, NaN elsewhere
        assert torch.equal(decode_logprobs(fwd, s[:10], s[10:], caches=paged), lp[9:])
        assert torch.equal(score_sequences(fwd, [s])[0], lp)
        assert torch.equal(lp[:TOPK], d[:TOPK])  # every context within top-k: the dense bits
        assert not torch.equal(lp[TOPK:], d[TOPK:])  # longer contexts attend a selection


def _without_indexer(weights: K3Weights) -> K3Weights:
    cfg = replace(weights.cfg, index_n_heads=None, index_head_dim=None, index_topk=None)
    return K3Weights(cfg, {n: t for n, t in weights.tensors.items() if ".indexer." not in n})


def test_selection_is_the_float64_references(tmp_path: Path) -> None:
    """The indexer of an fp32 k3.1-tiny on random inputs: the positions each of 48 queries selects equal the float64
    reference's (`parity.reference.dsa`) wherever the reference's top-k boundary is not a near tie."""
    cfg, tensors = load_checkpoint(init_checkpoint(CONFIG, tmp_path / "ckpt", seed=1, dtype="float32"))
    fwd = K3Forward(K3Weights.from_official(cfg.text, tensors), INVARIANT)
    p = "language_model.layers.3.self_attn"
    w = {n[len(p) + 1 :]: t.double() for n, t in tensors.items() if n.startswith(p + ".")}
    g = torch.Generator().manual_seed(2)
    t = 48
    x = torch.randn(1, t, cfg.text.hidden_size, generator=g)
    qr = torch.randn(1, t, cfg.text.q_lora_rank, generator=g)
    cache = MLACache(torch.zeros(1, 0, cfg.text.mla_latent_size), torch.zeros(1, dtype=torch.long),
                     torch.zeros(1, 0, cfg.text.index_head_dim))
    cache.append(torch.zeros(1, t, cfg.text.mla_latent_size), torch.tensor([t]), fwd._index_keys(x, p))
    selected, count = fwd._select(x, qr, p, cache, torch.arange(t).view(1, t))
    ref_scores = index_scores(x[0].double(), qr[0].double(), w, cfg.text)
    assert torch.allclose(cache.index[0].double(), index_keys(x[0].double(), w), rtol=0.07, atol=1e-6)
    ref = select(ref_scores, TOPK)
    checked = 0
    for row, keep in enumerate(ref):
        got = selected[0, row, : int(count[0, row])].tolist()
        ranked = ref_scores[row, : row + 1].sort(descending=True).values
        if row + 1 > TOPK and (ranked[TOPK - 1] - ranked[TOPK]).abs() < 1e-3 * ranked[0].abs():
            continue  # a near tie at the boundary: fp32 may order it either way
        assert got == keep, (row, got, keep)
        checked += 1
    assert checked >= 40 and any(len(k) == TOPK and k != list(range(TOPK)) for k in ref)


def test_top_positions_break_ties_by_the_lowest_position() -> None:
    """The top-k every kernel set shares (`parity.kernels.dsa.top_positions`, a top-k over unique integer keys) picks
    the float64 reference's positions on scores full of ties: few distinct values, +0 and -0 (equal), subnormals."""
    values = torch.tensor([-0.0, 0.0, 1.5, -1.5, 3.0, 1e-45, -1e-45, 2.0 ** -126])
    t = 60
    g = torch.Generator().manual_seed(5)
    causal = torch.arange(t).view(1, -1) <= torch.arange(t).view(-1, 1)
    scores = torch.where(causal, values[torch.randint(0, len(values), (t, t), generator=g)], float("-inf"))
    selected, count = top_positions(scores.unsqueeze(0), TOPK)
    for row, keep in enumerate(select(scores.double(), TOPK)):
        assert selected[0, row, : int(count[0, row])].tolist() == keep, row


def test_scores_are_vllms_deepseek_v32_indexer_logits(tmp_path: Path) -> None:
    """The indexer's scores (fp32 k3.1-tiny, random inputs, 40 queries) equal those of vLLM's torch reference of
    DeepSeek-V3.2's indexer logits (`fp8_mqa_logits_torch`: FP8 query codes . FP8 key codes x the key scale, ReLU,
    weighted by weights_proj with the query scale folded in, summed over heads) from the same codes and scales, to that
    reference's bf16 rounding of each dot product; the same keys are candidates."""
    from parity.quant import fp8
    from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_mqa_logits_torch

    cfg, tensors = load_checkpoint(init_checkpoint(CONFIG, tmp_path / "ckpt", seed=3, dtype="float32"))
    c = cfg.text
    fwd = K3Forward(K3Weights.from_official(c, tensors), INVARIANT)
    p, t = "language_model.layers.7.self_attn", 40
    g = torch.Generator().manual_seed(4)
    x, qr = torch.randn(1, t, c.hidden_size, generator=g), torch.randn(1, t, c.q_lora_rank, generator=g)
    cache = MLACache(torch.zeros(1, 0, c.mla_latent_size), torch.zeros(1, dtype=torch.long),
                     torch.zeros(1, 0, c.index_head_dim))
    cache.append(torch.zeros(1, t, c.mla_latent_size), torch.tensor([t]), fwd._index_keys(x, p))
    ours = fwd.index_scores(x, qr, p, cache, torch.arange(t).view(1, t))[0]
    q_codes, q_scale = fp8.quantize_scaled(fwd._lin(qr, f"{p}.indexer.wq_b.weight").view(t, c.index_n_heads, -1))
    k_codes, k_scale = fp8.quantize_scaled(cache.index[0])
    weights = fwd._lin(x, f"{p}.indexer.weights_proj.weight")[0] * (c.index_head_dim * c.index_n_heads) ** -0.5
    ks, ke = torch.zeros(t, dtype=torch.int32), torch.arange(1, t + 1, dtype=torch.int32)
    theirs = fp8_mqa_logits_torch(q_codes, (k_codes, k_scale), weights * q_scale[..., 0], ks, ke)
    # each of its dots rounded to bf16 (relative 2^-9): |error| <= 2^-9 sum_j |w_j| ReLU(q_j . k), doubled for margin
    bound = 2 ** -8 * fp8_mqa_logits_torch(q_codes, (k_codes, k_scale), (weights * q_scale[..., 0]).abs(), ks, ke)
    finite = torch.isfinite(ours)
    assert torch.equal(finite, torch.isfinite(theirs)) and finite.sum() == t * (t + 1) // 2
    assert ((ours - theirs)[finite].abs() <= bound[finite] + 1e-30).all()


@pytest.mark.parametrize(("edit", "says"), [
    ({"index_topk": 0}, "index_n_heads, index_head_dim and index_topk, each an integer >= 1"),
    ({"index_head_dim": None}, "index_n_heads, index_head_dim and index_topk"),
    ({"q_lora_rank": None}, "reads the low-rank query (q_lora_rank)"),
])
def test_bad_indexer_configs_are_refused(edit: dict, says: str) -> None:
    raw = dict(load_model_config(CONFIG).raw)
    raw["text_config"] = {**raw["text_config"], **edit}
    with pytest.raises(ConfigError, match=re.escape(says)):
        parse_model_config(raw)


def test_trainer_has_the_shared_forward_bits_and_keeps_the_indexer_frozen(checkpoint: Path,
                                                                          weights: K3Weights) -> None:
    """The Megatron trainer on k3.1-tiny: log-probs = the shared forward's (torch.equal) on sequences longer than
    top-k; one optimizer step changes the model but not the indexer (frozen: the loss reaches it only through the
    discrete top-k)."""
    from trainer.backend import build_backend
    from trainer.logprobs import PaddedBatch, token_logprobs

    seqs = _seqs(40, 27)
    batch = PaddedBatch.from_sequences(seqs)
    want = score_sequences(K3Forward(weights, INVARIANT), seqs)
    trainer = build_backend(checkpoint, lr=1e-3)
    try:
        got = trainer.logprobs(batch, 1.0)
        before = {n: t.clone() for n, t in trainer.export_official().items()}  # the export may be the live weights
        trainer.train_step(lambda model: -token_logprobs(model, batch, 1.0).sum() / batch.lens.sum())
        after = trainer.export_official()
    finally:
        trainer.close()
    assert all(torch.equal(g[: len(s) - 1], w) for g, s, w in zip(got, seqs, want))
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and not any(is_indexer(n) for n in changed)
    assert any(is_indexer(n) for n in before)
