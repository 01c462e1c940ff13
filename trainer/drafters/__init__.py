"""Drafter architectures, one per file; parameter names equal the checkpoint keys of each reference format."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from trainer.drafters.dflash import DFlashDraftModel, build_config, target_layer_ids
from trainer.drafters.families import FAMILIES
from trainer.errors import UserError
from trainer.paths import project_path

# The ``architectures`` name a saved config.json carries → the class that loads it.
DRAFTER_CLASSES: dict[str, type[PreTrainedModel]] = {f.architecture: f.cls for f in FAMILIES.values()}


def drafter_class(architectures: Sequence[str], where: object) -> type[PreTrainedModel]:
    """The drafter class of a config's ``architectures``; ``where`` (a file) names the config in the error.

    A class's own name counts too: ``save_pretrained`` writes it into the in-memory config, which is what a
    training checkpoint records (EAGLE-3's file carries SGLang's name instead)."""
    by_name = {**{c.__name__: c for c in DRAFTER_CLASSES.values()}, **DRAFTER_CLASSES}
    for name in architectures:
        if name in by_name:
            return by_name[name]
    raise UserError(f"{where}: architectures {list(architectures)} name no drafter ({sorted(DRAFTER_CLASSES)})")


def load_drafter(path: str | Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A DFlash, TreeFlash, EAGLE-3 or SpecBlock drafter from an HF directory (a shipped one from any
    directory, ``trainer.paths``), by its ``architectures``."""
    path = project_path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"no drafter at {path}: {config_file} does not exist")
    architectures = json.loads(config_file.read_text()).get("architectures") or []
    return drafter_class(architectures, config_file).from_pretrained(path, dtype=dtype).eval()


__all__ = ["DRAFTER_CLASSES", "DFlashDraftModel", "build_config", "drafter_class", "load_drafter", "target_layer_ids"]
