"""Verifier log v1: the validator rejects each kind of bad record with its reason, the writer's segments read
back through the reader exactly once each (rotation, partial lines, the finishing rename), and hostile files
cost neither a crash nor a lost record."""

import json
import math
import os
import time
import tracemalloc
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from trainer.errors import UserError
from trainer.vlog.reader import Item, LogReader
from trainer.vlog.recorder import _log_softmax
from trainer.vlog.schema import RecordError, request_record, step_record, validate
from trainer.vlog.writer import CHECKED_FIRST, LogWriter

V = 100


def step(request: str = "r0", n: int = 3, k: int = 8, **overrides) -> dict:
    """A valid step record: a chain of ``n`` draft nodes, the first two accepted."""
    record = step_record(
        server="s",
        request=request,
        tenant=None,
        shareable=True,
        step=0,
        drafter="dflash_tiny",
        drafter_version=None,
        tree="ddtree",
        budget=n,
        pos=5,
        root=7,
        tokens=[10 + i for i in range(n)],
        parents=list(range(-1, n - 1)),
        accepted=list(range(min(2, n))),
        bonus=42,
        topk_ids=[[(r + c) % V for c in range(k)] for r in range(n + 1)],
        topk_logprobs=[[-0.1 * (c + 1) for c in range(k)] for _ in range(n + 1)],
        ms={"draft": 1.0, "tree": 0.5, "verify": 2.0},
    )
    record.update(overrides)
    return record


def request(**overrides) -> dict:
    record = request_record(server="s", request="r0", tenant="acme", shareable=False, prompt_ids=[1, 2, 3],
                            output_ids=[4, 5], prefill_topk_ids=[list(range(8))] * 3)  # fmt: skip
    record.update(overrides)
    return record


def reason(record: object, vocab_size: int | None = V) -> str:
    with pytest.raises(RecordError) as e:
        validate(record, vocab_size)
    return e.value.reason


def test_valid_records_pass_unchanged():
    for record in (step(), step(n=0, accepted=[]), request(), request(prefill_topk_ids=None), step(tenant="t")):
        assert validate(record, V) is record
    # A branching tree: node 2 hangs off the root beside node 0; the accepted path 2 -> 3 is a root path.
    branching = step(n=4, parents=[-1, 0, -1, 2], accepted=[2, 3])
    assert validate(branching, V) is branching


FAULTS = [
    ([1, 2], "a record is a JSON object"),
    (step(v=2), "unknown version v=2"),
    (step(v=True), "unknown version v=True"),
    ({"kind": "step"}, "missing field 'v'"),
    (step(kind="prefill"), "unknown kind 'prefill'"),
    (step(shareable=1), "field 'shareable' must be bool"),
    (step(tenant=3), "field 'tenant' must be str or null"),
    (step(budget=2.0), "field 'budget' must be int"),
    (step(pos=-1), "field 'pos' must be >= 0"),
    (step(tokens=[10, "11", 12]), "field 'tokens' must hold token ids (int), found str"),
    (step(tokens=[10, 11, True]), "found bool"),
    (step(root=V), f"field 'root' holds token id {V} outside the vocabulary of {V}"),
    (step(tokens=[10, 11, 100000]), "outside the vocabulary"),
    (step(tokens=[10, -1, 11]), "negative token id -1"),
    (step(parents=[-1, 0]), "field 'parents' has 2 entries for 3 tokens"),
    (step(parents=[-1, 1, 1]), "parents[1] = 1: a parent is -1 (root) or an earlier node"),
    (step(parents=[-1, 0, -2]), "parents[2] = -2"),
    (step(accepted=[1]), "accepted[0] = 1 is not a child of -1"),
    (step(accepted=[0, 3]), "accepted[1] = 3 is not a node of a tree with 3 draft nodes"),
    (step(budget=2), "more than its budget 2"),
    (step(topk_ids=step()["topk_ids"][:3]), "field 'topk_ids' has 3 rows, expected 4"),
    (step(k=4), "top-k needs k >= 8"),
    (step(topk_ids=[list(range(8))] * 3 + [list(range(9))]), "rows of unequal widths [8, 9]"),
    (step(topk_logprobs=[[-1.0] * 9] * 4), "rows of different widths"),
    (step(topk_logprobs=[[-1.0] * 7 + [math.nan]] + [[-1.0] * 8] * 3), "topk_logprobs[0][7] is nan"),
    (step(topk_logprobs=[[-1.0] * 8] * 3 + [[-math.inf] * 8]), "topk_logprobs[3][0] is -inf"),
    (step(topk_logprobs=[[3.5] * 8] * 4), "log-probs, not logits"),
    (step(ms={"draft": 1.0, "tree": 0.5}), "missing field 'verify'"),
    (step(ms={"draft": 1.0, "tree": math.nan, "verify": 1.0}), "ms.tree = nan"),
    (request(prefill_topk_ids=[list(range(8))] * 2), "field 'prefill_topk_ids' has 2 rows, expected 3"),
    (request(output_ids=[4, V]), "field 'output_ids' holds token id 100 outside the vocabulary"),
]


