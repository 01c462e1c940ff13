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
V·4, fixed at construction whatever the traffic; a batch's scratch is R·9 bytes plus a few times its own size.

Try it::

    python -c "import torch; from trainer.adapt.candidates import CandidateTable; t = CandidateTable(16, 4, 3); \\
        t.add(torch.tensor([1, 1]), torch.tensor([[2, 3], [3, 5]]), torch.tensor([[700, 200], [900, 50]]), 1); \\
        print(t.adjacency(2))"
"""

from __future__ import annotations

import numpy as np
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


# Held candidates are matched against a batch this many nodes at a time: the (C, K, nodes) comparison stays
# a few MB whatever the batch size.
_MATCH_NODES = 8192


def _segment_starts(sorted_keys: np.ndarray) -> np.ndarray:
    """Index of the first element of every run of equal values in ``sorted_keys`` (non-empty)."""
    return np.flatnonzero(np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]]))


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
        rows, cands, weights = np.asarray(rows.numpy(), dtype=np.int64), cands.numpy(), weights.numpy()
        live = (cands >= 0) & (weights > 0)
        keep = torch.from_numpy(live).any(dim=1).numpy()
        if not keep.all():
            rows, cands, weights, live = rows[keep], cands[keep], weights[keep], live[keep]
        if rows.size:
            rows, cands, weights, live = self._allocate(rows, cands, weights, live, tick)
        if rows.size == 0:
            return 0
        node_slots = self.slot.numpy()[rows]
        held = np.zeros(self.row.shape[0], dtype=bool)
        held[node_slots] = True
        touched = np.flatnonzero(held)
        # The batch works on a copy of its touched rows, renumbered 0..T-1 (``local``), written back once.
        local = np.empty(self.row.shape[0], dtype=np.int64)
        local[touched] = np.arange(touched.size)
        ids, score = self.ids.numpy()[touched], self._decayed(touched, tick)
        self._merge(ids, score, local[node_slots], cands, weights, live)
        np.minimum(score, _MAX_SCORE, out=score)
        self.ids.numpy()[touched] = ids
        self.score.numpy()[touched] = score
        return touched.size

    def _allocate(
        self, rows: np.ndarray, cands: np.ndarray, weights: np.ndarray, live: np.ndarray, tick: int
    ) -> tuple[np.ndarray, ...]:
        """Give every new row a slot, evicting least recently touched rows; drop what cannot be held."""
        slot, row, touched = self.slot.numpy(), self.row.numpy(), self.touched.numpy()
        new_mask = slot[rows] < 0
        if not new_mask.any():
            return rows, cands, weights, live
        new, inverse = np.unique(rows[new_mask], return_inverse=True)
        free = np.flatnonzero(row < 0)
        if new.size > free.size:
            in_batch = np.zeros(row.shape[0], dtype=bool)
            in_batch[slot[rows[~new_mask]]] = True
            evictable = np.flatnonzero((row >= 0) & ~in_batch)
            # Held tokens are distinct, so (touched, token) orders the evictable rows totally.
            evict = evictable[np.lexsort((row[evictable], touched[evictable]))][: new.size - free.size]
            slot[row[evict]] = -1
            row[evict] = -1
            self.ids.numpy()[evict] = -1
            self.score.numpy()[evict] = 0
            free = np.flatnonzero(row < 0)
        if new.size > free.size:
            total = np.zeros(new.size, dtype=np.int64)
            np.add.at(total, inverse, (weights[new_mask] * live[new_mask]).sum(axis=1))
            admitted = np.zeros(new.size, dtype=bool)
            # Heaviest first, ties: smaller token id (new tokens are distinct: a total order).
            admitted[np.lexsort((new, -total))[: free.size]] = True
            self.dropped += int(total[~admitted].sum())
            keep = np.ones(rows.size, dtype=bool)
            keep[new_mask] = admitted[inverse]
            rows, cands, weights, live = rows[keep], cands[keep], weights[keep], live[keep]
            new = new[admitted]
        taken = free[: new.size]
        slot[new] = taken
        row[taken] = new
        touched[taken] = tick
        return rows, cands, weights, live

    def _decayed(self, slots: np.ndarray, tick: int) -> np.ndarray:
        """Scores of ``slots`` (T,) decayed to ``tick``, shape (T, C); their clock moves to ``tick``."""
        slots_t = torch.from_numpy(slots)
        age = (tick - self.touched[slots_t]).double()
        factor = torch.floor(torch.exp2(_Q - age / self.half_life)).long()
        self.touched[slots_t] = tick
        score = self.score.numpy()[slots]
        score *= factor.numpy()[:, None]
        score >>= _Q
        return score

    def _merge(
        self,
        ids: np.ndarray,
        score: np.ndarray,
        node_local: np.ndarray,
        cands: np.ndarray,
        weights: np.ndarray,
        live: np.ndarray,
    ) -> None:
        """Add a batch to the touched rows ``ids``, ``score`` (T, C), in place; ``node_local`` (N,) is each node's
        row in them, ``cands``, ``weights``, ``live`` (N, K) its candidates."""
        T, C, V = ids.shape[0], self.candidates, self.vocab_size
        N, K = cands.shape
        # Column + 1 of each candidate in its row, 0 when not held (a row holds an id at most once, and a live id
        # never equals an empty column's -1), found by comparing candidate-major (K, n) blocks with the nodes' row
        # ids (C, n): every pass runs over n contiguous nodes. Live ids are < V < 2**23: int32 is exact, and dead
        # entries are masked by ``live`` whatever their cast value.
        by_k = np.ascontiguousarray(cands.T, dtype=np.int32)
        ids_by_column = np.ascontiguousarray(ids.T)
        column_by_k = np.empty((K, N), dtype=np.uint8 if C < 256 else np.int32)
        column_weights = np.arange(1, C + 1, dtype=column_by_k.dtype)[:, None, None]
        hits = np.empty((C, K, min(N, _MATCH_NODES)), dtype=bool)
        for start in range(0, N, _MATCH_NODES):
            nodes = slice(start, start + _MATCH_NODES)
            # ``take`` keeps (C, n) C-contiguous (``[:, index]`` would not).
            row_ids = np.take(ids_by_column, node_local[nodes], axis=1)
            chunk_hits = hits[:, :, : row_ids.shape[1]]
            np.equal(row_ids[:, None, :], by_k[None, :, nodes], out=chunk_hits)
            np.max(chunk_hits * column_weights, axis=0, out=column_by_k[:, nodes])
        column = np.ascontiguousarray(column_by_k.T).reshape(-1)
        # Flat (N * K) positions of the live entries, held or not; position ``p`` belongs to node ``p // K``.
        found = column > 0
        live = live.reshape(-1)
        held_at = np.flatnonzero(live & found)
        fresh_at = np.flatnonzero(live & ~found)
        cands, weights = cands.reshape(-1), weights.reshape(-1)
        cell = node_local[held_at // K] * C + column[held_at] - 1
        np.add.at(score.reshape(-1), cell, weights[held_at])
        if fresh_at.size == 0:
            return
        # Candidates not held, summed per (row, token) key; ``pairs`` comes out sorted, so row-major. Keys fit
        # int32 in most batches, which halves the sort.
        keys = node_local[fresh_at // K] * V + cands[fresh_at]
        keys, order = torch.sort(torch.from_numpy(keys.astype(np.int32) if T * V <= 1 << 31 else keys))
        keys = keys.numpy()
        starts = _segment_starts(keys)
        pairs = keys[starts].astype(np.int64)
        pair_w = np.add.reduceat(weights[fresh_at][order.numpy()], starts)
        new_row, new_id = pairs // V, pairs % V
        # New candidates compete with their row's held ones; each affected row keeps its C best. One stable
        # sort on (row, score descending): ties keep the held candidate, then the smaller token id.
        occupied = ids >= 0
        # A new candidate that does not beat the weakest of a full row cannot enter it: leave it out of the sort.
        floor = np.where(occupied.all(axis=1), score.min(axis=1), -1)
        enters = pair_w > floor[new_row]
        if not enters.any():
            return
        new_row, new_id, new_w = new_row[enters], new_id[enters], pair_w[enters]
        # Only rows that some new candidate enters are rebuilt; ``new_local`` renumbers them 0..A-1.
        first = _segment_starts(new_row)
        rebuilt = new_row[first]
        A = rebuilt.size
        new_local = np.zeros(new_row.size, dtype=np.int64)
        new_local[first[1:]] = 1
        np.cumsum(new_local, out=new_local)
        held_cell = np.flatnonzero(occupied[rebuilt])  # flat (A * C) positions of the held candidates
        all_row = np.concatenate([held_cell // C, new_local])
        all_id = np.concatenate([ids[rebuilt].reshape(-1)[held_cell], new_id.astype(np.int32)])
        all_score = np.concatenate([score[rebuilt].reshape(-1)[held_cell], new_w])
        key = (all_row << _SCORE_BITS) | (_SCORE_MASK - np.minimum(all_score, _SCORE_MASK))
        order = torch.sort(torch.from_numpy(key), stable=True).indices.numpy()
        all_row, all_id, all_score = all_row[order], all_id[order], all_score[order]
        counts = np.bincount(all_row, minlength=A)
        rank = np.arange(all_row.size) - np.repeat(np.cumsum(counts) - counts, counts)
        kept = rank < C
        cell = all_row[kept] * C + rank[kept]
        rows_ids = np.full(A * C, -1, dtype=np.int32)
        rows_score = np.zeros(A * C, dtype=np.int64)
        rows_ids[cell] = all_id[kept]
        rows_score[cell] = all_score[kept]
        ids[rebuilt] = rows_ids.reshape(A, C)
        score[rebuilt] = rows_score.reshape(A, C)

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
        """The tensors that restore this table exactly: the held slots and their contents (a free slot holds
        nothing a later batch reads), and the slot count. ``slot`` is derived from ``row``. At a 152k
        vocabulary with a few tens of thousands of rows held, that is a fifth of the whole arrays."""
        held = (self.row >= 0).nonzero().squeeze(1)
        return {
            "capacity": torch.tensor([self.row.shape[0]], dtype=torch.int64),
            "slots": held,
            "row": self.row[held],
            "touched": self.touched[held],
            "ids": self.ids[held],
            "score": self.score[held],
        }

    @classmethod
    def from_state(
        cls, tensors: dict[str, torch.Tensor], vocab_size: int, half_life: float, dropped: int
    ) -> CandidateTable:
        slots = tensors["slots"]
        table = cls(vocab_size, int(tensors["capacity"][0]), tensors["ids"].shape[1], half_life)
        table.row[slots], table.touched[slots] = tensors["row"], tensors["touched"]
        table.ids[slots], table.score[slots] = tensors["ids"].to(torch.int32), tensors["score"]
        held = (table.row >= 0).nonzero().squeeze(1)
        table.slot[table.row[held]] = held.to(torch.int32)
        table.dropped = dropped
        return table
