"""Run one `zerokl` command on N local processes with torchrun's environment (`zerokl ppo --nproc-per-node N`).

Rank r runs `python -m zerokl.cli ARGV` with RANK = LOCAL_RANK = r, WORLD_SIZE = LOCAL_WORLD_SIZE = N, MASTER_ADDR =
127.0.0.1, MASTER_PORT = the port of a rendezvous store this process hosts (bound before any rank starts, so no other
process can take it; every rank joins it as a client, as under torchrun's agent), and OMP_NUM_THREADS = cores / N
unless it is set (the parity kernels' bits do not depend on the thread count). The processes share this one's terminal
and process group.

Invariant: the exit code is rank 0's when it fails, else the first failing rank's, else 0; once a rank has failed the
others get a second to stop and are then killed, so none is left waiting in a collective. (torchrun would report any
failure as 1; zerokl's codes, 0 parity held, 1 parity broken, 2 user error, are kept.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence

from parity.sync.group import AGENT_STORE_ENV, host_store

POLL_S = 0.2


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """This process's environment plus what `torch.distributed`'s env:// rendezvous reads."""
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // world))
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": threads, **AGENT_STORE_ENV}


def launch(argv: Sequence[str], nproc: int) -> int:
    """Run `zerokl ARGV` on `nproc` ranks and wait for them (see the module docstring for the exit code)."""
    return run_ranks([sys.executable, "-m", "zerokl.cli", *argv], nproc)


def run_ranks(cmd: Sequence[str], nproc: int) -> int:
    """Run `cmd` as `nproc` ranks (`rank_env`) and wait for them; the exit code as in the module docstring."""
    store = host_store()  # lives, and serves the ranks' rendezvous, until they are done
    procs = [subprocess.Popen(list(cmd), env=rank_env(rank, nproc, store.port)) for rank in range(nproc)]
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                time.sleep(1.0)  # ranks stopping together (a parity break, a user error) all get to exit
                codes = [p.poll() for p in procs]
                return codes[0] if codes[0] not in (None, 0) else failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(POLL_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
