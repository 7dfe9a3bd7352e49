"""`zerokl lora push` over several servers: all or nothing (fake servers speaking the routes' JSON).

The live-server path is tested in tests/engines/test_rollout_lora.py; here the rollback rules: a refused load anywhere
unloads the new version everywhere it was taken and leaves the name unchanged; a failed switch switches the
others back; an unreachable server stops the push before any change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lora.adapter import save_adapter
from lora.init import random_adapter
from lora.push import STATE_ROUTE, SWITCH_ROUTE, PushError, Server, push
from parity.config import load_model_config


@dataclass(frozen=True)
class FakeServer(Server):
    """Holds adapters as `zerokl serve --lora-root` does; `refuse` names the routes it answers with an error."""

    root: Path = Path("/")
    config: dict = field(default_factory=dict)
    refuse: frozenset[str] = frozenset()
    held: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)

    def call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        self.calls.append((route, body))
        if route in self.refuse:
            raise PushError(f"{self.url}: {method} {route}: HTTP 500: refused")
        if route == STATE_ROUTE:
            return {"model": "m", "config": self.config, "max_lora_rank": 8, "max_loras": 2,
                    "lora_root": str(self.root), "adapters": json.loads(json.dumps(self.held))}
        if route == "/v1/load_lora_adapter":
            self.held[body["lora_name"]] = {"serves": body["lora_name"], "id": len(self.held) + 1,
                                            "path": body["lora_path"]}
        elif route == "/v1/unload_lora_adapter":
            del self.held[body["lora_name"]]
        elif route == SWITCH_ROUTE:
            self.held[body["name"]] = {**self.held[body["target"]], "serves": body["target"]}
        return "ok"


@pytest.fixture(scope="module")
def setup(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("adapters")
    ckpt = k3_tiny
    cfg = load_model_config(ckpt)
    for seed in (1, 2):
        save_adapter(random_adapter(cfg.text, rank=4, seed=seed), root / f"a{seed}")
    return json.loads((ckpt / "config.json").read_text()), root


def _servers(setup: tuple[dict, Path], refuse: tuple[frozenset[str], ...]) -> list[FakeServer]:
    config, root = setup
    return [FakeServer(f"http://s{i}", root=root, config=config, refuse=r, held={}, calls=[])
            for i, r in enumerate(refuse)]


def test_push_then_replace_switches_every_server(setup: tuple[dict, Path]) -> None:
    servers = _servers(setup, (frozenset(), frozenset()))
    root = setup[1]
    assert push(servers, "policy", root / "a1", log=lambda m: None) == 1
    assert push(servers, "policy", root / "a2", log=lambda m: None) == 2
    for s in servers:
        assert set(s.held) == {"policy", "policy@v2"} and s.held["policy"]["serves"] == "policy@v2"
        assert s.held["policy"]["path"] == str((root / "a2").resolve())


def test_a_refused_load_is_unloaded_everywhere_and_the_name_stays(setup: tuple[dict, Path]) -> None:
    servers = _servers(setup, (frozenset(), frozenset()))
    root = setup[1]
    push(servers, "policy", root / "a1", log=lambda m: None)
    broken = FakeServer(servers[1].url, root=root, config=setup[0], refuse=frozenset({"/v1/load_lora_adapter"}),
                        held=servers[1].held, calls=[])
    with pytest.raises(PushError, match=r"refused; policy@v2 unloaded from the 1 server\(s\) that took it"):
        push([servers[0], broken], "policy", root / "a2", log=lambda m: None)
    for s in (servers[0], broken):
        assert set(s.held) == {"policy", "policy@v1"} and s.held["policy"]["serves"] == "policy@v1"


def test_a_failed_switch_switches_the_others_back(setup: tuple[dict, Path]) -> None:
    servers = _servers(setup, (frozenset(), frozenset()))
    root = setup[1]
    push(servers, "policy", root / "a1", log=lambda m: None)
    broken = FakeServer(servers[1].url, root=root, config=setup[0], refuse=frozenset({SWITCH_ROUTE}),
                        held=servers[1].held, calls=[])
    with pytest.raises(PushError, match="switched policy back on 1 server"):
        push([servers[0], broken], "policy", root / "a2", log=lambda m: None)
    for s in (servers[0], broken):
        assert s.held["policy"]["serves"] == "policy@v1" and "policy@v2" not in s.held


def test_an_unreachable_server_stops_the_push_before_any_change(setup: tuple[dict, Path]) -> None:
    servers = _servers(setup, (frozenset(), frozenset({STATE_ROUTE})))
    with pytest.raises(PushError, match="refused"):
        push(servers, "policy", setup[1] / "a1", log=lambda m: None)
    assert [route for route, _ in servers[0].calls] == [STATE_ROUTE] and not servers[0].held
