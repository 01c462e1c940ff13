"""Where a run keeps what a user points commands at: the HF drafter directory of a run (or the directory itself),
and the target its resolved recipe trained against. Every ``--drafter`` that may name a run resolves here:
``trainer eval``, ``trainer export``, ``trainer serve`` and ``trainer adapt bandit``."""

from __future__ import annotations

from pathlib import Path

import yaml

from trainer.errors import UserError
from trainer.paths import project_path


def resolve_drafter(path: str | Path) -> tuple[Path, str | None]:
    """The HF directory of a drafter given it (a shipped one such as ``checkpoints/dflash_tiny`` from any working
    directory) or a training run directory (its newest ``hf/`` export), and the target the run's resolved recipe
    (``config.yaml`` beside ``hf/``) names: None when there is no recipe or it names none."""
    path = project_path(path)
    if not path.exists():
        raise UserError(f"drafter {path} does not exist")
    if (path / "config.json").is_file():
        hf = path
    else:
        exports = sorted(path.glob("**/hf/config.json"), key=lambda p: p.stat().st_mtime)
        if not exports:
            raise UserError(
                f"{path} is neither an HF drafter directory (config.json) nor a run with an <run>/hf export"
            )
        hf = exports[-1].parent
    return hf, _recipe_target(hf.parent / "config.yaml")


def _recipe_target(recipe: Path) -> str | None:
    """The target a run's resolved recipe trained against; None without a recipe or a target in it."""
    if not recipe.is_file():
        return None
    config = yaml.safe_load(recipe.read_text())
    try:
        return config["model"]["init_args"]["target"]
    except (KeyError, TypeError):
        return None
