"""Decoding batches of log lines in worker processes, so that a daemon aggregates one batch while the next ones
are decoded on other cores.

``Decoding(vocab_size, workers)`` hands each batch to a worker (round robin) and returns the results in
submission order. A worker is ``python -m trainer.vlog.workers VOCAB``: it imports numpy, simdjson and the
decoder only (a fraction of a second to start), reads length-prefixed batches from its stdin on a thread of its
own (so a parent writing the next batch never waits for the worker to finish the current one) and writes the
decoded batches to its stdout. The frames are pickles passed between a process and the child it started, never
read from anywhere else. A worker exits when its stdin closes, so a parent killed by SIGKILL leaves none
behind; a worker that dies costs nothing but time: its batches are decoded in the parent, and the workers are
started again at the next batch. On CPU::

    python -c "from trainer.vlog.workers import Decoding; d = Decoding(8192, 1); \\
        print(d.result(d.submit([b'{}']))); d.close()"
"""

from __future__ import annotations

import pickle
import queue
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import BinaryIO

from trainer.errors import UserError
from trainer.vlog.columns import BatchDecoder, Decoded

_LENGTH = struct.Struct("<Q")


def _write_frame(stream: BinaryIO, obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_frame(stream: BinaryIO) -> object:
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        raise EOFError("the other end closed the pipe")
    (size,) = _LENGTH.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the other end closed the pipe mid-frame")
    return pickle.loads(data)


@dataclass
class Pending:
    """A submitted batch: the worker decoding it (None: decode it at ``result``) and its lines."""

    worker: subprocess.Popen | None
    lines: list[bytes]


class Decoding:
    """Decodes batches of log lines in ``workers`` worker processes (0: in this process); see the module
    docstring. Results must be taken in submission order."""

    def __init__(self, vocab_size: int, workers: int) -> None:
        if workers < 0:
            raise UserError(f"--decode-workers must be >= 0, got {workers}")
        self.vocab_size, self.workers = vocab_size, workers
        self.decode = BatchDecoder(vocab_size)
        # Batches in flight: one being decoded and one waiting per worker.
        self.ahead = 2 * workers
        self._procs: list[subprocess.Popen] = []
        self._turn = 0

    def submit(self, lines: list[bytes]) -> Pending:
        if not self.workers:
            return Pending(None, lines)
        try:
            if not self._procs:
                self._start()
            worker = self._procs[self._turn % len(self._procs)]
            self._turn += 1
            _write_frame(worker.stdin, lines)
            return Pending(worker, lines)
        except OSError:
            self._stop()
            return Pending(None, lines)

    def result(self, pending: Pending) -> Decoded:
        if pending.worker is not None and pending.worker in self._procs:
            try:
                decoded = _read_frame(pending.worker.stdout)
                if isinstance(decoded, Decoded):
                    return decoded
            except (OSError, EOFError, pickle.UnpicklingError):
                pass
            # The worker died or broke its protocol: every batch it holds is decoded here, and the workers
            # start afresh at the next batch.
            self._stop()
        return self.decode(pending.lines)

    def _start(self) -> None:
        command = [sys.executable, "-m", "trainer.vlog.workers", str(self.vocab_size)]
        self._procs = [
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in range(self.workers)
        ]

    def _stop(self) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait()
            proc.stdin.close()
            proc.stdout.close()
        self._procs = []

    def close(self) -> None:
        """Stop the workers: closing their stdin ends them."""
        for proc in self._procs:
            proc.stdin.close()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        self._procs = []


def _serve(vocab_size: int) -> None:
    decode = BatchDecoder(vocab_size)
    frames: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            while True:
                frames.put(_read_frame(sys.stdin.buffer))
        except EOFError:
            frames.put(None)

    threading.Thread(target=read, daemon=True).start()
    while (lines := frames.get()) is not None:
        _write_frame(sys.stdout.buffer, decode(lines))


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
