"""Atomic directory writes: a directory is filled under a sibling `.partial` name and renamed into place in one
step, so a reader (or a crash) never sees it half written."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def partial_path(final: Path) -> Path:
    """The sibling directory `final` is written under until it is complete."""
    return final.with_name(final.name + ".partial")


def start_partial(final: Path) -> Path:
    """A fresh, empty `partial_path(final)` (a leftover from an earlier crash is removed)."""
    tmp = partial_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit_partial(final: Path, replace: bool = False) -> Path:
    """Rename the filled `partial_path(final)` to `final`. An empty `final` directory is replaced; a non-empty one
    only with `replace` (removed first), else FileExistsError."""
    if final.exists():
        if replace:
            shutil.rmtree(final)
        elif final.is_dir() and not any(final.iterdir()):
            final.rmdir()
        else:
            raise FileExistsError(f"{final} exists")
    partial_path(final).rename(final)
    return final


@contextmanager
def atomic_dir(final: str | Path, replace: bool = False) -> Iterator[Path]:
    """`with atomic_dir(out) as tmp:` fill `tmp`; on a clean exit it becomes `out` (`commit_partial`), on an
    exception it is removed and `out` is left as it was."""
    final = Path(final)
    tmp = start_partial(final)
    try:
        yield tmp
        commit_partial(final, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(final: str | Path) -> Iterator[Path]:
    """`with atomic_file(path) as tmp:` write `tmp`; on a clean exit it replaces `path` in one step, on an
    exception it is removed."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(final)
    try:
        yield tmp
        tmp.replace(final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