@pytest.mark.parametrize(("record", "expected"), FAULTS)
def test_validator_names_the_fault(record, expected):
    assert expected in reason(record)


def arrayed(record: dict) -> dict | None:
    """``record`` with each tree list that a numpy array encodes to the same JSON as an array (what the recorder
    hands the writer); None when no list converts."""
    import numpy as np
    import orjson

    out, converted = dict(record), False
    for name in ("tokens", "parents", "topk_ids", "topk_logprobs"):
        try:
            array = np.array(record[name])
            same = orjson.dumps(array, option=orjson.OPT_SERIALIZE_NUMPY) == orjson.dumps(record[name])
        except (KeyError, ValueError, TypeError, orjson.JSONEncodeError):
            continue
        if same:
            out[name], converted = array, True
    return out if converted else None


STEPS = [step(), step(n=0, accepted=[]), step(n=4, parents=[-1, 0, -1, 2], accepted=[2, 3])] + [
    r for r, _ in FAULTS if isinstance(r, dict) and r.get("kind") == "step"
]


@pytest.mark.parametrize("record", [r for r in STEPS if arrayed(r) is not None])
def test_arrays_get_the_verdict_and_reason_of_the_equal_lists(record):
    as_arrays = arrayed(record)
    try:
        validate(record, V)
    except RecordError as e:
        assert reason(as_arrays) == e.reason
    else:
        assert validate(as_arrays, V) is as_arrays


def test_an_array_of_bools_is_not_token_ids():
    import numpy as np

    # JSON true is not a token id; numpy's bool is not either, though it encodes as one.
    assert "found bool" in reason(step(tokens=np.array([True, False, True])))


def test_vocabulary_is_checked_only_when_known():
    record = step(bonus=V + 5)
    assert validate(record) is record
    assert "outside the vocabulary" in reason(record, V)


# ---- writer -> reader ---------------------------------------------------------------------------------------
def read_all(directory, offsets=None, **kw) -> tuple[list[Item], LogReader]:
    reader = LogReader(directory, offsets, vocab_size=V, **kw)
    return list(reader), reader


def records_of(items: Iterable[Item]) -> list:
    """The record (or rejection) of each line."""
    return [item.record for item in items]


