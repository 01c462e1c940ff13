"""Append verifier log records to rotating segments from a background thread.

``write`` only appends to a queue: validation, JSON encoding and file I/O happen on the writer thread, so the
decoding loop pays for a deque append. The thread is not woken per record (a wake-up costs the caller a context
switch); it drains the queue every ``interval`` seconds, so readers see a record within about that. A record
may be given as a zero-argument callable returning the dict; it is called on the writer thread, which keeps
tensor -> list conversion off the caller's path too. The queue is bounded: when the disk falls behind,
``write`` waits for room rather than dropping records.

A segment is ``{prefix}-{seq:06d}-{unix_ms}.jsonl.part`` while open and is finished (fsync, then an atomic
rename to ``.jsonl``) when it reaches ``max_bytes``, when it has been open ``max_seconds``, and on ``close``.
A server calls ``close`` from its SIGTERM handler; a process that exits without it is closed at exit. One live
writer per prefix (a lock file enforces it); a new writer finishes the ``.part`` segments a dead one of the
same prefix left behind, so readers stop waiting on them (a torn last line then reads as truncated).

A writer made with ``on_error`` fails open, for producers that run inside another program (vLLM's engine): a
record that cannot be written (refused by the validator, a full disk, a full queue, a stopped writer thread) is
dropped and ``on_error(error)`` is called (on the writer thread, or on the caller's for a full queue or a stopped
thread), and no call ever raises it. Without it, ``write`` waits for room and the first failure on the thread is
raised on the caller's next call.

Every record is validated unless ``check_every`` N > 1: then the first ``CHECKED_FIRST`` records and one in N
after them are. The validator is pure Python and holds the GIL; a producer whose hot loop shares the process
(vLLM's worker: validation was half of the plugin's logging overhead) and whose records are built by tested
code may sample it. Every reader validates every line it reads, so an invalid line is still quarantined with its
reason, never trusted::

    python -c "from trainer.vlog.writer import LogWriter; from trainer.vlog.schema import request_record; \\
        w = LogWriter('runs/logs', 'replica0'); \\
        w.write(request_record(server='s', request='r', tenant=None, shareable=True, prompt_ids=[1], \\
        output_ids=[2])); w.close()"
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import orjson

from trainer.errors import UserError
from trainer.io import fsync
from trainer.vlog.schema import (
    FINISHED,
    MAX_LINE_BYTES,
    PART,
    PREFIX,
    RecordError,
    list_segments,
    segment_stem,
    validate,
)

Record = dict | Callable[[], dict]
# With ``check_every`` > 1, the records validated before sampling starts.
CHECKED_FIRST = 1000


class WriterStalled(RuntimeError):
    """A fail-open writer dropped a record without trying to write it: its queue is full, or its thread stopped
    (``stopped``: no later record will be written either)."""

    def __init__(self, message: str, stopped: bool) -> None:
        super().__init__(message)
        self.stopped = stopped


class LogWriter:
    def __init__(
        self,
        directory: str | Path,
        prefix: str,
        max_bytes: int = 64 << 20,
        max_seconds: float = 300.0,
        queue_size: int = 4096,
        vocab_size: int | None = None,
        max_deferred: int = 8,
        interval: float = 0.1,
        check_every: int = 1,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        if not PREFIX.fullmatch(prefix):
            raise UserError(f"log prefix {prefix!r} must be letters, digits, '_', '.', '-' (not starting with '.')")
        self.directory = Path(directory)
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.max_seconds = max_seconds
        self.vocab_size = vocab_size
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.directory / f".{prefix}.lock", "w")  # noqa: SIM115 (held for the writer's life)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise UserError(f"another live writer uses prefix {prefix!r} in {self.directory}") from None
        own = [s for s in list_segments(self.directory) if s.prefix == prefix]
        for s in own:
            if not s.finished:
                self._rename(s.stem)
        self._seq = max((s.seq for s in own), default=-1) + 1
        self._last_ms = max((s.unix_ms for s in own), default=0)
        self._file = None
        self._stem = ""
        self._opened = 0.0
        self._size = 0
        self.queue_size = queue_size
        self.interval = interval
        # Records, flush markers (Event) and the closing None, in order; the writer thread pops from the left.
        self._queue: deque = deque()
        # Wake-ups for the writer thread. A SimpleQueue, not an Event: its put is reentrant, so a SIGTERM handler
        # calling close() while the main thread is inside a wake-up does not deadlock (Event.set takes a lock).
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        # Slots for queued callables that hold large tensors (a step's logits): whoever takes one releases it
        # once its callable has run; without a slot, reduce the tensor before writing.
        self.deferred = threading.BoundedSemaphore(max_deferred)
        self._error: Exception | None = None
        self.on_error = on_error
        self._failed = 0
        self._closed = False
        self.records = 0
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.check_every = check_every
        self.segments: list[str] = []
        self._thread = threading.Thread(target=self._run, name=f"vlog-{prefix}", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # ---- caller side ------------------------------------------------------------------------------------------
    def write(self, record: Record) -> None:
        """Enqueue one record (a dict, or a callable making it on the writer thread)."""
        self._check()
        if self._closed:
            raise RuntimeError("write after close")
        if self.on_error is not None and (len(self._queue) >= self.queue_size or not self.alive):
            why = "queue full" if self.alive else "writer thread stopped"
            self.on_error(WriterStalled(f"verifier log {self.directory}/{self.prefix}: {why}; record dropped",
                                        stopped=not self.alive))  # fmt: skip
            return
        # Full: poll for room rather than take a lock that a signal handler calling close() could deadlock on.
        while len(self._queue) >= self.queue_size and self._thread.is_alive():
            self._wake.put(None)
            time.sleep(self.interval / 20)
        self._queue.append(record)

    def flush(self) -> None:
        """Return once every record written so far is in the segment file (visible to readers)."""
        if self._closed:
            self._check()
            return
        done = threading.Event()
        self._queue.append(done)
        self._wake.put(None)
        done.wait()
        self._check()

    def close(self) -> None:
        """Write what is queued, finish the open segment, stop the thread. Idempotent."""
        if not self._closed:
            self._closed = True
            atexit.unregister(self.close)
            self._queue.append(None)
            self._wake.put(None)
            self._thread.join()
            self._lock.close()
        self._check()

    @property
    def alive(self) -> bool:
        """Whether the writer thread runs (it ends at ``close``, or when something killed it)."""
        return self._thread.is_alive()

    def cpu_seconds(self) -> float:
        """CPU time the writer thread has used (the share of logging a caller does not see on its own thread)."""
        return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self) -> None:
        # Failures on the thread surface on the caller's next call: the first one, with the count of records lost.
        error, failed = self._error, self._failed
        if error is not None:
            self._error, self._failed = None, 0
            error.add_note(f"{failed} failure(s) on the writer thread since the last call; failed records are lost")
            raise error

    # ---- writer thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with contextlib.suppress(queue.Empty):
                self._wake.get(timeout=self._timeout())
            while not self._wake.empty():
                self._wake.get_nowait()
            while self._queue:
                item = self._queue.popleft()
                if item is None:
                    self._guard(self._finish)
                    return
                if isinstance(item, threading.Event):
                    self._guard(self._flush)
                    item.set()
                else:
                    self._guard(self._append, item)
            self._guard(self._flush)
            self._guard(self._finish_if_old)

    def _timeout(self) -> float:
        if self._file is None:
            return self.interval
        return min(max(self._opened + self.max_seconds - time.monotonic(), 0.0), self.interval)

    def _guard(self, fn: Callable, *args: object) -> None:
        try:
            fn(*args)
        except Exception as e:  # kept for the caller: the thread must outlive a bad record or a full disk
            if self.on_error is not None:
                with contextlib.suppress(Exception):
                    self.on_error(e)
                return
            self._failed += 1
            if self._error is None:
                self._error = e

    def _append(self, item: Record) -> None:
        record = item() if callable(item) else item
        if self.records < CHECKED_FIRST or self.records % self.check_every == 0:
            validate(record, self.vocab_size)
        try:
            line = orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
        except orjson.JSONEncodeError as e:
            raise RecordError(f"record cannot be encoded as JSON: {e}") from None
        if len(line) > MAX_LINE_BYTES:
            raise RecordError(f"record of {len(line)} bytes exceeds the {MAX_LINE_BYTES}-byte line limit")
        if self._file is not None and self._size and self._size + len(line) > self.max_bytes:
            self._finish()
        self._finish_if_old()
        if self._file is None:
            self._open()
        self._file.write(line)
        self._size += len(line)
        self.records += 1

    def _open(self) -> None:
        # unix_ms never decreases per prefix, so readers' creation-time order keeps this writer's sequence.
        self._last_ms = max(self._last_ms, int(time.time() * 1000))
        self._stem = segment_stem(self.prefix, self._seq, self._last_ms)
        self._seq += 1
        self._file = open(self.directory / (self._stem + PART), "xb", buffering=1 << 16)  # noqa: SIM115
        self._opened = time.monotonic()
        self._size = 0

    def _flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def _finish_if_old(self) -> None:
        if self._file is not None and time.monotonic() - self._opened >= self.max_seconds:
            self._finish()

    def _finish(self) -> None:
        if self._file is None:
            return
        file, self._file = self._file, None
        with file:
            file.flush()
            os.fsync(file.fileno())
        self._rename(self._stem)
        self.segments.append(self._stem + FINISHED)

    def _rename(self, name: str) -> None:
        os.replace(self.directory / (name + PART), self.directory / (name + FINISHED))
        fsync(self.directory)
