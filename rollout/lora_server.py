"""Server side of `zerokl lora push / list`: an HTTP middleware for vLLM's OpenAI server.

`zerokl serve --lora-root DIR` starts vLLM with runtime LoRA updating (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`) and this middleware (vLLM's `--middleware`), which adds:

- the allowed directory: a load whose `lora_path` does not resolve (symlinks and `..` followed) to a path
  inside DIR is refused with HTTP 400 before vLLM sees it;
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

from lora.push import LOAD_ROUTE, STATE_ROUTE, SWITCH_ROUTE, VERSION_SEP

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


def _api_keys(request: Request) -> list[str]:
    keys = getattr(request.app.state.args, "api_key", None) or os.environ.get("VLLM_API_KEY") or []
    return [keys] if isinstance(keys, str) else list(keys)


def _authorized(request: Request) -> bool:
    keys = _api_keys(request)
    return not keys or request.headers.get("authorization", "") in {f"Bearer {k}" for k in keys}


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


async def lora_admin(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """The middleware (`--middleware rollout.lora_server.lora_admin`)."""
    path = request.url.path
    if path == LOAD_ROUTE and request.method == "POST":
        try:
            body = await request.json()
        except ValueError:
            return _error("request body is not JSON", HTTPStatus.BAD_REQUEST)
        problem = outside_root(body.get("lora_path") if isinstance(body, dict) else None, lora_root())
        if problem:
            return _error(problem, HTTPStatus.BAD_REQUEST)
        return await call_next(request)
    if not path.startswith("/zerokl/"):
        return await call_next(request)
    if not _authorized(request):
        return _error("missing or wrong API key", HTTPStatus.UNAUTHORIZED)
    if path == STATE_ROUTE and request.method == "GET":
        return JSONResponse(server_state(request, lora_root()))
    if path == SWITCH_ROUTE and request.method == "POST":
        return await _switch(request)
    return _error(f"no route {request.method} {path}", HTTPStatus.NOT_FOUND)
