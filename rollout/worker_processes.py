"""vLLM's worker processes for the engines this process builds, forked from one server process that imported vLLM,
zerokl's plugin and model once (multiprocessing's forkserver), where vLLM would spawn each one fresh.

On CPU vLLM always spawns its workers (`vllm/platforms/cpu.py` sets `VLLM_WORKER_MULTIPROC_METHOD=spawn`), and a
spawned worker imports vLLM again: about 10 s of CPU for every engine. Forked from the server, the second engine of a
process starts in 3.3 s instead of 10.8 s (k3-micro, 2-core CPU); the first pays the server's imports once. A worker
still runs with the environment its engine's builder has when it starts the worker (carried with the process object
and installed before vLLM's entry point runs), not the server's; only what a module reads when it is imported (OpenMP
reads `OMP_NUM_THREADS` when it loads) is the server's, and vLLM's CPU worker sets its threads and their cores itself.
The forkserver is shared with every other user of it in this process (`zerokl.ppo.environments`): whichever starts it
first names what it imports; each works with the other's. The patch covers `get_mp_context` as
`vllm/v1/executor/multiproc_executor.py` of vLLM 0.32.0 imports it (the workers' context,
`MultiprocExecutor._init_executor` and `WorkerProc.make_worker_process`), on CPU only.
"""

from __future__ import annotations

import os
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

from parity.patching import install

PRELOAD = ["vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker", "rollout.vllm.plugin",
           "rollout.vllm.model", "rollout.server.worker"]
_MARK = "zerokl: vLLM workers forked from a preloaded server"


class _WorkerProcess(ForkServerProcess):
    """A forkserver process that runs with its starter's environment at `start()`."""

    def start(self) -> None:
        self._environ = dict(os.environ)
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


class _WorkerContext(ForkServerContext):
    Process = _WorkerProcess


_CONTEXT = _WorkerContext()


def _forked_when_spawned(get_mp_context: Any) -> Any:
    def get_context() -> Any:
        context = get_mp_context()  # vLLM's own checks and choice (spawn on CPU)
        if context.get_start_method() != "spawn":
            return context
        _CONTEXT.set_forkserver_preload(PRELOAD)  # what the server imports, if this starts it
        return _CONTEXT

    return get_context


def install_on_cpu() -> None:
    """Fork vLLM's workers from the preloaded server when vLLM runs on the CPU (idempotent). The caller has checked
    vLLM's version (`rollout.vllm.compat.check_version`)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        install("vllm.v1.executor.multiproc_executor:get_mp_context", _forked_when_spawned, _MARK)
