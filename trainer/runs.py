"""Where a run keeps what a user points commands at: the HF drafter directory of a run (or the directory itself),
and the target its resolved recipe trained against. ``trainer eval``, ``trainer export`` and the daemons resolve
``--drafter`` through here."""

from __future__ import annotations

from pathlib import Path

import yaml

from trainer.errors import UserError


def resolve_drafter(path: Path) -> tuple[Path, Path | None]:
    """The HF directory of a drafter given it or a training run directory, and the run's resolved recipe
    (``config.yaml``) when there is one."""
    if not path.exists():
        raise UserError(f"drafter {path} does not exist")
    if (path / "config.json").is_file():
        recipe = path.parent / "config.yaml"
        return path, recipe if recipe.is_file() else None
    exports = sorted(path.glob("**/hf/config.json"), key=lambda p: p.stat().st_mtime)
    if not exports:
        raise UserError(f"{path} is neither an HF drafter directory (config.json) nor a run with an <run>/hf export")
    hf = exports[-1].parent
    recipe = hf.parent / "config.yaml"
    return hf, recipe if recipe.is_file() else None

def recipe_target(recipe: Path) -> str:
    """The target a run trained against, from its resolved recipe."""
    config = yaml.safe_load(recipe.read_text())
    try:
        return config["model"]["init_args"]["target"]
    except (KeyError, TypeError):
        raise UserError(f"{recipe} names no model.init_args.target; pass --target") from None
