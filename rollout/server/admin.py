"""The rollout-server side of weight sync and versioned generation: an HTTP middleware for vLLM's OpenAI server
(`zerokl serve` always installs it, `--middleware rollout.server.admin.sync_admin`).

`zerokl serve` starts vLLM in its development-server mode, which mounts vLLM's RL routes (`/pause`, `/resume`,
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`, ...) and its
scale-out token-in/token-out route (`/inference/v1/generate`). This middleware:

- passes the RL routes a trainer needs (`SYNC_ROUTES`), behind the server's API key when it has one (vLLM checks the
  key only under /v1, /v2, /inference);
- refuses every other development route (`/collective_rpc` runs any worker method, `/sleep` drops the weights, ...)
  with HTTP 404;
- after a successful `/finish_weight_update`, labels the engine's outputs with the version the workers now hold and
  drops the prefix cache (its latents and states came from the old weights), whatever the client sent;
- refuses, with HTTP 409, a generation request whose `X-ZeroKL-Weight-Version` header names a version the server
  does not hold (a request is never silently served by other weights than the ones its client expects);
- adds `GET /zerokl/weights` (`{"version": N, "checksum": C, "vision_synced": B}`, from the live parameters:
  `rollout.server.worker`; B: the vision tower is among them, `zerokl serve --sync-vision-tower`),
  `POST /zerokl/abort_weight_update`, `POST /zerokl/rollback_weight_update` (a committed update undone: the previous
  weights, their version label, the prefix cache dropped) and `POST /zerokl/confirm_weight_update` (the two phases of
  a sync over several servers: `rollout.client.remote`), `POST /zerokl/records/start` and `POST /zerokl/records
  {"request_ids": [...]}` (the raw log-probs and expert choices of recorded requests).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

VERSION_HEADER = "X-ZeroKL-Weight-Version"
RECORD_MARK = "zerokl-rec-"  # request ids the servers record (`rollout.server.worker`), from here on
WEIGHTS_ROUTE = "/zerokl/weights"
ABORT_ROUTE = "/zerokl/abort_weight_update"
ROLLBACK_ROUTE = "/zerokl/rollback_weight_update"
CONFIRM_ROUTE = "/zerokl/confirm_weight_update"
RECORDS_START_ROUTE = "/zerokl/records/start"
RECORDS_ROUTE = "/zerokl/records"
GENERATE_ROUTE = "/inference/v1/generate"
SYNC_ROUTES = ("/pause", "/resume", "/is_paused", "/init_weight_transfer_engine", "/start_weight_update",
               "/update_weights", "/finish_weight_update", "/update_weight_version", "/weight_info",
               "/get_world_size")
ZEROKL_ROUTES = (WEIGHTS_ROUTE, ABORT_ROUTE, ROLLBACK_ROUTE, CONFIRM_ROUTE, RECORDS_START_ROUTE, RECORDS_ROUTE)
VERSIONED_ROUTES = (GENERATE_ROUTE, "/v1/completions", "/v1/chat/completions")
# every route the development mode mounts, read off vLLM's routers (a route a later vLLM adds is refused too)
_DEV_ROUTERS = ("vllm.entrypoints.rl.online.api_router", "vllm.entrypoints.serve.dev.cache.api_router",
                "vllm.entrypoints.serve.dev.rpc.api_router", "vllm.entrypoints.serve.dev.server_info.api_router",
                "vllm.entrypoints.serve.dev.sleep.api_router")
_dev_paths: frozenset[str] | None = None


def dev_paths() -> frozenset[str]:
    """The paths vLLM's development mode adds to its server."""
    global _dev_paths
    if _dev_paths is None:
        import importlib

        _dev_paths = frozenset(route.path for module in _DEV_ROUTERS
                               for route in importlib.import_module(module).router.routes)
    return _dev_paths


def _error(message: str, status: HTTPStatus) -> JSONResponse:
    """vLLM's error body shape."""
    return JSONResponse({"error": {"message": message, "type": status.phrase, "code": status.value}},
                        status_code=status.value)


