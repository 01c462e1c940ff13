"""``trainer adapt graft``: snapshot publishing, the candidate aggregation rule, tenants, quarantine, and the
daemon's --once / SIGTERM / SIGKILL-restart behaviour."""

import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from safetensors.torch import save_file

from trainer.adapt import graft as graft_module
from trainer.adapt.candidates import SCALE, CandidateTable
from trainer.adapt.graft import STATE_FILE, GraftConfig, run_graft
from trainer.adapt.journal import METRICS, QUARANTINE
from trainer.errors import UserError
from trainer.snapshots import (
    ADJACENCY,
    CURRENT,
    PublishError,
    load_adjacency,
    publish,
    read_current,
    read_manifest,
    snapshot_kind,
    tenant_filename,
    version_path,
)
from trainer.vlog.schema import request_record, segment_stem, step_record
from trainer.vlog.workers import DecodePool


def _adjacency_payload(adjacency: torch.Tensor, deltas: dict[str, torch.Tensor] | None = None):
    def write(directory):
        save_file({"adjacency": adjacency.contiguous()}, directory / ADJACENCY)
        for name, delta in (deltas or {}).items():
            rows = (delta >= 0).any(dim=1).nonzero().squeeze(1)
            save_file({"rows": rows, "adjacency": delta[rows].contiguous()}, directory / tenant_filename(name))

    return write


# ---------------------------------------------------------------- publish


def test_publish_versions_parent_and_retention(tmp_path):
    root = tmp_path / "pub"
    assert read_current(root) is None
    for i in range(1, 8):
        assert publish(root, _adjacency_payload(torch.full((4, 2), i)), {"records": i}, keep=3) == i
    version, directory = read_current(root)
    assert (version, directory.name) == (7, "v000007")
    assert read_manifest(directory) == {"records": 7, "version": 7, "parent": 6}
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("v")) == ["v000005", "v000006", "v000007"]
    assert load_adjacency(directory).eq(7).all()


def test_a_versions_directory_and_what_it_holds(tmp_path):
    """A server tells a graft matrix from a drafter by the version's files; a version holding neither is refused."""
    root = tmp_path / "pub"
    adjacency = publish(root, _adjacency_payload(torch.zeros(4, 2, dtype=torch.int32)), {})
    drafter = publish(root, lambda d: (d / "config.json").write_text("{}"), {})
    empty = publish(root, lambda d: None, {})
    assert version_path(root, empty) == read_current(root)[1] == root / "v000003"
    assert snapshot_kind(version_path(root, adjacency)) == "adjacency"
    assert snapshot_kind(version_path(root, drafter)) == "drafter"
    with pytest.raises(PublishError, match=r"holds neither adjacency\.safetensors nor a drafter's config\.json"):
        snapshot_kind(version_path(root, empty))


def test_publish_failure_keeps_previous_snapshot(tmp_path, monkeypatch):
    root = tmp_path / "pub"
    publish(root, _adjacency_payload(torch.zeros(4, 2, dtype=torch.int32)), {})

    def no_space(directory):
        (directory / ADJACENCY).write_bytes(b"partial")
        raise OSError(28, "No space left on device", str(directory / ADJACENCY))

    with pytest.raises(PublishError, match=r"No space left on device.*v000001 is still current"):
        publish(root, no_space, {})
    assert read_current(root)[0] == 1
    assert not list(root.glob("*.partial")), "the failed version's temporary directory is removed"
    assert load_adjacency(read_current(root)[1]).eq(0).all()


def test_publish_without_permission_says_why(tmp_path, monkeypatch):
    """As a read-only directory does for a non-root user (the tests may run as root, which ignores modes)."""
    root = tmp_path / "pub"
    publish(root, _adjacency_payload(torch.zeros(4, 2, dtype=torch.int32)), {})
    real_mkdir = type(root).mkdir

    def read_only_mkdir(self, *args, **kwargs):
        if self.parent == root:
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(type(root), "mkdir", read_only_mkdir)
    with pytest.raises(PublishError, match=r"Permission denied.*v000001 is still current"):
        publish(root, _adjacency_payload(torch.ones(4, 2, dtype=torch.int32)), {})
    assert load_adjacency(read_current(root)[1]).eq(0).all()


def test_reader_never_sees_a_torn_snapshot(tmp_path):
    """A reader polling while versions are published sees, every time, a whole matrix of one version."""
    root = tmp_path / "pub"
    publish(root, _adjacency_payload(torch.zeros(512, 8, dtype=torch.int32)), {})
    done, seen, errors = threading.Event(), set(), []

    def read():
        while not done.is_set():
            version, directory = read_current(root)
            try:
                m = load_adjacency(directory)
            except PublishError as e:  # only a version removed by retention may vanish, never a torn one
                if directory.exists():
                    errors.append(e)
                continue
            values = m.unique().tolist()
            if values != [version - 1]:
                errors.append((version, values))
            seen.add(version)

    reader = threading.Thread(target=read)
    reader.start()
    for v in range(2, 30):
        publish(root, _adjacency_payload(torch.full((512, 8), v - 1, dtype=torch.int32)), {}, keep=3)
    done.set()
    reader.join()
    assert not errors
    assert len(seen) > 1


