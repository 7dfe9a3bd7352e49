"""Patches of a dependency's internals, each held to the release it was written for.

A patch is written against one release's code: on another it may miss its target or, worse, silently change bits.
So every place that patches a dependency (`rollout.vllm.compat`, `rollout.vllm.plugin`,
`trainer.megatron.cpu_compat`) or loads one of its files by path (`parity.quant.mxfp4`) first calls `require` with
the installed version and the releases it was written for: any other version stops with `UnsupportedVersion`, naming
the package, its version, the patch and the release, before anything is touched. `install` then puts one patch in
place and checks that the target now holds it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class UnsupportedVersion(RuntimeError):
    """An installed dependency's version is not one a zerokl patch of it was written for."""


def require(package: str, version: str, written_for: tuple[str, ...], what: str) -> None:
    """Raise UnsupportedVersion unless `version` of `package` is one of `written_for` (the releases `what`, a patch,
    was written for)."""
    if version not in written_for:
        raise UnsupportedVersion(
            f"{package} {version} is not supported by {what} (written for {' or '.join(written_for)}); install "
            f"{package} {written_for[-1]}, the release zerokl pins")


def resolve(target: str) -> tuple[Any, str]:
    """"module:attr" or "module:Class.attr" -> (the object holding the attribute, its name)."""
    module, _, path = target.partition(":")
    owner: Any = importlib.import_module(module)
    *outer, attr = path.split(".")
    for name in outer:
        owner = getattr(owner, name)
    return owner, attr


def install(target: str, wrap: Callable[[Any], Any], mark: str) -> None:
    """Replace `target` by `wrap(current)`, tagged with `mark` (idempotent: a target already tagged is left alone);
    RuntimeError when the target does not hold the replacement afterwards."""
    owner, attr = resolve(target)
    current = getattr(owner, attr)
    if getattr(current, "__zerokl_patch__", None) == mark:
        return
    replacement = wrap(current)
    replacement.__zerokl_patch__ = mark
    setattr(owner, attr, replacement)
    if getattr(getattr(owner, attr), "__zerokl_patch__", None) != mark:
        raise RuntimeError(f"{mark} did not apply: {target} does not hold the patched function")
