"""Append-only files a daemon commits with its state (quarantine, decision log): lines are appended and
fsynced before the state that counts them is replaced, and a restart cuts a file back to the committed length,
so lines of work redone after a kill are not written twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.vlog.schema import RecordError


def truncate_to(path: Path, size: int) -> None:
    """Drop what was appended to ``path`` after the last commit (which recorded ``size``)."""
    if path.exists() and path.stat().st_size > size:
        with open(path, "r+b") as f:
            f.truncate(size)


def append_lines(path: Path, objects: list[dict]) -> int:
    """Append one JSON line per object durably; returns the file's new length (raises ``OSError``)."""
    with open(path, "ab") as f:
        f.write("".join(json.dumps(o) + "\n" for o in objects).encode())
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def quarantine_lines(errors: list[RecordError]) -> list[dict]:
    """The quarantine entry of each rejected log line: segment file, byte offset, reason."""
    return [{"file": f"{e.file}.jsonl", "offset": e.offset, "reason": e.reason} for e in errors]
