"""The K3 trainer on Megatron-core, one process (TP = EP = 1, gloo world of one): checkpoint I/O, log-probs
against the float64 reference (tolerance) and against the rollout decode schedule (bits), float64 gradient
checks of every block, one Megatron optimizer step, GAE's value head beside the log-probs. TP = 2 and EP = 2 runs:
tests/trainers/test_trainer_parallel.py."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.func import functional_call

from parity.config import ModelConfig, load_model_config, parse_model_config
from parity.kernels import INVARIANT
from parity.kernels.moe import experts_combine
from parity.model import K3Forward, K3Weights, decode_logprobs
from parity.reference import ReferenceK3
from parity.weights import text_specs
from trainer.megatron import cpu_compat
from trainer.megatron.io import export_official, load_official, load_official_dir
from trainer.megatron.config import k3_transformer_config
from trainer.megatron.forward import fold_slots
from trainer.logprobs import PackedBatch, PaddedBatch, token_logprobs
from trainer.megatron.modules import MegatronK3Model
from trainer.megatron.parallel import ParallelContext, destroy_parallel, init_parallel
from trainer.megatron.sharding import Split, split_of, split_roles
from trainer.megatron.train import build_model, build_trainer, train_step
from parity.io.checkpoint import CheckpointError, load_checkpoint, random_weights

ROOT = Path(__file__).resolve().parents[2]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def par() -> Iterator[ParallelContext]:
    ctx = init_parallel()
    yield ctx
    destroy_parallel(ctx)


@pytest.fixture(scope="module")
def checkpoint(k3_tiny: Path) -> Path:
    return k3_tiny


@pytest.fixture(scope="module")
def official(checkpoint: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    return load_checkpoint(checkpoint)


def _seqs(lens: tuple[int, ...], seed: int, vocab: int = 1024) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]


def _assert_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if not torch.equal(a, b):
        i = int((a != b).nonzero()[0, 0])
        raise AssertionError(f"{what}: first mismatching token {i}, max |d| = {(a - b).abs().max().item():.3e}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


@pytest.mark.parametrize("config", ["k3-tiny", "k3-small", "k3.1-pro"])
def test_sharding_table_places_every_text_tensor(config: str) -> None:
    text = load_model_config(ROOT / "configs" / f"{config}.yaml").text
    assert split_roles(text).keys() == text_specs(text).keys()
    with pytest.raises(KeyError, match="no sharding entry"):
        split_of("language_model.layers.0.self_attn.new_proj.weight")


def test_column_shards_keep_the_gemm_bits(official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """What TP bit-equality of column-parallel layers rests on: for every column-split (and vocab-split) k3-tiny
    projection, each TP = 2 and TP = 4 shard's GEMM gives the same bits as those columns of the whole GEMM
    (`parity.kernels` invariant linear; KDA b_proj's shards are 2 and 1 columns wide)."""
    cfg, weights = official
    g = torch.Generator().manual_seed(2)
    shapes = {tuple(weights[n].shape) for n, r in split_roles(cfg.text).items()
              if r in (Split.COLUMN, Split.VOCAB) and weights[n].dim() == 2}
    for out_f, in_f in sorted(shapes):
        x, w = torch.randn(37, in_f, generator=g), torch.randn(out_f, in_f, generator=g)
        whole = INVARIANT.linear(x, w)
        for tp in (2, 4):
            for part, cols in zip(w.chunk(tp), whole.chunk(tp, dim=1)):
                _assert_bits(INVARIANT.linear(x, part), cols, f"weight {out_f}x{in_f}, 1/{tp} of the columns")


def test_cpu_compat_wraps_exactly_the_listed_spots() -> None:
    """Every listed megatron-core callable is wrapped, once: a second `apply` wraps nothing again (the wrapped
    callables run in every trainer test below)."""
    cpu_compat.apply()
    wrapped = [p.owner.__dict__[p.attr] for p in cpu_compat.PATCHES]
    cpu_compat.apply()
    again = [p.owner.__dict__[p.attr] for p in cpu_compat.PATCHES]
    for p, fn, fn2 in zip(cpu_compat.PATCHES, wrapped, again):
        inner = fn.__func__ if isinstance(fn, staticmethod) else fn
        assert getattr(inner, "__zerokl_cpu_compat__", False), f"{p.attr} not wrapped"
        assert fn2 is fn, f"{p.attr} wrapped twice"
        assert not getattr(getattr(inner, "__wrapped__", None), "__zerokl_cpu_compat__", False), f"{p.attr} nested"


def test_load_export_round_trip_is_bitwise(par: ParallelContext, checkpoint: Path,
                                           official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    cfg, weights = official
    model = MegatronK3Model(k3_transformer_config(cfg, par))
    loaded = load_official_dir(model, checkpoint)
    assert sorted(loaded) == sorted(text_specs(cfg.text))
    assert model.passthrough and all(not n.startswith("language_model.") for n in model.passthrough)
    exported = export_official(model)
    assert exported.keys() == weights.keys()
    for name, t in weights.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    missing = dict(weights)
    del missing["language_model.layers.3.self_attn.kv_b_proj.weight"]
    with pytest.raises(CheckpointError, match="kv_b_proj"):
        load_official(model, missing)
    extra = {**weights, "language_model.layers.3.self_attn.extra.weight": torch.zeros(1)}
    with pytest.raises(CheckpointError, match="unexpected"):
        load_official(model, extra)


def test_logprobs_and_gradients_match_float64_reference(
        par: ParallelContext, checkpoint: Path, official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """Megatron model (fp32) vs `parity.reference.ReferenceK3` (float64), both loaded from the checkpoint."""
    cfg, weights = official
    model = build_model(cfg, weights, par)
    seqs = _seqs((9, 6), seed=3)
    lp = token_logprobs(model, PaddedBatch.from_sequences(seqs), TEMPERATURE)
    (-lp.sum()).backward()
    ref = ReferenceK3.from_checkpoint(checkpoint)
    for t in ref.weights.values():
        t.requires_grad_(True)
    ref_lp = [ref.logprobs(torch.tensor(s), TEMPERATURE) for s in seqs]
    (-sum(r.sum() for r in ref_lp)).backward()
    for i, s in enumerate(seqs):
        torch.testing.assert_close(lp[i, : len(s) - 1].double(), ref_lp[i].detach(), rtol=0, atol=1e-4)
    worst = {}
    for name, p in model.official_parameters().items():
        want = ref.weights[name].grad
        if want is None:  # the router's selection-only bias
            assert p.grad is None or not p.grad.any(), name
            continue
        worst[name] = _rel(p.grad, want)
    name = max(worst, key=worst.get)
    assert worst[name] < 1e-3, f"{name}: gradient off the float64 reference by {worst[name]:.2e} (relative)"


def test_megatron_logprobs_equal_shared_forward_decode_schedule(par: ParallelContext,
                                                official: tuple[ModelConfig, dict[str, torch.Tensor]]) -> None:
    """Prompts + completions scored in one padded (and one packed) forward by the Megatron model equal, bit for
    bit, the shared forward run the rollout engine's way: prefill the prompt, then decode one token per step."""
    cfg, weights = official
    model = build_model(cfg, weights, par)
    prompts, completions = _seqs((5, 9, 3), seed=11), _seqs((6, 2, 8), seed=12)
    seqs = [p + c for p, c in zip(prompts, completions)]
    batch = PaddedBatch.from_sequences(seqs)
    with torch.no_grad():
        lp = token_logprobs(model, batch, TEMPERATURE)
        packed = PackedBatch(torch.tensor([t for s in seqs for t in s]),
                             torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()]))
        _assert_bits(token_logprobs(model, packed, TEMPERATURE), lp[batch.mask()], "packed vs padded")
    fwd = K3Forward(K3Weights.from_official(cfg.text, weights), INVARIANT)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        rollout = decode_logprobs(fwd, prompt, completion, TEMPERATURE)
        start = len(prompt) - 1
        _assert_bits(lp[i, start : start + len(completion)], rollout, f"sequence {i}")


def test_one_optimizer_step_lowers_the_loss(par: ParallelContext, checkpoint: Path) -> None:
    """Megatron DDP + `get_megatron_optimizer` (Adam, fp32, clipping on) on a fixed batch."""
    trainer = build_trainer(checkpoint, par, lr=1e-3)
    batch = PaddedBatch.from_sequences(_seqs((12, 7), seed=5))

    def nll(model: torch.nn.Module) -> torch.Tensor:
        return -token_logprobs(model, batch, 1.0).sum() / (batch.lens - 1).sum()

    before = {n: p.detach().clone() for n, p in trainer.module.official_parameters().items()}
    loss, grad_norm = train_step(trainer, nll)
    after = float(nll(trainer.model).detach())
    moved = [n for n, p in trainer.module.official_parameters().items() if not torch.equal(p, before[n])]
    assert grad_norm > 0 and len(moved) > len(before) // 2
    assert after < loss, f"loss {loss:.5f} -> {after:.5f}"


def test_value_head_leaves_logprobs_and_exports_alone_and_trains(par: ParallelContext, checkpoint: Path) -> None:
    """GAE's value head: the log-probs keep every bit of a trainer without it, the head stays out of the official
    parameters and the export, starts at 0 and learns in the trainer's optimizer step at its own learning rate (Adam's
    first step moves each weight by about the rate)."""
    plain = build_trainer(checkpoint, par, lr=1e-3)
    critic = build_trainer(checkpoint, par, lr=1e-3, value_head_lr=1e-5)
    batch = PaddedBatch.from_sequences(_seqs((12, 7), seed=5))
    lp, values = critic.model(batch.input_ids, batch.lens, TEMPERATURE, values=True)
    _assert_bits(lp, token_logprobs(plain.model, batch, TEMPERATURE), "with vs without a value head")
    assert torch.equal(values, torch.zeros_like(values))
    assert export_official(critic.module).keys() == export_official(plain.module).keys()
    assert not any("value" in n for n in critic.module.official_parameters())

    def to_one(model: torch.nn.Module) -> torch.Tensor:
        return ((model(batch.input_ids, batch.lens, 1.0, values=True)[1] - 1) ** 2).mean()

    train_step(critic, to_one)
    assert 0.5e-5 < critic.module.value_head.weight.abs().max() <= 1.01e-5
    assert critic.model(batch.input_ids, batch.lens, 1.0, values=True)[1].mean() > 0


def _micro_config() -> ModelConfig:
    """k3-tiny shrunk for float64 finite differences: 4 layers (3 KDA + MLA; dense then LatentMoE), AttnRes."""
    raw = copy.deepcopy(load_model_config(ROOT / "configs" / "k3-tiny.yaml").raw)
    raw["torch_dtype"] = "float32"  # fp32 mode: the weights' own dtype (float64) is the compute dtype
    raw["text_config"].update(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                              num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                              qk_rope_head_dim=4, v_head_dim=8, num_experts=4, num_experts_per_token=2,
                              moe_intermediate_size=16, routed_expert_hidden_size=24)
    raw["text_config"]["linear_attn_config"].update(kda_layers=[1, 2, 3], full_attn_layers=[4], num_heads=2,
                                                    head_dim=8)
    raw["vision_config"]["text_hidden_size"] = 32
    return parse_model_config(raw)


def _block(param: str) -> str:
    """Parameter name -> its block: `layers.N.self_attn` / `.mlp` / `.block_sparse_moe`, `layers.N.norms`
    (layer norms and AttnRes scorers), `model` (embedding, final norm, output AttnRes), `lm_head`."""
    parts = param.split(".")
    if parts[0] != "layers":
        return parts[0]
    return ".".join(parts[:3]) if parts[2] in ("self_attn", "mlp", "block_sparse_moe") else f"layers.{parts[1]}.norms"


def test_gradcheck_float64_every_block(par: ParallelContext) -> None:
    """Autograd through the trainer's forward vs central finite differences in float64: one scalar per block
    moves that block's parameters along a fixed random direction (torch.autograd.gradcheck)."""
    cfg = _micro_config()
    model = build_model(cfg, random_weights(cfg, seed=1), par, params_dtype=torch.float64)
    batch = PaddedBatch.from_sequences(_seqs((7, 5), seed=3, vocab=64))
    params = {n: p.detach() for n, p in model.named_parameters()}
    blocks = sorted({_block(n) for n in params})
    g = torch.Generator().manual_seed(0)
    direction = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) * (p.pow(2).mean().sqrt() + 1e-3)
                 for n, p in params.items()}

    def loss(*steps: torch.Tensor) -> torch.Tensor:
        moved = {n: p + steps[blocks.index(_block(n))] * direction[n] for n, p in params.items()}
        return functional_call(model, moved, (batch.input_ids, batch.lens, TEMPERATURE)).sum()

    steps = tuple(torch.zeros((), dtype=torch.float64, requires_grad=True) for _ in blocks)
    assert len(blocks) == 14
    assert torch.autograd.gradcheck(loss, steps, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_expert_slots_fold_to_experts_combine_bits() -> None:
    """The EP path as `ParallelK3Forward._dispatch` runs it, without the all-to-all: slots grouped by owning
    rank (two owners of four experts), each owner forms weight * expert(row) with `experts_combine` (one slot
    per row, local expert ids), the products are put back and added in slot order. Equals `experts_combine`
    over all experts bit for bit."""
    g = torch.Generator().manual_seed(7)
    n, k, e, lat, inter = 37, 4, 8, 24, 16
    x = torch.randn(n, lat, generator=g)
    ids = torch.sort(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]), dim=1).values
    w = torch.rand(n, k, generator=g)
    w1, w3 = ([torch.randn(inter, lat, generator=g) for _ in range(e)] for _ in range(2))
    w2 = [torch.randn(lat, inter, generator=g) for _ in range(e)]
    act = INVARIANT.silu_glu
    whole = experts_combine(x, ids, w, w1, w3, w2, INVARIANT.linear, act)
    slot_ids, slot_w = ids.reshape(-1), w.reshape(-1)
    products = torch.empty(n * k, lat)
    for owner in range(2):
        mine = (slot_ids // 4 == owner).nonzero().squeeze(1)
        local = range(4 * owner, 4 * owner + 4)
        products[mine] = experts_combine(x[mine // k], (slot_ids[mine] - 4 * owner).unsqueeze(1),
                                         slot_w[mine].unsqueeze(1), [w1[i] for i in local], [w3[i] for i in local],
                                         [w2[i] for i in local], INVARIANT.linear, act)
    _assert_bits(fold_slots(products.view(n, k, lat)), whole, "slot-wise experts + fold")
