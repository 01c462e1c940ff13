"""Losses and distribution metrics shared by every drafter family.

The teacher is the target's next-token distribution, given as its top-k token ids and log-probs (what a
feature cache stores; online training uses the same form so both modes train identically). KL and TVD are
computed on that support: with k = 32 on a peaked target the mass outside it is small, and TVD is reported
as the lower bound it then is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.drafters.vocab import DraftVocab


def forward_kl_topk(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_lp: torch.Tensor) -> torch.Tensor:
    """``KL(p_T || q)`` on the teacher's top-k support, teacher renormalised there.

    Shape: student_logits (..., V), teacher_ids / teacher_lp (..., k) → (...)
    """
    p_log = torch.log_softmax(teacher_lp.float(), dim=-1)
    q_log = torch.log_softmax(student_logits.float(), dim=-1).gather(-1, teacher_ids)
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def tvd_topk(
    student_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_lp: torch.Tensor,
    support: torch.Tensor | None = None,
) -> torch.Tensor:
    """Total-variation distance, exact on the teacher's top-k and lumping the rest into one outcome (a lower
    bound of the full TVD). ``support`` (..., k) bool leaves out teacher entries outside it (a teacher restricted
    by :func:`draft_teacher`). Shape: (..., V), (..., k) → (...)"""
    p = teacher_lp.float().exp()
    q = torch.softmax(student_logits.float(), dim=-1).gather(-1, teacher_ids)
    if support is not None:
        p, q = p * support, q * support
    rest = (p.sum(-1) - q.sum(-1)).abs()
    return 0.5 * ((p - q).abs().sum(-1) + rest)


def cross_entropy(student_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Shape: (..., V), (...) → (...)"""
    return F.cross_entropy(student_logits.flatten(0, -2).float(), labels.flatten(), reduction="none").view(labels.shape)


def topk_coverage(student_logits: torch.Tensor, token: torch.Tensor, k: int) -> torch.Tensor:
    """Whether ``token`` is among the student's top-k. Shape: (..., V), (...) → (...) float."""
    top = student_logits.topk(k, dim=-1).indices
    return (top == token[..., None]).any(-1).float()


def weighted_slot_mean(values: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ w_k m v / Σ w_k m`` over blocks and slots. Shape: (B, N, K), (B, N, K), (K,) → ()"""
    w = weights * mask.float()
    return (values * w).sum() / w.sum().clamp(min=1e-8)


def draft_teacher(
    teacher_ids: torch.Tensor, teacher_lp: torch.Tensor, vocab: DraftVocab
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's top-k restricted to the draft vocabulary and renormalised there.

    Shape: (..., k) target ids and log-probs → draft ids (0 where none), log-probs (``finfo.min`` where the
    target id has no draft id), in-vocabulary mask, all (..., k).
    """
    in_vocab = vocab.t2d[teacher_ids]
    draft_ids = torch.where(in_vocab, vocab.to_draft(teacher_ids), 0)
    logp = teacher_lp.float().masked_fill(~in_vocab, torch.finfo(torch.float32).min)
    return draft_ids, torch.log_softmax(logp, dim=-1), in_vocab


def soft_cross_entropy_and_kl(
    student_logits: torch.Tensor, draft_ids: torch.Tensor, teacher_logp: torch.Tensor, in_vocab: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``-Σ p log q`` and ``Σ p (log p - log q)`` over the restricted teacher support.

    Shape: (..., Vd) draft logits, (..., k) from :func:`draft_teacher` → (...), (...)
    """
    q_log = torch.log_softmax(student_logits.float(), dim=-1).gather(-1, draft_ids)
    p = teacher_logp.exp().masked_fill(~in_vocab, 0.0)
    ce = -(p * q_log).sum(-1)
    kl = torch.where(in_vocab, p * (teacher_logp - q_log), 0.0).sum(-1)
    return ce, kl