def authorized(request: Request) -> bool:
    """The request carries one of the server's API keys (`--api-key` or VLLM_API_KEY), or the server has none."""
    keys = getattr(request.app.state.args, "api_key", None) or os.environ.get("VLLM_API_KEY") or []
    keys = [keys] if isinstance(keys, str) else list(keys)
    return not keys or request.headers.get("authorization", "") in {f"Bearer {k}" for k in keys}


def served_version(label: str | None) -> int:
    """The weight version of an engine's label (vLLM labels weights it was never told about "default": the
    checkpoint's, version 0)."""
    return 0 if label in (None, "", "default") else int(label)


async def _workers_weights(request: Request) -> dict[str, Any]:
    """The workers' `zerokl_weights`; every worker of a server holds the same version and bits."""
    found = await request.app.state.engine_client.collective_rpc("zerokl_weights")
    if any(w != found[0] for w in found):
        raise RuntimeError(f"the server's workers disagree on their weights: {found}")
    return found[0]


async def _after_finish(request: Request) -> None:
    engine = request.app.state.engine_client
    held = await _workers_weights(request)
    await engine.update_weight_version(str(held["version"]))
    await engine.reset_prefix_cache()


async def _records(request: Request) -> Response:
    try:
        body = await request.json()
        ids = [str(i) for i in body["request_ids"]]
    except (ValueError, KeyError, TypeError):
        return _error('expected JSON {"request_ids": [...]}', HTTPStatus.BAD_REQUEST)
    found: dict[str, Any] = {}
    for worker in await request.app.state.engine_client.collective_rpc("zerokl_records_take", args=(ids,)):
        found.update(worker)
    return JSONResponse({"records": found})


async def sync_admin(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """The middleware (`--middleware rollout.server.admin.sync_admin`)."""
    path = request.url.path.rstrip("/") or "/"
    engine = request.app.state.engine_client
    if path in VERSIONED_ROUTES and VERSION_HEADER.lower() in request.headers and authorized(request):
        expected = request.headers[VERSION_HEADER]
        held = served_version(await engine.get_weight_version())
        if expected != str(held):
            return _error(f"this server holds weight version {held}, the request expects {expected}",
                          HTTPStatus.CONFLICT)
        return await call_next(request)
    if path in ZEROKL_ROUTES or path in SYNC_ROUTES:
        if not authorized(request):
            return _error("missing or wrong API key", HTTPStatus.UNAUTHORIZED)
    elif path in dev_paths():
        return _error(f"no route {request.method} {path} on this server (a vLLM development route that zerokl "
                      f"serve does not open; weight updates use {', '.join(SYNC_ROUTES)})", HTTPStatus.NOT_FOUND)
    else:
        return await call_next(request)
    if path in SYNC_ROUTES:
        response = await call_next(request)
        if path == "/finish_weight_update" and response.status_code == HTTPStatus.OK:
            await _after_finish(request)
        return response
    if request.method != "POST" and path != WEIGHTS_ROUTE or request.method != "GET" and path == WEIGHTS_ROUTE:
        return _error(f"no route {request.method} {path}", HTTPStatus.METHOD_NOT_ALLOWED)
    if path == WEIGHTS_ROUTE:
        return JSONResponse(await _workers_weights(request))
    if path == ABORT_ROUTE:
        await engine.collective_rpc("zerokl_abort_weight_update")
        return JSONResponse({"message": "weight update aborted"})
    if path == ROLLBACK_ROUTE:  # the previous weights back: label the outputs with their version, drop the cache
        await engine.collective_rpc("zerokl_rollback_weight_update")
        await _after_finish(request)
        return JSONResponse({"message": "weight update rolled back"})
    if path == CONFIRM_ROUTE:
        await engine.collective_rpc("zerokl_confirm_weight_update")
        return JSONResponse({"message": "weight update confirmed"})
    if path == RECORDS_START_ROUTE:
        await engine.collective_rpc("zerokl_records_start")
        return JSONResponse({"message": "recording"})
    return await _records(request)