def test_round_trip_with_rotation(tmp_path):
    records = [step(request=f"r{i}", n=i % 5) for i in range(40)] + [request()]
    # Small segments: a rotation every few records; the callable form is built on the writer thread.
    with LogWriter(tmp_path, "replica0", max_bytes=4000, vocab_size=V) as writer:
        for r in records:
            writer.write(lambda r=r: r)
    with LogWriter(tmp_path, "replica1") as other:
        other.write(request(request="from-1"))
    names = sorted(os.listdir(tmp_path))
    segments = [n for n in names if n.endswith(".jsonl")]
    assert len(segments) == len(writer.segments) + 1 > 3
    assert not [n for n in names if n.endswith(".part")]
    assert all(os.path.getsize(tmp_path / s) <= 4000 for s in writer.segments)
    items, reader = read_all(tmp_path)
    got = records_of(items)
    assert [r for r in got if r["server"] == "s" and r["request"] != "from-1"] == records
    assert sum(r["request"] == "from-1" for r in got) == 1
    # Offsets cover every byte; a second reader resuming from them finds nothing new.
    assert all(reader.offsets[f] == os.path.getsize(tmp_path / f"{f}.jsonl") for f in {i.segment for i in items})
    assert read_all(tmp_path, reader.offsets)[0] == []


def test_time_rotation_finishes_an_idle_segment(tmp_path):
    with LogWriter(tmp_path, "w", max_seconds=0.05) as writer:
        writer.write(step())
        writer.flush()
        # Time alone finishes the segment, without a further record or close.
        for _ in range(200):
            if writer.segments:
                break
            time.sleep(0.01)
        assert len(writer.segments) == 1
        writer.write(step(request="later"))
    assert len(writer.segments) == 2
    assert [r["request"] for r in records_of(read_all(tmp_path)[0])] == ["r0", "later"]


def test_writer_refuses_an_invalid_record_and_goes_on(tmp_path):
    writer = LogWriter(tmp_path, "w", vocab_size=V)
    writer.write(step(root=V))
    writer.write(step(request="good"))
    writer.write(step(bonus=-1))
    with pytest.raises(RecordError, match="outside the vocabulary") as error:
        writer.flush()
    assert error.value.__notes__[0].startswith("2 failure(s) on the writer thread")
    writer.flush()
    writer.close()
    assert [r["request"] for r in records_of(read_all(tmp_path)[0])] == ["good"]


def test_a_sampling_writer_checks_its_first_records_and_one_in_n_and_readers_check_every_line(tmp_path):
    writer = LogWriter(tmp_path, "w", vocab_size=V, check_every=2)
    for i in range(CHECKED_FIRST):
        writer.write(step(request=str(i)))
    writer.write(step(request="checked", root=V))  # record 1000: 1000 % 2 == 0, validated and refused
    with pytest.raises(RecordError, match="outside the vocabulary"):
        writer.flush()
    writer.write(step(request="valid"))
    writer.write(step(request="unchecked", root=V))  # record 1001: not validated, written
    writer.close()
    items, _ = read_all(tmp_path)
    tail = [(r.get("request"), None) if isinstance(r, dict) else (None, str(r)) for r in records_of(items[-2:])]
    assert len(items) == CHECKED_FIRST + 2 and tail[0] == ("valid", None)
    assert "outside the vocabulary" in tail[1][1]


def test_a_full_queue_makes_write_wait_not_drop(tmp_path):
    with LogWriter(tmp_path, "w", queue_size=4, interval=0.05) as writer:
        for i in range(40):
            writer.write(step(request=str(i)))
            assert len(writer._queue) <= 4
    assert [r["request"] for r in records_of(read_all(tmp_path)[0])] == [str(i) for i in range(40)]


def test_one_live_writer_per_prefix_and_a_dead_ones_part_is_finished(tmp_path):
    line = json.dumps(step()) + "\n"
    # A writer killed mid-record left a .part whose last line is torn.
    (tmp_path / "w-000003-1700000000000.jsonl.part").write_text(line + line[:50])
    with LogWriter(tmp_path, "w") as writer:
        with pytest.raises(UserError, match="another live writer"):
            LogWriter(tmp_path, "w")
        writer.write(step(request="new"))
    assert sorted(os.listdir(tmp_path)) == [".w.lock", "w-000003-1700000000000.jsonl", writer.segments[0]]
    assert writer.segments[0].startswith("w-000004-")
    items = read_all(tmp_path)[0]
    assert [type(r) for r in records_of(items)] == [dict, RecordError, dict]
    assert items[1].record.reason == "unterminated last line (truncated)"
    assert items[1].start == len(line)


