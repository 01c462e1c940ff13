"""The EAGLE-3 loss with the training-time-test unroll (docs/algorithms.md §6), without Lightning: the
LightningModule (trainer/training/eagle3.py, whose docstring describes the unroll, its attention and the loss) and
the training-step API (trainer/training/step.py) call these, so the family has one loss in the codebase.

A batch has ``input_ids``, ``loss_mask``, ``position_ids``, ``doc_ids`` (B, T) and the target's ``features`` and
teacher top-k (``trainer.data.features.with_features``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from trainer.data.features import teacher_at
from trainer.drafters.attention import MaskRule, packed_causal_rule
from trainer.drafters.eagle3 import Eagle3DraftModel
from trainer.losses import draft_teacher, soft_cross_entropy_and_kl
from trainer.target import Target


@dataclass
class TTTStep:
    """One unrolled step over a batch of rows. Every tensor: Shape (B, T), indexed by the origin position ``t``."""

    # The token whose embedding is fed: x_{t+1+i}
    tokens: torch.Tensor
    # RoPE positions: position_ids[t] + i
    positions: torch.Tensor
    # The token to predict: x_{t+2+i}
    labels: torch.Tensor
    # Where the target's distribution over that token sits: t+1+i
    teacher_index: torch.Tensor
    # bool: the label lies in the same sample as t and under the loss mask
    label_mask: torch.Tensor


def ttt_step(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor, step: int
) -> TTTStep:
    """Inputs and labels of unrolled step ``step`` (0-based) for packed rows. Shape: (B, T) each."""
    t = input_ids.shape[1]
    origin = torch.arange(t, device=input_ids.device)
    # Indices past the row end are clamped to stay gatherable; label_mask drops those positions.
    fed = (origin + 1 + step).clamp(max=t - 1).expand_as(input_ids)
    label = (origin + 2 + step).clamp(max=t - 1).expand_as(input_ids)
    label_mask = (
        (origin + 2 + step < t)
        & (doc_ids.gather(1, label) == doc_ids)
        & (doc_ids > 0)
        & loss_mask.gather(1, label).bool()
    )
    return TTTStep(
        tokens=input_ids.gather(1, fed),
        positions=position_ids + step,
        labels=input_ids.gather(1, label),
        teacher_index=fed,
        label_mask=label_mask,
    )


def ttt_mask_rule(doc_ids: torch.Tensor, step: int) -> MaskRule:
    """The attention of unrolled step ``step`` over the keys of steps 0..step: causal within the query's sample
    for step 0, only the query's own origin position for steps 1..step."""
    return packed_causal_rule(doc_ids, step + 1)


def eagle3_unroll(
    drafter: Eagle3DraftModel, target: Target, batch: dict[str, torch.Tensor], ttt_steps: int
) -> tuple[list[torch.Tensor], list[TTTStep]]:
    """Pre-norm drafter outputs (B, T, H) and the step description of every unrolled step."""
    dtype = drafter.fc.weight.dtype
    hidden = drafter.fuse(batch["features"].to(dtype))
    cache = drafter.make_cache()
    outputs, steps = [], []
    for i in range(ttt_steps):
        step = ttt_step(batch["input_ids"], batch["loss_mask"], batch["position_ids"], batch["doc_ids"], i)
        embeds = target.embed_tokens(step.tokens).to(dtype)
        mask = ttt_mask_rule(batch["doc_ids"], i)
        hidden = drafter(hidden, embeds, step.positions, mask, past_key_values=cache, use_cache=True)
        outputs.append(hidden)
        steps.append(step)
    return outputs, steps


class UnrolledStep(NamedTuple):
    """One unrolled step's outputs: draft logits (B, T, Vd), the step, the teacher's top-k ids (B, T, k), the KL to
    the restricted teacher (B, T) and the loss mask (B, T)."""

    logits: torch.Tensor
    step: TTTStep
    teacher_ids: torch.Tensor
    kl: torch.Tensor
    mask: torch.Tensor


class Eagle3Loss(NamedTuple):
    """``Σ_i step_decay^i · CE_i`` and each unrolled step's outputs."""

    loss: torch.Tensor
    steps: list[UnrolledStep]


def eagle3_loss(
    drafter: Eagle3DraftModel, target: Target, batch: dict[str, torch.Tensor], ttt_steps: int, step_decay: float
) -> Eagle3Loss:
    """``Σ_i step_decay^i · CE_i`` of a batch with features, and per unrolled step its outputs."""
    vocab = drafter.draft_vocab
    outputs, steps = eagle3_unroll(drafter, target, batch, ttt_steps)
    loss = torch.zeros((), device=batch["input_ids"].device)
    per_step = []
    for i, (hidden, step) in enumerate(zip(outputs, steps, strict=True)):
        logits = drafter.logits(hidden)
        t_ids, t_lp = teacher_at(batch, step.teacher_index)
        d_ids, d_logp, in_vocab = draft_teacher(t_ids, t_lp, vocab)
        mask = step.label_mask & in_vocab[..., 0]
        ce, kl = soft_cross_entropy_and_kl(logits, d_ids, d_logp, in_vocab)
        m = mask.float()
        loss = loss + step_decay**i * (ce * m).sum() / m.sum().clamp(min=1)
        per_step.append(UnrolledStep(logits, step, t_ids, kl, mask))
    return Eagle3Loss(loss, per_step)
