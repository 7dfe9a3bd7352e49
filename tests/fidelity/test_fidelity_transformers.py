"""zerokl's Kimi Linear forward against transformers' `KimiLinearForCausalLM`, code nobody here wrote.

The weights: `zerokl init-checkpoint --config configs/kimi-linear-tiny.yaml` (seed 0, bf16 storage), read by
transformers' own `from_pretrained`, whose checkpoint conversion maps the official names onto its modules (f_a /
f_b / A_log / dt_bias into `forget_gate`, q / k / v convs stacked into `conv1d`, `block_sparse_moe` renamed to
`mlp`, per-expert w1 / w3 / w2 merged). transformers runs in fp32, eager attention and eager experts, on its
pure-torch fallbacks (no fla or causal-conv1d kernels installed). zerokl runs the float64 reference and
`parity.model` on both kernel sets, the prompts batched (right-padded) as the trainer scores them.

Bounds (fp32 vs fp64 and fp32 vs fp32), stated once; fp32 round-off accumulated through 8 layers:
  LOGPROB_ATOL = 5e-5     per-token log-probs, |lp| up to ~10 (fp32 spacing 9.5e-7 there);
                          measured <= 1.4e-5 (transformers), <= 4.1e-6 (zerokl) vs float64
  HIDDEN_RTOL = 3e-5      per-layer tensors: max |Δ| <= HIDDEN_RTOL * max |x| of the float64 tensor (about 250
                          fp32 ulp of the tensor's largest value); measured <= 6.5e-6 (zerokl vs transformers)

Where transformers and vLLM (the engine zerokl must match bit for bit) disagree on something zerokl shares,
`test_where_transformers_and_vllm_differ` pins the difference and says which side zerokl follows.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from torch import Tensor

from parity.config import TextConfig, load_model_config
from parity.kernels import FAST, INVARIANT
from parity.caches import new_cache
from parity.model import KDA_NORM_EPS, K3Forward, K3Weights, score_sequences
from parity.reference import ReferenceK3
from parity.io.checkpoint import load_checkpoint

modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny float64 ops (conftest.py)

TINY = Path(__file__).resolve().parents[2] / "configs" / "kimi-linear-tiny.yaml"
LOGPROB_ATOL = 5e-5
HIDDEN_RTOL = 3e-5
PROMPT_LENS = (2, 17, 64, 97)  # 64: one whole transformers KDA chunk; 97 crosses into a second
F64 = torch.float64


def assert_close(actual: Tensor, expected: Tensor, atol: float, what: str) -> None:
    """Fail with the first mismatching index and the max |Δ| when |actual - expected| > atol anywhere."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    diff = (actual.to(F64) - expected.to(F64)).abs()
    bad = ~(diff <= atol)
    if bad.any():
        first = tuple(int(i) for i in bad.nonzero()[0])
        pytest.fail(f"{what}: {int(bad.sum())} of {diff.numel()} values off by > {atol:g}; first at {first} "
                    f"({float(actual[first]):.9g} vs {float(expected[first]):.9g}); max |Δ| {float(diff.max()):.3e}")


def assert_rel(actual: Tensor, expected: Tensor, what: str) -> None:
    assert_close(actual, expected, HIDDEN_RTOL * float(expected.abs().max()), what)



@pytest.fixture(scope="module")
def ckpt(kimi_linear_tiny: Path) -> Path:
    return kimi_linear_tiny


@pytest.fixture(scope="module")
def hf(ckpt: Path):
    """transformers' model on our checkpoint, with its loading report."""
    model, info = modeling.KimiLinearForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def ours(ckpt: Path) -> tuple[TextConfig, dict[str, Tensor]]:
    cfg, weights = load_checkpoint(ckpt)
    return cfg.text, weights


@pytest.fixture(scope="module")
def prompts() -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1024, (n,), generator=gen) for n in PROMPT_LENS]


def test_transformers_loads_our_checkpoint(hf, ours):
    """No missing, unexpected or mismatched keys: every transformers parameter and buffer comes from our files."""
    model, info = hf
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert not info["error_msgs"]
    cfg, weights = ours
    loaded = sum(t.numel() for t in model.state_dict().values())
    assert loaded == sum(t.numel() for t in weights.values())
    assert cfg.checkpoint_family == "kimi_linear" and not cfg.use_full_rank_gate


