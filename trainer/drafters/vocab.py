"""Reduced draft vocabulary for EAGLE-3 style heads: the most frequent target tokens of the training data.

Counts run over loss-masked tokens only (what the drafter must predict; ``trainer.data.pack.loss_token_counts``).
``d2t[d]`` is the offset that maps draft id ``d`` to target id ``d + d2t[d]``; ``t2d`` is a ``[V]`` bool mask of
the target ids that have a draft id. Draft ids are in target-id order, so ``d2t`` is non-decreasing, as the
reference exports have it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer.io import atomic_path


@dataclass
class DraftVocab:
    # Shape: (N,) int64
    d2t: torch.Tensor
    # Shape: (V,) bool
    t2d: torch.Tensor

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int) -> DraftVocab:
        """The ``size`` most frequent ids (ties by lower id), ordered by target id."""
        vocab = counts.numel()
        size = min(size, vocab)
        # Stable sort on descending counts keeps lower ids first among ties.
        order = torch.sort(counts, descending=True, stable=True).indices[:size]
        chosen = torch.sort(order).values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[chosen] = True
        return cls(d2t=chosen - torch.arange(size), t2d=t2d)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids of target ids that have one (``t2d[target_ids]`` must hold)."""
        target_draft = torch.cumsum(self.t2d.long(), 0) - 1
        return target_draft[target_ids]

    def save(self, path: Path) -> None:
        with atomic_path(path) as tmp:
            save_file({"d2t": self.d2t, "t2d": self.t2d}, str(tmp))

    @classmethod
    def load(cls, path: Path) -> DraftVocab:
        tensors = load_file(str(path))
        return cls(d2t=tensors["d2t"], t2d=tensors["t2d"])
