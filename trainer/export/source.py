"""What ``trainer export`` reads: a training run, a Lightning checkpoint or an HF drafter directory.

A run directory gives its newest ``hf/`` export; a ``.ckpt`` (a file, or an FSDP2 run's sharded directory) gives
the drafter weights it holds, rebuilt from the drafter config saved beside them; an HF directory is loaded as it
is. The target the drafter was trained against comes from the run's recipe or the checkpoint's hyperparameters,
when there is one.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import PreTrainedModel

from trainer.drafters import drafter_class, load_drafter
from trainer.errors import UserError
from trainer.paths import project_path
from trainer.runs import resolve_drafter

# Lightning keeps the drafter's weights under this prefix of the LightningModule's state dict.
DRAFTER_PREFIX = "drafter."
# What marks a sharded (distributed) Lightning checkpoint directory: the non-tensor part of the checkpoint.
SHARDED_METADATA = "meta.pt"


@dataclass
class Source:
    """A drafter to export, float32, in eval mode, and the target it was trained against (path or hub id)."""

    drafter: PreTrainedModel
    target: str | None
    origin: Path


def load_source(path: Path) -> Source:
    """The drafter of a run directory, a Lightning ``.ckpt`` or an HF directory at ``path`` (a shipped one such as
    ``checkpoints/dflash_tiny`` from any working directory)."""
    path = project_path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist: give a run directory, a Lightning .ckpt or an HF drafter directory")
    if path.is_file():
        if path.suffix != ".ckpt":
            raise UserError(f"{path} is a file but not a Lightning checkpoint (.ckpt)")
        return _from_checkpoint(path)
    if (path / SHARDED_METADATA).is_file():
        return _from_checkpoint(path)
    hf, target = resolve_drafter(path)
    return Source(load_drafter(hf), target, hf)


def _read_checkpoint(path: Path) -> dict[str, Any]:
    """A whole Lightning checkpoint: one file, or a sharded (FSDP2) directory of DCP shards plus ``meta.pt``."""
    try:
        # weights_only: a checkpoint is data; nothing in it may run code on load.
        if path.is_file():
            return torch.load(path, map_location="cpu", weights_only=True)
        checkpoint = torch.load(path / SHARDED_METADATA, map_location="cpu", weights_only=True)
        with tempfile.TemporaryDirectory() as tmp:
            # The shards hold full tensors' pieces; one process reassembles them without a process group.
            dcp_to_torch_save(path, Path(tmp) / "full.pt")
            checkpoint.update(torch.load(Path(tmp) / "full.pt", map_location="cpu", weights_only=True))
        return checkpoint
    except Exception as e:
        raise UserError(f"{path}: not a readable Lightning checkpoint ({type(e).__name__}: {e})") from None


def _from_checkpoint(path: Path) -> Source:
    checkpoint = _read_checkpoint(path)
    config = checkpoint.get("drafter_config")
    if not config:
        raise UserError(
            f"{path} holds no drafter config (trainer fit writes one): export a run's hf/ directory instead"
        )
    state = {k[len(DRAFTER_PREFIX) :]: v for k, v in checkpoint["state_dict"].items() if k.startswith(DRAFTER_PREFIX)}
    model_class = drafter_class(config.get("architectures") or [], path)
    drafter = model_class(model_class.config_class.from_dict(config))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(
            f"{path}: the checkpoint's weights do not fit its {model_class.__name__} config: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    hparams: dict[str, Any] = checkpoint.get("hyper_parameters") or {}
    return Source(drafter.float().eval(), hparams.get("target"), path)
