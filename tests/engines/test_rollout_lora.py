"""vLLM LoRA on zerokl's K3 model (CPU, parity mode): bits, not tolerances.

The session's shared engine (`k3_engine`: `enable_lora`, `max_loras=2`, `max_lora_rank=8`) and three PEFT adapters from
`zerokl lora init` (scales 2, 3/8 and 1, so the scale's place in the formula matters). Every adapter request's
log-probs must equal the shared forward with `K3Weights.lora` from `lora.adapter.load_lora` (what the trainer
computes), alone and in mixed batches; the two vLLM CPU LoRA bugs the issue lists must not reach us: a base
request batched with adapter requests while all slots are full, and prompt log-probs of two prompts with LoRA.
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora.adapter import Adapter, load_adapter, load_lora, save_adapter
from lora.init import random_adapter
from lora.push import LOAD_ROUTE, UNLOAD_ROUTE, Server, list_servers, push
from lora.spec import AdapterError
from parity.kernels import INVARIANT
from parity.model import K3Forward, K3Weights, decode_logprobs, score_sequences
from rollout.engine import RolloutEngine, RolloutError, sample_seed
from rollout.server.lora import route_of
from parity.io.checkpoint import load_checkpoint
from zerokl.cli import main
from parity.sync.bundle import SyncError, WeightBundle

pytestmark = pytest.mark.slow  # starts engines, trainers or processes: scheduled first (conftest.py)


TEMPERATURE = 0.8
MAX_TOKENS = 6
ALPHAS = {"a1": 16.0, "a2": 3.0, "a3": 8.0}  # rank 8: scales 2, 0.375, 1



@pytest.fixture(scope="module")
def checkpoint(k3_tiny: Path) -> Path:
    return k3_tiny


@pytest.fixture(scope="module")
def adapters(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cfg, _ = load_checkpoint(checkpoint)
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for seed, (name, alpha) in enumerate(ALPHAS.items(), start=1):
        out[name] = save_adapter(random_adapter(cfg.text, rank=8, alpha=alpha, seed=seed), root / name)
    return out


@pytest.fixture(scope="module")
def engine(k3_engine: RolloutEngine) -> RolloutEngine:
    return k3_engine


@pytest.fixture(scope="module")
def forwards(checkpoint: Path, adapters: dict[str, Path]) -> dict[str | None, K3Forward]:
    """The shared forward per adapter (None: base), as the trainer computes it."""
    cfg, tensors = load_checkpoint(checkpoint)
    base = K3Weights.from_official(cfg.text, tensors)
    out: dict[str | None, K3Forward] = {None: K3Forward(base, INVARIANT)}
    for name, path in adapters.items():
        out[name] = K3Forward(K3Weights(cfg.text, base.tensors, load_lora(path, cfg.text)), INVARIANT)
    return out


PROMPTS = [[5, 9, 13, 22, 7], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48], [300, 7, 7, 9],
           [17] * 20, [3, 1, 4, 1, 5, 9, 2, 6]]
SEEDS = [11, 12, 13, 14, 15, 16]


def _expect(fwd: K3Forward, prompt: list[int], completion: list[int]) -> torch.Tensor:
    return decode_logprobs(fwd, prompt, completion, TEMPERATURE)


def test_mixed_base_and_two_adapters_with_all_slots_full_are_bitwise(
        engine: RolloutEngine, adapters: dict[str, Path], forwards: dict[str | None, K3Forward]) -> None:
    """Base + a1 + a2 in one batch (both slots taken: vLLM's -1 index bug would give the base rows an
    adapter): each request equals itself alone and the shared forward with its adapter."""
    a1, a2 = engine.load_adapter("a1", adapters["a1"]), engine.load_adapter("a2", adapters["a2"])
    which = [None, a1, a2, None, a2, a1]
    names = [None if r is None else r.lora_name for r in which]
    mixed = engine.generate(PROMPTS, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=SEEDS, lora=which)
    for i, (prompt, seed, req, name) in enumerate(zip(PROMPTS, SEEDS, which, names)):
        alone = engine.generate([prompt], temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=[seed], lora=req)[0]
        assert mixed[i].completion_ids == alone.completion_ids, i
        assert torch.equal(mixed[i].logprobs, alone.logprobs), i
        assert torch.equal(mixed[i].logprobs, _expect(forwards[name], prompt, mixed[i].completion_ids)), i
    base_as_a1 = _expect(forwards["a1"], PROMPTS[0], mixed[0].completion_ids)
    assert not torch.equal(mixed[0].logprobs, base_as_a1), "the adapter must change log-probs"
    engine.remove_adapter(a1)
    engine.remove_adapter(a2)


def test_more_adapters_than_slots_share_batches_bitwise(
        engine: RolloutEngine, adapters: dict[str, Path], forwards: dict[str | None, K3Forward]) -> None:
    """Three adapters and the base with max_loras=2: vLLM schedules them in turns, LRU-evicting; bits hold."""
    reqs = {name: engine.load_adapter(name, path) for name, path in adapters.items()}
    which = ["a1", "a2", "a3", None, "a3", "a1"]
    out = engine.generate(PROMPTS, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=SEEDS,
                          lora=[None if w is None else reqs[w] for w in which])
    for sample, prompt, name in zip(out, PROMPTS, which):
        assert torch.equal(sample.logprobs, _expect(forwards[name], prompt, sample.completion_ids)), name
    for req in reqs.values():
        engine.remove_adapter(req)


def test_prompt_logprobs_of_two_prompts_with_lora(
        engine: RolloutEngine, adapters: dict[str, Path], forwards: dict[str | None, K3Forward]) -> None:
    """vLLM's punica CPU path crashes here (`add_lora_logits`); zerokl's model computes them, bitwise."""
    from vllm import SamplingParams

    req = engine.load_adapter("a2", adapters["a2"])
    prompts = PROMPTS[:3]
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0),
                               lora_request=req, use_tqdm=False)
    expected = score_sequences(forwards["a2"], prompts)
    for out, prompt, exp in zip(outs, prompts, expected):
        got = torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], prompt[1:])])
        assert torch.equal(got, exp[: len(prompt) - 1])
    engine.remove_adapter(req)


def test_malformed_adapter_is_refused_and_the_loaded_one_keeps_serving(
        engine: RolloutEngine, adapters: dict[str, Path], forwards: dict[str | None, K3Forward],
        tmp_path: Path) -> None:
    good = engine.load_adapter("a1", adapters["a1"])
    bad = tmp_path / "bad"
    _break_shape(adapters["a1"], bad)
    with pytest.raises(RolloutError, match=r"has shape .* expected"):
        engine.load_adapter("bad", bad)
    with pytest.raises(RolloutError, match="no adapter_config.json"):
        engine.load_adapter("missing", tmp_path / "nowhere")
    sample = engine.generate([PROMPTS[1]], temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=[5], lora=good)[0]
    assert torch.equal(sample.logprobs, _expect(forwards["a1"], PROMPTS[1], sample.completion_ids))
    engine.remove_adapter(good)


def test_lora_arguments_are_checked(engine: RolloutEngine) -> None:
    with pytest.raises(RolloutError, match="one per prompt"):
        engine.generate(PROMPTS[:2], lora=[None])


# --- hot-swap into a live server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lora_root(adapters: dict[str, Path], k3_server: tuple[str, Path]) -> Path:
    """The shared server's adapter directory, given copies of a1 and a2, and a1 with one tensor of the wrong shape."""
    root = k3_server[1]
    for name in ("a1", "a2"):
        shutil.copytree(adapters[name], root / name)
    _break_shape(adapters["a1"], root / "bad")
    return root


