"""`zerokl ppo --ray auto --num-rollout-servers 2` on a local Ray cluster started here (`ray.init(num_cpus=3)`): two
rollout servers and the trainer as Ray actors in one placement group (k3-tiny-mxfp4, `sync: torch_distributed`: the
trainer actor broadcasts over the node's address into both servers' workers every step). One server is killed after
step 0 and the run goes on with the other, its prompts retried there; the prompts carry pictures (task `squares`, sent
to the servers as PNG content parts) and the vision tower trains (`vision_tower: trainable`: the servers are started
to take its syncs); every step's log-probs, raw log-probs and expert choices are bitwise the trainer's; the servers,
the actors and the placement group are gone when the command returns.
(`--num-rollout-servers` without Ray: tests/engines/test_rollout_servers.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from helpers import PPO_REFERENCE_CONFIG, ppo_config_file
from parity.io.checkpoint import load_checkpoint

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # a Ray cluster, two servers and a trainer: scheduled first

REPO = Path(__file__).resolve().parents[2]
STEPS = 2  # the second server dies after step 0: step 1 runs on the first alone


def server_group(url: str, out: Path) -> int | None:
    """The process group of the server listening at `url`, read from the server's own log under `out`: its
    non-default args name its port and its log lines its API process's pid, which leads the group (the host's
    process table is not relied on: a sandboxed host need not list a process's sockets or command line)."""
    port = int(url.rsplit(":", 1)[1])
    for path in sorted((out / "servers").glob("*/*.log")):
        text = path.read_text(errors="replace")
        pid = re.search(r"\(APIServer pid=(\d+)\)", text)
        if pid and f"'port': {port}," in text:
            return os.getpgid(int(pid.group(1)))
    return None


def alive(group: int) -> list[int]:
    """The processes of `group` still running (zombies, which nothing here reaps, do not count)."""
    out = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.pid) == group and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except ProcessLookupError:
            pass
    return out


def test_ppo_on_a_local_ray_cluster_survives_losing_a_server(k3_tiny_mxfp4: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    config = ppo_config_file(tmp_path, PPO_REFERENCE_CONFIG, k3_tiny_mxfp4, steps=STEPS, checkpoint_every=STEPS,
                             sync="torch_distributed", task="squares", task_args="{max_count: 4}",
                             vision_tower="trainable")
    out, log = tmp_path / "run", tmp_path / "console.log"
    # Ray's memory monitor kills a worker when the whole host passes 95% of its memory, which the suite's other
    # worker (its own engines and servers) can push it to on a 24 GiB machine: off for this cluster
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)  # one node: the run keeps to the loopback
    groups: list[int | None] = []
    try:
        with log.open("w") as console:
            proc = subprocess.Popen([str(Path(sys.executable).with_name("zerokl")), "ppo", "--config", str(config),
                                     "--out", str(out), "--ray", "auto", "--num-rollout-servers", "2"], cwd=REPO,
                                    stdout=console, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 600
            while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
                assert proc.poll() is None, log.read_text()[-4000:]
                assert time.time() < deadline, "no step in 600 s: " + log.read_text()[-4000:]
                time.sleep(0.5)
            urls = re.search(r"rollout servers on Ray: (\S+), (\S+)", log.read_text()).groups()
            assert all(u.startswith("http://127.0.0.1:") for u in urls), urls  # one node: loopback only
            groups = [server_group(u, out) for u in urls]
            assert None not in groups, (urls, groups, log.read_text()[-4000:])
            os.killpg(groups[1], signal.SIGKILL)  # the second server dies after step 0
            assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        placement = ray.util.placement_group_table()
        assert placement and all(g["state"] == "REMOVED" for g in placement.values()), placement
    finally:
        ray.shutdown()
    assert not [alive(g) for g in groups if alive(g)]  # the run stopped the server it still had
    text = log.read_text()
    assert f"rollout server {urls[1]} failed" in text, text[-3000:]
    metrics = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m in metrics:
        assert m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 and m["raw_bitwise_equal_frac"] == 1.0 \
            and m["routing_agreement"] == 1.0 and m["policy_version"] == m["step"], m
    trained = torch.load(out / "checkpoints" / f"step-{STEPS}" / "weights.pt")
    base = load_checkpoint(k3_tiny_mxfp4)[1]
    tower = [n for n in base if n.startswith(("vision_tower.", "mm_projector."))]
    assert tower and all(not torch.equal(trained[n].to(base[n].dtype), base[n]) for n in tower)
