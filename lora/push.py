"""`zerokl lora push / list`: hot-swap PEFT adapters into running `zerokl serve --lora-root` servers.

push, all-or-nothing over every server:
1. ask each server what it serves (`GET /zerokl/v1/lora`, see `rollout.server.lora`); an unreachable server
   stops the push before anything changes;
2. validate the adapter against each served model (`lora.adapter.load_adapter`: safetensors only, target
   modules, shapes, finite values) and its `max_lora_rank`, and check it lies in the server's adapter directory;
3. load it on every server under the next free version name `NAME@vK` (vLLM's `/v1/load_lora_adapter`, where
   the worker validates it again); if any server refuses, unload it from the servers that took it;
4. switch `NAME` to `NAME@vK` on every server; if a switch fails, switch the others back;
5. unload the previous version. Requests for `NAME` are served by the old or the new version, never neither.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora.adapter import load_adapter
from lora.spec import AdapterError
from parity.config import parse_model_config

STATE_ROUTE = "/zerokl/v1/lora"  # rollout.server.lora serves these two routes
SWITCH_ROUTE = "/zerokl/v1/lora/switch"
LOAD_ROUTE = "/v1/load_lora_adapter"  # vLLM's runtime LoRA routes
UNLOAD_ROUTE = "/v1/unload_lora_adapter"
VERSION_SEP = "@v"  # `name@v3`: version 3 of adapter `name` (servers and the engine's policy adapter)


class PushError(RuntimeError):
    """A push or list that did not complete; the message names the server and its reason, and what was
    rolled back."""


@dataclass(frozen=True)
class Server:
    url: str
    api_key: str | None = None

    def call(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """One HTTP call; returns the decoded JSON (or text); raises PushError with the server's message."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url.rstrip("/") + route, data, headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as e:
            raise PushError(f"{self.url}: {method} {route}: HTTP {e.code}: {error_message(e.read().decode())}") from None
        except (urllib.error.URLError, OSError) as e:
            raise PushError(f"{self.url}: unreachable ({getattr(e, 'reason', e)})") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text


def error_message(text: str) -> str:
    """The server's own message in an error answer's body (vLLM's and zerokl's error bodies), else the text."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()
    err = body.get("error", body) if isinstance(body, dict) else body
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


def versions(state: dict[str, Any], name: str) -> dict[int, str]:
    """Loaded versions of adapter `name` on one server: version -> loaded name."""
    out = {}
    for loaded in state["adapters"]:
        base, sep, version = loaded.rpartition(VERSION_SEP)
        if sep and base == name and version.isdigit():
            out[int(version)] = loaded
    return out


def check_adapter(adapter: Path, server: Server, state: dict[str, Any]) -> None:
    """Validate `adapter` against what `server` serves (raises AdapterError naming the problem)."""
    cfg = parse_model_config(state["config"])
    spec = load_adapter(adapter, cfg.text).spec
    ranks = [spec.r, *spec.rank_pattern.values()] if spec.rank_pattern else [spec.r]
    if max(ranks) > state["max_lora_rank"]:
        raise AdapterError(f"{server.url}: adapter rank {max(ranks)} exceeds the server's max_lora_rank "
                           f"{state['max_lora_rank']}")
    root = Path(state["lora_root"])
    if root not in adapter.resolve().parents:
        raise AdapterError(f"{server.url}: {adapter.resolve()} is outside the server's adapter directory {root}")


def push(servers: Sequence[Server], name: str, adapter: str | Path,
         log: Callable[[str], None] = print) -> int:
    """Push `adapter` as `name` to every server, atomically (see the module doc); returns the new version."""
    if not name or VERSION_SEP in name:
        raise AdapterError(f"--name {name!r}: give a non-empty name without {VERSION_SEP!r}")
    path = Path(adapter).resolve()
    states = [s.call("GET", STATE_ROUTE) for s in servers]
    for server, state in zip(servers, states):
        check_adapter(path, server, state)
    log(f"validated {path} against {len(servers)} server(s)")
    version = 1 + max((max(versions(st, name), default=0) for st in states), default=0)
    loaded_name = f"{name}{VERSION_SEP}{version}"
    previous = [st["adapters"].get(name, {}).get("serves") for st in states]
    done: list[Server] = []
    try:
        for server in servers:
            server.call("POST", LOAD_ROUTE, {"lora_name": loaded_name, "lora_path": str(path)})
            done.append(server)
            log(f"{server.url}: loaded {loaded_name}")
    except PushError as e:
        _unload(done, loaded_name, log)
        raise PushError(f"{e}; {loaded_name} unloaded from the {len(done)} server(s) that took it, "
                        f"{name} unchanged everywhere") from None
    switched: list[tuple[Server, str | None]] = []
    try:
        for server, old in zip(servers, previous):
            server.call("POST", SWITCH_ROUTE, {"name": name, "target": loaded_name})
            switched.append((server, old))
    except PushError as e:
        for server, old in switched:
            if old is not None:
                try:
                    server.call("POST", SWITCH_ROUTE, {"name": name, "target": old})
                except PushError as back:
                    log(f"warning: could not switch {name} back: {back}")
        _unload(done, loaded_name, log)
        raise PushError(f"{e}; switched {name} back on {len(switched)} server(s)") from None
    log(f"{name} -> {loaded_name} on {len(servers)} server(s)")
    for server, old in zip(servers, previous):
        if old is not None and old != loaded_name:
            _unload([server], old, log)
    return version


def _unload(servers: Sequence[Server], loaded_name: str, log: Callable[[str], None]) -> None:
    for server in servers:
        try:
            server.call("POST", UNLOAD_ROUTE, {"lora_name": loaded_name})
            log(f"{server.url}: unloaded {loaded_name}")
        except PushError as e:
            log(f"warning: {e}")


def list_servers(servers: Sequence[Server]) -> list[tuple[Server, dict[str, Any]]]:
    """(server, state) for each server; raises PushError on the first unreachable one."""
    return [(s, s.call("GET", STATE_ROUTE)) for s in servers]


def format_listing(listing: list[tuple[Server, dict[str, Any]]]) -> str:
    lines = []
    for server, state in listing:
        lines.append(f"{server.url}  model {state['model']}  max_loras {state['max_loras']}  "
                     f"max_lora_rank {state['max_lora_rank']}  adapter dir {state['lora_root']}")
        adapters = state["adapters"]
        if not adapters:
            lines.append("  (no adapters)")
        for name, info in sorted(adapters.items()):
            target = f" -> {info['serves']}" if info["serves"] != name else ""
            lines.append(f"  {name}{target}  id {info['id']}  {info['path']}")
    return "\n".join(lines)
