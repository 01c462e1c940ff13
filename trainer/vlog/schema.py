"""Verifier log v1: records (the one validator every reader uses, and constructors for writers) and segment names.

The format is described in docs/verifier_log.md. A record is a JSON object; ``validate`` returns it unchanged
when it is a well-formed v1 record and raises ``RecordError`` naming the first field that is not. Checks run
over whole lists at C speed (``map``/``set``/``min``/``max``) so a reader validates large trees cheaply. A record
built in process (``trainer.vlog.recorder``) may hold its four tree lists (``tokens``, ``parents``, ``topk_ids``,
``topk_logprobs``) as numpy arrays, which the writer encodes as the same JSON lists; ``validate`` checks an array
with numpy and gives it the verdict it gives the equal list, naming the same field (``tests/test_vlog.py``
compares them)::

    python -c "from trainer.vlog.schema import request_record, validate; \\
        print(validate(request_record(server='s', request='r', tenant=None, shareable=True, \\
        prompt_ids=[1, 2], output_ids=[3]), vocab_size=8192))"

A log directory holds segment files ``{prefix}-{seq:06d}-{unix_ms}.jsonl`` once finished, with ``.part``
appended while a writer appends to it. The stem (the name without either suffix) survives the finishing rename,
so readers key their offsets by it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from itertools import chain
from operator import lt
from pathlib import Path
from types import NoneType

import numpy as np
import orjson

VERSION = 1
KINDS = ("step", "request")
# Fewest target candidates a verified node carries: the adjacency daemons fill rows of this width.
MIN_TOPK = 8
# Log-probs are <= 0; float rounding of log-softmax may land a hair above.
LOGPROB_SLACK = 1e-3
# Longest line a reader accepts and a writer emits (bytes, newline excluded).
MAX_LINE_BYTES = 8 << 20
PHASES = ("draft", "tree", "verify")
# The types each step record field other than its five lists may have: ``type``, not ``isinstance`` (JSON true is
# not an int). Readers that take a line apart themselves check the same (``trainer/vlog/reader.py``).
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "v": (int,),
    "kind": (str,),
    "server": (str,),
    "request": (str,),
    "tenant": (str, NoneType),
    "shareable": (bool,),
    "step": (int,),
    "drafter": (str, NoneType),
    "drafter_version": (str, int, NoneType),
    "tree": (str,),
    "budget": (int,),
    "pos": (int,),
    "root": (int,),
    "bonus": (int,),
    "ms": (dict,),
}
# Optional step record fields: checked when present (an absent one is null).
OPTIONAL_STEP_TYPES: dict[str, tuple[type, ...]] = {"adjacency_version": (int, NoneType)}


class RecordError(ValueError):
    """A record that is not valid v1; ``file`` and ``offset`` say where when it was read from a segment."""

    def __init__(self, reason: str, file: str | None = None, offset: int | None = None) -> None:
        super().__init__(reason if file is None else f"{file}:{offset}: {reason}")
        self.reason = reason
        self.file = file
        self.offset = offset


def _finite(value: float | int) -> bool:
    # An int beyond the float range (JSON allows any length) is not a usable number either.
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _show(value: object) -> str:
    """A value for a reason, cut short: an integer may have thousands of digits."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _require(record: dict, name: str, kinds: tuple[type, ...]) -> object:
    try:
        value = record[name]
    except KeyError:
        raise RecordError(f"missing field {name!r}") from None
    # type() rather than isinstance: JSON true is not an int, and an int is not a float here.
    if type(value) not in kinds:
        wanted = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise RecordError(f"field {name!r} must be {wanted}, got {type(value).__name__}")
    return value


def _count(record: dict, name: str) -> int:
    value = _require(record, name, FIELD_TYPES.get(name) or OPTIONAL_STEP_TYPES[name])
    if value < 0:
        raise RecordError(f"field {name!r} must be >= 0, got {_show(value)}")
    return value


def _token_list(name: str, values: list, vocab_size: int | None) -> None:
    """Token ids: ints in [0, vocab_size)."""
    if not values:
        return
    if set(map(type, values)) != {int}:
        bad = next(v for v in values if type(v) is not int)
        raise RecordError(f"{name} must hold token ids (int), found {type(bad).__name__} {_show(repr(bad))}")
    _token_range(name, min(values), max(values), vocab_size)


