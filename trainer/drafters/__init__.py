"""Drafter architectures, one per file; parameter names equal the checkpoint keys of each reference format."""

from trainer.drafters.dflash import DFlashDraftModel, build_config, target_layer_ids

__all__ = ["DFlashDraftModel", "build_config", "target_layer_ids"]
