"""Degeneration statistics of generated token sequences: verbatim loops and n-gram repetition.

A small target under greedy decoding falls into loops; a looping output makes any copying drafter look
good, so evaluation reports how much of the output loops next to every acceptance figure.
"""

from __future__ import annotations

from collections.abc import Sequence

LOOP_MIN_TOKENS = 16
LOOP_MAX_PERIOD = 32


def ends_in_loop(tokens: Sequence[int], min_tokens: int = LOOP_MIN_TOKENS, max_period: int = LOOP_MAX_PERIOD) -> bool:
    """Whether the sequence ends in a verbatim cycle: for some period ``p <= max_period`` the last
    ``max(2p, min_tokens)`` tokens repeat with period ``p`` (at least two full periods, at least
    ``min_tokens`` tokens)."""
    n = len(tokens)
    for p in range(1, max_period + 1):
        k = max(2 * p, min_tokens)
        if k > n:
            break
        tail = tokens[n - k :]
        if all(tail[i] == tail[i - p] for i in range(p, k)):
            return True
    return False


def ngram_repetition(tokens: Sequence[int], n: int = 4) -> float:
    """Fraction of the sequence's n-grams that already occurred earlier in it (0 when it has none)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)