def _token_range(name: str, low: int, high: int, vocab_size: int | None) -> None:
    if low < 0:
        raise RecordError(f"{name} holds a negative token id {_show(low)}")
    if vocab_size is not None and high >= vocab_size:
        raise RecordError(f"{name} holds token id {_show(high)} outside the vocabulary of {vocab_size}")


def _token_array(name: str, values: np.ndarray, vocab_size: int | None) -> None:
    """``_token_list`` for a numpy array of any shape (an empty one, whatever its dtype, is the empty list)."""
    if not values.size:
        return
    if values.dtype.kind not in "iu":
        kind = "bool" if values.dtype.kind == "b" else "float" if values.dtype.kind == "f" else str(values.dtype)
        raise RecordError(f"{name} must hold token ids (int), found {kind} values")
    _token_range(name, int(values.min()), int(values.max()), vocab_size)


def _tokens(name: str, values: list | np.ndarray, vocab_size: int | None) -> None:
    (_token_array if type(values) is np.ndarray else _token_list)(name, values, vocab_size)


def _token(record: dict, name: str, vocab_size: int | None) -> int:
    value = _require(record, name, FIELD_TYPES[name])
    if value < 0:
        raise RecordError(f"field {name!r} holds a negative token id {_show(value)}")
    if vocab_size is not None and value >= vocab_size:
        raise RecordError(f"field {name!r} holds token id {_show(value)} outside the vocabulary of {vocab_size}")
    return value


def _rows(name: str, rows: object, n_rows: int) -> int:
    """A list (or 2-d array) of ``n_rows`` lists of one common width k >= MIN_TOPK; returns k."""
    if type(rows) not in (list, np.ndarray):
        raise RecordError(f"field {name!r} must be a list of rows, got {type(rows).__name__}")
    if len(rows) != n_rows:
        raise RecordError(f"field {name!r} has {len(rows)} rows, expected {n_rows}")
    if not len(rows):
        return 0
    if type(rows) is np.ndarray:
        if rows.ndim != 2:
            raise RecordError(f"field {name!r} must be a list of lists")
        widths = {rows.shape[1]}
    elif set(map(type, rows)) != {list}:
        raise RecordError(f"field {name!r} must be a list of lists")
    else:
        widths = set(map(len, rows))
    if len(widths) != 1:
        raise RecordError(f"field {name!r} has rows of unequal widths {sorted(widths)}")
    k = widths.pop()
    if k < MIN_TOPK:
        raise RecordError(f"field {name!r} has rows of width {k}; top-k needs k >= {MIN_TOPK}")
    return k


def _common(record: dict) -> None:
    for name in ("server", "request", "tenant", "shareable"):
        _require(record, name, FIELD_TYPES[name])


def _step_scalars(record: dict, vocab_size: int | None) -> int:
    """The step record's fields other than its lists and ``ms``; returns the budget."""
    _count(record, "step")
    for name in ("drafter", "drafter_version", "tree"):
        _require(record, name, FIELD_TYPES[name])
    if record.get("adjacency_version") is not None:
        _count(record, "adjacency_version")
    budget = _count(record, "budget")
    _count(record, "pos")
    _token(record, "root", vocab_size)
    _token(record, "bonus", vocab_size)
    return budget


def _ms(record: dict) -> None:
    ms = _require(record, "ms", FIELD_TYPES["ms"])
    for phase in PHASES:
        value = _require(ms, phase, (float, int))
        if not _finite(value) or value < 0:
            raise RecordError(f"ms.{phase} = {_show(value)} is not a finite duration >= 0")


