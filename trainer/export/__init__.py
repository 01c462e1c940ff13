"""``trainer export``: a trained drafter in the directory layout an inference engine loads.

One module per format (``dflash``, ``treeflash``, ``speculators``, ``sglang``, ``specblock``), each with ``ACCEPTS``
(the names of the drafter families it takes, ``trainer.drafters.families``) and ``write(drafter, out, verifier)``;
which engine loads which format, with which flags, is the table of docs/export.md.

The directory is written beside ``DIR`` and swapped in whole (:func:`trainer.io.write_dir_atomic`), so a
kill leaves the previous export or the new one. On CPU::

    trainer export checkpoints/dflash_tiny --format treeflash --out runs/export/treeflash_tiny
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import ModuleType

import torch
from transformers import PreTrainedModel

from trainer.drafters.families import FAMILIES, family_of
from trainer.errors import UserError
from trainer.export import dflash, sglang, specblock, speculators, treeflash
from trainer.export.source import load_source
from trainer.io import write_dir_atomic

FORMATS: dict[str, ModuleType] = {
    "dflash": dflash,
    "treeflash": treeflash,
    "speculators": speculators,
    "sglang": sglang,
    "specblock": specblock,
}


def formats_for(drafter: PreTrainedModel) -> list[str]:
    """The formats that take ``drafter``."""
    family = family_of(drafter).name
    return [name for name, module in FORMATS.items() if family in module.ACCEPTS]


def write_export(
    drafter: PreTrainedModel, fmt: str, out: Path, verifier: str | None = None, dtype: torch.dtype | None = None
) -> Path:
    """Write ``drafter`` to ``out`` in format ``fmt`` (in ``dtype``, default its own); ``verifier`` names the
    target for the formats that record it."""
    if fmt not in FORMATS:
        raise UserError(f"unknown export format '{fmt}'; formats: {', '.join(FORMATS)}")
    module = FORMATS[fmt]
    if fmt not in formats_for(drafter):
        raise UserError(
            f"--format {fmt} takes {' or '.join(FAMILIES[n].cls.__name__ for n in module.ACCEPTS)}, not "
            f"{type(drafter).__name__}; this drafter exports as: {', '.join(formats_for(drafter))}"
        )
    if dtype is not None:
        # Module.to converts in place; the caller's drafter keeps its dtype.
        drafter = copy.deepcopy(drafter).to(dtype)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_dir_atomic(out, lambda tmp: module.write(drafter, tmp, verifier))
    return out


def export(source: Path, fmt: str, out: Path, target: str | None = None, dtype: torch.dtype | None = None) -> Path:
    """Export the drafter of a run directory, Lightning checkpoint or HF directory ``source``; ``target``
    overrides the target recorded by the run."""
    loaded = load_source(Path(source))
    return write_export(loaded.drafter, fmt, out, target or loaded.target, dtype)
