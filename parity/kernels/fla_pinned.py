"""fla's Triton kernels with one launch configuration each: deterministic across processes.

fla autotunes its kernels: the first call of each shape times every candidate configuration and keeps the fastest.
The candidates tile the reductions differently (block sizes over K and V), so which one wins - a matter of timing
noise - changes the order of fp32 additions, and two processes (a run and its resume) can get different gradient bits.
Inside `pinned()` every fla autotuner holds only its first candidate (a fixed function of the kernel and the GPU
kind: fla builds its candidate lists from the device's capability), so no timing decides anything and the same
inputs give the same bits in every process on that kind of GPU. On leaving, each autotuner gets its candidates back,
so fla outside the block (the fast kernel set) autotunes as its users run it.

A patch of a dependency's internals: written for fla-core 0.6.0 (its `CachedAutotuner`, a Triton `Autotuner`, runs
the single-candidate path without timing when it holds one configuration); another version is refused.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

from parity.patching import require

WRITTEN_FOR = ("0.6.0",)
_LOCK = threading.RLock()
_FOUND: dict[int, list] = {}  # the last walk: the number of loaded modules then -> fla's autotuners


def check_version() -> None:
    """`parity.patching.UnsupportedVersion` unless the installed fla is one this patch was written for."""
    import fla

    require("fla-core", fla.__version__, WRITTEN_FOR, "zerokl's pinning of fla's autotuned kernels")


def autotuners() -> list:
    """Every Triton autotuner among the loaded fla modules (under `triton.heuristics` wrappers too), each once. The
    walk over the modules' attributes (a few ms; a trainer step pins once per KDA layer) is redone only when a module
    has been imported since the last one."""
    from triton.runtime.autotuner import Autotuner

    loaded = len(sys.modules)
    if loaded in _FOUND:
        return _FOUND[loaded]
    found: dict[int, Autotuner] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for obj in list(vars(module).values()):
            while obj is not None and not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
                obj = obj.fn  # Heuristics -> Autotuner -> JITFunction
            if isinstance(obj, Autotuner):
                found.setdefault(id(obj), obj)
    _FOUND.clear()
    _FOUND[loaded] = list(found.values())
    return _FOUND[loaded]


@contextlib.contextmanager
def pinned() -> Iterator[None]:
    """Run fla's kernels with each autotuner's first configuration (no timing, the same choice in every process)."""
    check_version()
    import fla.ops.kda  # noqa: F401  (loads every module chunk_kda's forward and backward launch from)

    with _LOCK:
        held = [(tuner, tuner.configs) for tuner in autotuners()]
        try:
            for tuner, configs in held:
                tuner.configs = configs[:1]
            yield
        finally:
            for tuner, configs in held:
                tuner.configs = configs
