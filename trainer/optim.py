"""The optimiser every recipe uses: AdamW (no decay on norms and biases), linear warm-up, cosine to a floor."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


def adamw_warmup_cosine(
    params: Iterable[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float,
    betas: tuple[float, float] = (0.9, 0.999),
) -> dict[str, Any]:
    """A LightningModule ``configure_optimizers`` result, stepping the schedule every optimiser step."""
    params = list(params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=betas,
    )
    total = max(1, total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
