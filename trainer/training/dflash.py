"""DFlash block-drafter training (docs/algorithms.md §1): random anchors, block masks, decaying slot weights.

Recipe ``recipes/dflash_tiny.yaml`` trains the tiny DFlash backbone on the shipped tiny target; on CPU::

    trainer fit --recipe dflash_tiny --trainer.max_steps 20
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from transformers import PreTrainedModel

from trainer.drafters.dflash import DFlashDraftModel, build_config
from trainer.errors import UserError
from trainer.paths import project_path
from trainer.training.block_drafter import BlockDrafterTraining
from trainer.training.blocks import BlockLoss, Blocks, dflash_loss


class DFlashTraining(BlockDrafterTraining):
    """Trains a DFlash drafter against a frozen target.

    Args:
        target: HF causal LM (directory or hub id); its embedding and LM head are the drafter's.
        num_layers: drafter decoder layers.
        block_size: slots per block (anchor + B-1 masked slots).
        loss: ``ce`` against the data token or ``kl`` (forward KL) against the target's distribution.
        mask_token_id: the MASK token; default the tokenizer's mask token of the target directory.
        intermediate_size: drafter MLP width; default the target's.
        init_from: start from this DFlash checkpoint directory instead of a random init.
        lr: peak AdamW learning rate.

    The other arguments: see :class:`~trainer.training.block_drafter.BlockDrafterTraining` and
    :class:`~trainer.training.frozen_target.FrozenTargetTraining`.
    """

    def __init__(
        self,
        target: str,
        num_layers: int = 1,
        block_size: int = 16,
        loss: Literal["ce", "kl"] = "ce",
        mask_token_id: int | None = None,
        intermediate_size: int | None = None,
        init_from: str | None = None,
        lr: float = 6e-4,
        **kwargs: Any,
    ) -> None:
        super().__init__(target=target, lr=lr, **kwargs)
        self.num_layers = num_layers
        self.block_size = block_size
        self.loss = loss
        self.mask_token_id = mask_token_id
        self.intermediate_size = intermediate_size
        self.init_from = init_from

    family = "DFlash"
    depth_names = ("dflash",)

    def build_drafter(self, target: PreTrainedModel) -> DFlashDraftModel:
        if self.init_from:
            return self.load_drafter(DFlashDraftModel, self.init_from)
        mask_id = self.mask_token_id
        if mask_id is None:
            from transformers import AutoTokenizer

            mask_id = AutoTokenizer.from_pretrained(str(project_path(self.target_path))).mask_token_id
            if mask_id is None:
                raise UserError("the target's tokenizer has no mask token; set model.mask_token_id")
        overrides = {"intermediate_size": self.intermediate_size} if self.intermediate_size else {}
        config = build_config(target.config, self.num_layers, self.block_size, mask_id, **overrides)
        return DFlashDraftModel(config)

    def _slot_losses(self, batch) -> tuple[BlockLoss, Blocks]:
        batch, blocks = self._blocks(batch)
        return dflash_loss(self.drafter, self.target, batch, blocks, self.slot_weights(), self.loss), blocks

    def training_step(self, batch, batch_idx):
        result, blocks = self._slot_losses(batch)
        self.log("train/loss", result.loss, prog_bar=True)
        with torch.no_grad():
            acc = (result.logits.argmax(-1) == blocks.labels).float()
            self.log("train/slot1_acc", acc[..., 1][blocks.label_mask[..., 1]].mean())
        return result.loss

    def validation_step(self, batch, batch_idx):
        result, blocks = self._slot_losses(batch)
        self.log("val/loss", result.loss, prog_bar=True, sync_dist=True)
        self.accumulate_depth_metrics("dflash", result.logits, blocks, result.teacher_ids, result.teacher_logprobs)