def _transformers_logprobs(model, ids: Tensor) -> Tensor:
    with torch.no_grad():
        logits = model(ids[None]).logits[0]
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]


def test_logprobs_agree(hf, ours, prompts):
    """Per-token log-probs of each prompt: transformers, zerokl's float64 reference and `parity.model` on the
    invariant and fast kernel sets (all prompts scored in one right-padded batch) agree within LOGPROB_ATOL."""
    model, _ = hf
    cfg, weights = ours
    reference = ReferenceK3(cfg, weights)
    seqs = [p.tolist() for p in prompts]
    w = K3Weights.from_official(cfg, weights)
    invariant, fast = (score_sequences(K3Forward(w, kernels), seqs) for kernels in (INVARIANT, FAST))
    for i, ids in enumerate(prompts):
        want = reference.logprobs(ids)
        theirs = _transformers_logprobs(model, ids)
        assert_close(theirs, want, LOGPROB_ATOL, f"prompt {i}: transformers vs float64 reference")
        assert_close(invariant[i], want, LOGPROB_ATOL, f"prompt {i}: zerokl invariant vs float64 reference")
        assert_close(fast[i], want, LOGPROB_ATOL, f"prompt {i}: zerokl fast vs float64 reference")
        assert_close(invariant[i], theirs, LOGPROB_ATOL, f"prompt {i}: zerokl invariant vs transformers")


def _transformers_states(model, ids: Tensor) -> dict[str, Tensor]:
    """Forward hooks on transformers' modules: the embedding, each layer's attention and MLP outputs and the
    residual stream after it (the decoder layer's output), the final norm, and the logits."""
    modules = {"embed": model.model.embed_tokens, "final_norm": model.model.norm}
    for i, layer in enumerate(model.model.layers):
        modules.update({f"layer{i}.attn": layer.self_attn, f"layer{i}.mlp": layer.mlp, f"layer{i}.out": layer})
    states: dict[str, Tensor] = {}

    def keep(key: str):
        def hook(_module, _args, out):
            states[key] = (out[0] if isinstance(out, tuple) else out)[0]  # MLA returns (output, weights)
        return hook

    hooks = [module.register_forward_hook(keep(key)) for key, module in modules.items()]
    try:
        with torch.no_grad():
            states["logits"] = model(ids[None]).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return states


