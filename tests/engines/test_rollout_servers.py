"""Rollouts and weight sync over live `zerokl serve` servers (`rollout.client.remote`, `rollout.server.admin`).

`zerokl ppo --num-rollout-servers 1` with LoRA (k3-tiny): the base synced once, every adapter version pushed into
the server the command started and sampled from, every log-prob bitwise the trainer's, the server stopped at the end
(two servers, one killed mid-run, `sync: torch_distributed`: tests/engines/test_ray.py). On the session's server
(k3-tiny): a remote rollout equals the in-process engine's bit for bit (tokens, log-probs, raw log-probs, routing); `GET
/zerokl/weights` gives the checksum the trainer computes for the checkpoint's weights; a request for another version
is refused (409); stale and malformed updates are refused by every server, which keeps its version and bits; vLLM's
development routes that do not serve weight sync are closed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from helpers import picture, ppo_config_file
from parity.config import load_model_config
from parity.io.checkpoint import load_checkpoint
from parity.routing import NOT_COMPUTED
from parity.sync.bundle import SyncError, WeightBundle, weights_checksum
from parity.weights import master_weights, serving_weights
from rollout.client.remote import RemoteRollout
from rollout.sampling import ImagePrompt, sample_seed
from rollout.server.admin import VERSION_HEADER

REPO = Path(__file__).resolve().parents[2]


def _checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    cfg, stored = load_checkpoint(checkpoint)
    return serving_weights(cfg.text, master_weights(cfg.text, stored))


def _post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                     **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_remote_rollout_equals_the_engine_and_bad_updates_change_nothing(k3_server: tuple[str, Path],
                                                                         k3_engine, k3_tiny: Path) -> None:
    url = k3_server[0]
    remote = RemoteRollout([url], load_model_config(k3_tiny).text, log=lambda _: None)
    weights = _checkpoint_weights(k3_tiny)
    checksum = weights_checksum(WeightBundle.make(0, weights).checksums)
    assert remote.version == 0 and remote.checksums == {url: checksum}
    prompts = [[5, 17, 29, 41, 53][: 2 + i] for i in range(4)]
    got = remote.generate(prompts, n=2, max_tokens=6, seed=11, record=True)
    want = k3_engine.generate(prompts, n=2, max_tokens=6, seed=11, record=True)
    for g, w in zip(got, want):
        assert g.completion_ids == w.completion_ids and g.policy_version == 0
        for a, b in ((g.logprobs, w.logprobs), (g.raw_logprobs, w.raw_logprobs), (g.routing, w.routing)):
            assert torch.equal(a, b)
    status, body = _post(f"{url}/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {"max_tokens": 1}},
                         {VERSION_HEADER: "3"})
    assert status == 409 and "holds weight version 0, the request expects 3" in body["error"]["message"]
    for route in ("/collective_rpc", "/sleep", "/reset_mm_cache"):
        assert _post(url + route, {})[0] == 404
    wrong = dict(weights)
    name = sorted(wrong)[3]
    wrong[name] = wrong[name][:1]
    for bundle, says in ((WeightBundle.make(0, weights), "stale update"), (WeightBundle.make(1, wrong), name)):
        with pytest.raises(SyncError, match=says):
            remote.sync(bundle)
        assert remote.servers[0].weights() == {"version": 0, "checksum": checksum, "vision_synced": False}
    after = remote.generate(prompts[:1], n=2, max_tokens=6, seed=11)
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(after, got[:2]))


def test_image_prompts_over_the_server_equal_the_engine(k3_server: tuple[str, Path], k3_engine, k3_tiny: Path) -> None:
    """Image prompts (sent as PNG content parts of token-in requests) and a text one through `zerokl serve`: the prompt
    as the server expanded it, the tokens, log-probs, raw log-probs and routing (where both computed it) equal the offline engine's bit for bit;
    the same image again is served from the server's prefix cache with the same bits."""
    remote = RemoteRollout([k3_server[0]], load_model_config(k3_tiny).text, log=lambda _: None)
    long = [5, 17, 29, 41] * 40  # past the server's 128-token cache block
    prompts = [ImagePrompt([3] + long, (picture(60, 40, 1),)), long[:6],
               ImagePrompt([40, 3, 41, 3, 42], (picture(30, 100, 2), picture(90, 90, 3)))]
    got = remote.generate(prompts, n=2, max_tokens=6, seed=11, record=True)
    want = k3_engine.generate(prompts, n=2, max_tokens=6, seed=11, record=True)
    for g, w in zip(got, want):
        assert g.prompt_ids == w.prompt_ids and g.completion_ids == w.completion_ids
        assert torch.equal(g.logprobs, w.logprobs) and torch.equal(g.raw_logprobs, w.raw_logprobs)
        both = (g.routing != NOT_COMPUTED) & (w.routing != NOT_COMPUTED)  # a prefix hit on either side computes less
        assert bool(both[-6:].all()) and torch.equal(g.routing[both], w.routing[both])
    assert len(got[0].prompt_ids) > len(prompts[0].token_ids)  # the image's tokens
    assert remote.vision_synced == {k3_server[0]: False}  # its tower stays as loaded (no --sync-vision-tower)
    again = remote.generate(prompts[:1], n=2, max_tokens=6, seed=[sample_seed(11, 0)])
    assert all(a.cached_tokens >= 128 for a in again), [a.cached_tokens for a in again]
    assert all(torch.equal(a.logprobs, g.logprobs) and a.completion_ids == g.completion_ids
               for a, g in zip(again, got[:2]))


