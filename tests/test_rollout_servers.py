"""Rollouts and weight sync over live `zerokl serve` servers (`rollout.remote`, `rollout.server_admin`).

`zerokl ppo --num-rollout-servers 2` (k3-tiny-mxfp4, `sync: torch_distributed`: a gloo broadcast into both servers'
workers every step) keeps every log-prob, raw and processed, and every expert choice bitwise equal to the trainer's at
every step; one server is killed mid-run and the run goes on with the other (its prompts retried there), and the run
stops every server it started. On the session's server (k3-tiny): a remote rollout equals the in-process engine's bit
for bit (tokens, log-probs, raw log-probs, routing); `GET /zerokl/weights` gives the checksum the trainer computes for
the checkpoint's weights; a request for another version is refused (409); stale and malformed updates are refused by
every server, which keeps its version and bits; vLLM's development routes that do not serve weight sync are closed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch

from helpers import K3_ENGINE_ARGS, PPO_REFERENCE_CONFIG, ppo_config_file
from parity.config import load_model_config
from parity.io.checkpoint import load_checkpoint
from parity.sync.bundle import SyncError, WeightBundle, weights_checksum
from parity.weights import master_weights, serving_weights
from rollout.remote import RemoteRollout
from rollout.server_admin import VERSION_HEADER

REPO = Path(__file__).resolve().parents[1]
STEPS = 4


def _server_group(url: str) -> int:
    """The process group of the server listening at `url` (its API process leads it)."""
    port = int(url.rsplit(":", 1)[1])
    pid = next(c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port
               and c.status == psutil.CONN_LISTEN)
    return os.getpgid(pid)


@pytest.mark.slow
def test_ppo_on_two_started_servers_survives_losing_one(k3_tiny_mxfp4: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    cfg = ppo_config_file(out, PPO_REFERENCE_CONFIG, k3_tiny_mxfp4, steps=STEPS, checkpoint_every=STEPS,
                          sync="torch_distributed")
    log = out / "console.log"
    with log.open("w") as console:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("zerokl")), "ppo", "--config", str(cfg), "--out",
                                 str(out), "--num-rollout-servers", "2"], cwd=REPO, stdout=console,
                                stderr=subprocess.STDOUT, start_new_session=True)
    groups: list[int] = []
    try:
        deadline = time.time() + 600
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.time() < deadline, "no step in time"
            time.sleep(0.5)
        urls = re.search(r"rollout servers ready in \d+ s: (\S+), (\S+) ", log.read_text()).groups()
        groups = [_server_group(u) for u in urls]
        os.killpg(groups[1], signal.SIGKILL)  # the second server dies after step 0
        assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    metrics = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m in metrics:
        assert m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 and m["raw_bitwise_equal_frac"] == 1.0 \
            and m["routing_agreement"] == 1.0 and m["policy_version"] == m["step"], m
    assert f"rollout server {urls[1]} failed" in text, text[-3000:]
    for g in groups:  # the run stopped the server it still had
        with pytest.raises(ProcessLookupError):
            os.killpg(g, 0)


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
        assert remote.servers[0].weights() == {"version": 0, "checksum": checksum}
    after = remote.generate(prompts[:1], n=2, max_tokens=6, seed=11)
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(after, got[:2]))
