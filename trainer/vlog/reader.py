"""Tail a verifier log directory: every finished line of every segment once, valid records or the reason why not.

Offsets are byte offsets keyed by segment stem, so a consumer that persists them (with what it made of the
records) resumes exactly where it stopped, across the ``.part`` -> ``.jsonl`` rename. An unfinished last line
of a ``.part`` segment is not an error: the reader stops before it and reads it once the writer completes it.
Lines are read in bounded chunks, so an oversized line costs at most ``max_line_bytes`` of memory::

    python -c "from trainer.vlog.reader import LogReader; \\
        [print(f, o, r) for f, o, e, r in LogReader('runs/logs')]"
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

from trainer.vlog.schema import FINISHED, MAX_LINE_BYTES, PART, RecordError, Segment, decode, list_segments


class Item(NamedTuple):
    """One line of the log: its segment's stem, the offset of the line and the offset after its newline, and the
    record (with ``raw``: the line's bytes) or why it was rejected."""

    segment: str
    start: int
    end: int
    record: dict | bytes | RecordError


class LogReader:
    """Iterating yields what is readable now and stops; ``follow`` keeps tailing. ``offsets`` (a copy of the
    one given) advances past each yielded line. With ``raw`` a line comes as its bytes, for a consumer that
    decodes batches itself (``trainer/vlog/columns.py``); lines over the limit and a truncated last line are
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