def _step(record: dict, vocab_size: int | None) -> None:
    budget = _step_scalars(record, vocab_size)

    tokens = _require(record, "tokens", (list, np.ndarray))
    n = len(tokens)
    if type(tokens) is np.ndarray and tokens.ndim != 1:
        raise RecordError(f"field 'tokens' must be a list of token ids, got an array of shape {tokens.shape}")
    if n > budget:
        raise RecordError(f"the tree has {n} draft nodes, more than its budget {budget}")
    _tokens("field 'tokens'", tokens, vocab_size)

    parents = _require(record, "parents", (list, np.ndarray))
    if type(parents) is np.ndarray and parents.ndim != 1:
        raise RecordError(f"field 'parents' must be a list of ints, got an array of shape {parents.shape}")
    if len(parents) != n:
        raise RecordError(f"field 'parents' has {len(parents)} entries for {n} tokens")
    if n:
        _parents(parents)

    accepted = _require(record, "accepted", (list,))
    if accepted and set(map(type, accepted)) != {int}:
        raise RecordError("field 'accepted' must hold ints")
    parent = -1
    for j, node in enumerate(accepted):
        if not 0 <= node < n:
            raise RecordError(f"accepted[{j}] = {_show(node)} is not a node of a tree with {n} draft nodes")
        if parents[node] != parent:
            raise RecordError(f"accepted[{j}] = {node} is not a child of {parent}: 'accepted' must be a root path")
        parent = node

    ids = _require(record, "topk_ids", (list, np.ndarray))
    k = _rows("topk_ids", ids, n + 1)
    _tokens("field 'topk_ids'", ids if type(ids) is np.ndarray else list(chain.from_iterable(ids)), vocab_size)
    logprobs = _require(record, "topk_logprobs", (list, np.ndarray))
    if _rows("topk_logprobs", logprobs, n + 1) != k:
        raise RecordError("fields 'topk_logprobs' and 'topk_ids' have rows of different widths")
    _logprobs(logprobs, k)
    _ms(record)


def _parents(parents: list | np.ndarray) -> None:
    """Topological order: every parent is -1 (the root) or an earlier node."""
    n = len(parents)
    if type(parents) is np.ndarray:
        if parents.dtype.kind not in "iu":
            raise RecordError("field 'parents' must hold ints")
        bad_at = np.flatnonzero((parents < -1) | (parents >= np.arange(n)))
        bad = int(bad_at[0]) if bad_at.size else None
    else:
        if set(map(type, parents)) != {int}:
            raise RecordError("field 'parents' must hold ints")
        ordered = min(parents) >= -1 and all(map(lt, parents, range(n)))
        bad = None if ordered else next(i for i, p in enumerate(parents) if not -1 <= p < i)
    if bad is not None:
        raise RecordError(f"parents[{bad}] = {_show(parents[bad])}: a parent is -1 (root) or an earlier node")


def _logprobs(logprobs: list | np.ndarray, k: int) -> None:
    """Finite numbers <= 0 (within ``LOGPROB_SLACK``), row-major over rows of width ``k``."""
    if type(logprobs) is np.ndarray:
        if logprobs.dtype.kind not in "fiu":
            raise RecordError("field 'topk_logprobs' must hold numbers")
        flat = logprobs.reshape(-1)
        bad_at = np.flatnonzero(~np.isfinite(flat))
        bad = int(bad_at[0]) if bad_at.size else None
        high = float(flat.max()) if flat.size else None
    else:
        flat = list(chain.from_iterable(logprobs))
        if not set(map(type, flat)) <= {float, int}:
            raise RecordError("field 'topk_logprobs' must hold numbers")
        try:
            finite = all(map(math.isfinite, flat))
        except OverflowError:
            finite = False
        bad = None if finite else next(i for i, v in enumerate(flat) if not _finite(v))
        high = max(flat) if flat and finite else None
    if bad is not None:
        row, col = divmod(bad, k)
        raise RecordError(f"topk_logprobs[{row}][{col}] is {_show(flat[bad])}, not a finite log-prob")
    if high is not None and high > LOGPROB_SLACK:
        raise RecordError(f"field 'topk_logprobs' holds {high} > 0: log-probs, not logits, are logged")


def _request(record: dict, vocab_size: int | None) -> None:
    prompt = _require(record, "prompt_ids", (list,))
    _token_list("field 'prompt_ids'", prompt, vocab_size)
    _token_list("field 'output_ids'", _require(record, "output_ids", (list,)), vocab_size)
    if record.get("prefill_topk_ids") is not None:
        rows = record["prefill_topk_ids"]
        _rows("prefill_topk_ids", rows, len(prompt))
        _token_list("field 'prefill_topk_ids'", list(chain.from_iterable(rows)), vocab_size)


def validate(obj: object, vocab_size: int | None = None) -> dict:
    """``obj`` when it is a valid v1 record, else ``RecordError`` with the reason. Token ids are checked
    against ``vocab_size`` when given. A step record's optional ``adjacency_version`` is an int >= 0 or null when
    present; other fields beyond the v1 set are allowed and left alone."""
    if type(obj) is not dict:
        raise RecordError(f"a record is a JSON object, got {type(obj).__name__}")
    _version(obj)
    _common(obj)
    (_step if obj["kind"] == "step" else _request)(obj, vocab_size)
    return obj


