"""Drafter architectures, one per file; parameter names equal the checkpoint keys of each reference format.

The family registry and ``load_drafter`` live in :mod:`trainer.drafters.families`; the names below are the
package's public face."""

from trainer.drafters.dflash import DFlashDraftModel, build_config, default_target_layer_ids
from trainer.drafters.families import DRAFTER_CLASSES, drafter_class, load_drafter

__all__ = [
    "DRAFTER_CLASSES",
    "DFlashDraftModel",
    "build_config",
    "default_target_layer_ids",
    "drafter_class",
    "load_drafter",
]
