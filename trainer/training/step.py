"""The training-step API: one optimiser step of a drafter against the frozen target, without a Lightning Trainer.

The adaptation daemons (``trainer adapt bandit``) call these. Each family's function computes its loss with
the function its LightningModule's training step calls (``dflash_loss``, ``treeflash_loss`` in
trainer/training/block_losses.py), with the same anchor draws for the same ``(seed, step)``,
so a step here equals one step of the LightningModule on the same batch. On CPU::

    target = Target(load_causal_lm("checkpoints/target_tiny"), drafter.target_layer_ids)
    batch = context_batch([ids], [len(prompt)], pad_id=0)
    loss = dflash_step(drafter, target, batch, torch.optim.AdamW(params, 1e-4), step=0)

The parameter subset is the optimiser's: parameters outside it keep their values (their gradients are
dropped). A non-finite loss or gradient raises ``NonFiniteStep`` before the optimiser moves anything.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

from trainer.data.features import with_features
from trainer.data.pack import collate
from trainer.drafters.dflash import DFlashDraftModel
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.target import Target
from trainer.training.block_batches import slot_weights
from trainer.training.block_losses import block_batch, blocks_at, dflash_loss, treeflash_loss


class NonFiniteStep(ArithmeticError):
    """The loss or a gradient was NaN/inf; the optimiser did not step."""


@dataclass(frozen=True)
class BlockStepOptions:
    """What a block-drafter step reads besides the batch; the LightningModules' arguments of the same names."""

    topk: int = 32
    gamma: float = 7.0
    max_anchors: int = 32
    seed: int = 0
    loss: Literal["ce", "kl"] = "ce"


def context_batch(sequences: list[list[int]], loss_starts: list[int], pad_id: int) -> dict[str, torch.Tensor]:
    """Logged contexts (prompt + output ids) as a block-drafter batch, one sample per row: the loss covers
    positions from ``loss_starts[i]`` on (the output), as the chat template's loss mask covers a reply."""
    rows = [
        {
            "input_ids": ids,
            "loss_mask": [0] * start + [1] * (len(ids) - start),
            "position_ids": list(range(len(ids))),
            "doc_ids": [1] * len(ids),
        }
        for ids, start in zip(sequences, loss_starts, strict=True)
    ]
    return collate(rows, pad_id)


def _apply(loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> float:
    """Backward and step, unless the loss or a gradient is not finite (then nothing moves)."""
    optimizer.zero_grad(set_to_none=True)
    value = float(loss.detach())
    if not math.isfinite(value):
        raise NonFiniteStep(f"loss is {value}")
    loss.backward()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not torch.isfinite(p.grad).all():
                optimizer.zero_grad(set_to_none=True)
                raise NonFiniteStep("a gradient is not finite")
    optimizer.step()
    return value


@contextmanager
def _stepping(drafter: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Train mode, with ``requires_grad`` off for the drafter's parameters outside the optimiser (restored)."""
    inside = {id(p) for group in optimizer.param_groups for p in group["params"]}
    frozen = [p for p in drafter.parameters() if id(p) not in inside and p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    drafter.train()
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def dflash_step(
    drafter: DFlashDraftModel,
    target: Target,
    batch: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    step: int,
    options: BlockStepOptions = BlockStepOptions(),
) -> float:
    """One DFlash step on ``batch`` (online: the target computes features); returns the loss before the step."""
    return _block_step(drafter, target, batch, optimizer, step, options)


def treeflash_step(
    drafter: TreeFlashDraftModel,
    target: Target,
    batch: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    step: int,
    options: BlockStepOptions = BlockStepOptions(),
) -> float:
    """One TreeFlash step (forward KL of the corrected distribution); ``options.loss`` is not read."""
    return _block_step(drafter, target, batch, optimizer, step, options)


def _family_loss(drafter, target, batch, blocks, options) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits (B, N, K, V)) of the drafter's family; TreeFlash's logits are the corrected ones."""
    backbone = drafter.model if isinstance(drafter, TreeFlashDraftModel) else drafter
    weights = slot_weights(backbone.block_size, options.gamma, device=batch["input_ids"].device)
    if isinstance(drafter, TreeFlashDraftModel):
        loss, _, logits, *_ = treeflash_loss(drafter, target, batch, blocks, weights)
    else:
        loss, logits, *_ = dflash_loss(drafter, target, batch, blocks, weights, options.loss)
    return loss, logits


def _block_step(drafter, target, batch, optimizer, step: int, options: BlockStepOptions) -> float:
    backbone = drafter.model if isinstance(drafter, TreeFlashDraftModel) else drafter
    with _stepping(drafter, optimizer):
        batch, blocks = block_batch(backbone, target, batch, options.topk, options.max_anchors, options.seed, step)
        return _apply(_family_loss(drafter, target, batch, blocks, options)[0], optimizer)


@torch.no_grad()
def block_logits(
    drafter: DFlashDraftModel | TreeFlashDraftModel,
    target: Target,
    batch: dict[str, torch.Tensor],
    anchors: torch.Tensor,
    options: BlockStepOptions = BlockStepOptions(),
) -> torch.Tensor:
    """The drafter's logits of every slot of blocks anchored at ``anchors`` (slot ``k`` drafts position
    ``anchor + k``), computed by the family's loss function; TreeFlash's are the corrected ones, teacher-forced on
    the batch's tokens. No gradient, nothing stepped. Shape: anchors (B, N) → (B, N, K, V)
    """
    backbone = drafter.model if isinstance(drafter, TreeFlashDraftModel) else drafter
    batch = with_features(batch, target, options.topk)
    return _family_loss(drafter, target, batch, blocks_at(backbone, batch, anchors, anchors >= 0), options)[1]
