"""TreeFlash training (docs/algorithms.md §4): a SwiGLU AR-approximator over a pretrained DFlash backbone.

Teacher forcing gives slot ``k`` the ground-truth previous token ``x_{a+k-1}``; the loss is the forward KL to
the target's distribution with depth-decaying weights. Per-depth KL, TVD and top-1/top-5 coverage of the
marginal (DFlash) and corrected (TreeFlash) distributions go to TensorBoard, and the table is printed at the
end. The README's main job, on CPU::

    trainer fit --recipe treeflash_tiny
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from trainer.drafters.dflash import DFlashDraftModel
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.errors import UserError
from trainer.paths import project_path
from trainer.training.block_drafter import BlockDrafterTraining
from trainer.training.blocks import Blocks, TreeFlashLoss, treeflash_loss


class TreeFlashTraining(BlockDrafterTraining):
    """Trains the AR-approximator of a TreeFlash drafter (and optionally its backbone).

    Args:
        target: HF causal LM (directory or hub id) the backbone was trained for.
        backbone: DFlash checkpoint directory (reference format or ours) or a TreeFlash directory to continue.
        freeze_backbone: train only the approximator (the paper finds this about equal to full fine-tuning).
        warmup_steps: linear warm-up steps.

    The end of fit writes the drafter to ``export_dir`` in the reference TreeFlash format. The other arguments:
    see :class:`~trainer.training.block_drafter.BlockDrafterTraining` and
    :class:`~trainer.training.frozen_target.FrozenTargetTraining`.
    """

    def __init__(
        self, target: str, backbone: str, freeze_backbone: bool = True, warmup_steps: int = 30, **kwargs: Any
    ) -> None:
        super().__init__(target=target, warmup_steps=warmup_steps, **kwargs)
        self.backbone = backbone
        self.freeze_backbone = freeze_backbone

    family = "TreeFlash"
    depth_names = ("dflash", "treeflash")

    def build_drafter(self, target: PreTrainedModel) -> TreeFlashDraftModel:
        source = str(project_path(self.backbone))
        try:
            architectures = PretrainedConfig.get_config_dict(source)[0].get("architectures") or []
        except OSError as e:
            raise UserError(f"model.backbone: no DFlash or TreeFlash checkpoint at '{source}': {e}") from None
        if "TreeFlashDraftModel" in architectures:
            model = TreeFlashDraftModel.from_pretrained(source, dtype=torch.float32)
        else:
            backbone = DFlashDraftModel.from_pretrained(source, dtype=torch.float32)
            model = TreeFlashDraftModel.from_dflash(backbone)
        model.model.requires_grad_(not self.freeze_backbone)
        return model

    def _forward(self, batch) -> tuple[TreeFlashLoss, Blocks]:
        batch, blocks = self._blocks(batch)
        return treeflash_loss(self.drafter, self.target, batch, blocks, self.slot_weights()), blocks

    def training_step(self, batch, batch_idx):
        result, _ = self._forward(batch)
        self.log("train/kl", result.loss, prog_bar=True)
        return result.loss

    def validation_step(self, batch, batch_idx):
        result, blocks = self._forward(batch)
        self.log("val/kl", result.loss, prog_bar=True, sync_dist=True)
        teacher = (result.teacher_ids, result.teacher_logprobs)
        self.accumulate_depth_metrics("treeflash", result.logits, blocks, *teacher)
        self.accumulate_depth_metrics("dflash", self.logits(result.normed), blocks, *teacher)
