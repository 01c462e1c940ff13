"""Where shipped assets live: relative paths resolve against the working directory, then the project root."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def project_path(path: str | Path) -> Path:
    """``path`` itself when it exists or is absolute; else the same relative path under the project root.

    So ``checkpoints/target_tiny`` in a recipe works from any working directory of an editable install.
    """
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    shipped = PROJECT_ROOT / p
    return shipped if shipped.exists() else p
