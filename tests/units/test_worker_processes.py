"""vLLM's workers forked from the preloaded server (`rollout.worker_processes`) run with the environment their
engine's builder has when it starts them, not the one the server was started with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Its own process, so that the forkserver it starts (without the preload) is not the one this worker's engines use.
SCRIPT = """
import os, sys
from rollout.worker_processes import _WorkerContext

def report(queue):
    queue.put(os.environ.get("ZEROKL_PROBE"))

if __name__ == "__main__":
    ctx = _WorkerContext()
    queue = ctx.Queue()
    seen = []
    for value in ("first", "second"):  # the server starts with the first process and keeps its environment
        os.environ["ZEROKL_PROBE"] = value
        p = ctx.Process(target=report, args=(queue,))
        p.start()
        seen.append(queue.get(timeout=60))
        p.join()
    print(seen)
"""


def test_a_forked_worker_runs_with_the_environment_its_starter_has(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "['first', 'second']", run.stdout
