"""One `zerokl serve` server as a client sees it (`Server`: JSON calls, `ServerDown` for an unreachable server or a
5xx answer), and the collection of the servers' answers to calls made on all of them at once.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lora.push import error_message
from parity.sync.bundle import SyncError
from rollout.sampling import root_message
from rollout.server.admin import WEIGHTS_ROUTE


class ServerDown(RuntimeError):
    """A server that cannot be reached or answers with a server error."""


@dataclass
class Server:
    """One `zerokl serve` server at `url` (scheme://host:port)."""

    url: str
    api_key: str | None = None
    timeout_s: float = 600.0
    workers: int = 1  # vLLM worker processes (each joins a sync group)

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Any:
        """The JSON answer; HTTPError for a 4xx answer, ServerDown when unreachable or on a 5xx answer."""
        data = None if body is None else json.dumps(body).encode()
        head = {"Content-Type": "application/json", **(headers or {})}
        if self.api_key:
            head["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url.rstrip("/") + path, data, head, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            if e.code >= 500:
                raise ServerDown(f"{self.url}{path}: HTTP {e.code}: {root_message(message(e))}") from None
            raise
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            raise ServerDown(f"{self.url}: {getattr(e, 'reason', e)}") from None

    def weights(self) -> dict[str, Any]:
        return self.call("GET", WEIGHTS_ROUTE)


def message(error: urllib.error.HTTPError) -> str:
    """The server's own message in an error answer (`lora.push.error_message` of its body), else the HTTP reason."""
    try:
        return error_message(error.read().decode(errors="replace")) or str(error.reason)
    except OSError:
        return str(error.reason)


def catching(fn: Callable[[Any], Any]) -> Callable[[Any], tuple[Any, BaseException | None]]:
    def wrapped(arg: Any) -> tuple[Any, BaseException | None]:
        try:
            return fn(arg), None
        except Exception as e:  # returned to the caller, which decides per kind
            return None, e
    return wrapped


def errors(futures: list) -> list[str]:
    out = []
    for f in futures:
        try:
            f.result()
        except urllib.error.HTTPError as e:
            out.append(f"{e.url}: HTTP {e.code}: {message(e)}")
        except Exception as e:  # a server's failure, reported in the sync's error
            out.append(str(e))
    return out


def results(futures: list, what: str) -> None:
    failed = errors(futures)
    if failed:
        raise SyncError(f"rollout servers could not {what}: {failed[0]}")


def each(servers: list[Server], call: Callable[[Server], Any], strict: bool = True) -> None:
    """`call` on every server at once; with `strict`, SyncError naming the first failure."""
    with ThreadPoolExecutor(len(servers)) as pool:
        failed = errors([pool.submit(call, s) for s in servers])
    if failed and strict:
        raise SyncError(failed[0])