# ---- reader against a live or hostile directory ---------------------------------------------------------------
def test_partial_last_line_is_waited_for_and_the_rename_keeps_offsets(tmp_path):
    part = tmp_path / "w-000000-1700000000000.jsonl.part"
    lines = [(json.dumps(step(request=f"r{i}")) + "\n").encode() for i in range(3)]
    part.write_bytes(lines[0] + lines[1][:40])
    reader = LogReader(tmp_path, vocab_size=V)
    assert [r["request"] for r in records_of(reader)] == ["r0"]
    assert list(reader) == []  # still unfinished: no error, no progress
    with open(part, "ab") as f:
        f.write(lines[1][40:] + lines[2][:10])
    assert [r["request"] for r in records_of(reader)] == ["r1"]
    # The writer completes the line and finishes the segment between two polls.
    with open(part, "ab") as f:
        f.write(lines[2][10:])
    part.rename(tmp_path / "w-000000-1700000000000.jsonl")
    assert [(i.record["request"], i.start) for i in reader] == [("r2", len(lines[0]) + len(lines[1]))]
    assert list(reader) == []
    assert reader.offsets == {"w-000000-1700000000000": sum(map(len, lines))}


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (json.dumps(step())[:-30], "not JSON"),
        (json.dumps(step(pos="5")), "field 'pos' must be int, got str"),
        (json.dumps(step(v=7)), "unknown version v=7"),
        (json.dumps(step(tokens=[10, 11, 5000])), "token id 5000 outside the vocabulary of 100"),
        (json.dumps(step(topk_logprobs=[[-1.0] * 8] * 3 + [[-1.0, math.nan] + [-2.0] * 6])), "is nan"),
        (json.dumps(step(parents=[-1, 0])), "'parents' has 2 entries for 3 tokens"),
        ("", "empty line"),
        ('"just a string"', "a record is a JSON object, got str"),
        (b'{"v": 1, "kind": "\xff\xfe"}', "line is not UTF-8"),
        ("[" * 100000 + "]" * 100000, "nested too deeply"),
        # Integers beyond 64 bits reach the validator through the standard parser; past its digit limit, not even.
        (json.dumps(step(topk_logprobs=[[-1.0] * 8] * 3 + [[-(10**400)] + [-1.0] * 7])), "[3][0] is -1000"),
        (json.dumps(step(ms={"draft": 10**400, "tree": 0.5, "verify": 1.0})), "characters) is not a finite duration"),
        ('{"v": ' + "9" * 5000 + "}", "not JSON this reader can hold"),
    ],
)
def test_hostile_lines_are_rejected_with_their_reason_between_good_ones(tmp_path, line, expected):
    good = json.dumps(step()).encode() + b"\n"
    line = line if isinstance(line, bytes) else line.encode()
    (tmp_path / "w-000000-1700000000000.jsonl").write_bytes(good + line + b"\n" + good)
    items = read_all(tmp_path)[0]
    assert [type(r) for r in records_of(items)] == [dict, RecordError, dict]
    item, error = items[1], items[1].record
    assert (item.segment, item.start, item.end) == ("w-000000-1700000000000", len(good), len(good) + len(line) + 1)
    assert expected in error.reason
    assert (error.file, error.offset) == (item.segment, item.start)


