"""Nucleus (top-p) filtering, shared by speculative verification (``trainer.spec.verify``) and data
regeneration (``trainer.data.regenerate``), so that both sample from the same warped distribution."""

from __future__ import annotations

import torch


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` kept on the smallest set of most likely tokens whose mass reaches ``top_p`` (the token that
    crosses it included, so never empty) and renormalised there. Shape: (..., V) → (..., V)"""
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs * keep)
    return kept / kept.sum(-1, keepdim=True)
