"""Each trajectory's environment in a child process of its own, so that a step which overruns its time limit can be
ended for good: the process is killed, and nothing of the environment keeps running or writes into a later
trajectory.

`Environment(recipe)` starts the child, which makes the episode there (`make_task(task, **task_args)
.episode(problem)`: a user's environment class is imported from its file in the child too) and then answers one
action at a time. `step(action, timeout_s)` returns the episode's `Turn`, or why there is none (the step raised,
returned something else, did not answer within `timeout_s`, or the process died); after anything but a `Turn` the
child is gone. A step's time limit counts the step alone: the first one first waits (up to `START_TIMEOUT_S`) for the
child to say its episode is made, so a slow process start on a loaded machine is never a step that overran.
`close()` ends it. Children are forked from one clean server process that has imported the task
modules once (multiprocessing's `forkserver`), never from the run's own process with its engine threads.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from zerokl.tasks.agent import Turn
from zerokl.tasks.base import Problem

_CONTEXT: Any = None
_READY = ("zerokl-environment-ready",)  # the child's first message (a reply is a Turn or a str, never a tuple)
START_TIMEOUT_S = 120.0


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["zerokl.tasks"])
    return _CONTEXT


@dataclass(frozen=True)
class Recipe:
    """How the child makes its episode: the run's task by name and arguments, and the trajectory's problem."""

    task: str
    problem: Problem
    task_args: dict[str, Any] = field(default_factory=dict)


def _serve(conn: Connection, recipe: Recipe) -> None:
    """The child: make the episode, then answer each action with the step's `Turn` or why there is none."""
    from zerokl.tasks import make_task

    try:
        episode: Any = make_task(recipe.task, **recipe.task_args).episode(recipe.problem)
    except Exception as e:  # every step of this trajectory says so; the run goes on
        episode, made = None, f"making the episode raised {type(e).__name__}: {e}"
    conn.send(_READY)
    while True:
        try:
            action = conn.recv()
        except EOFError:
            return
        if episode is None:
            conn.send(made)
            continue
        try:
            reply = episode.step(action)
        except Exception as e:  # a user environment's failure ends its trajectory, never the run
            conn.send(f"the environment step raised {type(e).__name__}: {e}")
            continue
        conn.send(reply if isinstance(reply, Turn) else
                  f"the environment step returned {type(reply).__name__}, not a Turn")


class Environment:
    """One trajectory's environment, running in its own child process (see the module docstring)."""

    def __init__(self, recipe: Recipe):
        ctx = _context()
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, recipe), name="zerokl-environment", daemon=True)
        self._process.start()
        child.close()
        self._started = False

    def step(self, action: Any, timeout_s: float) -> Turn | str:
        """The episode's answer to `action` within `timeout_s` of sending it, or why there is none (then the child is
        ended)."""
        try:
            if not self._started:
                if not self._conn.poll(START_TIMEOUT_S):
                    self.close()
                    return f"the environment process did not start within {START_TIMEOUT_S:g} s"
                self._conn.recv()  # _READY
                self._started = True
            self._conn.send(action)
            if not self._conn.poll(timeout_s):
                self.close()
                return f"the environment step took longer than {timeout_s:g} s"
            reply = self._conn.recv()
        except (EOFError, OSError):
            self.close()
            return f"the environment process ended (exit code {self._process.exitcode})"
        if not isinstance(reply, Turn):
            self.close()
        return reply

    def close(self) -> None:
        """End the child (idempotent)."""
        if self._process.is_alive():
            self._process.kill()
        self._process.join()
        self._conn.close()