def test_tenant_overlay_and_file_names(tmp_path):
    shared = torch.tensor([[1, 2], [3, -1], [-1, -1]])
    delta = torch.tensor([[-1, -1], [7, 8], [-1, -1]])
    publish(tmp_path, _adjacency_payload(shared, {"acme/../x": delta}), {})
    directory = read_current(tmp_path)[1]
    assert load_adjacency(directory, "acme/../x").tolist() == [[1, 2], [7, 8], [-1, -1]]
    assert load_adjacency(directory, "other").tolist() == shared.tolist()
    assert load_adjacency(directory, None).tolist() == shared.tolist()
    names = [tenant_filename(t) for t in ("a/b", "a_b", "a%2Fb", "A", "a", ".", "..", "x" * 500, "x" * 501)]
    assert len(set(names)) == len(names)
    assert all("/" not in n and len(n) < 200 and not n.startswith(".") for n in names)


def test_a_delta_outside_the_vocabulary_is_refused(tmp_path):
    def payload(directory):
        save_file({"adjacency": torch.zeros(4, 2, dtype=torch.int32)}, directory / ADJACENCY)
        delta = {"rows": torch.tensor([4]), "adjacency": torch.ones(1, 2, dtype=torch.int32)}
        save_file(delta, directory / tenant_filename("t"))

    publish(tmp_path, payload, {})
    with pytest.raises(PublishError, match=r"1 rows and a \(1, 2\) adjacency do not fit the shared \(4, 2\)"):
        load_adjacency(read_current(tmp_path)[1], "t")


def test_read_current_rejects_a_bad_pointer(tmp_path):
    (tmp_path / CURRENT).write_text("../../etc\n")
    with pytest.raises(PublishError, match="not a version directory"):
        read_current(tmp_path)


# ---------------------------------------------------------------- aggregation rule


def _add(table, tick, *evidence):
    """``evidence``: (row, [(cand, probability), ...]) per node."""
    k = max(len(c) for _, c in evidence)
    rows = torch.tensor([r for r, _ in evidence])
    cands = torch.tensor([[c for c, _ in cs] + [-1] * (k - len(cs)) for _, cs in evidence])
    weights = torch.tensor([[round(p * SCALE) for _, p in cs] + [0] * (k - len(cs)) for _, cs in evidence])
    return table.add(rows, cands, weights, tick)


def test_scores_accumulate_and_order_rows():
    table = CandidateTable(vocab_size=10, rows=10, candidates=4, half_life=1e9)
    assert _add(table, 1, (3, [(5, 0.6), (6, 0.3)]), (3, [(6, 0.5), (7, 0.4)]), (4, [(1, 0.9)])) == 2
    adjacency = table.adjacency(3)
    assert adjacency[3].tolist() == [6, 5, 7]  # 0.8 > 0.6 > 0.4
    assert adjacency[4].tolist() == [1, -1, -1]
    assert adjacency[0].tolist() == [-1, -1, -1]


def test_one_noisy_observation_does_not_overwrite_a_row():
    """Last-write-wins (what an in-process Token-Recycling row does) would flip the row; accumulated evidence
    keeps the consensus until the contrary evidence outweighs it."""
    table = CandidateTable(vocab_size=10, rows=10, candidates=4, half_life=8)
    for tick in range(1, 6):
        _add(table, tick, (2, [(5, 0.9), (6, 0.05)]))
    _add(table, 6, (2, [(9, 0.95), (8, 0.03)]))
    assert table.adjacency(2)[2].tolist() == [5, 9]
    for tick in range(7, 40):  # the new regime persists: recency lets it take over
        _add(table, tick, (2, [(9, 0.95), (8, 0.03)]))
    assert table.adjacency(1)[2].tolist() == [9]