def test_a_10mb_line_is_an_error_read_in_bounded_chunks(tmp_path):
    good = json.dumps(step()).encode() + b"\n"
    huge = b'{"v": 1, "pad": "' + b"x" * (10 << 20) + b'"}\n'
    (tmp_path / "w-000000-1700000000000.jsonl").write_bytes(good + huge + good)
    tracemalloc.start()
    items = list(LogReader(tmp_path, vocab_size=V, max_line_bytes=1 << 20, chunk_bytes=1 << 16))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [type(r) for r in records_of(items)] == [dict, RecordError, dict]
    assert items[1].record.reason == f"line of {len(huge) - 1} bytes exceeds the {1 << 20}-byte limit"
    assert (items[1].start, items[1].end) == (len(good), len(good) + len(huge))
    # Never the whole line in memory: at most the limit plus a chunk or two.
    assert peak < 3 << 20
    # The default limit (8 MiB) rejects it too.
    assert [type(r) for r in records_of(LogReader(tmp_path))] == [dict, RecordError, dict]


def test_an_oversized_line_in_an_unfinished_segment_is_waited_for_then_rejected(tmp_path):
    part = tmp_path / "w-000000-1700000000000.jsonl.part"
    part.write_bytes(b"x" * 5000)
    reader = LogReader(tmp_path, max_line_bytes=1000, chunk_bytes=512)
    assert list(reader) == []
    with open(part, "ab") as f:
        f.write(b"\n" + json.dumps(step()).encode() + b"\n")
    items = list(reader)
    assert [type(r) for r in records_of(items)] == [RecordError, dict]
    assert "line of 5000 bytes" in items[0].record.reason


def test_empty_and_foreign_files_yield_nothing(tmp_path):
    (tmp_path / "w-000000-1700000000000.jsonl").write_bytes(b"")
    (tmp_path / "w-000001-1700000000001.jsonl.part").write_bytes(b"")
    (tmp_path / "quarantine.jsonl").write_text("not a segment\n")
    (tmp_path / "notes.txt").write_text("hello\n")
    items, reader = read_all(tmp_path)
    assert items == []
    assert reader.offsets == {}


def test_following_a_rotating_writer_reads_every_record_once(tmp_path):
    import threading

    n = 300

    def produce():
        with LogWriter(tmp_path, "live", max_bytes=3000, interval=0.001) as writer:
            for i in range(n):
                writer.write(step(request=str(i), n=i % 4))
                if i % 50 == 0:
                    time.sleep(0.01)

    producer = threading.Thread(target=produce)
    producer.start()
    stop = threading.Event()
    seen = []
    deadline = time.monotonic() + 60
    for item in LogReader(tmp_path, vocab_size=V).follow(stop, interval=0.001):
        seen.append(item.record["request"])
        if len(seen) == n or time.monotonic() > deadline:
            stop.set()
    producer.join()
    assert seen == [str(i) for i in range(n)]
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".jsonl")]) > 10


