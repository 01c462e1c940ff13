"""Writing an HF directory so that a kill at any moment leaves either the old or the new one, whole."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path


def save_hf_dir(out: Path, save: Callable[[Path], None]) -> None:
    """``save(tmp)`` into a sibling ``.partial`` directory, then swap it in; the old one is removed last."""
    tmp = out.with_name(out.name + ".partial")
    old = out.with_name(out.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp)
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
