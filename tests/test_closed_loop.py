"""The closed loop: ``trainer serve``, ``trainer adapt graft`` and ``trainer adapt bandit`` run as processes, a
prompt stream shifts domain, and the daemons' snapshots reach the server (hot reload) while τ is read back from the
verifier log."""

import json
import sys

import pytest
from conftest import ROOT

from trainer.vlog.schema import validate

sys.path.insert(0, str(ROOT / "benchmarks"))
from closed_loop import bandit_decisions, run_loop, write_report

pytestmark = pytest.mark.slow


def test_closed_loop_serves_with_published_adjacency(tmp_path):
    served = run_loop(tmp_path, requests=5, max_tokens=24, temperature=0.7, publish_seconds=1.0)
    assert [s.domain for s in served] == ["stdlib"] * 5 + ["foreign"] * 10
    # Every request has its request record, and every one that decoded past its prefill token was verified
    # step by step (its step records are in the log; a sampled end-of-text first token ends a request early).
    assert all(s.tokens >= 1 for s in served)
    assert all(s.steps >= 1 and s.tau >= 1.0 for s in served if s.tokens > 1)
    assert sum(s.steps for s in served) >= 10
    # ...the stdlib phase ran before any snapshot, and the foreign one with both daemons' snapshots: the graft
    # daemon's adjacency and the drafter version the bandit daemon serves from.
    assert served[0].version == 0 and served[0].drafter_version == 0
    assert all(s.version >= 1 and s.drafter_version >= 1 for s in served[5:])
    # The bandit read the live steps of its version and decided at least once (on this CPU: not to update).
    decisions = bandit_decisions(tmp_path)
    assert decisions and all(d["version"] >= 1 and d["tau"] >= 1.0 for d in decisions)
    rows = write_report(tmp_path, served, size=5)
    assert [r["domain"] for r in rows] == ["stdlib", "foreign", "foreign"]
    assert (tmp_path / "loop.png").stat().st_size > 0 and "| τ |" in (tmp_path / "loop.md").read_text()


def test_closed_loop_in_the_readme_setup_judges_versions_on_their_own_steps(tmp_path):
    """``trainer serve`` with its default ``--tree auto`` (the controller runs plain decoding most steps on a CPU),
    both daemons, the bandit's drafter version published while the server runs: plain and recycling steps name no
    drafter and no drafter version, never enter a version's live τ, and the bandit neither rolls back nor raises
    the alarm (an alarm would have made ``run_loop`` fail on the daemon's exit code)."""
    served = run_loop(tmp_path, requests=4, max_tokens=24, temperature=0.7, publish_seconds=1.0, tree="auto")
    assert served[-1].drafter_version >= 1 and served[-1].version >= 1
    steps = [
        record
        for segment in sorted((tmp_path / "logs").glob("*.jsonl"))
        for line in segment.read_text().splitlines()
        if (record := validate(json.loads(line)))["kind"] == "step"
    ]
    free = [r for r in steps if r["tree"] in ("none", "recycling")]
    assert free, "the controller decoded without a drafter at least once"
    assert all(r["drafter"] is None and r["drafter_version"] is None for r in free)
    assert all(r.get("adjacency_version") is None for r in steps if r["tree"] == "none")
    drafted: dict[str, int] = {}
    for r in steps:
        if r["drafter"] is not None:
            assert r["tree"] == "ddtree"
            drafted[str(r["drafter_version"])] = drafted.get(str(r["drafter_version"]), 0) + 1
    state = json.loads((tmp_path / "bandit-state" / "state.json").read_text())
    # The bandit's live steps per version are the version's drafted steps (at most: it may stop before the last).
    for version, live in state["live"].items():
        assert live["steps"] <= drafted.get(version, 0), (version, live["steps"], drafted)
    metrics = json.loads((tmp_path / "bandit-state" / "metrics.json").read_text())
    assert metrics["ignored_steps"]["no drafter"] >= 1 and metrics["alarm"] is None
    journal = tmp_path / "bandit-state" / "decisions.jsonl"
    events = [json.loads(line) for line in journal.read_text().splitlines()] if journal.is_file() else []
    assert not [e for e in events if e.get("event") == "alarm" or "rolled_back_to" in e]
