"""Packing short samples into rows of ``max_length`` without attention across samples.

A packed row carries ``doc_ids`` (1, 2, ... per sample; 0 marks padding) and ``position_ids`` that restart
at 0 for every sample. ``packed_attention_mask`` turns ``doc_ids`` into the 4-D additive mask that HF models
take (``0`` where allowed, ``finfo.min`` elsewhere): causal and within one sample. A boolean mask would be
silently wrong with eager attention, which adds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.data.render import Rendered
from trainer.drafters.attention import additive_mask, packed_causal_rule
from trainer.errors import UserError


@dataclass
class PackedRow:
    # Shape: (T,) each, T <= max_length
    input_ids: list[int]
    loss_mask: list[int]
    position_ids: list[int]
    doc_ids: list[int]


def truncate(sample: Rendered, max_length: int) -> Rendered:
    return Rendered(sample.input_ids[:max_length], sample.loss_mask[:max_length], sample.text)


def pack(samples: Iterable[Rendered], max_length: int, packing: bool = True) -> list[PackedRow]:
    """Greedy in-order packing: a sample joins the current row when it fits, else starts a new row.

    Samples longer than ``max_length`` must be truncated before; a sample with no loss-mask token is dropped
    (it would only cost compute). Without ``packing`` every sample is its own row.
    """
    rows: list[PackedRow] = []
    current: PackedRow | None = None
    for sample in samples:
        n = len(sample.input_ids)
        if n > max_length:
            raise UserError(f"sample of {n} tokens exceeds max_length {max_length}; truncate it first")
        if n < 2 or not any(sample.loss_mask[1:]):
            continue
        if current is None or not packing or len(current.input_ids) + n > max_length:
            current = PackedRow([], [], [], [])
            rows.append(current)
        doc = (current.doc_ids[-1] if current.doc_ids else 0) + 1
        current.input_ids += sample.input_ids
        current.loss_mask += sample.loss_mask
        current.position_ids += list(range(n))
        current.doc_ids += [doc] * n
    return rows


def loss_token_counts(rows: Iterable[Mapping[str, Any]], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs under the loss mask of rows with ``input_ids`` / ``loss_mask`` (lists or
    tensors). Shape: (V,)"""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
        counts += torch.bincount(ids[torch.as_tensor(row["loss_mask"]).bool()], minlength=vocab_size)
    return counts


def collate(rows: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pads rows of ``input_ids``/``loss_mask``/``position_ids``/``doc_ids`` to the longest one."""
    width = max(len(r["input_ids"]) for r in rows)

    def padded(key: str, fill: int) -> torch.Tensor:
        out = torch.full((len(rows), width), fill, dtype=torch.long)
        for i, r in enumerate(rows):
            # Lists (online rows) and int32/int8 tensor views (cache rows) alike, one vectorised copy each.
            values = torch.as_tensor(r[key])
            out[i, : len(values)] = values
        return out

    return {
        "input_ids": padded("input_ids", pad_id),
        "loss_mask": padded("loss_mask", 0),
        "position_ids": padded("position_ids", 0),
        "doc_ids": padded("doc_ids", 0),
    }


# What a row carries besides its tokens when its target features were computed before (a feature cache, or a
# daemon's own): the concatenated hidden states, and the teacher's top-k ids and log-probs per position.
FEATURE_KEYS = ("features", "teacher_topk_ids", "teacher_topk_logprobs")


def collate_features(rows: list[dict], pad_id: int) -> dict:
    """``collate`` plus right-padded ``FEATURE_KEYS`` when the rows carry them (offline)."""
    batch = collate(rows, pad_id)
    if "features" in rows[0]:
        width = batch["input_ids"].shape[1]
        for key in FEATURE_KEYS:
            first = rows[0][key]
            out = torch.zeros((len(rows), width, first.shape[-1]), dtype=first.dtype)
            for i, r in enumerate(rows):
                out[i, : r[key].shape[0]] = r[key]
            batch[key] = out.long() if key == "teacher_topk_ids" else out
    return batch


def packed_attention_mask(doc_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Shape: doc_ids (B, T) → additive mask (B, 1, T, T). Causal within a sample; padding sees itself only."""
    return additive_mask(packed_causal_rule(doc_ids).dense(), dtype)
