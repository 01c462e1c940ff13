"""The read side of a verifier log: its lines (``LogReader``) and batches of them as arrays (``decode_batch``).

**Lines.** ``LogReader`` tails a log directory: every finished line of every segment once, valid records or the
reason why not. Offsets are byte offsets keyed by segment stem, so a consumer that persists them (with what it
made of the records) resumes exactly where it stopped, across the ``.part`` -> ``.jsonl`` rename. An unfinished
last line of a ``.part`` segment is not an error: the reader stops before it and reads it once the writer
completes it. Lines are read in bounded chunks, so an oversized line costs at most ``max_line_bytes`` of memory.

**Columns**, the graft daemon's ingest path: step records decoded without a Python object per number.
``decode_batch(lines, vocab_size)`` gives for a batch of log lines what ``schema.decode`` gives line by line:
every valid step record, every valid request record (a dict), and a ``RecordError`` with the reason for every
other line; the valid step records come as one ``StepColumns``. A step line is parsed with simdjson, its five
lists are copied straight into numpy buffers (``Array.as_buffer``) and the list checks of ``validate`` run
vectorised over the whole batch; the other fields are checked against ``schema.FIELD_TYPES`` by one set lookup
of their types and a few comparisons (``_head_valid``). A line this path cannot prove valid (a failed check, a
duplicate key, a ``[`` inside a string or an extra list field, a request record, any parse error) is decoded by
``schema.decode``, so the reference validator decides every rejection and its reason, and a line is accepted here
only when it passes every check of ``validate`` with the same values (``tests/test_vlog_decoder.py`` compares the
two on mutated records). Both, on CPU::

    python -c "from trainer.vlog.reader import LogReader; \\
        [print(i.segment, i.start, i.record) for i in LogReader('runs/logs')]"
    python -c "import orjson; from trainer.vlog.reader import decode_batch; \\
        from trainer.vlog.schema import step_record; line = orjson.dumps(step_record(server='s', request='r', \\
        tenant=None, shareable=True, step=0, drafter=None, drafter_version=None, tree='chain', budget=1, pos=0, \\
        root=1, tokens=[2], parents=[-1], accepted=[0], bonus=3, topk_ids=[list(range(8))] * 2, \\
        topk_logprobs=[[-1.0] * 8] * 2, ms={'draft': 0, 'tree': 0, 'verify': 1})); \\
        print(decode_batch([line, b'{}'], vocab_size=8192))"
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, product
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
import simdjson

from trainer.vlog.schema import (
    FIELD_TYPES,
    FINISHED,
    LOGPROB_SLACK,
    MAX_LINE_BYTES,
    MIN_TOPK,
    OPTIONAL_STEP_TYPES,
    PART,
    PHASES,
    VERSION,
    RecordError,
    Segment,
    decode,
    list_segments,
)


@dataclass(frozen=True, slots=True)
class Item:
    """One line of the log: its segment's stem, the offset of the line and the offset after its newline, and the
    record (with ``raw``: the line's bytes) or why it was rejected. Read by name: not a tuple."""

    segment: str
    start: int
    end: int
    record: dict | bytes | RecordError


class LogReader:
    """Iterating yields what is readable now and stops; ``follow`` keeps tailing. ``offsets`` (a copy of the
    one given) advances past each yielded line. With ``raw`` a line comes as its bytes, for a consumer that
    decodes batches itself (``decode_batch``); lines over the limit and a truncated last line are
    still ``RecordError``."""

    def __init__(
        self,
        directory: str | Path,
        offsets: dict[str, int] | None = None,
        vocab_size: int | None = None,
        max_line_bytes: int = MAX_LINE_BYTES,
        chunk_bytes: int = 1 << 20,
        raw: bool = False,
    ) -> None:
        self.directory = Path(directory)
        self.offsets = dict(offsets or {})
        self.vocab_size = vocab_size
        self.max_line_bytes = max_line_bytes
        self.chunk_bytes = chunk_bytes
        self.raw = raw

    def __iter__(self) -> Iterator[Item]:
        for segment in list_segments(self.directory):
            yield from self._segment(segment)

    def follow(self, stop: threading.Event, interval: float = 0.2) -> Iterator[Item]:
        """Tail until ``stop`` is set, polling every ``interval`` seconds while nothing new arrives."""
        while not stop.is_set():
            idle = True
            for item in self:
                idle = False
                yield item
            if idle:
                stop.wait(interval)

    def _open(self, segment: Segment) -> tuple[BinaryIO, bool] | None:
        # A .part may be renamed between listing and opening; the finished name then holds the same bytes.
        for finished in (segment.finished, True):
            path = self.directory / (segment.stem + (FINISHED if finished else PART))
            try:
                return open(path, "rb"), finished
            except FileNotFoundError:
                continue
        # Removed since listing (retention): nothing left to read.
        return None

    def _segment(self, segment: Segment) -> Iterator[Item]:
        opened = self._open(segment)
        if opened is None:
            return
        fh, finished = opened
        key = segment.stem
        start = self.offsets.get(key, 0)
        limit = self.max_line_bytes
        with fh:
            fh.seek(start)
            buf = bytearray()  # the current line so far; stays empty while an overlong line is dropped
            dropped = 0  # bytes of the current line dropped because it is over the limit
            while True:
                chunk = fh.read(self.chunk_bytes)
                if not chunk:
                    if not buf and not dropped:
                        return
                    if not finished:
                        # The writer renames only after its last write: once renamed, the file is complete.
                        finished = (self.directory / (key + FINISHED)).exists()
                        if finished:
                            continue
                        return
                    end = start + dropped + len(buf)
                    reason = self._too_long(dropped + len(buf)) if dropped else "unterminated last line (truncated)"
                    self.offsets[key] = end
                    yield Item(key, start, end, RecordError(reason, key, start))
                    return
                at = 0
                while (newline := chunk.find(b"\n", at)) >= 0:
                    size = dropped + len(buf) + newline - at
                    end = start + size + 1
                    if dropped or size > limit:
                        item = RecordError(self._too_long(size), key, start)
                    else:
                        item = self._decode(bytes(buf) + chunk[at:newline] if buf else chunk[at:newline], key, start)
                    self.offsets[key] = end
                    yield Item(key, start, end, item)
                    start, at, dropped = end, newline + 1, 0
                    buf.clear()
                rest = len(chunk) - at
                if dropped or len(buf) + rest > limit:
                    dropped += len(buf) + rest
                    buf.clear()
                else:
                    buf += chunk[at:]

    def _too_long(self, size: int) -> str:
        return f"line of {size} bytes exceeds the {self.max_line_bytes}-byte limit"

    def _decode(self, line: bytes, key: str, offset: int) -> bytes | dict | RecordError:
        if self.raw:
            return line
        try:
            return decode(line, self.vocab_size)
        except RecordError as e:
            return RecordError(e.reason, key, offset)


# The step record's fields other than its five lists.
_HEAD = tuple(FIELD_TYPES)
# Every combination of their allowed types, so that one set lookup checks all fifteen.
_SIGNATURES = frozenset(product(*FIELD_TYPES.values()))
_V, _STEP, _BUDGET, _POS, _ROOT, _BONUS, _MS = map(_HEAD.index, ("v", "step", "budget", "pos", "root", "bonus", "ms"))
_SERVER, _TENANT, _SHAREABLE = map(_HEAD.index, ("server", "tenant", "shareable"))
# Fields of a v1 step record: the head and the five lists.
_FIELDS = len(_HEAD) + 5
# The largest finite float: an int duration above it is not finite for ``validate`` either.
_FLOAT_MAX = sys.float_info.max
# Top-k ids and log-probs as the graft daemon uses them (``trainer.adapt.graft.step_evidence``): ids below any
# vocabulary size a decoder takes (< 2**31), log-probs at the precision its weights are computed in (checked in
# float64 first). Half the bytes a decode worker hands back.
ID_DTYPE = np.int32
LOGPROB_DTYPE = np.float32


@dataclass
class StepColumns:
    """``R`` valid step records and their verified nodes (per record the root, then its ``N`` draft nodes)."""

    server: list[str]
    tenant: list[str | None]
    shareable: list[bool]
    # Shape: (R + 1,) record r's nodes are rows[start[r]:start[r + 1]].
    start: np.ndarray
    # Shape: (nodes,) int64 token of every verified node.
    rows: np.ndarray
    # Shape: (R,) int64 top-k width of each record.
    k: np.ndarray
    # Shape: (R + 1,) record r's top-k entries are topk_ids[topk_start[r]:topk_start[r + 1]], row-major (node, k).
    topk_start: np.ndarray
    # Shape: (Σ nodes_r · k_r,) ids (``ID_DTYPE``) and log-probs (``LOGPROB_DTYPE``).
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray

    def __len__(self) -> int:
        return len(self.server)

    @property
    def nodes(self) -> int:
        return self.rows.size

    @classmethod
    def empty(cls) -> StepColumns:
        zero = np.zeros(1, dtype=np.int64)
        none = np.zeros(0, dtype=np.int64)
        return cls([], [], [], zero, none, none, zero, np.zeros(0, ID_DTYPE), np.zeros(0, LOGPROB_DTYPE))

    @classmethod
    def from_records(cls, records: list[dict]) -> StepColumns:
        """Valid step records (dicts, as ``validate`` passed them) as columns."""
        if not records:
            return cls.empty()
        counts = np.array([len(r["tokens"]) + 1 for r in records], dtype=np.int64)
        k = np.array([len(r["topk_ids"][0]) for r in records], dtype=np.int64)
        rows = np.fromiter(chain.from_iterable(chain((r["root"],), r["tokens"]) for r in records), np.int64)
        ids = np.fromiter(chain.from_iterable(chain.from_iterable(r["topk_ids"] for r in records)), ID_DTYPE)
        logprobs = chain.from_iterable(chain.from_iterable(r["topk_logprobs"] for r in records))
        return cls(
            [r["server"] for r in records],
            [r["tenant"] for r in records],
            [r["shareable"] for r in records],
            _offsets(counts),
            rows,
            k,
            _offsets(counts * k),
            ids,
            _narrow(np.fromiter(logprobs, np.float64)),
        )

    def select(self, index: list[int] | np.ndarray) -> StepColumns:
        """The records ``index`` (in that order)."""
        index = np.asarray(index, dtype=np.int64)
        if index.size == len(self) and np.array_equal(index, np.arange(len(self))):
            return self
        nodes = _ranges(self.start[index], self.start[index + 1])
        entries = _ranges(self.topk_start[index], self.topk_start[index + 1])
        k = self.k[index]
        return StepColumns(
            [self.server[i] for i in index],
            [self.tenant[i] for i in index],
            [self.shareable[i] for i in index],
            _offsets(self.start[index + 1] - self.start[index]),
            self.rows[nodes],
            k,
            _offsets(self.topk_start[index + 1] - self.topk_start[index]),
            self.topk_ids[entries],
            self.topk_logprobs[entries],
        )

    @classmethod
    def concat(cls, parts: list[StepColumns]) -> StepColumns:
        parts = [p for p in parts if len(p)]
        if len(parts) <= 1:
            return parts[0] if parts else cls.empty()
        return cls(
            [s for p in parts for s in p.server],
            [t for p in parts for t in p.tenant],
            [s for p in parts for s in p.shareable],
            _offsets(np.concatenate([np.diff(p.start) for p in parts])),
            np.concatenate([p.rows for p in parts]),
            np.concatenate([p.k for p in parts]),
            _offsets(np.concatenate([np.diff(p.topk_start) for p in parts])),
            np.concatenate([p.topk_ids for p in parts]),
            np.concatenate([p.topk_logprobs for p in parts]),
        )


@dataclass
class Decoded:
    """A batch of lines decoded: the valid step records, the valid request records, and the rejected lines as
    ``(index of the line in the batch, reason)``."""

    steps: StepColumns
    requests: list[dict]
    errors: list[tuple[int, RecordError]]


def _narrow(logprobs: np.ndarray) -> np.ndarray:
    """Log-probs as ``LOGPROB_DTYPE``; a finite one beyond its range becomes -inf (weight 0)."""
    with np.errstate(over="ignore"):
        return logprobs.astype(LOGPROB_DTYPE)


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def _ranges(start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(start[i], stop[i])`` over i."""
    lengths = stop - start
    before = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(start - before, lengths)


def _bad_per_segment(bad: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per segment of ``counts`` consecutive entries of ``bad``: whether any is True."""
    total = np.zeros(bad.size + 1, dtype=np.int64)
    np.cumsum(bad, out=total[1:])
    ends = _offsets(counts)
    return total[ends[1:]] > total[ends[:-1]]


class _Line(NamedTuple):
    """What one step line's parse leaves for the vectorised checks (the buffers copied out of the document)."""

    index: int
    # The head fields the columns keep.
    root: int
    server: str
    tenant: str | None
    shareable: bool
    n: int
    k: int
    m: int
    # simdjson ArrayBuffers (the buffer protocol; no len).
    tokens: object
    parents: object
    accepted: object
    topk_ids: object
    topk_logprobs: object


class BatchDecoder:
    """``decode_batch`` with one simdjson parser kept across batches."""

    def __init__(self, vocab_size: int) -> None:
        if not 0 < vocab_size <= np.iinfo(ID_DTYPE).max + 1:
            raise ValueError(f"vocab_size must be in [1, 2**31], got {vocab_size}")
        self.vocab_size = vocab_size
        self._parser = simdjson.Parser()

    def __call__(self, lines: list[bytes]) -> Decoded:
        parsed: list[_Line] = []
        slow: list[int] = []
        for i, line in enumerate(lines):
            item = self._parse(i, line)
            (slow.append(i) if item is None else parsed.append(item))
        steps, rejected = self._check(parsed)
        slow.extend(rejected)
        requests, errors, accepted = [], [], []
        for i in sorted(slow):
            try:
                record = decode(lines[i], self.vocab_size)
            except RecordError as e:
                errors.append((i, e))
                continue
            (requests if record["kind"] == "request" else accepted).append(record)
        if accepted:
            steps = StepColumns.concat([steps, StepColumns.from_records(accepted)])
        return Decoded(steps, requests, errors)

    def _parse(self, index: int, line: bytes) -> _Line | None:
        """The fields of a step line whose structure is exactly v1's, else None (the reference decides)."""
        try:
            doc = self._parser.parse(line)
        except RuntimeError:
            # A value of the previous document still referenced (an exception's traceback): a fresh parser.
            self._parser = simdjson.Parser()
            return None
        except Exception:  # any parse failure: the reference parser says why
            return None
        try:
            return _fields(index, line, doc, self.vocab_size)
        except Exception:  # a field of an unexpected type or shape: the reference validator says which
            return None
        finally:
            del doc

    def _check(self, parsed: list[_Line]) -> tuple[StepColumns, list[int]]:
        """The list checks of ``validate`` over all parsed lines at once; the columns of those that pass and
        the indices of those that do not."""
        if not parsed:
            return StepColumns.empty(), []
        vocab = self.vocab_size
        n = np.array([p.n for p in parsed], dtype=np.int64)
        k = np.array([p.k for p in parsed], dtype=np.int64)
        m = np.array([p.m for p in parsed], dtype=np.int64)
        entries = (n + 1) * k
        tokens = np.frombuffer(bytearray().join(p.tokens for p in parsed), dtype=np.uint64)
        parents = np.frombuffer(bytearray().join(p.parents for p in parsed), dtype=np.int64)
        accepted = np.frombuffer(bytearray().join(p.accepted for p in parsed), dtype=np.int64)
        ids = np.frombuffer(bytearray().join(p.topk_ids for p in parsed), dtype=np.uint64)
        logprobs = np.frombuffer(bytearray().join(p.topk_logprobs for p in parsed), dtype=np.float64)
        if (tokens.size, parents.size, accepted.size, ids.size) != (n.sum(), n.sum(), m.sum(), entries.sum()):
            # _fields' bracket count rules this out; should it ever fail, the reference decides every line.
            return StepColumns.empty(), [p.index for p in parsed]

        bad = np.zeros(len(parsed), dtype=bool)

        def reject(mask: np.ndarray, counts: np.ndarray) -> None:
            # A clean batch (the usual case) costs one reduction per check.
            if mask.any():
                np.logical_or(bad, _bad_per_segment(mask, counts), out=bad)

        def reject_ids(ids: np.ndarray, counts: np.ndarray) -> None:
            # Unsigned, so only the top is checked: one reduction for a clean batch, the mask only when it fails.
            if ids.size and ids.max() >= vocab:
                reject(ids >= vocab, counts)

        reject_ids(tokens, n)
        # Topological order: each parent is -1 (the root) or an earlier draft node.
        node_start = _offsets(n)
        local = np.arange(parents.size, dtype=np.int64) - np.repeat(node_start[:-1], n)
        reject((parents < -1) | (parents >= local), n)
        # The accepted path: draft nodes, each a child of the previous one (the first a child of the root).
        record = np.repeat(np.arange(len(parsed)), m)
        inside = (accepted >= 0) & (accepted < n[record])
        previous = np.empty_like(accepted)
        previous[1:] = accepted[:-1]
        previous[_offsets(m)[:-1][m > 0]] = -1
        at = np.clip(node_start[record] + accepted, 0, max(parents.size - 1, 0))
        parent = parents[at] if parents.size else np.full_like(accepted, -2)
        reject(~inside | (parent != previous), m)
        reject_ids(ids, entries)
        # NaN makes both reductions NaN, -inf the first: a clean batch costs two reductions.
        if logprobs.size and not (np.isfinite(logprobs.min()) and logprobs.max() <= LOGPROB_SLACK):
            reject(~(logprobs <= LOGPROB_SLACK) | ~np.isfinite(logprobs), entries)

        good = np.flatnonzero(~bad)
        counts = n + 1
        root_at = _offsets(counts)
        rows = np.empty(int(root_at[-1]), dtype=np.int64)
        is_root = np.zeros(rows.size, dtype=bool)
        is_root[root_at[:-1]] = True
        rows[is_root] = [p.root for p in parsed]
        rows[~is_root] = tokens
        columns = StepColumns(
            [p.server for p in parsed],
            [p.tenant for p in parsed],
            [p.shareable for p in parsed],
            root_at,
            rows,
            k,
            _offsets(entries),
            # A rejected record's ids may not fit; ``select`` drops them.
            ids.astype(ID_DTYPE),
            _narrow(logprobs),
        )
        return columns.select(good), [parsed[i].index for i in np.flatnonzero(bad)]


def _optional_valid(doc: object) -> bool:
    """The checks of ``validate`` on the optional step fields (``schema.OPTIONAL_STEP_TYPES``) present."""
    for name in OPTIONAL_STEP_TYPES:
        value = doc.get(name)
        if value is not None and (type(value) is not int or value < 0):
            return False
    return True


def _fields(index: int, line: bytes, doc: object, vocab_size: int) -> _Line | None:
    Array, Object = simdjson.Array, simdjson.Object
    if type(doc) is not Object or doc.get("kind") != "step":
        return None
    # A missing field raises KeyError: the reference names it.
    values = [doc[name] for name in _HEAD]
    # orjson keeps a duplicate key's last value, simdjson finds its first: let the reference read such a line.
    # A record of exactly the v1 fields, all present (the head above, the lists below), has none.
    if len(doc) != _FIELDS and len(set(doc.keys())) != len(doc):
        return None
    ms = values[_MS]
    if type(ms) is not Object:
        return None
    values[_MS] = ms.as_dict()
    if len(values[_MS]) != len(ms):
        return None
    del ms
    if not _head_valid(values, vocab_size):
        return None
    if len(doc) != _FIELDS and not _optional_valid(doc):
        return None
    budget = values[_BUDGET]
    tokens, parents, accepted = doc["tokens"], doc["parents"], doc["accepted"]
    ids, logprobs = doc["topk_ids"], doc["topk_logprobs"]
    if not type(tokens) is type(parents) is type(accepted) is type(ids) is type(logprobs) is Array:
        return None
    n = len(tokens)
    if n > budget or len(parents) != n or len(ids) != n + 1 or len(logprobs) != n + 1:
        return None
    # len() below fails on a row that is not a list and as_buffer() on anything but numbers, so every row
    # holds one bracket pair and this count holds exactly when no list is nested deeper than v1 says and no
    # string or extra field holds a bracket. Then each buffer has as many numbers as its rows say.
    if line.count(b"[") != 3 + 2 * (n + 2):
        return None
    widths = set(map(len, ids))
    if len(widths) != 1 or set(map(len, logprobs)) != widths:
        return None
    k = widths.pop()
    if k < MIN_TOPK:
        return None
    return _Line(
        index,
        values[_ROOT],
        values[_SERVER],
        values[_TENANT],
        values[_SHAREABLE],
        n,
        k,
        len(accepted),
        tokens.as_buffer(of_type="u"),
        parents.as_buffer(of_type="i"),
        accepted.as_buffer(of_type="i"),
        ids.as_buffer(of_type="u"),
        logprobs.as_buffer(of_type="d"),
    )


def _head_valid(values: list, vocab_size: int) -> bool:
    """The checks of ``validate`` on a step record's fields other than its five lists (``values`` in ``_HEAD``
    order), as a few comparisons; False means the reference decides (and names the fault)."""
    if tuple(map(type, values)) not in _SIGNATURES or values[_V] != VERSION:
        return False
    if values[_STEP] < 0 or values[_BUDGET] < 0 or values[_POS] < 0:
        return False
    if not (0 <= values[_ROOT] < vocab_size and 0 <= values[_BONUS] < vocab_size):
        return False
    ms = values[_MS]
    for phase in PHASES:
        duration = ms.get(phase)
        # Not bool (JSON true), and finite >= 0: NaN fails both comparisons, inf and huge ints the second.
        if type(duration) not in (float, int) or not 0 <= duration <= _FLOAT_MAX:
            return False
    return True


def decode_batch(lines: list[bytes], vocab_size: int) -> Decoded:
    """Decode and validate a batch of log lines (each without its newline); see the module docstring."""
    return BatchDecoder(vocab_size)(lines)
