"""What the adaptation daemons share about their state directory: one daemon per directory (a lock), and the
append-only files committed with the state (quarantine, decision log): lines are appended and fsynced before
the state that counts them is replaced, and a restart cuts a file back to the committed length, so lines of
work redone after a kill are not written twice.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

from trainer.errors import UserError
from trainer.vlog.schema import RecordError

# The files both daemons keep in their state directory: rejected log lines (one JSON line each), and the
# metrics snapshot replaced at every commit.
QUARANTINE = "quarantine.jsonl"
METRICS = "metrics.json"


class StateError(UserError):
    """A daemon's state directory cannot be read or written; the message says which file and why."""


def truncate_to(path: Path, size: int) -> None:
    """Drop what was appended to ``path`` after the last commit (which recorded ``size``)."""
    if path.exists() and path.stat().st_size > size:
        with open(path, "r+b") as f:
            f.truncate(size)


def append_lines(path: Path, objects: list[dict]) -> int:
    """Append one JSON line per object durably; returns the file's new length. A failed write raises
    ``StateError``: the state that would count the lines is not committed, so a restart redoes the work."""
    try:
        with open(path, "ab") as f:
            f.write("".join(json.dumps(o) + "\n" for o in objects).encode())
            f.flush()
            os.fsync(f.fileno())
            return f.tell()
    except OSError as e:
        raise StateError(f"cannot append to {path}: {e.strerror}; restart once it is writable") from e


def quarantine(state_dir: Path, errors: list[RecordError]) -> int:
    """Append the quarantine entry of each rejected log line (segment file, byte offset, reason) to
    ``state_dir``'s quarantine durably; returns its new length."""
    entries = [{"file": f"{e.file}.jsonl", "offset": e.offset, "reason": e.reason} for e in errors]
    return append_lines(state_dir / QUARANTINE, entries)


def lock_state_dir(state_dir: Path, daemon: str) -> IO:
    """Hold ``state_dir`` for this process (release by closing the returned file): a second daemon would commit
    over the first's offsets."""
    lock = open(state_dir / ".lock", "a")  # noqa: SIM115 (held for the daemon's life)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise UserError(f"another {daemon} daemon uses the state directory {state_dir}") from None
    return lock


def run_until_signalled(stop: threading.Event, run: Callable[[], int]) -> int:
    """``run()`` with SIGTERM/SIGINT setting ``stop`` (the daemon finishes its step, commits and returns); the
    previous handlers are restored afterwards."""
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
