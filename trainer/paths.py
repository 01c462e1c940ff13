"""Where the shipped assets live, and the one lookup that finds them from any working directory.

The shipped assets are the repository's top-level ``checkpoints/`` (the tiny target and DFlash backbone),
``data/`` (held-out module list, prompt sets) and ``recipes/``. In a checkout (an editable install, or
``PYTHONPATH`` pointing at it) they are read where they are; a wheel carries the same directories inside the
package as ``trainer/shipped/`` (``setup.py`` maps them), so ``checkpoints/target_tiny`` means the same
thing after ``pip install .`` as in the checkout::

    python -c "from trainer.paths import project_path; print(project_path('checkpoints/target_tiny'))"
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
# The directory holding checkpoints/, data/ and recipes/: the wheel's copy inside the package, else the
# checkout that contains the package.
SHIPPED_ROOT = _PACKAGE / "shipped" if (_PACKAGE / "shipped").is_dir() else _PACKAGE.parent


def project_path(path: str | Path) -> Path:
    """``path`` itself when it exists or is absolute; else the shipped asset of that relative path
    (``checkpoints/target_tiny``, ``data/prompts/...``) when there is one; else ``path`` unchanged, so that a
    hub id or a missing file reaches the loader and its error as the user wrote it."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    shipped = SHIPPED_ROOT / p
    return shipped if shipped.exists() else p