def test_sigterm_handler_closing_the_writer_leaves_only_finished_segments(tmp_path):
    import signal
    import subprocess
    import sys

    script = f"""
import signal, sys
from trainer.vlog.writer import LogWriter
from trainer.vlog.schema import request_record
writer = LogWriter({str(tmp_path)!r}, "srv", max_bytes=2000)
def stop(*_):
    writer.close()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
i = 0
while True:
    writer.write(request_record(server="s", request=str(i), tenant=None, shareable=True, prompt_ids=[1],
                                output_ids=[2]))
    if i == 200:
        print("ready", flush=True)
    i += 1
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".part")]
    requests = [r["request"] for r in records_of(LogReader(tmp_path))]
    # Everything written before the signal, in order, nothing torn.
    assert len(requests) > 200 and requests == [str(i) for i in range(len(requests))]


@pytest.mark.parametrize("max_deferred", [0, 2, 8])
def test_recorder_logs_the_targets_topk_whether_reduced_here_or_on_the_writer_thread(tmp_path, max_deferred):
    import torch

    from trainer.decoding.events import StepEvent
    from trainer.decoding.tree import Tree
    from trainer.sampling import top_rows
    from trainer.vlog.recorder import StepRecorder

    torch.manual_seed(0)
    tree = Tree.from_lists([5, 10, 11, 12, 13], [-1, 0, 0, 1, 3])
    logits = [torch.randn(5, V) for _ in range(12)]
    # Every third step carries the ids greedy verification found (too narrow for k = 9 on step 3: ignored).
    found = {i: top_rows(logits[i], 12 if i != 3 else 8)[0] for i in range(0, 12, 3)}
    events = [
        StepEvent(i, 20 + i, 5, tree, [0, 1, 3], 7, logits[i], {"draft": 1.0, "tree": 0.1, "verify": 2.0},
                  6, "ddtree", found.get(i))
        for i in range(12)
    ]  # fmt: skip
    # max_deferred = 0 reduces every step on the decoding thread; 2 mixes both paths.
    with LogWriter(tmp_path, "w", vocab_size=V, max_deferred=max_deferred) as writer:
        recorder = StepRecorder(writer, server="s", request="r", tenant="t", shareable=False, drafter=None,
                                drafter_version=3, k=9)  # fmt: skip
        for event in events:
            recorder(event)
        recorder.finish([1, 2], [5, 10, 12, 7])
    records = records_of(LogReader(tmp_path, vocab_size=V))
    assert [r["kind"] for r in records] == ["step"] * 12 + ["request"]
    for event, r in zip(events, records, strict=False):
        expected = event.logits.log_softmax(-1).topk(9, dim=-1)
        assert r["topk_ids"] == expected.indices.tolist()
        assert torch.allclose(torch.tensor(r["topk_logprobs"]), expected.values, atol=1e-4)
        assert (r["step"], r["pos"], r["root"], r["bonus"]) == (event.step, event.pos, 5, 7)
        # Engine nodes 1..4 are draft nodes 0..3; the path 0 -> 1 -> 3 is draft nodes 0 -> 2.
        assert (r["tokens"], r["parents"], r["accepted"]) == ([10, 11, 12, 13], [-1, -1, 0, 2], [0, 2])
        assert (r["tenant"], r["shareable"], r["drafter_version"], r["budget"]) == ("t", False, 3, 6)


@pytest.mark.parametrize("vocab", [8192, 1000])
def test_two_stage_topk_equals_the_full_topk(vocab):
    import torch

    from trainer.sampling import CHUNK, top_rows
    from trainer.vlog.recorder import _top

    torch.manual_seed(0)
    logits = torch.randn(6, vocab)
    # Row 1: the 12 best logits share one chunk; row 2: each of the 8 best sits in its own chunk, and the
    # runners-up are chunk maxima too, so the pre-selection must pick exactly the right chunks.
    logits[1, 3 * CHUNK : 3 * CHUNK + 12] = torch.arange(12.0) + 10
    logits[2, torch.arange(16) * (vocab // 16)] = torch.linspace(20, 5, 16)
    ids, logprobs = _top(logits, 8, None)
    expected = logits.log_softmax(-1).topk(8, dim=-1)
    assert torch.equal(ids, expected.indices)
    assert torch.equal(logprobs, expected.values)
    raw = top_rows(logits, 8)  # what Token Recycling keeps: the same selection on raw logits
    assert torch.equal(raw[0], logits.topk(8, dim=-1).indices) and torch.equal(raw[1], logits.topk(8, dim=-1).values)
    # Ids that greedy verification found (wider than k) give the same record without a second selection.
    assert all(map(torch.equal, _top(logits, 8, top_rows(logits, 9)[0]), (ids, logprobs)))


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_top_rows_first_column_tie_breaks_like_argmax(rows):
    """Greedy verification takes column 0 for the target's choice: on equal maxima it must be the first index,
    as the target's own greedy decoding (argmax) picks, or speculative output would differ from it."""
    import torch

    from trainer.sampling import CHUNK, top_rows

    torch.manual_seed(rows)
    for vocab in (8192, 1000):
        # Coarse values tie often; every row also holds its maximum at the end of one chunk, at the start of a
        # later one, and in more chunks than k.
        logits = (torch.randn(rows, vocab) * 2).round()
        logits[:, [CHUNK - 1, 5 * CHUNK, 9 * CHUNK + 3, *range(10 * CHUNK, vocab, 100)]] = 50.0
        for k in (1, 8, 40):
            ids, values = top_rows(logits, k)
            assert torch.equal(ids[:, 0], logits.argmax(-1))
            assert torch.equal(values, logits.topk(k, dim=-1).values)
            assert torch.equal(logits.gather(1, ids), values)
            # No id twice in a row: the first maximum is moved to column 0, not copied over another id.
            assert all(len(set(row)) == k for row in ids.tolist())


