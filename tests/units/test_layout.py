"""The package layout: every import arrow points down, and no module imports itself through others.

Floors, bottom up: `parity` (model math, kernels, checkpoint I/O, weight sync) < `lora` < `rollout`,
`trainer` (the two engines, which never import each other) < `zerokl` (command line, PPO, parity check,
planner). Imports inside functions count: a lazy import is still an arrow.

Inside `rollout`, rooms by job, bottom up: the records every room shares (`sampling`, `speculative`) < `generate` (no
vLLM) < `vllm` (what vLLM loads) < `server` (`zerokl serve`) < `client` (talking to servers) < `engine` (the in-process
engine over `vllm.LLM`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLOOR = {"parity": 0, "lora": 1, "rollout": 2, "trainer": 2, "zerokl": 3}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (absolute imports; `from a import b` counts as `a.b` when
    `a.b` is a module, else as `a`)."""
    files = {_module(f): f for pkg in FLOOR for f in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                         for a in node.names]
            else:
                continue
            out |= {n for n in names if n.split(".")[0] in FLOOR and n != mod}
        graph[mod] = out
    return graph


def test_every_arrow_points_down() -> None:
    up = sorted(f"{a} -> {b}" for a, bs in import_graph().items() for b in bs
                if FLOOR[b.split(".")[0]] > FLOOR[a.split(".")[0]]
                or ({a.split(".")[0], b.split(".")[0]} == {"rollout", "trainer"}))
    assert not up, "imports that point up or across the engines:\n" + "\n".join(up)


ROLLOUT_ROOM = {"sampling": 0, "speculative": 0, "worker_processes": 0, "generate": 1, "vllm": 2, "server": 3,
                "client": 4, "engine": 5}


def test_rollout_rooms_point_down() -> None:
    rooms = {f.stem if f.parent.name == "rollout" else f.parent.name for f in (ROOT / "rollout").rglob("*.py")}
    assert rooms - {"__init__"} == ROLLOUT_ROOM.keys(), "a rollout module outside the rooms: update ROLLOUT_ROOM"

    def room(module: str) -> str:
        return module.split(".")[1]

    up = sorted(f"{a} -> {b}" for a, bs in import_graph().items() if a.startswith("rollout.") for b in bs
                if b.startswith("rollout.") and ROLLOUT_ROOM[room(b)] > ROLLOUT_ROOM[room(a)])
    assert not up, "rollout imports that point up a room:\n" + "\n".join(up)


def test_no_import_cycles() -> None:
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)
