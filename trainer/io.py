"""Writing files and directories so that a kill at any moment leaves the old version or the new one, whole.

A file is written under a hidden temporary name beside it, flushed to disk (``fsync``), then renamed over the
target; a directory is written beside the old one and swapped in. Readers therefore never see half a
checkpoint, cache shard, manifest or exported model, and a rerun finds either nothing or a finished file.
Plain Python and ``os`` only: usable from every part of the package.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory after a rename in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path to write ``path``'s new content to; on leaving without an error it replaces ``path``.

    The temporary name starts with a dot and ends in ``.tmp<pid>``, so globs for finished files never match
    it; an error removes it and leaves ``path`` as it was. A writer that appends its own suffix to a name
    (``numpy.save``) is given an open file on this path instead.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        fsync(tmp)
        os.replace(tmp, path)
        fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def partial_path(out: Path) -> Path:
    """Where the next version of the directory ``out`` is written before :func:`swap_in` makes it ``out``."""
    return out.with_name(out.name + ".partial")


def swap_in(out: Path) -> None:
    """Replace ``out`` (a directory, a file, or nothing) by its finished :func:`partial_path`, fsynced; the old one
    is removed last, so a kill leaves ``out`` (old or new) or, between the two renames, ``out.old`` whole.
    Sharded checkpoints call it on one rank once every rank has written its part."""
    tmp, old = partial_path(out), out.with_name(out.name + ".old")
    for file in tmp.rglob("*"):
        if file.is_file():
            fsync(file)
    _remove(old)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    fsync(out.parent)
    _remove(old)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def write_dir_atomic(out: Path, save: Callable[[Path], None]) -> None:
    """``save(tmp)`` into a sibling ``.partial`` directory, then :func:`swap_in` it for ``out``."""
    _remove(partial_path(out))
    save(partial_path(out))
    swap_in(out)
