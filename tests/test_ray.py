"""`zerokl ppo --ray auto` on a local Ray cluster started here (`ray.init(num_cpus=2)`): one rollout server and the
trainer as Ray actors in one placement group (k3-tiny-mxfp4, `sync: torch_distributed` from the trainer actor into
the server's worker over the node's address); every step's log-probs, raw log-probs and expert choices bitwise the
trainer's; the server, the actors and the placement group are gone when the command returns.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers import PPO_REFERENCE_CONFIG, ppo_config_file
from zerokl.cli import main

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow  # a Ray cluster, a server and a trainer: scheduled first (conftest.py)

STEPS = 2


def test_ppo_on_a_local_ray_cluster(k3_tiny_mxfp4: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = ppo_config_file(tmp_path, PPO_REFERENCE_CONFIG, k3_tiny_mxfp4, steps=STEPS, checkpoint_every=STEPS,
                             sync="torch_distributed")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert main(["ppo", "--config", str(config), "--out", str(tmp_path / "run"), "--ray", "auto"]) == 0
        groups = ray.util.placement_group_table()
        assert groups and all(g["state"] == "REMOVED" for g in groups.values()), groups
    finally:
        ray.shutdown()
    url = re.search(r"rollout servers on Ray: (\S+)", capsys.readouterr().out).group(1)
    with pytest.raises(urllib.error.URLError):  # the server stopped with the run
        urllib.request.urlopen(url + "/health", timeout=5)
    metrics = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m in metrics:
        assert m["kl"] == 0.0 and m["bitwise_equal_frac"] == 1.0 and m["raw_bitwise_equal_frac"] == 1.0 \
            and m["routing_agreement"] == 1.0, m
    assert (tmp_path / "run" / "servers" / "server-0" / "server-0.log").is_file()
