"""``--format dflash``: the reference DFlash directory (``z-lab/Qwen3-4B-DFlash-b16``; ALGORITHMS.md §1).

``config.json`` is a Qwen3 config with ``architectures: ["DFlashDraftModel"]``, ``block_size``,
``num_target_layers`` and ``dflash_config: {mask_token_id, target_layer_ids}``; the weights are
``layers.{i}.*``, ``fc``, ``hidden_norm``, ``norm``. ``DFlashDraftModel`` of the ``dflash`` package loads it, and
so do the engines that take z-lab's DFlash checkpoints. A TreeFlash drafter exports its DFlash backbone (the
AR-approximator has no place in this layout).
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedModel, Qwen3Config

from trainer.drafters.dflash import DFlashDraftModel
from trainer.drafters.families import family_of
from trainer.drafters.treeflash import TreeFlashDraftModel

ACCEPTS = ("dflash", "treeflash")


def as_dflash(drafter: DFlashDraftModel | TreeFlashDraftModel) -> DFlashDraftModel:
    """The DFlash drafter itself, or a TreeFlash drafter's backbone under a config of its own (the backbone shares
    the TreeFlash config, whose architecture and ``treeflash_config`` must not reach a DFlash directory)."""
    if family_of(drafter).name == "dflash":
        return drafter
    config = drafter.config.to_dict()
    config.pop("treeflash_config", None)
    config["architectures"] = ["DFlashDraftModel"]
    backbone = DFlashDraftModel(Qwen3Config.from_dict(config)).to(drafter.dtype)
    backbone.load_state_dict(drafter.model.state_dict())
    return backbone.eval()


def write(drafter: PreTrainedModel, out: Path, verifier: str | None) -> None:
    as_dflash(drafter).save_pretrained(out)
