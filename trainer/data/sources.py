"""Data sources: chat conversations (OpenAI ``messages`` or ShareGPT ``conversations``) and plain text.

Every source becomes a ``datasets.Dataset`` with one normalised column: ``messages`` (a list of
``{"role", "content"}`` plus optional ``reasoning_content``) for chat, ``text`` for plain text. Each row keeps
``source`` (``file:line`` or ``file#row``) so any later problem can be traced back. Malformed rows are counted
and reported with their file and line; ``strict`` turns the first one into an error. An empty result is
always an error. On CPU::

    python -c "from trainer.data.sources import load_chat; print(load_chat(['data.jsonl']))"
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

from trainer.errors import UserError
from trainer.tiny.corpus import SPLITS, list_modules

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
}
OPENAI_ROLES = {"system", "user", "assistant", "tool", "developer"}
TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java", ".json"}


class MalformedRow(ValueError):
    """One row that cannot be used; the message says why."""


@dataclass
class LoadReport:
    """What a load kept and what it dropped, with the place of every dropped row."""

    kept: int = 0
    malformed: list[str] = field(default_factory=list)

    def summary(self, limit: int = 10) -> str:
        head = f"{self.kept} rows kept, {len(self.malformed)} malformed"
        shown = "\n".join(f"  {m}" for m in self.malformed[:limit])
        more = f"\n  ... and {len(self.malformed) - limit} more" if len(self.malformed) > limit else ""
        return head + (f":\n{shown}{more}" if self.malformed else "")


def normalise_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """A conversation as ``[{"role", "content"[, "reasoning_content"]}]`` from either supported format."""
    if "messages" in row:
        raw, fmt = row["messages"], "messages"
    elif "conversations" in row:
        raw, fmt = row["conversations"], "conversations"
    else:
        raise MalformedRow(f"no 'messages' or 'conversations' field (keys: {sorted(row)})")
    if not isinstance(raw, list) or not raw:
        raise MalformedRow(f"'{fmt}' must be a non-empty list")
    out = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, dict):
            raise MalformedRow(f"{fmt}[{i}] is not an object")
        if fmt == "messages":
            role, content = turn.get("role"), turn.get("content")
            if role not in OPENAI_ROLES:
                raise MalformedRow(f"messages[{i}].role {role!r} is not one of {sorted(OPENAI_ROLES)}")
        else:
            speaker, content = turn.get("from"), turn.get("value")
            if speaker not in SHAREGPT_ROLES:
                raise MalformedRow(f"conversations[{i}].from {speaker!r} is not one of {sorted(SHAREGPT_ROLES)}")
            role = SHAREGPT_ROLES[speaker]
        if not isinstance(content, str):
            raise MalformedRow(f"{fmt}[{i}] content is {type(content).__name__}, not a string")
        message = {"role": role, "content": content}
        reasoning = turn.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            message["reasoning_content"] = reasoning
        out.append(message)
    if not any(m["role"] == "assistant" for m in out):
        raise MalformedRow("conversation has no assistant turn (nothing to learn)")
    return out


def _json_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(place, record) for a JSON Lines file, or for a JSON file holding a list of records."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        yield f"{path}", MalformedRow(f"file is not UTF-8 ({e.reason} at byte {e.start})")
        return
    stripped = text.lstrip()
    if path.suffix == ".json" and stripped.startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            yield f"{path}:{e.lineno}", MalformedRow(f"invalid JSON: {e.msg}")
            return
        for i, rec in enumerate(records):
            yield f"{path}#{i}", rec
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            yield f"{path}:{lineno}", MalformedRow(f"invalid JSON: {e.msg} at column {e.colno}")


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    table = datasets.Dataset.from_parquet(str(path))
    for i, rec in enumerate(table):
        yield f"{path}#{i}", rec


def _expand(paths: Sequence[str | Path], suffixes: set[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes)
        elif p.is_file():
            files.append(p)
        else:
            raise UserError(f"data file or directory not found: {p}")
    if not files:
        raise UserError(f"no data files with suffix {sorted(suffixes)} under {[str(p) for p in paths]}")
    return files


def _finish(rows: list[dict], report: LoadReport, what: str) -> datasets.Dataset:
    report.kept = len(rows)
    if not rows:
        raise UserError(f"no usable {what} rows: {report.summary()}")
    return datasets.Dataset.from_list(rows)


def _record(place: str, rec: Any, report: LoadReport, strict: bool) -> dict | None:
    try:
        if isinstance(rec, MalformedRow):
            raise rec
        if not isinstance(rec, dict):
            raise MalformedRow(f"record is {type(rec).__name__}, not an object")
        return {"messages": normalise_messages(rec), "source": place}
    except MalformedRow as e:
        if strict:
            raise UserError(
                f"malformed row at {place}: {e} (strict mode; set strict: false to skip such rows)"
            ) from None
        report.malformed.append(f"{place}: {e}")
        return None


def load_chat(paths: Sequence[str | Path], strict: bool = False, report: LoadReport | None = None) -> datasets.Dataset:
    """Conversations from local JSON / JSONL / Parquet files or directories of them."""
    report = report if report is not None else LoadReport()
    rows = []
    for path in _expand(paths, {".json", ".jsonl", ".parquet"}):
        records = _parquet_records(path) if path.suffix == ".parquet" else _json_records(path)
        for place, rec in records:
            row = _record(place, rec, report, strict)
            if row is not None:
                rows.append(row)
    return _finish(rows, report, "conversation")


def load_text(paths: Sequence[str | Path], suffixes: Iterable[str] = TEXT_SUFFIXES) -> datasets.Dataset:
    """One row per non-empty UTF-8 text file (code or prose); undecodable files are reported, not kept.

    ``stdlib:train`` (or ``validation``, ``heldout``) stands for that split of the embedded stdlib corpus. A
    ``.jsonl`` file holds one text per line as ``{"text": ...}`` (what ``trainer data regenerate --format text``
    writes); a line without a string ``text`` is reported with its file and line, not kept.
    """
    report = LoadReport()
    rows = []
    files: list[Path] = []
    for p in paths:
        if str(p).startswith("stdlib:"):
            # The embedded corpus: the running interpreter's standard library, one split of it.
            split = str(p).split(":", 1)[1]
            if split not in SPLITS:
                raise UserError(f"unknown stdlib split in {p!r}; use one of {', '.join('stdlib:' + s for s in SPLITS)}")
            files += [m.path for m in list_modules(split)]
        else:
            files += _expand([p], set(suffixes) | {".jsonl"})
    for path in files:
        if path.suffix == ".jsonl":
            for place, rec in _json_records(path):
                if isinstance(rec, dict) and isinstance(rec.get("text"), str):
                    if rec["text"].strip():
                        rows.append({"text": rec["text"], "source": place})
                else:
                    reason = rec if isinstance(rec, MalformedRow) else "no string 'text' field"
                    report.malformed.append(f"{place}: {reason}")
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            report.malformed.append(f"{path}: not UTF-8 ({e.reason} at byte {e.start})")
            continue
        if text.strip():
            rows.append({"text": text, "source": str(path)})
    return _finish(rows, report, "text")


def load_hub(name: str, split: str = "train", strict: bool = False) -> datasets.Dataset:
    """A chat dataset by hub name (only where a hub is reachable); rows normalised as for local files."""
    try:
        raw = datasets.load_dataset(name, split=split)
    except Exception as e:
        raise UserError(
            f"cannot load dataset '{name}' from a hub ({type(e).__name__}: {e}); "
            "download it and pass local files instead"
        ) from None
    report = LoadReport()
    rows = [r for i, rec in enumerate(raw) if (r := _record(f"{name}#{i}", rec, report, strict))]
    return _finish(rows, report, "conversation")


def split_train_validation(
    ds: datasets.Dataset, validation_fraction: float, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Deterministic shuffle (by ``seed``) and split; the validation part has at least one row."""
    if not 0.0 < validation_fraction < 1.0:
        raise UserError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    if len(ds) < 2:
        raise UserError(f"need at least 2 rows to split train/validation, got {len(ds)}")
    order = list(range(len(ds)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(ds) * validation_fraction))
    return ds.select(order[n_val:]), ds.select(order[:n_val])
