"""The closed loop: ``trainer serve``, ``trainer adapt graft`` and ``trainer adapt bandit`` run as processes, a
prompt stream shifts domain, and the daemons' snapshots reach the server (hot reload) while τ is read back from the
verifier log."""

from trainer.serve.loop import bandit_decisions, run_loop, write_report


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
