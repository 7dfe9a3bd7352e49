"""Server side of `zerokl lora push / list`: an HTTP middleware for vLLM's OpenAI server.

`zerokl serve --lora-root DIR` starts vLLM with runtime LoRA updating (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`) and this middleware (vLLM's `--middleware`), which adds:

- the allowed directory: a load whose `lora_path` does not resolve (symlinks and `..` followed) to a path
  inside DIR is refused with HTTP 400 before vLLM sees it;
- an unload of an adapter that a switched name still serves is refused with HTTP 409 (push another version first);
- every route of the server is classified (`ROUTES`): vLLM's routes that take an adapter only as the `model` of a
  request, resolved through vLLM's name table, pass; the two runtime LoRA routes pass the checks above; the
  SageMaker routes (`/adapters` loads from any path and unloads, `/invocations` selects an adapter by header) and
  any route this table does not know (one a later vLLM adds) are refused with HTTP 404; the weight-sync routes pass
  to `rollout.server.admin`'s checks (its middleware is outside this one: it sees every request first and refuses
  vLLM's other development routes);
- `GET /zerokl/v1/lora`: what a client needs to validate an adapter before sending it (the served
  checkpoint's config.json, `max_lora_rank`, `max_loras`, the allowed directory) and what the server holds
  (every adapter name -> the adapter it serves, its id and path);
- `POST /zerokl/v1/lora/switch {"name": N, "target": T}`: make requests for model `N` use the loaded adapter
  `T` (one dict assignment under vLLM's per-name lock, so a request resolves to the old or the new adapter,
  never to neither). `zerokl lora push` loads versions under `N@vK` and switches `N` between them.

The `/zerokl/` routes require the server's API key when it has one (vLLM's own key check runs inside this
middleware, so it does not cover them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rollout.server import admin
from lora.push import LOAD_ROUTE, STATE_ROUTE, SWITCH_ROUTE, UNLOAD_ROUTE, VERSION_SEP

LORA_ROOT_ENV = "ZEROKL_LORA_ROOT"


def _error(message: str, status: HTTPStatus) -> JSONResponse:
    """vLLM's error body shape."""
    return JSONResponse({"error": {"message": message, "type": status.phrase, "code": status.value}},
                        status_code=status.value)


def lora_root() -> Path:
    """The allowed adapter directory (resolved), from the environment `zerokl serve` sets."""
    root = os.environ.get(LORA_ROOT_ENV)
    if not root:
        raise RuntimeError(f"{LORA_ROOT_ENV} is not set: start the server with `zerokl serve --lora-root DIR`")
    return Path(root).resolve()


def outside_root(path: str | None, root: Path) -> str | None:
    """Why `path` may not be loaded (None when it resolves inside `root`)."""
    if not path:
        return "lora_path is required"
    resolved = Path(path).expanduser().resolve()
    if resolved != root and root not in resolved.parents:
        return f"lora_path {path} resolves to {resolved}, outside this server's adapter directory {root}"
    return None


def served_as(request: Request, name: object) -> list[str]:
    """The other names (`switch`) whose requests adapter `name` serves."""
    models = request.app.state.openai_serving_models
    return sorted(alias for alias, req in models.lora_requests.items() if alias != name and req.lora_name == name)


def server_state(request: Request, root: Path) -> dict[str, Any]:
    """The JSON of `GET /zerokl/v1/lora`."""
    models = request.app.state.openai_serving_models
    lora_config = request.app.state.vllm_config.lora_config
    checkpoint = Path(models.base_model_paths[0].model_path)
    return {
        "model": models.base_model_paths[0].name,
        "config": json.loads((checkpoint / "config.json").read_text()),
        "max_lora_rank": lora_config.max_lora_rank,
        "max_loras": lora_config.max_loras,
        "lora_root": str(root),
        "adapters": {name: {"serves": req.lora_name, "id": req.lora_int_id, "path": req.lora_path}
                     for name, req in models.lora_requests.items()},
    }


async def _switch(request: Request) -> Response:
    try:
        body = await request.json()
        name, target = str(body["name"]), str(body["target"])
    except (ValueError, KeyError, TypeError):
        return _error('expected JSON {"name": ..., "target": ...}', HTTPStatus.BAD_REQUEST)
    models = request.app.state.openai_serving_models
    if VERSION_SEP in name:
        return _error(f"{name!r}: a switched name may not contain {VERSION_SEP!r}", HTTPStatus.BAD_REQUEST)
    if models.is_base_model(name):
        return _error(f"{name!r} is the served base model's name", HTTPStatus.BAD_REQUEST)
    async with models.lora_resolver_lock[name]:
        if target not in models.lora_requests:
            return _error(f"adapter {target!r} is not loaded", HTTPStatus.NOT_FOUND)
        models.lora_requests[name] = models.lora_requests[target]
    return JSONResponse({"name": name, "serves": target})


