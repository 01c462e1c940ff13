"""Additive attention masks: ``0`` where a query may attend a key, ``finfo(dtype).min`` where it may not.

HF attention adds a float mask to the scores; a boolean mask is silently wrong with eager attention (which
adds it), so every mask of the package (packed samples, training blocks, the training-time test, draft and
verification trees) is built as a boolean "allowed" tensor and turned into this form here.
"""

from __future__ import annotations

import torch


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as an additive mask in ``dtype``; a float mask is already additive
    and only moved into ``dtype``'s range (``finfo(float32).min`` would overflow to -inf in float16).
    Shape: any → the same."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask.to(dtype).clamp_min(torch.finfo(dtype).min)
