"""The block drafters' losses (DFlash, TreeFlash), without Lightning: the LightningModules' training steps and
the training-step API (trainer/training/step.py) call these, so each family has one loss in the codebase.

A batch has ``input_ids``, ``loss_mask``, ``position_ids``, ``doc_ids`` (B, T) and, offline, the feature
cache's ``features`` and teacher top-k; ``block_batch`` computes those online with the frozen target.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from trainer.data.features import teacher_at, with_features
from trainer.drafters.dflash import DFlashDraftModel
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.losses import cross_entropy, forward_kl_topk, weighted_slot_mean
from trainer.target import Target
from trainer.training.block_batches import (
    Blocks,
    anchor_generator,
    block_mask_rule,
    make_blocks,
    sample_anchors,
)


def block_batch(
    dflash: torch.nn.Module,
    target: Target,
    batch: dict[str, torch.Tensor],
    topk: int,
    max_anchors: int,
    seed: int,
    step: int | None,
) -> tuple[dict[str, torch.Tensor], Blocks]:
    """The batch with target features and its blocks; anchors are drawn from ``(seed, step)`` (``None``: the
    fixed validation draw), so a training step and the training-step API draw the same anchors."""
    batch = with_features(batch, target, topk)
    anchors, valid = sample_anchors(batch["loss_mask"], batch["doc_ids"], max_anchors, anchor_generator(seed, step))
    return batch, blocks_at(dflash, batch, anchors, valid)


def blocks_at(
    dflash: torch.nn.Module, batch: dict[str, torch.Tensor], anchors: torch.Tensor, valid: torch.Tensor
) -> Blocks:
    """The drafter's blocks anchored at ``anchors`` (B, N) where ``valid``."""
    return make_blocks(
        batch["input_ids"],
        batch["loss_mask"],
        batch["position_ids"],
        batch["doc_ids"],
        anchors,
        valid,
        dflash.block_size,
        dflash.mask_token_id,
    )


def block_hidden(
    dflash: torch.nn.Module, target: Target, batch: dict[str, torch.Tensor], blocks: Blocks
) -> torch.Tensor:
    """The DFlash-style drafter's pre-norm hidden states of every block slot. Shape: (B, N, K, H)"""
    b, n, k = blocks.tokens.shape
    dtype = dflash.fc.weight.dtype
    noise = target.embed_tokens(blocks.tokens.flatten(1)).to(dtype)
    positions = torch.cat([batch["position_ids"], blocks.positions.flatten(1)], dim=1)
    hidden = dflash(
        noise_embedding=noise,
        target_hidden=batch["features"].to(dtype),
        position_ids=positions,
        attention_mask=block_mask_rule(batch["doc_ids"], blocks),
        return_prenorm=True,
    )
    return hidden.view(b, n, k, -1)


class BlockLoss(NamedTuple):
    """A block drafter's loss of a batch and what it was computed from. Shapes: loss (); logits (B, N, K, V)
    (TreeFlash: corrected); teacher top-k ids and log-probs (B, N, K, k)."""

    loss: torch.Tensor
    logits: torch.Tensor
    teacher_ids: torch.Tensor
    teacher_logprobs: torch.Tensor


class TreeFlashLoss(NamedTuple):
    """``BlockLoss`` plus the backbone's normed hidden states (B, N, K, H), which the marginal metrics read."""

    loss: torch.Tensor
    normed: torch.Tensor
    logits: torch.Tensor
    teacher_ids: torch.Tensor
    teacher_logprobs: torch.Tensor


def dflash_loss(
    drafter: DFlashDraftModel,
    target: Target,
    batch: dict[str, torch.Tensor],
    blocks: Blocks,
    weights: torch.Tensor,
    kind: Literal["ce", "kl"],
) -> BlockLoss:
    """The DFlash loss of a batch with features: depth-weighted mean over valid slots of the cross-entropy to
    the data token (``ce``) or the forward KL to the target's top-k (``kl``).

    Returns: loss (), logits (B, N, K, V), teacher top-k ids and log-probs (B, N, K, k).
    """
    logits = target.lm_head(drafter.norm(block_hidden(drafter, target, batch, blocks)))
    t_ids, t_lp = teacher_at(batch, blocks.teacher_index)
    per_slot = forward_kl_topk(logits, t_ids, t_lp) if kind == "kl" else cross_entropy(logits, blocks.labels)
    return BlockLoss(weighted_slot_mean(per_slot, blocks.label_mask, weights), logits, t_ids, t_lp)


def treeflash_loss(
    drafter: TreeFlashDraftModel,
    target: Target,
    batch: dict[str, torch.Tensor],
    blocks: Blocks,
    weights: torch.Tensor,
) -> TreeFlashLoss:
    """The TreeFlash loss of a batch with features: depth-weighted forward KL of the corrected distribution
    (teacher-forced previous token) to the target's top-k, over valid slots.

    Returns: loss (), the backbone's normed hidden (B, N, K, H), corrected logits (B, N, K, V), teacher top-k
    ids and log-probs (B, N, K, k).
    """
    hidden = block_hidden(drafter.model, target, batch, blocks)
    normed = drafter.model.norm(hidden)
    prev = target.embed_tokens(blocks.prev_tokens).to(hidden.dtype)
    corrected = target.lm_head(drafter.correct(hidden, normed, prev))
    t_ids, t_lp = teacher_at(batch, blocks.teacher_index)
    loss = weighted_slot_mean(forward_kl_topk(corrected, t_ids, t_lp), blocks.label_mask, weights)
    return TreeFlashLoss(loss, normed, corrected, t_ids, t_lp)