def _version(obj: dict) -> None:
    if "v" not in obj:
        raise RecordError("missing field 'v' (format version)")
    if type(obj["v"]) is not int or obj["v"] != VERSION:
        raise RecordError(f"unknown version v={_show(repr(obj['v']))}; this reader knows v={VERSION}")
    kind = obj.get("kind")
    if kind not in KINDS:
        raise RecordError(f"unknown kind {_show(repr(kind))}; expected one of {list(KINDS)}")


def decode(line: bytes, vocab_size: int | None = None) -> dict:
    """One log line (without its newline) as a valid record, else ``RecordError`` with the reason."""
    if not line.strip():
        raise RecordError("empty line")
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        obj = _parse_slowly(line)
    return validate(obj, vocab_size)


def _parse_slowly(line: bytes) -> object:
    """The standard parser on what orjson refused: it accepts NaN/Infinity and integers beyond 64 bits (the
    validator then names the field), and otherwise says what is wrong and where."""
    try:
        return json.loads(line)
    except UnicodeDecodeError:
        raise RecordError("line is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise RecordError(f"not JSON: {e.msg} at column {e.colno}") from None
    except ValueError as e:
        # An integer literal beyond the interpreter's digit limit (sys.get_int_max_str_digits()).
        raise RecordError(f"not JSON this reader can hold: {e}") from None
    except RecursionError:
        raise RecordError("JSON nested too deeply") from None


def step_record(
    *,
    server: str,
    request: str,
    tenant: str | None,
    shareable: bool,
    step: int,
    drafter: str | None,
    drafter_version: str | int | None,
    tree: str,
    budget: int,
    pos: int,
    root: int,
    tokens: list[int] | np.ndarray,
    parents: list[int] | np.ndarray,
    accepted: list[int],
    bonus: int,
    topk_ids: list[list[int]] | np.ndarray,
    topk_logprobs: list[list[float]] | np.ndarray,
    ms: dict[str, float],
    adjacency_version: int | None = None,
) -> dict:
    """A step record with the v1 field names; ``validate`` it (the writer does) before trusting it. The tree
    lists may be numpy arrays (1-d, and (N + 1, k) for the top-k), which the writer encodes as JSON lists.
    ``adjacency_version`` is left out when not given."""
    record = {
        "v": VERSION,
        "kind": "step",
        "server": server,
        "request": request,
        "tenant": tenant,
        "shareable": shareable,
        "step": step,
        "drafter": drafter,
        "drafter_version": drafter_version,
        "tree": tree,
        "budget": budget,
        "pos": pos,
        "root": root,
        "tokens": tokens,
        "parents": parents,
        "accepted": accepted,
        "bonus": bonus,
        "topk_ids": topk_ids,
        "topk_logprobs": topk_logprobs,
        "ms": ms,
    }
    if adjacency_version is not None:
        record["adjacency_version"] = adjacency_version
    return record


def request_record(
    *,
    server: str,
    request: str,
    tenant: str | None,
    shareable: bool,
    prompt_ids: list[int],
    output_ids: list[int],
    prefill_topk_ids: list[list[int]] | None = None,
) -> dict:
    """A request record with the v1 field names; ``prefill_topk_ids`` is left out when not given."""
    record = {
        "v": VERSION,
        "kind": "request",
        "server": server,
        "request": request,
        "tenant": tenant,
        "shareable": shareable,
        "prompt_ids": prompt_ids,
        "output_ids": output_ids,
    }
    if prefill_topk_ids is not None:
        record["prefill_topk_ids"] = prefill_topk_ids
    return record


# ---- segment files ----------------------------------------------------------------------------------------
PREFIX = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_NAME = re.compile(rf"(?P<stem>(?P<prefix>{PREFIX.pattern})-(?P<seq>\d{{6,}})-(?P<ms>\d+))\.jsonl(?P<part>\.part)?")
FINISHED = ".jsonl"
PART = FINISHED + ".part"


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


def segment_stem(prefix: str, seq: int, unix_ms: int) -> str:
    return f"{prefix}-{seq:06d}-{unix_ms}"


def parse_segment(name: str) -> Segment | None:
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
            segment = parse_segment(entry.name)
            if segment is not None and (segment.stem not in found or segment.finished):
                found[segment.stem] = segment
    return sorted(found.values(), key=lambda s: (s.unix_ms, s.prefix, s.seq))
