"""The columnar step decoder (trainer/vlog/reader.py) against the reference decoder (schema.decode): on valid
and mutated lines, mixed in batches, it accepts exactly what the reference accepts, with the same values, and
rejects the rest with the reference's reason; valid step lines take its fast path."""

import json
import math
import random
import warnings

import numpy as np
import orjson
import pytest

from trainer.vlog.reader import LOGPROB_DTYPE, BatchDecoder, StepColumns, decode_batch
from trainer.vlog.schema import RecordError, decode, request_record, step_record

V = 300


def tree(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    parents = [rng.randrange(-1, i) for i in range(n)]
    path, node = [], -1
    while children := [i for i, p in enumerate(parents) if p == node]:
        if rng.random() < 0.3:
            break
        node = rng.choice(children)
        path.append(node)
    return parents, path


def logprobs(rng: random.Random, k: int) -> list[float]:
    return sorted((-round(rng.random() * 9, rng.choice([2, 4, 7])) for _ in range(k)), reverse=True)


def valid_step(rng: random.Random) -> dict:
    n = rng.choice([0, 1, 3, 8, 17])
    k = rng.choice([8, 8, 10])
    parents, accepted = tree(rng, n)
    shareable = rng.random() < 0.8
    return step_record(
        server=rng.choice(["a", "b", "c"]),
        request=f"r{rng.randrange(100)}",
        tenant=None if shareable and rng.random() < 0.7 else rng.choice(["t1", "t2"]),
        shareable=shareable,
        step=rng.randrange(50),
        drafter=rng.choice([None, "dflash_tiny"]),
        drafter_version=rng.choice([None, 3, "v2"]),
        tree=rng.choice(["ddtree", "chain"]),
        budget=n + rng.randrange(3),
        pos=rng.randrange(500),
        root=rng.randrange(V),
        tokens=[rng.randrange(V) for _ in range(n)],
        parents=parents,
        accepted=accepted,
        bonus=rng.randrange(V),
        topk_ids=[rng.sample(range(V), k) for _ in range(n + 1)],
        topk_logprobs=[logprobs(rng, k) for _ in range(n + 1)],
        ms={"draft": rng.random(), "tree": rng.choice([0, 0.25]), "verify": 2.0},
    )


REQUEST = request_record(server="a", request="q", tenant="t1", shareable=False, prompt_ids=[1, 2], output_ids=[3],
                         prefill_topk_ids=[list(range(8))] * 2)  # fmt: skip
BAD_MS = [{"draft": 1, "tree": 1}, {"draft": -1, "tree": 0, "verify": 0}, [], 5,
          {"draft": True, "tree": 0, "verify": 0}, {"draft": 1e400, "tree": 0, "verify": 0}]  # fmt: skip
LIST_FIELDS = ("tokens", "parents", "accepted", "topk_ids", "topk_logprobs")
BAD_VALUES = [-1, V, 2**63, 2**64, 10**30, 1.5, 1.0, True, None, "7", [], [1], {"a": 1}, float("nan"), -0.0, 1e400]


def mutate(rng: random.Random, record: dict) -> bytes:
    """One line: ``record`` with one random fault (or none), as JSON text."""
    r = json.loads(json.dumps(record))
    choice = rng.randrange(14)
    if choice == 0:  # a field deleted
        del r[rng.choice(list(r))]
    elif choice == 1:  # a scalar field replaced
        r[rng.choice([f for f in r if f not in LIST_FIELDS])] = rng.choice(BAD_VALUES)
    elif choice == 2:  # a list element replaced
        field = rng.choice(LIST_FIELDS)
        values = r[field]
        if field.startswith("topk") and values:
            values = rng.choice(values)
        if values:
            values[rng.randrange(len(values))] = rng.choice(BAD_VALUES)
    elif choice == 3:  # a list replaced whole
        r[rng.choice(LIST_FIELDS)] = rng.choice([[], [[]], [[1] * 8], 5, "x", {"a": []}, [[[1] * 8]]])
    elif choice == 4:  # a row of a top-k list shortened, lengthened, nested or dropped
        field = rng.choice(["topk_ids", "topk_logprobs"])
        row = rng.randrange(len(r[field]))
        op = rng.randrange(4)
        if op == 0:
            r[field][row] = r[field][row][:-1]
        elif op == 1:
            r[field][row] = [*r[field][row], 0]
        elif op == 2:
            r[field][row][0] = [r[field][row][0]]
        else:
            del r[field][row]
    elif choice == 5:  # width below the minimum, in every row
        r["topk_ids"] = [row[:7] for row in r["topk_ids"]]
        r["topk_logprobs"] = [row[:7] for row in r["topk_logprobs"]]
    elif choice == 6:  # a log-prob above 0, or infinite
        r["topk_logprobs"][0][0] = rng.choice([0.5, 0.0005, float("inf"), -float("inf"), 0])
    elif choice == 7 and r["tokens"]:  # a parent pointing forward, or below -1
        i = rng.randrange(len(r["parents"]))
        r["parents"][i] = rng.choice([i, i + 1, -2])
    elif choice == 8:  # an accepted path that is not a root path
        r["accepted"] = rng.choice([[0, 0], [len(r["tokens"])], [-1], [1], [0, 2]])
    elif choice == 9:  # ms broken
        r["ms"] = rng.choice(BAD_MS)
    elif choice == 10:  # fields beyond v1: allowed; a bracket in a string takes the reference path
        r[rng.choice(["note", "extra"])] = rng.choice(["a[b]", [1, [2]], {"x": [1]}, 3])
        if rng.random() < 0.5:
            r["server"] = "gpu[0]"
    elif choice == 11:  # kind and version
        r[rng.choice(["kind", "v"])] = rng.choice(["request", "x", 2, "1", None])
    text = json.dumps(r, separators=rng.choice([(",", ":"), (", ", ": ")]))
    if choice == 12:  # a duplicated key: JSON parsers keep the last value
        field = rng.choice(["root", "tokens", "tenant", "shareable"])
        text = text[:-1] + f', "{field}": {json.dumps(rng.choice([*BAD_VALUES, 1]))}}}'
    elif choice == 13:  # byte damage
        cut = rng.randrange(1, len(text))
        text = rng.choice([text[:cut], text[:cut] + "\x00" + text[cut:], text.replace("1", "١", 1), " " + text])
    return text.encode("utf-8", "surrogatepass")


def expected(line: bytes) -> dict | str:
    try:
        return decode(line, V)
    except RecordError as e:
        return e.reason


def assert_columns_equal(a: StepColumns, b: StepColumns) -> None:
    assert (a.server, a.tenant, a.shareable) == (b.server, b.tenant, b.shareable)
    for name in ("start", "rows", "k", "topk_start", "topk_ids", "topk_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


@pytest.mark.parametrize("seed", range(6))
def test_decoder_agrees_with_the_reference_on_mutated_lines(seed):
    rng = random.Random(seed)
    decoder = BatchDecoder(V)
    fast = 0
    for _ in range(8):
        lines = []
        for _ in range(120):
            if rng.random() < 0.1:
                lines.append(orjson.dumps(REQUEST))
            else:
                record = valid_step(rng)
                lines.append(orjson.dumps(record) if rng.random() < 0.4 else mutate(rng, record))
        fast += sum(decoder._parse(i, line) is not None for i, line in enumerate(lines))
        want = [expected(line) for line in lines]
        got = decoder(lines)
        assert [(i, e.reason) for i, e in got.errors] == [(i, w) for i, w in enumerate(want) if isinstance(w, str)]
        steps = [w for w in want if isinstance(w, dict) and w["kind"] == "step"]
        assert got.requests == [w for w in want if isinstance(w, dict) and w["kind"] == "request"]
        # The fast path's records come first, then those only the reference accepted: compare as multisets.
        order = sorted(range(len(got.steps)), key=lambda i: orjson.dumps(
            [got.steps.server[i], got.steps.rows[got.steps.start[i]:got.steps.start[i + 1]].tolist()]))  # fmt: skip
        want_order = sorted(range(len(steps)), key=lambda i: orjson.dumps(
            [steps[i]["server"], [steps[i]["root"], *steps[i]["tokens"]]]))  # fmt: skip
        reference = StepColumns.from_records(steps).select(want_order)
        assert_columns_equal(got.steps.select(order), reference)
    # Valid step lines (about 40% of all) took the fast path; the mutated ones that stay valid may too.
    assert fast >= 0.3 * 8 * 120


def test_a_clean_batch_is_decoded_entirely_on_the_fast_path_with_exact_values():
    rng = random.Random(7)
    records = [valid_step(rng) for _ in range(50)]
    lines = [orjson.dumps(r) for r in records]
    decoder = BatchDecoder(V)
    assert all(decoder._parse(i, line) is not None for i, line in enumerate(lines))
    got = decoder(lines)
    assert not got.errors and not got.requests
    assert_columns_equal(got.steps, StepColumns.from_records(records))
    logged = np.array([x for r in records for row in r["topk_logprobs"] for x in row])
    # Kept at the precision the daemon's weights use: each logged value rounded once, to the nearest float32.
    assert got.steps.topk_logprobs.dtype == LOGPROB_DTYPE
    assert got.steps.topk_logprobs.tolist() == logged.astype(LOGPROB_DTYPE).tolist()


def test_a_log_prob_beyond_float32_is_kept_as_minus_infinity_without_a_warning():
    # -1e300 is a finite log-prob (valid v1); at float32 it is -inf, i.e. weight 0 for the daemon.
    record = valid_step(random.Random(5))
    record["topk_logprobs"][0][0] = -1e300
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = decode_batch([orjson.dumps(record)], V)
        reference = StepColumns.from_records([record])
    assert not fast.errors and len(fast.steps) == 1
    assert fast.steps.topk_logprobs[0] == reference.topk_logprobs[0] == -np.inf


def test_one_bad_record_among_good_ones_is_rejected_alone():
    rng = random.Random(3)
    records = [valid_step(rng) for _ in range(9)]
    forward = dict(records[6], tokens=[1, 2], parents=[-1, 1], accepted=[], budget=2)
    forward["topk_ids"], forward["topk_logprobs"] = [list(range(8))] * 3, [[-1.0] * 8] * 3
    bad = [
        dict(records[4], topk_ids=[[V, *row[1:]] for row in records[4]["topk_ids"]]),
        forward,
        dict(records[8], topk_logprobs=[[math.inf, *row[1:]] for row in records[8]["topk_logprobs"]]),
    ]
    lines = [orjson.dumps(r) for r in records[:4]] + [json.dumps(b).encode() for b in bad] + [orjson.dumps(records[0])]
    got = decode_batch(lines, V)
    assert [i for i, _ in got.errors] == [4, 5, 6]
    assert [e.reason for _, e in got.errors] == [expected(line) for line in lines[4:7]]
    assert len(got.steps) == 5


@pytest.mark.parametrize("value,valid", [(4, True), (0, True), (None, True), (-1, False), (True, False), ("3", False)])
def test_the_optional_adjacency_version_is_checked_alike_by_both_decoders(value, valid):
    """A step record may carry the adjacency version its tree read (docs/verifier_log.md): an int >= 0 or null.
    The reference validator and the fast path give it the same verdict and reason."""
    record = dict(valid_step(random.Random(5)), adjacency_version=value)
    line = json.dumps(record).encode()
    got = decode_batch([line], V)
    if valid:
        assert decode(line, V)["adjacency_version"] == value and len(got.steps) == 1 and not got.errors
    else:
        with pytest.raises(RecordError, match="adjacency_version"):
            decode(line, V)
        assert [e.reason for _, e in got.errors] == [expected(line)]