def _break_shape(src: Path, dest: Path) -> str:
    shutil.copytree(src, dest)
    tensors = load_file(str(dest / "adapter_model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    return name


@pytest.fixture(scope="module")
def server(k3_server: tuple[str, Path], lora_root: Path) -> str:
    return k3_server[0]


def _complete(base: str, model: str, prompt: list[int], seed: int) -> tuple[list[int], torch.Tensor]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE, "logprobs": 0,
            "seed": sample_seed(seed, 0), "return_tokens_as_token_ids": True}
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        lp = json.loads(resp.read())["choices"][0]["logprobs"]
    return [int(t.removeprefix("token_id:")) for t in lp["tokens"]], torch.tensor(lp["token_logprobs"])


def _assert_serves(base: str, engine: RolloutEngine, adapter: Path, name: str) -> None:
    """Completions for model `name` equal the offline engine's with `adapter`, bit for bit."""
    offline = engine.load_adapter(adapter.name, adapter)
    expected = engine.generate(PROMPTS[:3], temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=SEEDS[:3],
                               lora=offline)
    engine.remove_adapter(offline)
    for prompt, seed, exp in zip(PROMPTS, SEEDS, expected):
        tokens, logprobs = _complete(base, name, prompt, seed)
        assert tokens == exp.completion_ids
        assert torch.equal(logprobs, exp.logprobs)


def _request(method: str, url: str, body: dict | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, None if body is None else json.dumps(body).encode(),
                                 {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_push_replace_and_refuse_on_a_live_server(server: str, engine: RolloutEngine, lora_root: Path,
                                                  tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    servers = [Server(server)]
    assert push(servers, "policy", lora_root / "a1", log=lambda m: None) == 1
    _assert_serves(server, engine, lora_root / "a1", "policy")

    assert push(servers, "policy", lora_root / "a2", log=lambda m: None) == 2
    _assert_serves(server, engine, lora_root / "a2", "policy")
    state = list_servers(servers)[0][1]["adapters"]
    assert state["policy"]["serves"] == "policy@v2" and "policy@v1" not in state

    # refused by the client's validation, and (sent directly) by the server: the served version stays
    with pytest.raises(AdapterError, match="has shape"):
        push(servers, "policy", lora_root / "bad", log=lambda m: None)
    status, body = _request("POST", f"{server}{LOAD_ROUTE}", {"lora_name": "x", "lora_path": str(lora_root / "bad")})
    assert status >= 400 and "has shape" in body
    outside = tmp_path / "outside"
    shutil.copytree(lora_root / "a1", outside)
    with pytest.raises(AdapterError, match="outside the server's adapter directory"):
        push(servers, "policy", outside, log=lambda m: None)
    for path in (outside, lora_root / ".." / outside.name):
        status, body = _request("POST", f"{server}{LOAD_ROUTE}", {"lora_name": "x", "lora_path": str(path)})
        assert status == 400 and "outside this server's adapter directory" in body
    _assert_serves(server, engine, lora_root / "a2", "policy")

    assert main(["lora", "list", "--server", server]) == 0
    assert "policy -> policy@v2" in capsys.readouterr().out
    assert main(["lora", "push", "--server", server, "--name", "policy", "--adapter", str(lora_root / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zerokl: error:") and "has shape" in err[0]
    assert main(["lora", "list", "--server", "http://127.0.0.1:1"]) == 1
    assert "unreachable" in capsys.readouterr().err


def test_every_route_of_the_server_is_classified_and_the_others_refused(server: str, lora_root: Path) -> None:
    """vLLM's own route list (/openapi.json) against `rollout.server.lora`'s table: a route a later vLLM adds fails
    here (and is refused by the server meanwhile); the SageMaker adapter routes cannot load from outside the
    adapter directory, unload, or select an adapter; an adapter a name serves cannot be unloaded under it."""
    status, body = _request("GET", f"{server}/openapi.json")
    assert status == 200
    routes = json.loads(body)["paths"]
    assert LOAD_ROUTE in routes and UNLOAD_ROUTE in routes and "/adapters" in routes  # the table's premise
    assert not [r for r in routes if route_of(r) is None], "routes zerokl serve does not classify"
    refused = [("POST", "/adapters", {"name": "x", "src": "/etc"}), ("DELETE", "/adapters/policy", None),
               ("POST", "/invocations", {"prompt": [5], "max_tokens": 1}), ("POST", "/v1/not_a_route_yet", {}),
               ("POST", "/scale_elastic_ep", {})]
    for method, path, payload in refused:
        status, body = _request(method, f"{server}{path}", payload)
        assert status == 404 and "no route" in body, (method, path, status, body)
    served = list_servers([Server(server)])[0][1]["adapters"]["policy"]["serves"]
    status, body = _request("POST", f"{server}{UNLOAD_ROUTE}", {"lora_name": served})
    assert status == 409 and "'policy'" in body, body
    assert list_servers([Server(server)])[0][1]["adapters"]["policy"]["serves"] == served


def test_adapter_bundles_replace_the_policy_adapter_verified_and_versioned(
        engine: RolloutEngine, checkpoint: Path, adapters: dict[str, Path]) -> None:
    """The PPO sync path: adapter-only bundles; a corrupt or misshapen one leaves the engine as it was."""
    cfg, tensors = load_checkpoint(checkpoint)
    base = K3Weights.from_official(cfg.text, tensors).tensors
    first, second = load_adapter(adapters["a1"], cfg.text), load_adapter(adapters["a2"], cfg.text)
    start = engine.policy_version
    engine.set_policy_adapter("policy", adapters["a1"])
    moved = Adapter(first.spec, second.weights)  # new values, the policy's config (scale 2)

    def expect(adapter: Adapter, sample: object) -> torch.Tensor:
        fwd = K3Forward(K3Weights(cfg.text, base, adapter.lora()), INVARIANT)
        return _expect(fwd, PROMPTS[2], sample.completion_ids)

    bundle = WeightBundle.make(start + 1, moved.tensors(), kind="adapter")
    engine.update_weights(bundle)
    assert engine.policy_version == start + 1 and engine.policy_adapter.lora_name == f"policy@v{start + 1}"
    s = engine.generate([PROMPTS[2]], temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=[3],
                        lora=engine.policy_adapter)[0]
    assert s.policy_version == start + 1 and torch.equal(s.logprobs, expect(moved, s))

    corrupt = WeightBundle(start + 2, "adapter", {n: t + 1 for n, t in bundle.tensors.items()}, bundle.checksums)
    name = sorted(bundle.tensors)[0]
    misshapen = WeightBundle.make(start + 2, {**bundle.tensors, name: bundle.tensors[name][:, :-1]}, kind="adapter")
    stale = WeightBundle.make(start + 1, first.tensors(), kind="adapter")
    for bad, match in ((corrupt, "checksum mismatch"), (misshapen, "expected"), (stale, "stale")):
        with pytest.raises(SyncError, match=match):
            engine.update_weights(bad)
    assert engine.policy_version == start + 1
    again = engine.generate([PROMPTS[2]], temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=[3],
                            lora=engine.policy_adapter)[0]
    assert torch.equal(again.logprobs, s.logprobs)
