"""``trainer adapt graft``: snapshot publishing, the candidate aggregation rule, tenants, quarantine, and the
daemon's --once / SIGTERM / SIGKILL-restart behaviour."""

import threading

import pytest
import torch
from safetensors.torch import save_file

from trainer.adapt.candidates import SCALE, CandidateTable
from trainer.adapt.publish import (
    ADJACENCY,
    CURRENT,
    PublishError,
    load_adjacency,
    publish,
    read_current,
    read_manifest,
    tenant_filename,
)


def _adjacency_payload(adjacency: torch.Tensor, deltas: dict[str, torch.Tensor] | None = None):
    def write(directory):
        save_file({"adjacency": adjacency.contiguous()}, directory / ADJACENCY)
        for name, delta in (deltas or {}).items():
            save_file({"adjacency": delta.contiguous()}, directory / tenant_filename(name))

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


def test_publish_failure_keeps_previous_snapshot(tmp_path, monkeypatch):
    root = tmp_path / "pub"
    publish(root, _adjacency_payload(torch.zeros(4, 2, dtype=torch.int32)), {})

    def no_space(directory):
        (directory / ADJACENCY).write_bytes(b"partial")
        raise OSError(28, "No space left on device", str(directory / ADJACENCY))

    with pytest.raises(PublishError, match=r"No space left on device.*v000001 is still current"):
        publish(root, no_space, {})
    assert read_current(root)[0] == 1
    assert not list(root.glob(".tmp-*")), "the failed version's temporary directory is removed"
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


def test_state_round_trip_is_exact():
    torch.manual_seed(1)
    table = CandidateTable(vocab_size=40, rows=20, candidates=4, half_life=5)
    for tick in range(1, 6):
        table.add(torch.randint(0, 40, (50,)), torch.randint(0, 40, (50, 8)), torch.randint(0, SCALE, (50, 8)), tick)
    copy = CandidateTable.from_state(table.state(), 40, 5, table.dropped)
    for t in (table, copy):
        t.add(
            torch.arange(40),
            torch.randint(0, 40, (40, 8), generator=torch.Generator().manual_seed(3)),
            torch.full((40, 8), 100),
            6,
        )
    assert torch.equal(copy.adjacency(4), table.adjacency(4))
    assert torch.equal(copy.score, table.score) and torch.equal(copy.slot, table.slot)