def test_decay_halves_scores_per_half_life():
    table = CandidateTable(vocab_size=4, rows=4, candidates=2, half_life=2)
    _add(table, 1, (0, [(1, 1.0)]))
    _add(table, 5, (0, [(2, 0.25)]))  # two half-lives later: 1.0 -> 0.25, plus 0.25 for token 2
    assert table.score[table.slot[0]].tolist() == [SCALE // 4, SCALE // 4]
    assert table.adjacency(2)[0].tolist() == [1, 2]  # a tie goes to the smaller id


def test_bounded_candidates_and_rows():
    table = CandidateTable(vocab_size=100, rows=3, candidates=2, half_life=1e9)
    _add(table, 1, (1, [(10, 0.5), (11, 0.4), (12, 0.3)]))
    assert table.ids[table.slot[1]].tolist() == [10, 11]  # the weakest candidate does not fit
    _add(table, 2, (2, [(20, 0.5)]), (3, [(30, 0.5)]))
    _add(table, 3, (4, [(40, 0.5)]))  # evicts row 1, the least recently touched
    assert table.slot[1] == -1 and table.held() == 3
    _add(table, 4, (5, [(50, 0.5)]), (6, [(60, 0.5)]), (7, [(70, 0.9)]), (8, [(80, 0.1)]))
    assert sorted(table.row.tolist()) == [5, 6, 7]  # 8 has the smallest weight and finds no slot
    assert table.dropped == round(0.1 * SCALE)
    assert table.adjacency(1)[[5, 6, 7, 8], 0].tolist() == [50, 60, 70, -1]


def test_batch_result_does_not_depend_on_evidence_order():
    """Same batches, evidence shuffled inside each: bit-identical tables (what SIGKILL-restart relies on)."""
    torch.manual_seed(0)
    rows = torch.randint(0, 50, (400,))
    cands = torch.randint(0, 50, (400, 8))
    weights = torch.randint(0, SCALE, (400, 8))
    tables = []
    for trial in range(3):
        table = CandidateTable(vocab_size=50, rows=30, candidates=6, half_life=3)
        for tick, batch in enumerate(torch.arange(400).view(4, 100), start=1):
            if trial:
                batch = batch[torch.randperm(100)]
            table.add(rows[batch], cands[batch], weights[batch], tick)
        tables.append(table)
    assert tables[0].dropped > 0, "the row cap is exercised"
    for other in tables[1:]:
        for name, tensor in tables[0].state().items():
            assert torch.equal(other.state()[name], tensor), name


def test_a_large_batch_does_not_depend_on_evidence_order():
    """A batch is matched against the held rows in blocks of nodes: shuffling moves nodes across blocks, and
    rows, held candidates, new ones and drops must come out bit-identical."""
    g = torch.Generator().manual_seed(2)
    rows = torch.randint(0, 2000, (2, 30_000), generator=g)
    cands = (rows[..., None] * 7 + torch.randint(0, 12, (2, 30_000, 8), generator=g)) % 2000
    cands = torch.where(torch.rand(cands.shape, generator=g) < 0.1, -1, cands)
    weights = torch.randint(0, SCALE, cands.shape, generator=g)
    tables = []
    for trial in range(3):
        table = CandidateTable(vocab_size=2000, rows=1500, candidates=6, half_life=3)
        for tick in (1, 2):
            order = torch.randperm(30_000, generator=g) if trial else torch.arange(30_000)
            table.add(rows[tick - 1, order], cands[tick - 1, order], weights[tick - 1, order], tick)
        tables.append(table)
    assert tables[0].dropped > 0 and tables[0].held() == 1500
    for other in tables[1:]:
        assert other.dropped == tables[0].dropped
        for name, tensor in tables[0].state().items():
            assert torch.equal(other.state()[name], tensor), name


@pytest.mark.parametrize("tokens", [40, 12])
def test_state_round_trip_is_exact(tokens):
    """Restored from its state, a table applies the next batch exactly as the original; with ``tokens`` 12 of 20
    slots stay free and the state holds only the held ones."""
    torch.manual_seed(1)
    table = CandidateTable(vocab_size=40, rows=20, candidates=4, half_life=5)
    for tick in range(1, 6):
        rows = torch.randint(0, tokens, (50,))
        table.add(rows, torch.randint(0, 40, (50, 8)), torch.randint(0, SCALE, (50, 8)), tick)
    state = table.state()
    assert state["row"].numel() == table.held() == min(tokens, 20)
    copy = CandidateTable.from_state(state, 40, 5, table.dropped)
    for t in (table, copy):
        t.add(
            torch.arange(40),
            torch.randint(0, 40, (40, 8), generator=torch.Generator().manual_seed(3)),
            torch.full((40, 8), 100),
            6,
        )
    assert torch.equal(copy.adjacency(4), table.adjacency(4))
    assert torch.equal(copy.score, table.score) and torch.equal(copy.slot, table.slot)


@pytest.mark.parametrize("dense", [True, False])
def test_replica_cap_scales_each_server_rows_batch_total(monkeypatch, dense):
    """Known answer: each (server, row)'s batch total is scaled to the cap, floor(w * cap / total) per weight;
    groups under the cap, and the same row from another server, keep their weights. Both ways of grouping
    (a dense count per key, and sorting when the key space is large) give it."""
    from trainer.adapt.graft import Evidence, cap_per_replica

    if not dense:
        monkeypatch.setattr(graft_module, "_DENSE_KEYS", 1)
    rows = torch.tensor([7, 7, 7, 3, 7])
    server = torch.tensor([0, 0, 0, 0, 1])
    weights = torch.tensor([[600, 300], [500, 0], [999, 1], [900, 900], [1000, 999]])
    # Server 0, row 7: total 2400 > 1000 -> w * 1000 // 2400; server 0, row 3: 1800 -> w * 1000 // 1800;
    # server 1, row 7: 1999 -> w * 1000 // 1999 (rounded down: 1000 * 1000 // 1999 = 500, 999000 // 1999 = 499).
    expected = torch.tensor([[250, 125], [208, 0], [416, 0], [500, 500], [500, 499]])
    capped = cap_per_replica(Evidence(rows, torch.zeros_like(weights), weights, server), 16, 1000)
    assert torch.equal(capped, expected)
    assert torch.equal(cap_per_replica(Evidence(rows, torch.zeros_like(weights), weights, server), 16, 2400)[:3],
                       weights[:3])  # fmt: skip


# ---------------------------------------------------------------- the daemon

V = 512


@pytest.fixture
def target(tmp_path):
    """A target directory whose config.json is all the daemon reads: a 512-token vocabulary."""
    directory = tmp_path / "target"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"vocab_size": V}))
    return directory


