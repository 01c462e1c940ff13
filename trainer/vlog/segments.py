"""Segment file names of a verifier log directory: ``{prefix}-{seq:06d}-{unix_ms}.jsonl`` once finished,
with ``.part`` appended while a writer appends to it. The stem (the name without either suffix) survives the
finishing rename, so readers key their offsets by it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

PREFIX = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_NAME = re.compile(
    r"(?P<stem>(?P<prefix>[A-Za-z0-9_][A-Za-z0-9_.-]*)-(?P<seq>\d{6,})-(?P<ms>\d+))\.jsonl(?P<part>\.part)?"
)
FINISHED = ".jsonl"
PART = ".jsonl.part"


@dataclass(frozen=True)
class Segment:
    stem: str
    prefix: str
    seq: int
    unix_ms: int
    finished: bool

    @property
    def name(self) -> str:
        return self.stem + (FINISHED if self.finished else PART)


def stem(prefix: str, seq: int, unix_ms: int) -> str:
    return f"{prefix}-{seq:06d}-{unix_ms}"


def parse(name: str) -> Segment | None:
    """The segment a file name denotes, or None for any other file (hidden files, state, quarantine)."""
    m = _NAME.fullmatch(name)
    if m is None:
        return None
    return Segment(m["stem"], m["prefix"], int(m["seq"]), int(m["ms"]), m["part"] is None)


def list_segments(directory: Path) -> list[Segment]:
    """Segments in ``directory`` ordered by creation time (writers keep ``unix_ms`` non-decreasing per prefix,
    so each writer's segments stay in sequence). A segment listed under both names while it is being renamed
    appears once, as finished."""
    found: dict[str, Segment] = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            segment = parse(entry.name)
            if segment is not None and (segment.stem not in found or segment.finished):
                found[segment.stem] = segment
    return sorted(found.values(), key=lambda s: (s.unix_ms, s.prefix, s.seq))
