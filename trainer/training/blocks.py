"""Block-drafter (DFlash, TreeFlash) training as pure tensor functions, without Lightning: batches and losses.

A DFlash-style drafter is trained on many blocks per sequence at once. Each anchor ``a`` opens a block of
``block_size`` slots: slot 0 holds the committed token ``x_a``, slots ``1..B-1`` hold ``MASK`` and are
labelled ``x_{a+k}``. All blocks of a row are concatenated along the query axis; the mask lets block ``n``
see the context keys ``j < a_n`` of its own packed sample and every slot of its own block, nothing else.

The LightningModules' training steps and the training-step API (trainer/training/step.py) call the losses
here, so each family has one loss in the codebase. A batch has ``input_ids``, ``loss_mask``, ``position_ids``,
``doc_ids`` (B, T) and, offline, the feature cache's ``features`` and teacher top-k; ``block_batch`` computes
those online with the frozen target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trainer.data.features import teacher_at, with_features
from trainer.drafters.attention import MaskRule, block_rule
from trainer.drafters.dflash import DFlashDraftModel
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.losses import cross_entropy, forward_kl_topk, weighted_slot_mean
from trainer.target import Target


@dataclass
class Blocks:
    # Shape: (B, N) anchor positions; -1 where a row has fewer than N anchors
    anchors: torch.Tensor
    # Shape: (B, N) bool
    valid: torch.Tensor
    # Shape: (B, N, K) block input tokens: x_a then MASK
    tokens: torch.Tensor
    # Shape: (B, N, K) RoPE positions of the block slots
    positions: torch.Tensor
    # Shape: (B, N, K) the token each slot predicts (x_{a+k}); slot 0 has none
    labels: torch.Tensor
    # Shape: (B, N, K) bool: slot k has a label inside the same sample and under the loss mask
    label_mask: torch.Tensor
    # Shape: (B, N, K) index of the sequence position whose target distribution predicts the slot (a+k-1)
    teacher_index: torch.Tensor
    # Shape: (B, N, K) the ground-truth previous token of each slot (x_{a+k-1}), for teacher forcing
    prev_tokens: torch.Tensor


def anchor_candidates(loss_mask: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """Shape: (B, T) → (B, T) bool: ``a`` with ``loss_mask[a]`` and ``loss_mask[a+1]`` in one sample."""
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[:, :-1] = (
        loss_mask[:, :-1].bool() & loss_mask[:, 1:].bool() & (doc_ids[:, :-1] == doc_ids[:, 1:]) & (doc_ids[:, :-1] > 0)
    )
    return ok


def sample_anchors(
    loss_mask: torch.Tensor, doc_ids: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``max_anchors`` distinct random anchors per row, sorted. Shape: (B, T) → anchors, valid (B, N)."""
    cand = anchor_candidates(loss_mask, doc_ids)
    rows = []
    for b in range(cand.shape[0]):
        pos = cand[b].nonzero().flatten()
        if len(pos) > max_anchors:
            pick = torch.randperm(len(pos), generator=generator, device="cpu")[:max_anchors].to(pos.device)
            pos = pos[pick].sort().values
        rows.append(pos)
    n = max(1, max(len(r) for r in rows))
    anchors = torch.full((cand.shape[0], n), -1, dtype=torch.long, device=loss_mask.device)
    for b, pos in enumerate(rows):
        anchors[b, : len(pos)] = pos
    return anchors, anchors >= 0


def anchor_generator(seed: int, step: int | None) -> torch.Generator:
    """The draws of training step ``step``, or of validation (``None``: the same draws every time). A function of
    seed and step only, so a resumed run draws what the uninterrupted run would have."""
    return torch.Generator().manual_seed(seed if step is None else seed * 1_000_003 + step)


def make_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    position_ids: torch.Tensor,
    doc_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> Blocks:
    """Block inputs, labels and teacher indices for the given anchors (see module docstring)."""
    t = input_ids.shape[1]
    k = torch.arange(block_size, device=input_ids.device)
    a = anchors.clamp(min=0)
    # Shape: (B, N, K)
    idx = a[..., None] + k
    inside = idx < t
    idx_c = idx.clamp(max=t - 1)

    def at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x.gather(1, index.flatten(1)).view(index.shape)

    same_doc = at(doc_ids, idx_c) == at(doc_ids, a)[..., None]
    label_mask = valid[..., None] & inside & same_doc & at(loss_mask, idx_c).bool() & (k > 0)
    tokens = torch.full_like(idx, mask_token_id)
    tokens[..., 0] = at(input_ids, a)
    prev_index = (idx_c - 1).clamp(min=0)
    return Blocks(
        anchors=anchors,
        valid=valid,
        tokens=tokens,
        positions=at(position_ids, a)[..., None] + k,
        labels=at(input_ids, idx_c),
        label_mask=label_mask,
        teacher_index=prev_index,
        prev_tokens=at(input_ids, prev_index),
    )


def block_mask_rule(doc_ids: torch.Tensor, blocks: Blocks) -> MaskRule:
    """The attention pattern of ``blocks`` over the row's context and themselves
    (:func:`trainer.drafters.attention.block_rule`)."""
    return block_rule(doc_ids, blocks.anchors, blocks.valid, blocks.tokens.shape[-1])


def slot_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """Shape: (K,) ``w_k = exp(-(k-1)/gamma)`` for slots 1..K-1; slot 0 has weight 0 (it has no label)."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


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


@dataclass(frozen=True)
class BlockLoss:
    """A block drafter's loss of a batch and what it was computed from."""

    # Shape: ()
    loss: torch.Tensor
    # Shape: (B, N, K, V); TreeFlash: the corrected logits
    logits: torch.Tensor
    # Shape: (B, N, K, k) the target's top-k ids and log-probs at each slot's label
    teacher_ids: torch.Tensor
    teacher_logprobs: torch.Tensor


@dataclass(frozen=True)
class TreeFlashLoss(BlockLoss):
    """``BlockLoss`` plus what TreeFlash's backbone-only (DFlash) metrics read."""

    # Shape: (B, N, K, H) the backbone's normed hidden states
    normed: torch.Tensor


def dflash_loss(
    drafter: DFlashDraftModel,
    target: Target,
    batch: dict[str, torch.Tensor],
    blocks: Blocks,
    weights: torch.Tensor,
    kind: Literal["ce", "kl"],
) -> BlockLoss:
    """The DFlash loss of a batch with features: depth-weighted mean over valid slots of the cross-entropy to
    the data token (``ce``) or the forward KL to the target's top-k (``kl``)."""
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
    (teacher-forced previous token) to the target's top-k, over valid slots."""
    hidden = block_hidden(drafter.model, target, batch, blocks)
    normed = drafter.model.norm(hidden)
    prev = target.embed_tokens(blocks.prev_tokens).to(hidden.dtype)
    corrected = target.lm_head(drafter.correct(hidden, normed, prev))
    t_ids, t_lp = teacher_at(batch, blocks.teacher_index)
    loss = weighted_slot_mean(forward_kl_topk(corrected, t_ids, t_lp), blocks.label_mask, weights)
    return TreeFlashLoss(loss, corrected, t_ids, t_lp, normed)
