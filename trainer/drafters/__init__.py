"""Drafter architectures, one per file; parameter names equal the checkpoint keys of each reference format.

The family registry and ``load_drafter`` live in :mod:`trainer.drafters.families`; the names below are the
package's public face. They load on first use, so a module that needs one leaf of the package (the log
recorder imports only ``attention``) does not load every drafter architecture."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.drafters.families import DRAFTER_CLASSES, drafter_class, load_drafter

__all__ = ["DRAFTER_CLASSES", "drafter_class", "load_drafter"]


def __getattr__(name: str) -> object:
    if name in __all__:
        return getattr(importlib.import_module("trainer.drafters.families"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
