"""A bounded, recency-weighted table of successor candidates per token: the aggregation behind ``adapt graft``.

Evidence is "after token ``row`` the target put ``cand`` in its top-k with probability ``p``". Each held row keeps
at most ``candidates`` (C) successors with integer scores (fixed point, ``SCALE`` = probability 1). A batch of
evidence is applied as one unit, at one tick (the caller's clock; the daemon counts log lines):

1. rows seen for the first time take a free slot; when ``rows`` (R) slots are all held, the least recently
   touched rows not in this batch are evicted (ties: smaller token id first); rows that still find no slot are
   dropped, smallest batch weight first, and their weight is counted in ``dropped``.
2. every touched row decays by ``2 ** (-(tick - touched) / half_life)`` (half-life in ticks), lazily: a row's
   candidates share one clock, so decay never changes the order inside a row and untouched rows cost nothing.
3. weights for candidates already in the row are added; new candidates compete with the row's decayed scores,
   and the row keeps its C best (score descending; ties keep the held candidate, then the smaller token id).

The result of a batch depends on the batch's evidence as a multiset, not on its order: scores are integers
(sums are exact in any order), every sort is stable on a deterministic key. So replaying the same batches
gives bit-identical tables, which is what a restart after SIGKILL relies on. Memory is R·(12·C + 16) bytes +
V·4, fixed at construction whatever the traffic.

Try it::

    python -c "import torch; from trainer.adapt.candidates import CandidateTable; t = CandidateTable(16, 4, 3); \\
        t.add(torch.tensor([1, 1]), torch.tensor([[2, 3], [3, 5]]), torch.tensor([[700, 200], [900, 50]]), 1); \\
        print(t.adjacency(2))"
"""

from __future__ import annotations

import torch

# Fixed-point unit of evidence: probability 1.0.
SCALE = 1 << 10
# Decay factors are applied as (score * factor) >> _Q with factor = floor(2**_Q * 2**(-Δ/half_life)).
_Q = 24
# Scores saturate here so that score * factor never overflows int64.
_MAX_SCORE = 1 << 32
# A merge sorts on row << _SCORE_BITS | inverted score in one int64: rows (< V) must fit in the other bits.
_SCORE_BITS = 40
_SCORE_MASK = (1 << _SCORE_BITS) - 1


def _stable_order(*keys: torch.Tensor) -> torch.Tensor:
    """Permutation sorting by ``keys[0]`` ascending, ties by ``keys[1]``, ...: stable sorts, last key first."""
    order = torch.arange(keys[0].numel())
    for key in reversed(keys):
        order = order[torch.sort(key[order], stable=True).indices]
    return order


