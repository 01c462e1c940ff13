"""Lossless tree verification (docs/algorithms.md §3): the tree attention mask, greedy and sampled acceptance, what a
step commits and when a request is done, and KV compaction to the accepted path.

Acceptance treats drafts as deterministic: at each node the target's own next token is decided (argmax,
or a draw from the target's warped distribution), and the walk moves to the child carrying it, if any. The
committed tokens are therefore exactly what the target alone would have produced (greedy) or distributed
exactly as the target's samples (sampling), whatever the tree. Pure functions; on CPU::

    python -c "
    import torch; from trainer.decoding.tree import Tree; from trainer.decoding.verify import GREEDY, accept
    t = Tree.from_lists([5, 7, 8], [-1, 0, 1]); print(accept(t, torch.eye(10)[[7, 9, 1]], GREEDY))"
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from trainer.decoding.tree import Tree
from trainer.drafters.attention import additive_mask
from trainer.sampling import draw, nucleus, top_rows


@dataclass(frozen=True)
class Sampling:
    """How the target's next token is chosen: greedy at temperature 0, else warped sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"sampling needs temperature >= 0, top_p in (0, 1] and top_k >= 0; got {self.temperature}, "
                f"{self.top_p}, {self.top_k}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The warped distribution: temperature, then top-k, then top-p (nucleus). Shape: (..., V) → (..., V)"""
        scores = logits.float() / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        return nucleus(scores.softmax(-1), self.top_p)

    def next_token(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        """One token from one row of logits. Shape: (V,)"""
        if self.greedy:
            return int(logits.argmax())
        return int(draw(self.probs(logits), generator))


GREEDY = Sampling()


def tree_attention_mask(tree: Tree, past_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask for verifying ``tree`` after ``past_len`` cached tokens: a node sees the whole prefix,
    its ancestors and itself. A float mask, because a boolean one is silently wrong with eager attention.
    Shape: (1, 1, N + 1, past_len + N + 1)"""
    n = tree.tokens.numel()
    mask = torch.zeros(1, 1, n, past_len + n, dtype=dtype, device=device)
    visible = tree.ancestor_mask().to(device)
    mask[0, 0, :, past_len:] = additive_mask(visible, dtype)
    return mask


@dataclass(frozen=True)
class Acceptance:
    # Node indices from the root (0) to the deepest accepted node.
    path: list[int]
    # The target's own token after the last accepted node.
    bonus: int

    @property
    def accepted(self) -> int:
        """Draft tokens accepted (the bonus excluded)."""
        return len(self.path) - 1


def accept(
    tree: Tree,
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator | None = None,
    top_ids: torch.Tensor | None = None,
) -> Acceptance:
    """Walk the tree along the target's own choices. ``logits`` Shape: (N + 1, V), row ``i`` = after node ``i``.
    ``top_ids`` (N + 1, k), when the caller has them: ``top_rows`` of ``logits``, whose first column is the
    greedy choice.

    Only the rows on the walk are looked at, so sampling draws exactly one token per committed position,
    like plain sampling does.
    """
    children = tree.children()
    # Greedy choices do not consume randomness: one pass over all rows costs less than one per row.
    argmax = None
    if sampling.greedy:
        argmax = (top_rows(logits, 1)[0] if top_ids is None else top_ids)[:, 0].tolist()
    node, path = 0, [0]
    while True:
        token = argmax[node] if argmax is not None else sampling.next_token(logits[node], generator)
        child = children[node].get(token)
        if child is None:
            return Acceptance(path, token)
        node = child
        path.append(node)


@dataclass(frozen=True)
class Verdict:
    """What verifying one tree decided: the walk, the tokens the step commits (``committed``), the nodes that enter
    the context (the walk's first ``len(new)``), and the logits' top-k ids when greedy verification found them."""

    acceptance: Acceptance
    new: list[int]
    path: list[int]
    top_ids: torch.Tensor | None


def verify_tree(
    tree: Tree, logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None, remaining: int,
    stops: set[int] | frozenset[int], topk: int = 0,
) -> Verdict:  # fmt: skip
    """Verify ``tree`` against the target's ``logits`` (Shape: (N + 1, V)) and cut what it commits to ``remaining``
    tokens and the first stop token. The decision half of every step, the same for one request (``engine.generate``)
    and for each row of a batch (``batch.BatchEngine._step``); ``drafting.commit_verdict`` then commits the verdict.
    ``topk``: the width of ``Verdict.top_ids`` under greedy verification, found in the pass that finds its choices
    (0: none), for a log hook that records each row's top-k."""
    top_ids = top_rows(logits, topk)[0] if topk and sampling.greedy else None
    acceptance = accept(tree, logits, sampling, generator, top_ids)
    new = committed(tree, acceptance, remaining, stops)
    return Verdict(acceptance, new, acceptance.path[: len(new)], top_ids)


def committed(tree: Tree, result: Acceptance, remaining: int, stops: set[int] | frozenset[int]) -> list[int]:
    """The tokens a step commits: the accepted drafts, then the target's bonus; never more than ``remaining``
    and never past a stop token. The first ``len(tokens)`` nodes of ``result.path`` enter the context."""
    tokens = tree.tokens.tolist()
    new = [tokens[node] for node in result.path[1:]] + [result.bonus]
    new = new[:remaining]
    for i, token in enumerate(new):
        if token in stops:
            return new[: i + 1]
    return new


def finish_reason(tokens: list[int], max_new_tokens: int, stops: set[int] | frozenset[int]) -> str | None:
    """Why a request whose new tokens are ``tokens`` (non-empty) is done: "stop" when the last is a stop token,
    "length" when it has ``max_new_tokens``; None while it goes on. The rule ``committed`` cuts a step by, checked
    after the prefill and after every step of one request (``engine.generate``) and of a batch's rows."""
    if tokens[-1] in stops:
        return "stop"
    return "length" if len(tokens) >= max_new_tokens else None


class GrowingLayer(DynamicLayer):
    """A full-attention KV layer over a preallocated buffer (B, heads, capacity, dim): appending writes the new
    positions in place and dropping positions shortens a view, so neither copies the cached prefix
    (``DynamicLayer`` concatenates, copying the whole cache at every forward). The buffer doubles when full.
    ``keys``/``values`` are views of the buffer's first ``get_seq_length()`` positions."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if not self._holds(key_states, end):
            self._key_buffer = _reserve(self.keys, key_states, start, end)
            self._value_buffer = _reserve(self.values, value_states, start, end)
        self._key_buffer[..., start:end, :] = key_states
        self._value_buffer[..., start:end, :] = value_states
        self.keys = self._key_buffer[..., :end, :]
        self.values = self._value_buffer[..., :end, :]
        return self.keys, self.values

    def _holds(self, key_states: torch.Tensor, end: int) -> bool:
        """The buffer has room for ``end`` positions and ``keys`` still views it (nothing replaced them)."""
        buffer = self._key_buffer
        return (
            buffer is not None
            and buffer.shape[-2] >= end
            and buffer.shape[:2] == key_states.shape[:2]
            and (end == key_states.shape[-2] or self.keys.data_ptr() == buffer.data_ptr())
        )


def _reserve(cached: torch.Tensor, new: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """A buffer for twice ``end`` positions holding the ``start`` cached ones."""
    buffer = new.new_empty((*new.shape[:2], max(2 * end, 256), new.shape[-1]))
    if start:
        buffer[..., :start, :] = cached
    return buffer


def cache_kwarg(model: PreTrainedModel) -> str:
    # transformers 5.24 renamed past_key_values to cache; earlier 5.x only knows the old name.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def growing_cache(config) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`GrowingLayer` s."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def compact_cache(cache: DynamicCache, past_len: int, keep: list[int]) -> None:
    """Keep the first ``past_len`` cached positions plus the tree positions ``keep`` (offsets after
    ``past_len``, increasing), dropping the rest of the verified tree. Kept positions move left in place, so
    only they are copied (none for a chain's accepted prefix); the cache then ends after them (a view)."""
    moved = [i for i, offset in enumerate(keep) if offset != i]
    end = past_len + len(keep)
    index = None
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, GrowingLayer):
            raise TypeError(
                f"tree verification compacts full-attention caches only; this target has a {type(layer).__name__}"
            )
        if not layer.is_initialized:
            continue
        if moved:
            if index is None or index.device != layer.keys.device:
                index = torch.tensor([keep[i] for i in moved], device=layer.keys.device) + past_len
                target = torch.tensor(moved, device=layer.keys.device) + past_len
            # Advanced indexing reads a copy first, so overlapping sources and destinations are safe.
            layer.keys[..., target, :] = layer.keys[..., index, :]
            layer.values[..., target, :] = layer.values[..., index, :]
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]
