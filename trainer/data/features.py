"""Online target features: the frozen target runs inside the training step.

``online_features`` returns what a feature cache stores for the same rows (``trainer.data.cache``): the
concatenated hidden states of the drafter's target layers, and the teacher's top-k token ids and log-probs at
every position (the distribution of the *next* token after that position). ``with_features`` is what a
LightningModule calls: it leaves an offline batch as it is and fills an online one.
"""

from __future__ import annotations

import torch

from trainer.data.pack import FEATURE_KEYS, packed_attention_mask
from trainer.target import Target

__all__ = ["FEATURE_KEYS", "online_features", "with_features"]


@torch.no_grad()
def online_features(target: Target, batch: dict[str, torch.Tensor], topk: int) -> dict[str, torch.Tensor]:
    """Shape: input_ids (B, T) → features (B, T, n·H), teacher_topk_ids / _logprobs (B, T, k).

    Packed rows are honoured: the 4-D mask keeps samples apart and positions restart per sample.
    """
    dtype = next(target.parameters()).dtype
    mask = packed_attention_mask(batch["doc_ids"], dtype=dtype)
    out = target(batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"])
    logprobs = torch.log_softmax(out.logits.float(), dim=-1)
    top = logprobs.topk(topk, dim=-1)
    return {"features": out.features, "teacher_topk_ids": top.indices, "teacher_topk_logprobs": top.values}


def teacher_at(batch: dict[str, torch.Tensor], index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids and log-probs at row positions ``index`` of a batch with features.

    Shape: index (B, ...) long → (B, ..., k) each
    """
    flat = index.flatten(1)[..., None]
    k = batch["teacher_topk_ids"].shape[-1]

    def take(values: torch.Tensor) -> torch.Tensor:
        return values.gather(1, flat.expand(-1, -1, k)).view(*index.shape, k)

    return take(batch["teacher_topk_ids"]), take(batch["teacher_topk_logprobs"])


def with_features(batch: dict[str, torch.Tensor], target: Target | None, topk: int) -> dict[str, torch.Tensor]:
    """The batch with features: as read from a cache (offline), or computed now by ``target`` (online)."""
    if all(k in batch for k in FEATURE_KEYS):
        return batch
    if target is None:
        raise ValueError("an online batch needs the target to compute its features")
    return {**batch, **online_features(target, batch, topk)}