def successors(token, k=8, salt=0):
    """The synthetic language's top-k after ``token``."""
    return [(token * 31 + 7 * j + 1 + salt) % V for j in range(k)]


def step(rng, server="r0", tenant=None, shareable=True, n=6, root=None, tokens=None, salt=0):
    root = rng.randrange(V) if root is None else root
    tokens = [rng.randrange(V) for _ in range(n)] if tokens is None else tokens
    parents = [-1, *range(len(tokens) - 1)]
    nodes = [root, *tokens]
    return step_record(
        server=server, request="q", tenant=tenant, shareable=shareable, step=0, drafter="eagle3",
        drafter_version=1, tree="ddtree", budget=max(len(tokens), 1), pos=3, root=root, tokens=tokens,
        parents=parents[: len(tokens)], accepted=[0] if tokens else [], bonus=1,
        topk_ids=[successors(t, salt=salt) for t in nodes],
        topk_logprobs=[[-0.2 - 0.4 * r - rng.random() * 0.05 for r in range(8)] for _ in nodes],
        ms={"draft": 1.0, "tree": 0.1, "verify": 2.0},
    )  # fmt: skip


def write_segment(directory, prefix, seq, lines, part=False):
    directory.mkdir(parents=True, exist_ok=True)
    name = segment_stem(prefix, seq, 1000 + seq) + (".jsonl.part" if part else ".jsonl")
    text = "".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines)
    (directory / name).write_text(text)
    return directory / name


def make_logs(directory, seed=0, segments=6, per_segment=40):
    """Two shared replicas, a private tenant, prompts, and one hostile line per segment."""
    rng = random.Random(seed)
    for seq in range(segments):
        for prefix in ("r0", "r1"):
            lines = [step(rng, server=prefix) for _ in range(per_segment)]
            lines += [step(rng, server=prefix, tenant="acme", shareable=False, salt=3) for _ in range(5)]
            prompt = [rng.randrange(V) for _ in range(30)]
            lines.append(request_record(server=prefix, request="q", tenant=None, shareable=True, prompt_ids=prompt,
                                        output_ids=[1, 2]))  # fmt: skip
            lines.insert(rng.randrange(len(lines)), '{"v": 1, "kind": "step", "truncated\n')
            write_segment(directory, prefix, seq, lines)


def adjacencies(publish_dir):
    version_dir = read_current(publish_dir)[1]
    return {t: load_adjacency(version_dir, t) for t in (None, "acme")}


def test_once_builds_rows_from_nodes_and_prompts(tmp_path, target, capsys):
    rng = random.Random(0)
    logs, pub = tmp_path / "logs", tmp_path / "pub"
    prefill = [successors(t, salt=5) for t in (400, 401)]
    write_segment(logs, "r0", 0, [
        step(rng, root=10, tokens=[11, 12]),
        request_record(server="r0", request="a", tenant=None, shareable=True, prompt_ids=[300, 301, 302],
                       output_ids=[303]),
        request_record(server="r0", request="b", tenant=None, shareable=True, prompt_ids=[400, 401],
                       output_ids=[402], prefill_topk_ids=prefill),
    ])  # fmt: skip
    assert run_graft(logs, pub, target, once=True, config=GraftConfig(width=4)) == 0
    m = load_adjacency(read_current(pub)[1])
    assert m.shape == (V, 4)
    for token in (10, 11, 12):  # the root row and every draft node's row
        assert m[token].tolist() == successors(token)[:4]
    assert m[300, 0] == 301 and m[302, 0] == 303 and (m[300, 1:] == -1).all()  # prompt bigrams
    assert m[400].tolist() == prefill[0][:4]  # prefill top-k replaces bigrams
    assert (m[402] == -1).all()
    manifest = read_manifest(read_current(pub)[1])
    assert manifest["version"] == 1 and manifest["parent"] is None
    first = segment_stem("r0", 0, 1000)
    assert manifest["files"] == {first: (logs / f"{first}.jsonl").stat().st_size}
    metrics = json.loads((pub / ".state" / METRICS).read_text())
    assert (metrics["lines"], metrics["records"], metrics["nodes"], metrics["version"]) == (3, 3, 3, 1)
    assert "records/s" in capsys.readouterr().out
    # Nothing new: a second --once publishes nothing and changes nothing.
    assert run_graft(logs, pub, target, once=True, config=GraftConfig(width=4)) == 0
    assert read_current(pub)[0] == 1