# Every route of vLLM 0.32's OpenAI server started by `zerokl serve --lora-root` (its /openapi.json, plus FastAPI's
# documentation pages), by what it can do with an adapter. `{x}` stands for one path segment.
PASS_ROUTES = (  # no adapter, or one named as the request's `model` (vLLM's name table, which `switch` sets)
    "/health", "/load", "/version", "/metrics", "/kv_event_sources", "/ping", "/v1/models", "/tokenize",
    "/detokenize", "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses",
    "/v1/responses/{x}", "/v1/responses/{x}/cancel", "/v1/messages", "/v1/messages/count_tokens",
    "/generative_scoring", "/v1/systemone", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json",
    # the token-in/token-out routes (render a request to ids and back, abort a request by id)
    "/v1/completions/render", "/v1/chat/completions/render", "/v1/messages/render", "/v1/completions/derender",
    "/v1/chat/completions/derender", "/inference/v1/abort_requests",
)
CHECKED_ROUTES = (LOAD_ROUTE, UNLOAD_ROUTE, STATE_ROUTE, SWITCH_ROUTE)  # this middleware's checks
SYNC_ROUTES = (*admin.SYNC_ROUTES, *admin.ZEROKL_ROUTES, admin.GENERATE_ROUTE)  # its checks
REFUSED_ROUTES = (  # load from any path, unload or select an adapter past the checks, or change the engine
    "/adapters", "/adapters/{x}", "/invocations", "/scale_elastic_ep", "/is_scaling_elastic_ep",
)


def route_of(path: str) -> str | None:
    """The table entry (`PASS_ROUTES`, `SYNC_ROUTES`, `CHECKED_ROUTES`, `REFUSED_ROUTES`) that `path` is, or None; vLLM's
    development routes but the sync ones are refused (by `rollout.server.admin`, before this middleware sees them)."""
    if path in admin.dev_paths() and path not in SYNC_ROUTES:
        return path
    parts = path.rstrip("/").split("/") if path != "/" else [""]
    for route in (*PASS_ROUTES, *SYNC_ROUTES, *CHECKED_ROUTES, *REFUSED_ROUTES):
        pattern = route.split("/")
        if len(pattern) == len(parts) and all(p == "{x}" or p == q for p, q in zip(pattern, parts)):
            return route
    return None


async def _json_body(request: Request) -> dict | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


async def lora_admin(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """The middleware (`--middleware rollout.server.lora.lora_admin`)."""
    path = request.url.path
    route = route_of(path)
    if route is None or route in REFUSED_ROUTES or route in admin.dev_paths() and route not in SYNC_ROUTES:
        why = "it can load, unload or select an adapter past --lora-root" if route else "zerokl serve does not know it"
        return _error(f"no route {request.method} {path} on this server ({why}); adapters load through "
                      f"{LOAD_ROUTE} from inside the adapter directory", HTTPStatus.NOT_FOUND)
    if route in PASS_ROUTES or route in SYNC_ROUTES:
        return await call_next(request)
    if route in (LOAD_ROUTE, UNLOAD_ROUTE) and request.method == "POST":
        body = await _json_body(request)
        if body is None:
            return _error("request body is not a JSON object", HTTPStatus.BAD_REQUEST)
        if route == LOAD_ROUTE:
            problem = outside_root(body.get("lora_path"), lora_root())
            if problem:
                return _error(problem, HTTPStatus.BAD_REQUEST)
        else:
            users = served_as(request, body.get("lora_name"))
            if users:
                return _error(f"adapter {body.get('lora_name')!r} is served as {', '.join(map(repr, users))}; "
                              "switch those names to another version first (zerokl lora push does)",
                              HTTPStatus.CONFLICT)
        return await call_next(request)
    if not admin.authorized(request):
        return _error("missing or wrong API key", HTTPStatus.UNAUTHORIZED)
    if path == STATE_ROUTE and request.method == "GET":
        return JSONResponse(server_state(request, lora_root()))
    if path == SWITCH_ROUTE and request.method == "POST":
        return await _switch(request)
    return _error(f"no route {request.method} {path}", HTTPStatus.NOT_FOUND)
