"""`zerokl ppo --ray auto|ADDRESS`: the run on a Ray cluster, as verl, OpenRLHF and NeMo-RL place theirs.

One placement group holds a bundle per rollout server (`num_rollout_servers`, 1 unless set) and per trainer rank
(`--nproc-per-node`), each one CPU (plus one GPU where the cluster has GPUs: trainer and rollout then on separate
GPUs); `PACK` puts them on as few nodes as fit. Each rollout server is a `RolloutServerActor` that runs `zerokl serve`
on its node (all interfaces, a free port) and stops it with itself; each trainer rank is a `TrainerActor` that runs
the ordinary `zerokl ppo` loop against the servers' URLs (`rollout_servers`), ranks meeting over torch.distributed at
rank 0's node. Rollouts, the zero-KL check and the weight sync (`sync: torch_distributed` reaches servers on any node)
are those of `rollout.client.remote`. Every node must see the checkpoint and the run directory at the same paths (a shared
filesystem). The servers, the actors and the placement group are removed however the run ends. On a cluster of one
node (a laptop, a test, CI) every connection stays on the loopback: servers listen on and are announced as 127.0.0.1,
the trainer ranks meet there; on several nodes they listen on every interface and are announced by node address.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from parity.config import ConfigError
from zerokl.ppo.config import PPOConfig

if TYPE_CHECKING:
    from rollout.server.serve import LoraServing

READY_TIMEOUT_S = 300.0  # for the placement group's resources


class RolloutServerActor:
    """A `zerokl serve` server on this actor's node, for as long as the actor lives."""

    def __init__(self, checkpoint: str, kernels: str, engine_args: dict[str, Any], log_dir: str,
                 lora: LoraServing | None, vision_synced: bool, local: bool):
        import ray

        from rollout.client.local_servers import LocalServers

        self.servers = LocalServers(checkpoint, 1, Path(log_dir), kernels, engine_args,
                                    host="127.0.0.1" if local else "0.0.0.0", lora=lora, vision_synced=vision_synced)
        self.address = self.servers.urls[0] if local else \
            self.servers.urls[0].replace("127.0.0.1", ray.util.get_node_ip_address())

    def url(self) -> str:
        return self.address

    def stop(self) -> None:
        self.servers.stop()


class TrainerActor:
    """One trainer rank: `zerokl ppo`'s loop in this actor's process."""

    def rendezvous(self, local: bool) -> tuple[str, int]:
        """This node's address (the loopback on a one-node cluster) and the port of the rendezvous store this actor
        now hosts (rank 0's: where the ranks meet; bound here, so no other process can take it in between)."""
        import ray

        from parity.sync.group import host_store

        host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        self.store = host_store("127.0.0.1" if local else "0.0.0.0")
        return host, int(self.store.port)

    def run(self, train: Callable[[PPOConfig, Path, str | None], int], cfg: PPOConfig, out: str, resume: str | None,
            env: dict[str, str]) -> int:
        """`train(cfg, out, resume)` (`zerokl.ppo.cli.train`, sent by reference) with this rank's environment."""
        os.environ.update(env)
        return train(cfg, Path(out), resume)


def run_on_ray(cfg: PPOConfig, out: Path, resume: str | None, address: str, ranks: int,
               train: Callable[[PPOConfig, Path, str | None], int]) -> int:
    """The run on the cluster at `address` ("auto": the one this machine belongs to; a Ray session already started
    in this process is used as it is), each trainer rank running `train`; rank 0's exit code."""
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'zerokl[ray]'") from None
    from parity.sync.group import AGENT_STORE_ENV
    from zerokl.ppo.setup import base_checkpoint, server_lora
    from zerokl.ppo.rollouts import engine_args_for

    if cfg.rollout_servers:
        raise ConfigError("--ray starts its own rollout servers (--num-rollout-servers N); drop rollout_servers")
    servers = cfg.num_rollout_servers
    if not ray.is_initialized():
        try:
            ray.init(address=address)
        except ConnectionError as e:
            raise ConfigError(f"--ray {address}: no Ray cluster answers ({e}); start one (`ray start --head`) or give "
                              "its address") from None
    local = len([n for n in ray.nodes() if n["Alive"]]) == 1  # every actor on this one node: loopback only
    gpus = ray.cluster_resources().get("GPU", 0) > 0
    unit = {"CPU": 1.0, **({"GPU": 1.0} if gpus else {})}
    checkpoint = base_checkpoint(cfg, out)
    lora = server_lora(cfg, checkpoint, resume, out / "served-adapters")
    group = placement_group([unit] * (servers + ranks), strategy="PACK")
    rollout: list[Any] = []
    trainers: list[Any] = []
    try:
        if not group.wait(READY_TIMEOUT_S):
            raise ConfigError(f"the Ray cluster cannot hold {servers} rollout server(s) and {ranks} trainer rank(s) "
                              f"({unit} each) within {READY_TIMEOUT_S:.0f} s; it has {ray.cluster_resources()}")

        def place(cls: type, index: int, **kw: Any) -> Any:
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
            return ray.remote(cls).options(scheduling_strategy=strategy, num_cpus=unit["CPU"],
                                           num_gpus=unit.get("GPU", 0)).remote(**kw)

        rollout += [place(RolloutServerActor, k, checkpoint=str(checkpoint), kernels=cfg.kernels,
                          engine_args=engine_args_for(cfg), log_dir=str(out / "servers" / f"server-{k}"), lora=lora,
                          vision_synced=cfg.vision_tower == "trainable", local=local)
                    for k in range(servers)]
        urls = ray.get([a.url.remote() for a in rollout])
        print(f"rollout servers on Ray: {', '.join(urls)}", flush=True)
        trainers += [place(TrainerActor, servers + r) for r in range(ranks)]
        env: dict[str, str] = {}
        if ranks > 1:
            host, port = ray.get(trainers[0].rendezvous.remote(local))
            env = {"WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": host,
                   "MASTER_PORT": str(port), **AGENT_STORE_ENV}
        run = replace(cfg, rollout_servers=list(urls), num_rollout_servers=0)
        ranked = [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} if ranks > 1 else {} for r in range(ranks)]
        codes = ray.get([t.run.remote(train, run, str(out), resume, e) for t, e in zip(trainers, ranked)])
        return codes[0] if codes[0] else next((c for c in codes if c), 0)
    finally:
        for actor in rollout:
            try:
                ray.get(actor.stop.remote(), timeout=60)
            except ray.exceptions.RayError:  # the actor died, and its server with it
                pass
        for actor in (*rollout, *trainers):
            ray.kill(actor)
        remove_placement_group(group)