def test_state_belongs_to_one_configuration(tmp_path, target):
    logs = tmp_path / "logs"
    write_segment(logs, "r0", 0, [step(random.Random(0))])
    run_graft(logs, tmp_path / "pub", target, once=True)
    with pytest.raises(UserError, match="was built for vocab_size 512 with"):
        run_graft(logs, tmp_path / "pub", target, once=True, config=GraftConfig(candidates=9))


def test_a_noisy_replica_cannot_thrash_a_row(tmp_path, target):
    """Replica r1 hammers row 7 with a wrong successor 400 times in one batch; r0's 20 observations keep it."""
    rng = random.Random(0)
    noisy = step(rng, server="r1", root=7, tokens=[])
    noisy["topk_ids"] = [successors(7, salt=100)]
    write_segment(tmp_path / "logs", "r0", 0, [step(rng, root=7, tokens=[]) for _ in range(20)] + [noisy] * 400)
    run_graft(tmp_path / "logs", tmp_path / "pub", target, once=True, config=GraftConfig(batch_records=1000))
    assert load_adjacency(read_current(tmp_path / "pub")[1])[7, 0] == successors(7)[0]


def test_tenants_never_leak_canaries(tmp_path, target):
    """Private canary sequences of tenant acme: drafted for acme, never for another tenant or the shared matrix."""
    rng = random.Random(1)
    canary = list(range(450, 470))  # tokens no other traffic in this test uses
    lines = []
    for _ in range(30):
        lines.append(step(rng, root=rng.randrange(400), tokens=[rng.randrange(400) for _ in range(5)]))
        lines.append(step(rng, server="r1", tenant="beta", shareable=False, root=rng.randrange(400), tokens=[3]))
    for i in range(len(canary) - 1):
        record = step(rng, tenant="acme", shareable=False, root=canary[i], tokens=[canary[i + 1]])
        record["topk_ids"] = [[canary[i + 1], *successors(canary[i])[1:]], [canary[i + 2 - (i == 18)]] * 8]
        lines.append(record)
        lines.append(request_record(server="r0", request="c", tenant="acme", shareable=False, prompt_ids=canary,
                                    output_ids=[]))  # fmt: skip
    lines.append(request_record(server="r0", request="d", tenant=None, shareable=False, prompt_ids=canary,
                                output_ids=[]))  # fmt: skip
    write_segment(tmp_path / "logs", "r0", 0, lines)
    run_graft(tmp_path / "logs", tmp_path / "pub", target, once=True)
    version_dir = read_current(tmp_path / "pub")[1]

    def hit_rate(tenant):
        m = load_adjacency(version_dir, tenant)
        return sum(int(b in m[a].tolist()) for a, b in pairwise(canary)) / (len(canary) - 1)

    assert hit_rate("acme") == 1.0
    assert hit_rate("beta") == 0.0 and hit_rate(None) == 0.0 and hit_rate("gamma") == 0.0
    assert (version_dir / tenant_filename("acme")).is_file() and (version_dir / tenant_filename("beta")).is_file()
    assert read_manifest(version_dir)["metrics"]["private_untenanted"] == 1


def test_tenant_count_and_rows_are_bounded(tmp_path, target):
    rng = random.Random(2)
    lines = [step(rng, tenant=f"t{i}", shareable=False, n=8) for i in range(6)]
    write_segment(tmp_path / "logs", "r0", 0, lines)
    config = GraftConfig(max_tenants=4, tenant_rows=5, batch_records=2)
    run_graft(tmp_path / "logs", tmp_path / "pub", target, once=True, config=config)
    manifest = read_manifest(read_current(tmp_path / "pub")[1])
    assert manifest["tenants"] == ["t2", "t3", "t4", "t5"]  # the least recently active two were evicted
    assert manifest["metrics"]["tenants_evicted"] == 2
    state = graft_module.GraftState.from_file(tmp_path / "pub" / ".state" / STATE_FILE, V, config)
    assert all(t.table.held() <= 5 for t in state.tenants.values())
    assert manifest["metrics"]["dropped_weight"] > 0  # 9 rows of evidence into 5 slots


