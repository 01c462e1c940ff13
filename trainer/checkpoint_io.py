"""Checkpoint writing that a kill cannot tear (``trainer.io.atomic_path``: temporary file, fsync, rename).

Used by the recipes as ``trainer.plugins``; ``--ckpt_path last`` after a SIGKILL then always finds a whole
checkpoint (the previous one if the kill hit during a save).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from trainer.io import atomic_path


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        with atomic_path(path) as tmp:
            torch.save(checkpoint, tmp)
