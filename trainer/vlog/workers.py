"""DecodePool batches of log lines in worker processes, so that a daemon aggregates one batch while the next ones are
decoded on other cores. ``DecodePool(vocab_size, workers)`` hands each batch to a worker (round robin) and returns the
results in submission order. A worker is ``python -m trainer.vlog.workers VOCAB``: it imports numpy, simdjson and
the decoder only (a fraction of a second to start), reads batches of lines from its stdin (count, lengths, bytes)
and writes the decoded batches to its stdout (length-prefixed pickles). The parent writes each batch from a thread
of its own per worker, so its main thread aggregates while a worker still decodes the batch before; it reads
results in submission order, so a worker blocked on writing a result always finds its reader. The pickles pass
between a process and the child it started, never read from anywhere else. A worker says it is ready once its
imports are done; until then ``submit`` hands the batch back and the parent decodes it itself, so a run does not
wait out the worker's start (0.13 s) doing nothing. A worker exits when its stdin closes, so a parent killed by
SIGKILL leaves none behind; a worker that dies costs nothing but time: its batches are decoded in the parent, and
the workers are started again at the next batch. On CPU::

    python -c "from trainer.vlog.workers import DecodePool; d = DecodePool(8192, 1); d.start(wait=True); \\
        print(d.result(d.submit([b'{}']))); d.close()"
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from trainer.errors import UserError
from trainer.vlog.reader import BatchDecoder, Decoded

_LENGTH = struct.Struct("<Q")
# A worker's first frame: its imports are done and it reads batches.
_READY = "ready"


def _write_frame(stream: BinaryIO, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the other end closed the pipe" + (" mid-frame" if data else ""))
    return data


def _read_frame(stream: BinaryIO) -> object:
    (size,) = _LENGTH.unpack(_read_exactly(stream, _LENGTH.size))
    return pickle.loads(_read_exactly(stream, size))


def _write_lines(stream: BinaryIO, lines: list[bytes]) -> None:
    """A batch of lines as their count, their lengths and their bytes: one copy each way (a pickle of the list
    cost 3.7 us per 4 kB line to write, most of the parent's share of handing a batch over)."""
    lengths = np.fromiter(map(len, lines), dtype=np.int64, count=len(lines))
    stream.write(_LENGTH.pack(len(lines)))
    stream.write(lengths.tobytes())
    stream.write(b"".join(lines))
    stream.flush()


def _read_lines(stream: BinaryIO) -> list[bytes]:
    (count,) = _LENGTH.unpack(_read_exactly(stream, _LENGTH.size))
    ends = np.cumsum(np.frombuffer(_read_exactly(stream, 8 * count), dtype=np.int64)).tolist()
    data = _read_exactly(stream, ends[-1] if ends else 0)
    return [data[start:end] for start, end in zip([0, *ends][:-1], ends, strict=True)]


@dataclass
class Pending:
    """A submitted batch: the worker decoding it and its lines (decoded here should the worker die)."""

    worker: _Worker
    lines: list[bytes]


class _Worker:
    """One worker process and the thread that feeds it."""

    def __init__(self, vocab_size: int) -> None:
        command = [sys.executable, "-m", "trainer.vlog.workers", str(vocab_size)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        for pipe in (self.proc.stdin, self.proc.stdout):
            _widen(pipe)
        self.batches: queue.Queue = queue.Queue()
        self.broken = False
        self.ready = False
        self.thread = threading.Thread(target=self._feed, daemon=True)
        self.thread.start()

    def started(self, wait: bool = False) -> bool:
        """Whether the worker has said it is ready (``wait``: until it has, or has died). Its first frame is
        small and written at once, so a readable pipe holds all of it."""
        if not self.ready and select.select([self.proc.stdout], [], [], None if wait else 0)[0]:
            try:
                self.ready = _read_frame(self.proc.stdout) == _READY
            except (OSError, EOFError, pickle.UnpicklingError):
                self.ready = False
        return self.ready

    def _feed(self) -> None:
        while (lines := self.batches.get()) is not None:
            try:
                _write_lines(self.proc.stdin, lines)
            except OSError:
                self.broken = True
                return

    def kill(self) -> None:
        """End the worker whatever it is doing; the feeding thread then fails its write and ends."""
        self.batches.put(None)
        self.proc.kill()
        self.proc.wait()
        self.thread.join()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


def _widen(pipe: BinaryIO) -> None:
    """A pipe of up to 1 MiB (Linux): a frame of a few MB then crosses in a few writes, not hundreds."""
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)


class DecodePool:
    """Decodes batches of log lines in ``workers`` worker processes (0: in this process); see the module
    docstring. Results must be taken in submission order."""

    def __init__(self, vocab_size: int, workers: int) -> None:
        if workers < 0:
            raise UserError(f"--decode-workers must be >= 0, got {workers}")
        self.vocab_size, self.workers = vocab_size, workers
        self.decode = BatchDecoder(vocab_size)
        # Batches in flight: one being decoded and two waiting per worker (a batch the parent decodes meanwhile
        # takes longer than one of the worker's).
        self.ahead = 3 * workers
        self._pool: list[_Worker] = []
        self._turn = 0

    def start(self, wait: bool = False) -> bool:
        """Start the workers if they are not running (``wait``: until each is ready or dead); whether any is."""
        if not self.workers:
            return False
        if not self._pool:
            try:
                self._pool = [_Worker(self.vocab_size) for _ in range(self.workers)]
            except OSError:
                self._stop()
                return False
        if wait:
            for worker in self._pool:
                worker.started(wait=True)
        return True

    def submit(self, lines: list[bytes]) -> Pending | None:
        """Hand ``lines`` to the next worker; None when there are no workers, they cannot start, or the next one
        is still starting (the caller decodes the batch itself)."""
        if not self.start():
            return None
        worker = self._pool[self._turn % len(self._pool)]
        if worker.proc.poll() is not None:
            # Found dead before its result was due: the batches it holds are decoded here; start afresh.
            self._stop()
            return self.submit(lines)
        if not worker.started():
            return None
        self._turn += 1
        worker.batches.put(lines)
        return Pending(worker, lines)

    def arrived(self, pending: Pending) -> bool:
        """Whether the worker has begun to write the batch's result (or died), so that ``result`` waits for no
        decoding; meaningful for the oldest batch a worker holds (results come in submission order)."""
        if pending.worker not in self._pool:
            return True
        stdout = pending.worker.proc.stdout
        return bool(select.select([stdout], [], [], 0)[0])

    def result(self, pending: Pending) -> Decoded:
        if pending.worker in self._pool:
            try:
                decoded = _read_frame(pending.worker.proc.stdout)
                if isinstance(decoded, Decoded):
                    return decoded
            except (OSError, EOFError, pickle.UnpicklingError):
                pass
            # The worker died or broke its protocol: every batch it holds is decoded here, and the workers
            # start afresh at the next batch.
            self._stop()
        return self.decode(pending.lines)

    def _stop(self) -> None:
        for worker in self._pool:
            worker.kill()
        self._pool = []

    def close(self) -> None:
        """Stop the workers. They hold nothing worth waiting for: a batch not yet applied is read again from the
        log after a restart, and a worker may be blocked writing a result that will never be read."""
        self._stop()


def _serve(vocab_size: int) -> None:
    decode = BatchDecoder(vocab_size)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    _write_frame(stdout, _READY)
    # Results are written from a thread of their own: a result (~4 MB for 1024 lines) is larger than the pipe,
    # so its write lasts until the parent reads it, and the parent reads it only once it has applied the batch
    # before. Written here, the next batch would wait for that (measured: a third of the worker's time).
    results: queue.Queue = queue.Queue(maxsize=1)

    def write() -> None:
        try:
            while (decoded := results.get()) is not None:
                _write_frame(stdout, decoded)
        except OSError:
            # The parent is gone (SIGKILL closes its end): nothing will read a result, and the decoding thread
            # may be blocked handing one over.
            os._exit(0)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    while True:
        try:
            lines = _read_lines(stdin)
        except EOFError:
            break
        results.put(decode(lines))
    results.put(None)
    writer.join()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