HOSTILE = {
    "truncated JSON": ('{"v": 1, "kind": "st\n', "not JSON"),
    "wrong type": (lambda r: {**r, "pos": "3"}, "field 'pos' must be int"),
    "unknown version": (lambda r: {**r, "v": 2}, "unknown version"),
    "id outside vocabulary": (lambda r: {**r, "root": V}, f"outside the vocabulary of {V}"),
    "NaN log-prob": (lambda r: {**r, "topk_logprobs": [[math.nan] * 8, *r["topk_logprobs"][1:]]}, "not a finite"),
    "mismatched lengths": (lambda r: {**r, "parents": r["parents"][:-1]}, "field 'parents' has"),
    "10 MB line": ('{"v": 1, "pad": "' + "x" * (10 << 20) + '"}\n', "exceeds the"),
    "empty line": ("\n", "empty line"),
}


def test_hostile_lines_are_quarantined_with_their_reason(tmp_path, target):
    rng = random.Random(3)
    logs, pub = tmp_path / "logs", tmp_path / "pub"
    lines, expected = [], []
    for make, reason in HOSTILE.values():
        lines.append(step(rng))
        line = make if isinstance(make, str) else json.dumps(make(step(rng))) + "\n"
        expected.append((sum(len(x if isinstance(x, str) else json.dumps(x) + "\n") for x in lines), reason))
        lines.append(line)
    lines.append(step(rng))
    segment = write_segment(logs, "r0", 0, lines)
    write_segment(logs, "r1", 1, [])  # an empty file
    partial = write_segment(logs, "r2", 2, [step(rng), json.dumps(step(rng))[:50]], part=True)
    run_graft(logs, pub, target, once=True)
    quarantined = [json.loads(x) for x in (pub / ".state" / QUARANTINE).read_text().splitlines()]
    assert [(q["file"], q["offset"]) for q in quarantined] == [(segment.name, offset) for offset, _ in expected]
    for q, (_, reason) in zip(quarantined, expected, strict=True):
        assert reason in q["reason"], (q, reason)
    metrics = json.loads((pub / ".state" / METRICS).read_text())
    assert metrics["quarantined"] == len(HOSTILE)
    assert metrics["records"] == len(HOSTILE) + 1 + 1  # the good lines, and the finished line of the .part
    # The unfinished last line was waited for, not rejected: completed and renamed, it is read.
    text = partial.read_text()
    partial.write_text(text[: text.rindex("\n") + 1] + json.dumps(step(rng)) + "\n")
    partial.rename(partial.with_name(partial.name.removesuffix(".part")))
    run_graft(logs, pub, target, once=True)
    metrics = json.loads((pub / ".state" / METRICS).read_text())
    assert (metrics["records"], metrics["quarantined"]) == (len(HOSTILE) + 3, len(HOSTILE))


def _daemon(logs, pub, target, *flags):
    args = ["graft", "--logs", str(logs), "--publish", str(pub), "--target", str(target), *flags]
    code = f"from trainer.adapt.cli import main; main({args!r})"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for(path, timeout=180.0):
    # Generous: a daemon starts in seconds, but far slower on a machine busy with other jobs.
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


@pytest.mark.slow
def test_sigterm_finishes_the_batch_persists_and_exits_0(tmp_path, target):
    logs, pub = tmp_path / "logs", tmp_path / "pub"
    make_logs(logs, segments=2)
    proc = _daemon(logs, pub, target, "--poll-seconds", "0.05")
    _wait_for(pub / CURRENT)
    write_segment(logs, "r0", 9, [step(random.Random(9))], part=True)  # tailing: a segment being written
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 0, out
    metrics = json.loads((pub / ".state" / METRICS).read_text())
    assert metrics["lines"] == 2 * 2 * 47 + 1
    assert read_manifest(read_current(pub)[1])["tick"] == metrics["lines"]