def test_an_image_in_a_chat_request_equals_the_engine(k3_server: tuple[str, Path], k3_engine, k3_tiny: Path) -> None:
    """An OpenAI chat request with an image content part (a PNG data URL): the chat template puts the image
    placeholder, vLLM's K3 processor expands it, and the tokens and log-probs equal the offline engine's on the
    template's ids with the same image, bit for bit."""
    import base64
    import io

    from parity.io.chat_format import chat_prompt_ids

    image = picture(70, 50, 5)
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    parts = [{"type": "text", "text": "How many squares?"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": str(k3_tiny), "messages": [{"role": "user", "content": parts}], "max_tokens": 6, "temperature": 1.0,
            "seed": sample_seed(4, 0), "logprobs": True, "return_token_ids": True}
    request = urllib.request.Request(f"{k3_server[0]}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        got = json.loads(reply.read())
    ids = chat_prompt_ids(k3_tiny, [{"role": "user", "content": [parts[0], {"type": "image_url",
                                                                          "image_url": {"url": "x.png"}}]}])
    want = k3_engine.generate([ImagePrompt(ids, (image,))], max_tokens=6, temperature=1.0, seed=[4])[0]
    choice = got["choices"][0]
    assert got["prompt_token_ids"] == want.prompt_ids and len(want.prompt_ids) > len(ids)  # the image's tokens
    assert choice["token_ids"] == want.completion_ids
    assert torch.equal(torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]]), want.logprobs)


def test_a_run_training_the_tower_refuses_a_server_holding_it_frozen(k3_server: tuple[str, Path], k3_tiny: Path,
                                                                    tmp_path: Path) -> None:
    """`vision_tower: trainable` against a server started without `--sync-vision-tower`: refused before any step or
    sync, naming the flag."""
    config = ppo_config_file(tmp_path, "configs/ppo-tiny-vision.yaml", k3_tiny, steps=1,
                             rollout_servers=f"[{k3_server[0]}]", vision_tower="trainable")
    done = subprocess.run([str(Path(sys.executable).with_name("zerokl")), "ppo", "--config", str(config), "--out",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"rollout server {k3_server[0]} holds its vision tower as loaded" in done.stderr \
        and "zerokl serve --sync-vision-tower" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_lora_ppo_on_a_server_it_starts(k3_tiny: Path, tmp_path: Path) -> None:
    """`zerokl ppo --num-rollout-servers 1` on configs/ppo-tiny-lora.yaml for 2 steps: the command starts a server
    that serves adapters from the run's directory; the base goes in once at version 1, then every version of the
    adapter is pushed (`zerokl lora push`: all servers or none) and sampled from, every log-prob bitwise the
    trainer's; the server is stopped when the command returns."""
    config = ppo_config_file(tmp_path, "configs/ppo-tiny-lora.yaml", k3_tiny, steps=2, checkpoint_every=2)
    out = tmp_path / "run"
    res = subprocess.run([str(Path(sys.executable).with_name("zerokl")), "ppo", "--config", str(config), "--out",
                          str(out), "--num-rollout-servers", "1"], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    metrics = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 and m["raw_bitwise_equal_frac"] == 1.0, m
        assert m["policy_version"] == m["step"] + 1 and m["sync_bytes"] < m["full_sync_bytes"] / 5
    assert [re.sub(r"-[0-9a-f]{8}-", "-*-", p.name) for p in (out / "served-adapters").iterdir()] == \
        ["policy-*-v00000003"]  # the served version; the earlier ones removed once replaced
    url = re.search(r"rollout servers ready in \d+ s: (\S+) ", res.stdout).group(1)
    with pytest.raises(urllib.error.URLError):  # stopped with the run
        urllib.request.urlopen(url + "/health", timeout=5)