class CandidateTable:
    """Successor candidates for at most ``rows`` of ``vocab_size`` tokens; see the module docstring."""

    def __init__(self, vocab_size: int, rows: int, candidates: int, half_life: float = 64.0) -> None:
        if not 0 < rows <= vocab_size < 1 << (63 - _SCORE_BITS) or candidates < 1 or half_life <= 0:
            raise ValueError(
                f"need 0 < rows <= vocab_size < 2**{63 - _SCORE_BITS}, candidates >= 1, half_life > 0; got "
                f"{rows}, {vocab_size}, {candidates}, {half_life}"
            )
        self.vocab_size, self.half_life = vocab_size, float(half_life)
        # Shape: (V,) slot of a token's row, -1 = not held.
        self.slot = torch.full((vocab_size,), -1, dtype=torch.int32)
        # Shape: (R,) token held in a slot, -1 = free; tick of the slot's last update.
        self.row = torch.full((rows,), -1, dtype=torch.int64)
        self.touched = torch.zeros(rows, dtype=torch.int64)
        # Shape: (R, C) candidate token ids (-1 = empty; int32 halves the row gathers) and their scores (0 when
        # empty).
        self.ids = torch.full((rows, candidates), -1, dtype=torch.int32)
        self.score = torch.zeros((rows, candidates), dtype=torch.int64)
        self.dropped = 0

    @property
    def candidates(self) -> int:
        return self.ids.shape[1]

    def held(self) -> int:
        return int((self.row >= 0).sum())

    def add(self, rows: torch.Tensor, cands: torch.Tensor, weights: torch.Tensor, tick: int) -> int:
        """Apply one batch: ``rows`` (N,) tokens, ``cands`` (N, K) successors (-1 = padding), ``weights``
        (N, K) int64 in ``SCALE`` units. ``tick`` increases from batch to batch. Returns the rows touched."""
        live = (cands >= 0) & (weights > 0)
        keep = live.any(dim=1)
        rows, cands, weights, live = rows[keep].long(), cands[keep].long(), weights[keep], live[keep]
        if rows.numel():
            rows, cands, weights, live = self._allocate(rows, cands, weights, live, tick)
        if rows.numel() == 0:
            return 0
        node_slots = self.slot[rows].long()
        touched = torch.unique(node_slots)
        self._decay(touched, tick)
        # Observation keys slot * V + candidate, -1 for padding. Shape: (N * K,).
        keys = torch.where(live, node_slots[:, None] * self.vocab_size + cands, -1).view(-1)
        self._merge(keys, weights.reshape(-1))
        self.score[touched] = self.score[touched].clamp(max=_MAX_SCORE)
        return touched.numel()

    def _allocate(
        self, rows: torch.Tensor, cands: torch.Tensor, weights: torch.Tensor, live: torch.Tensor, tick: int
    ) -> tuple[torch.Tensor, ...]:
        """Give every new row a slot, evicting least recently touched rows; drop what cannot be held."""
        new_mask = self.slot[rows] < 0
        if not new_mask.any():
            return rows, cands, weights, live
        new, inverse = torch.unique(rows[new_mask], return_inverse=True)
        free = (self.row < 0).nonzero().squeeze(1)
        if new.numel() > free.numel():
            in_batch = torch.zeros(self.row.shape[0], dtype=torch.bool)
            in_batch[self.slot[rows[~new_mask]].long()] = True
            evictable = ((self.row >= 0) & ~in_batch).nonzero().squeeze(1)
            evictable = evictable[_stable_order(self.touched[evictable], self.row[evictable])]
            evict = evictable[: new.numel() - free.numel()]
            self.slot[self.row[evict]] = -1
            self.row[evict] = -1
            self.ids[evict] = -1
            self.score[evict] = 0
            free = (self.row < 0).nonzero().squeeze(1)
        if new.numel() > free.numel():
            node_w = (weights[new_mask] * live[new_mask]).sum(1)
            total = torch.zeros(new.numel(), dtype=torch.int64).index_add_(0, inverse, node_w)
            admitted = torch.zeros(new.numel(), dtype=torch.bool)
            admitted[_stable_order(-total, new)[: free.numel()]] = True
            self.dropped += int(total[~admitted].sum())
            keep = torch.ones(rows.numel(), dtype=torch.bool)
            keep[new_mask] = admitted[inverse]
            rows, cands, weights, live = rows[keep], cands[keep], weights[keep], live[keep]
            new = new[admitted]
        taken = free[: new.numel()]
        self.slot[new] = taken.to(torch.int32)
        self.row[taken] = new
        self.touched[taken] = tick
        return rows, cands, weights, live

    def _decay(self, slots: torch.Tensor, tick: int) -> None:
        age = (tick - self.touched[slots]).double()
        factor = torch.floor(torch.exp2(_Q - age / self.half_life)).long()
        self.score[slots] = (self.score[slots] * factor[:, None]) >> _Q
        self.touched[slots] = tick

    def _merge(self, keys: torch.Tensor, weights: torch.Tensor) -> None:
        C, V = self.candidates, self.vocab_size
        # Sum the batch per (slot, token) key; ``pairs`` comes out sorted, so slot-major, padding (-1) first.
        pairs, inverse = torch.unique(keys, return_inverse=True)
        pair_w = torch.zeros(pairs.numel(), dtype=torch.int64).index_add_(0, inverse, weights)
        if pairs[0] < 0:
            pairs, pair_w = pairs[1:], pair_w[1:]
        # Pairs already held: compare with their row's C ids (a row holds an id at most once). Shape: (P, C).
        slot, token = pairs // V, (pairs % V).to(torch.int32)
        pair, column = (self.ids[slot] == token[:, None]).nonzero().unbind(1)
        self.score.view(-1)[slot[pair] * C + column] += pair_w[pair]
        found = torch.zeros(pairs.numel(), dtype=torch.bool)
        found[pair] = True
        if found.all():
            return
        # New candidates compete with their row's held ones; each affected row keeps its C best. One stable
        # sort on (row, score descending): ties keep the held candidate, then the smaller token id.
        new_id, new_w = token[~found], pair_w[~found]
        affected, new_row = torch.unique_consecutive(slot[~found], return_inverse=True)
        old_ids, old_score = self.ids[affected], self.score[affected]  # Shape: (A, C)
        occupied = old_ids >= 0
        # A new candidate that does not beat the weakest of a full row cannot enter it: leave it out of the sort.
        floor = torch.where(occupied.all(dim=1), old_score.min(dim=1).values, -1)
        enters = new_w > floor[new_row]
        if not enters.any():
            return
        # Only rows that some new candidate enters are rebuilt; ``local`` renumbers them 0..A-1.
        new_row, new_id, new_w = new_row[enters], new_id[enters], new_w[enters]
        rebuilt = torch.unique_consecutive(new_row)
        A = rebuilt.numel()
        local = torch.empty(affected.numel(), dtype=torch.int64)
        local[rebuilt] = torch.arange(A)
        affected, old_ids, old_score, occupied = (
            affected[rebuilt],
            old_ids[rebuilt],
            old_score[rebuilt],
            occupied[rebuilt],
        )
        all_row = torch.cat([torch.arange(A)[:, None].expand_as(old_ids)[occupied], local[new_row]])
        all_id = torch.cat([old_ids[occupied], new_id])
        all_score = torch.cat([old_score[occupied], new_w])
        key = (all_row << _SCORE_BITS) | (_SCORE_MASK - all_score.clamp(max=_SCORE_MASK))
        order = torch.sort(key, stable=True).indices
        all_row, all_id, all_score = all_row[order], all_id[order], all_score[order]
        counts = torch.bincount(all_row, minlength=A)
        rank = torch.arange(all_row.numel()) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        kept = rank < C
        ids = torch.full_like(old_ids, -1)
        score = torch.zeros_like(old_score)
        ids[all_row[kept], rank[kept]] = all_id[kept]
        score[all_row[kept], rank[kept]] = all_score[kept]
        self.ids[affected] = ids
        self.score[affected] = score

    def best(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, successors)``: the held rows with a live candidate, ascending, and their ``width`` best
        successors (R, width), score descending (ties: smaller id), -1 = empty."""
        held = (self.row >= 0).nonzero().squeeze(1)
        held = held[torch.sort(self.row[held]).indices]
        ids, score = self.ids[held].long(), self.score[held]
        # Empty and fully decayed candidates sort last; within a row: score descending, then id ascending.
        score = torch.where((ids >= 0) & (score > 0), score, torch.full_like(score, -1))
        by_id = torch.sort(torch.where(score >= 0, ids, torch.full_like(ids, self.vocab_size)), dim=1, stable=True)
        score = score.gather(1, by_id.indices)
        by_score = torch.sort(score, dim=1, descending=True, stable=True)
        best = by_id.values.gather(1, by_score.indices)[:, :width]
        best = torch.where(by_score.values[:, :width] > 0, best, torch.full_like(best, -1))
        if best.shape[1] < width:
            best = torch.cat([best, best.new_full((best.shape[0], width - best.shape[1]), -1)], dim=1)
        live = best[:, 0] >= 0
        return self.row[held][live], best[live]

    def adjacency(self, width: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        """(V, width) best successors per token (see ``best``), -1 = empty."""
        out = torch.full((self.vocab_size, width), -1, dtype=dtype)
        rows, best = self.best(width)
        out[rows] = best.to(dtype)
        return out

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors that restore this table exactly (``slot`` is derived from ``row``)."""
        return {"row": self.row, "touched": self.touched, "ids": self.ids, "score": self.score}

    @classmethod
    def from_state(
        cls, tensors: dict[str, torch.Tensor], vocab_size: int, half_life: float, dropped: int
    ) -> CandidateTable:
        rows, candidates = tensors["ids"].shape
        table = cls(vocab_size, rows, candidates, half_life)
        table.row, table.touched = tensors["row"].clone(), tensors["touched"].clone()
        table.ids, table.score = tensors["ids"].to(torch.int32), tensors["score"].clone()
        held = (table.row >= 0).nonzero().squeeze(1)
        table.slot[table.row[held]] = held.to(torch.int32)
        table.dropped = dropped
        return table