@pytest.mark.slow
def test_sigkill_then_restart_publishes_the_uninterrupted_matrix(tmp_path, target, monkeypatch):
    """Kills at random points, each followed by a --once restart: the final published matrices, counters and
    quarantine equal an uninterrupted run's. Simulated kills (the process dies just before its n-th call of
    os.fsync: quarantine lines, state, snapshot files; os.replace: state, metrics, pointer; os.rename: a
    version directory) cover every commit phase; real SIGKILLs of a daemon process land where the clock puts
    them."""
    logs = tmp_path / "logs"
    make_logs(logs, segments=3)
    flags = ["--once", "--batch-records", "16", "--commit-seconds", "0", "--rows", "400", "--tenant-rows", "40"]
    config = GraftConfig(batch_records=16, rows=400, tenant_rows=40)
    writes = ("replace", "rename", "fsync")
    real = {name: getattr(os, name) for name in writes}
    calls = dict.fromkeys(writes, 0)
    die = {"name": None, "at": 0}

    class Killed(BaseException):
        pass

    def tracked(name):
        def call(*args):
            calls[name] += 1
            if name == die["name"] and calls[name] == die["at"]:
                raise Killed
            return real[name](*args)

        return call

    for name in writes:
        monkeypatch.setattr(os, name, tracked(name))
    run_graft(logs, tmp_path / "ref", target, once=True, config=config, commit_seconds=0)
    counted = dict(calls)
    assert counted["replace"] > 10, "the state is committed after every batch"
    reference = adjacencies(tmp_path / "ref")
    ref_quarantine = (tmp_path / "ref" / ".state" / QUARANTINE).read_text()
    ref_metrics = json.loads((tmp_path / "ref" / ".state" / METRICS).read_text())
    assert ref_metrics["rows_held"] == 400, "the table is full: new rows evict old ones"

    def check(pub):
        die["name"] = None
        run_graft(logs, pub, target, once=True, config=config, commit_seconds=0)
        for tenant, m in adjacencies(pub).items():
            assert torch.equal(m, reference[tenant]), (pub, tenant)
        assert (pub / ".state" / QUARANTINE).read_text() == ref_quarantine
        metrics = json.loads((pub / ".state" / METRICS).read_text())
        for name in ("lines", "records", "nodes", "quarantined", "rows_touched", "dropped_weight"):
            assert metrics[name] == ref_metrics[name], name

    rng = random.Random(0)
    for trial in range(8):  # simulated: the process dies just before its n-th call of one kind of write
        name = ("replace", "fsync")[trial % 2] if trial < 7 else "rename"
        calls.update(dict.fromkeys(writes, 0))
        die.update(name=name, at=rng.randrange(1, counted[name] + 1))
        pub = tmp_path / f"sim{trial}"
        with pytest.raises(Killed):
            run_graft(logs, pub, target, once=True, config=config, commit_seconds=0)
        # A second death of the restarted process, before the rest of the work is done.
        calls.update(dict.fromkeys(writes, 0))
        die["at"] = rng.randrange(1, counted[name] + 1)
        with contextlib.suppress(Killed):
            run_graft(logs, pub, target, once=True, config=config, commit_seconds=0)
        check(pub)

    for name in writes:
        monkeypatch.setattr(os, name, real[name])
    pub = tmp_path / "killed"
    for _ in range(2):  # real SIGKILLs of one run, each at a random moment after its first commit
        proc = _daemon(logs, pub, target, *flags)
        _wait_for(pub / ".state" / METRICS)
        time.sleep(rng.uniform(0.0, 0.5))
        proc.kill()
        proc.wait()
    check(pub)


@pytest.mark.parametrize("steal", [False, True])
def test_decode_workers_publish_what_in_process_decoding_publishes(tmp_path, target, monkeypatch, steal):
    """Full batches go to worker processes, short ones are decoded in the daemon, and so are full ones the daemon
    takes over when the workers hold all they may and no result has arrived (``steal``: results never seem to
    arrive early; else they always do, and the daemon waits for them): the published matrices, the quarantine and
    the counters are those of a daemon that decodes everything itself."""
    # Batches decoded in the daemon's own process (at most one short batch, unless it takes full ones over).
    here: list[int] = []

    class Counting(DecodePool):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            # Ready before the first batch: the daemon decodes batches itself while its workers start.
            self.start(wait=True)
            decode = self.decode
            self.decode = lambda lines: here.append(len(lines)) or decode(lines)

    monkeypatch.setattr(graft_module, "DecodePool", Counting)
    monkeypatch.setattr(DecodePool, "arrived", lambda self, pending: not steal)
    logs = tmp_path / "logs"
    make_logs(logs, segments=2)
    config = GraftConfig(batch_records=16, rows=400, tenant_rows=40)
    results = []
    for workers in (0, 2):
        pub = tmp_path / f"workers{workers}"
        here.clear()
        run_graft(logs, pub, target, once=True, config=config, commit_seconds=0, decode_workers=workers)
        metrics = json.loads((pub / ".state" / METRICS).read_text())
        counts = {k: metrics[k] for k in ("lines", "records", "nodes", "quarantined", "rows_touched")}
        results.append((adjacencies(pub), (pub / ".state" / QUARANTINE).read_text(), counts))
    assert (len(here) >= 2) if steal else (len(here) <= 1), here
    (m0, q0, c0), (m2, q2, c2) = results
    assert all(torch.equal(m0[t], m2[t]) for t in m0)
    assert q0 == q2 and q0.count("\n") == c0["quarantined"] == 4
    assert c0 == c2