def _zerokl_states(w: K3Weights, kernels, prompts: list[Tensor], row: int) -> dict[str, Tensor]:
    """`parity.model` captures for prompt `row` of the right-padded batch of all prompts; the residual stream
    after each layer is rebuilt in the model's own order ((x + attn) + mlp)."""
    fwd = K3Forward(w, kernels)
    lens = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(len(prompts), int(lens.max()), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    pos = torch.arange(ids.shape[1]).expand_as(ids).clamp(max=(lens - 1).view(-1, 1))
    capture: dict[str, Tensor] = {}
    hidden = fwd.hidden(ids, pos, lens, new_cache(w.cfg, len(prompts)), capture)
    n = len(prompts[row])
    states = {k: v[row, :n] for k, v in capture.items()}
    x = states["embed"]
    for i in range(w.cfg.num_hidden_layers):
        x = (x + states[f"layer{i}.attn"]) + states[f"layer{i}.mlp"]
        states[f"layer{i}.out"] = x
    states["logits"] = fwd.logits(hidden[row, :n])
    return states


def test_hidden_states_agree(hf, ours, prompts):
    """Every layer's attention output, MLP output and residual stream, and the logits, for the 97-token prompt:
    transformers and zerokl (invariant and fast, inside the batch) each within HIDDEN_RTOL of the float64
    reference, and zerokl invariant within HIDDEN_RTOL of transformers."""
    model, _ = hf
    cfg, weights = ours
    row = len(prompts) - 1
    want = ReferenceK3(cfg, weights).hidden_states(prompts[row])
    theirs = _transformers_states(model, prompts[row])
    w = K3Weights.from_official(cfg, weights)
    mine = {k.name: _zerokl_states(w, k, prompts, row) for k in (INVARIANT, FAST)}
    keys = ["embed", *(f"layer{i}.{p}" for i in range(cfg.num_hidden_layers) for p in ("attn", "mlp", "out")),
            "logits"]
    for key in keys:
        assert_rel(theirs[key], want[key], f"{key}: transformers vs float64 reference")
        for name, states in mine.items():
            assert_rel(states[key], want[key], f"{key}: zerokl {name} vs float64 reference")
        assert_rel(mine["invariant"][key], theirs[key], f"{key}: zerokl invariant vs transformers")
    assert_rel(theirs["final_norm"], want["final_norm"], "final norm: transformers vs float64 reference")


def test_where_transformers_and_vllm_differ(hf, ours):
    """The points where the two independent implementations disagree on something zerokl shares. zerokl
    follows vLLM each time: its rollout engine is vLLM, and the released Kimi-Linear-48B config
    (configs/kimi-linear-48b-a3b.yaml) makes each difference moot.

    1. KDA output norm eps: vLLM builds `FusedRMSNormGated(head_dim, activation="sigmoid")` (eps 1e-5 always);
       transformers' `KimiLinearRMSNormGated` uses `rms_norm_eps`. zerokl: 1e-5 (`parity.model.KDA_NORM_EPS`).
       The released config has rms_norm_eps = 1e-5, so both give 1e-5 there (and in kimi-linear-tiny).
    2. KDA gate lower bound: vLLM applies `gate_lower_bound` (lb * sigmoid(...)) when the config sets it;
       transformers' `KimiLinearForgetGate` computes only the softplus form. zerokl follows the config, as vLLM.
       The released config sets none.
    3. Router score function: vLLM reads `moe_router_activation_func` (sigmoid or softmax); transformers'
       `KimiLinearTopkRouter` always takes the sigmoid. zerokl follows the config. The released config: sigmoid.
    4. Short-conv activation: vLLM always applies SiLU; transformers applies `hidden_act`. zerokl applies SiLU,
       as vLLM; Kimi Linear's hidden_act is silu, so they agree there (K3's situ would not).
    5. MLA latent norms: transformers builds `q_a_layernorm` / `kv_a_layernorm` as `KimiLinearRMSNorm(dim)`, eps
       1e-6 whatever the config says; vLLM (and zerokl) use `rms_norm_eps` (1e-5 in the released config). A
       systematic difference inside LOGPROB_ATOL: with transformers run in float64, aligning it lowers its max
       log-prob gap to zerokl's float64 reference from 7.0e-6 to 4.3e-6 (97 tokens, kimi-linear-tiny); the rest
       comes from transformers' fp32 casts inside RMSNorm, softmax and chunk_kda, which it keeps in float64.
    """
    from vllm.third_party.flash_linear_attention.ops.kda import FusedRMSNormGated

    from parity.reference.kda import kda_gate

    model, _ = hf
    cfg, weights = ours
    released = load_model_config(TINY.with_name("kimi-linear-48b-a3b.yaml")).text
    layer = cfg.kda_layers[0]
    kda = model.model.layers[layer].self_attn
    assert isinstance(kda, modeling.KimiLinearDeltaAttention)
    # 1
    assert inspect.signature(FusedRMSNormGated.__init__).parameters["eps"].default == KDA_NORM_EPS == 1e-5
    assert kda.o_norm.variance_epsilon == cfg.rms_norm_eps == released.rms_norm_eps == KDA_NORM_EPS
    # 2: transformers' gate is the softplus form whatever the config says
    x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = kda.forget_gate(x)[0]
    p = f"model.layers.{layer}.self_attn."
    raw = (x[0] @ weights[p + "f_a_proj.weight"].float().T) @ weights[p + "f_b_proj.weight"].float().T
    h, d = cfg.kda_num_heads, cfg.kda_head_dim
    softplus_form = kda_gate(raw.view(5, h, d).to(F64), weights[p + "A_log"].view(h).to(F64),
                             weights[p + "dt_bias"].view(h, d).to(F64), None)
    assert_rel(theirs, softplus_form, "transformers' forget gate vs the softplus form")
    assert cfg.gate_lower_bound is None and released.gate_lower_bound is None
    # 3
    assert ".sigmoid()" in inspect.getsource(modeling.KimiLinearTopkRouter.forward)
    assert cfg.router_activation == released.router_activation == "sigmoid"
    # 4
    assert kda.activation == cfg.hidden_act == released.hidden_act == "silu"
    # 5
    mla = model.model.layers[cfg.full_attn_layers[0]].self_attn
    assert mla.kv_a_layernorm.variance_epsilon == 1e-6 != cfg.rms_norm_eps == released.rms_norm_eps
    assert inspect.signature(modeling.KimiLinearRMSNorm.__init__).parameters["eps"].default == 1e-6