# ---- trainer eval --logs --------------------------------------------------------------------------------------
def test_eval_logs_reproduce_every_speculative_run(tmp_path):
    import torch
    from conftest import make_tiny_target

    from trainer.cli import main
    from trainer.drafters.dflash import DFlashDraftModel, build_config

    config = make_tiny_target(tmp_path / "target", num_layers=2)
    torch.manual_seed(0)
    DFlashDraftModel(build_config(config, 1, 8, mask_token_id=3)).save_pretrained(tmp_path / "dflash")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"def f{i}(x):\n"}) + "\n" for i in range(2)))
    main(
        ["eval", "--drafter", str(tmp_path / "dflash"), "--target", str(tmp_path / "target"), "--prompts",
         str(prompts), "--tree", "ddtree,recycling", "--budget", "4", "--max-new-tokens", "12", "--temperature",
         "0.7", "--out", str(tmp_path / "out"), "--check-lossless", "--ignore-eos", "--logs", str(tmp_path / "logs")]
    )  # fmt: skip
    items = list(LogReader(tmp_path / "logs", vocab_size=config.vocab_size))
    records = records_of(items)
    assert all(isinstance(r, dict) for r in records), [r for r in records if not isinstance(r, dict)]
    requests = {r["request"]: r for r in records if r["kind"] == "request"}
    runs = {f"{c}/{t}/4/p{i}" for c in ("T=0.7", "greedy") for t in ("ddtree", "recycling") for i in range(2)}
    assert set(requests) == runs
    assert all(r["server"] == "eval" and r["tenant"] is None and r["shareable"] for r in records)
    for name, req in requests.items():
        steps = [r for r in records if r["kind"] == "step" and r["request"] == name]
        assert [s["step"] for s in steps] == list(range(len(steps))) and steps
        # The drafter drafts DDTree's steps; recycling's are drafter-free (docs/verifier_log.md).
        assert {s["drafter"] for s in steps} == ({None} if "/recycling/" in name else {str(tmp_path / "dflash")})
        output, committed = req["output_ids"], req["output_ids"][:1]
        for s in steps:
            # The root is the last committed token, at the position after the context.
            assert (s["root"], s["pos"]) == (committed[-1], len(req["prompt_ids"]) + len(committed) - 1)
            new = [s["tokens"][a] for a in s["accepted"]] + [s["bonus"]]
            if name.startswith("greedy"):
                # Greedy commits the target's argmax: the top-1 of the root's row, then of each accepted node's.
                rows = [0] + [a + 1 for a in s["accepted"]]
                assert [s["topk_ids"][row][0] for row in rows] == new
            assert all(row == sorted(row, reverse=True) for row in s["topk_logprobs"])
            committed += new
        # Only the last step may commit less than it accepted (max_new_tokens).
        assert committed[: len(output)] == output and len(committed) - len(output) <= len(new) - 1
        assert len(output) == 12


def test_the_recorders_scratch_serves_callers_in_and_out_of_inference_mode():
    """The engine's step records under inference mode; a later record on the same thread outside it (a test, an
    eval) must not meet the inference tensor the first one left as scratch."""
    logits = torch.randn(3, 50)
    with torch.inference_mode():
        inside = _log_softmax(logits).clone()
    outside = _log_softmax(logits[:2])
    assert torch.allclose(inside, logits.log_softmax(-1)) and torch.allclose(outside, logits[:2].log_softmax(-1))