def test_a_dead_decode_worker_costs_only_time():
    """Batches held by a worker that dies are decoded in the daemon's process; the workers start again, and
    batches are decoded there while they start; closing with results never read (a daemon stopped mid-stream)
    returns at once."""
    assert DecodePool(V, workers=0).submit([b"{}"]) is None
    decoding = DecodePool(V, workers=1)
    rng = random.Random(1)
    lines = [json.dumps(step(rng)).encode() for _ in range(5)] + [b"{"]
    big = [json.dumps(step(rng, n=60)).encode() for _ in range(400)]
    try:
        # Still importing: the caller decodes the batch.
        assert decoding.submit(lines) is None and decoding._pool
        assert decoding.start(wait=True) and decoding._pool[0].ready
        first = decoding.submit(lines)
        # Dies holding a batch: the worker takes it, and is killed before it can answer.
        second = decoding.submit(lines[:2])
        first.worker.proc.kill()
        first.worker.proc.wait()
        assert len(decoding.result(first).steps) == 5
        assert len(decoding.result(second).steps) == 2
        # The workers start again at the next batch, which is decoded here while they do.
        assert decoding.submit(lines) is None and decoding.start(wait=True)
        held = decoding.submit(lines)
        held.worker.proc.kill()
        held.worker.proc.wait()
        # Found dead at the next submit: a fresh worker starts and takes the batch after; the dead one's is
        # decoded here.
        assert decoding.submit(lines) is None and decoding.start(wait=True)
        third = decoding.submit(lines)
        assert third.worker is not held.worker and third.worker.proc.poll() is None
        assert len(decoding.result(held).steps) == 5
        decoded = decoding.result(third)
        assert len(decoded.steps) == 5 and [i for i, _ in decoded.errors] == [5]
        for _ in range(4):
            decoding.submit(big)
        time.sleep(0.5)
    finally:
        start = time.monotonic()
        decoding.close()
    assert time.monotonic() - start < 5 and not decoding._pool
    with pytest.raises(UserError, match="--decode-workers must be >= 0"):
        DecodePool(V, workers=-1)


def test_a_worker_outlives_no_killed_parent(tmp_path):
    """SIGKILL of a daemon whose worker holds results it has not read (more than the pipe holds, a batch queued
    behind them): the worker exits."""
    rng = random.Random(0)
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(step(rng, n=60)) + "\n" for _ in range(400)))
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from trainer.vlog.workers import DecodePool\n"
        "lines = open(sys.argv[1], 'rb').read().splitlines()\n"
        f"d = DecodePool({V}, 1)\n"
        "d.start(wait=True)\n"
        "for _ in range(4):\n"
        "    d.submit(lines)\n"
        "print(d._pool[0].proc.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script), str(batch)], stdout=subprocess.PIPE, text=True)
    worker = int(parent.stdout.readline())
    time.sleep(1.0)  # the worker decodes what it was given and blocks handing results over
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            # An exited worker nobody has reaped yet (an init that does not reap) is a zombie: state Z.
            if Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.05)
    os.kill(worker, signal.SIGKILL)
    pytest.fail("the decode worker outlived its killed parent")


def test_cli_names_a_bad_log_directory(tmp_path, capsys):
    from trainer.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["adapt", "graft", "--logs", str(tmp_path / "nowhere"), "--publish", str(tmp_path / "pub"), "--once"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "nowhere is not a directory" in err and "trainer adapt" in err


def test_tailing_daemon_reports_a_failed_publish_and_goes_on(tmp_path, target, monkeypatch, capsys):
    logs, pub = tmp_path / "logs", tmp_path / "pub"
    write_segment(logs, "r0", 0, [step(random.Random(0))])
    real_publish, attempts = graft_module.publish, []

    def flaky(*args, **kwargs):
        attempts.append(1)
        if len(attempts) == 1:
            raise PublishError("could not publish a snapshot into pub: No space left on device; nothing is current")
        return real_publish(*args, **kwargs)

    monkeypatch.setattr(graft_module, "publish", flaky)
    daemon = graft_module.GraftDaemon(
        logs, pub, pub / ".state", V, GraftConfig(), publish_seconds=0.0, poll_seconds=0.01
    )
    runner = threading.Thread(target=daemon.run, args=(False,))
    runner.start()
    _wait_for(pub / CURRENT)
    write_segment(logs, "r1", 1, [step(random.Random(1))])  # a new segment while tailing
    deadline = time.monotonic() + 30
    while daemon.state.counters.records < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(UserError, match="another graft daemon uses the state directory"):
        graft_module.GraftDaemon(logs, pub, pub / ".state", V, GraftConfig())
    daemon.stop.set()
    runner.join()
    daemon.close()
    out = capsys.readouterr().out
    assert "publish failed:" in out and "No space left on device" in out
    assert daemon.state.counters.records == 2
    assert read_manifest(read_current(pub)[1])["tick"] == 2
