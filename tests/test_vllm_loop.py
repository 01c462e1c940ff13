"""The closed loop next to vLLM (marker ``vllm``, run in vLLM's environment): vLLM's OpenAI server with the plugin
serves the shipped EAGLE-3 drafter, ``trainer adapt bandit`` and ``trainer adapt graft`` read its verifier log, the
bandit's published version is hot-loaded by vLLM, and τ per request is read back from the log::

    .ci/vllm_env .venv-vllm && .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_loop.py -x -q
"""

import sys

import pytest
from conftest import ROOT

from trainer.snapshots import read_current

sys.path.insert(0, str(ROOT / "benchmarks"))
from closed_loop import VLLM_DRAFTER, bandit_decisions, log_records, run_loop, write_report

pytestmark = pytest.mark.vllm
REQUESTS = 4


def test_closed_loop_next_to_vllm(tmp_path):
    served = run_loop(
        tmp_path, requests=REQUESTS, max_tokens=32, temperature=0.7, publish_seconds=1.0, drafter=VLLM_DRAFTER,
        vllm_python=sys.executable, bandit_options=("--horizon-requests", "100000", "--alpha", "1"),
    )  # fmt: skip
    records = log_records(tmp_path / "logs")  # every line through the validator
    steps = [r for r in records if r["kind"] == "step"]
    requests = [r for r in records if r["kind"] == "request"]
    # Every step was verified by vLLM with the EAGLE-3 export, and every request has its record with the tenant and
    # shareable flag the client sent in vllm_xargs.
    assert steps and {r["tree"] for r in steps} == {"vllm-eagle3"}
    assert all(r["drafter"] is not None for r in steps)
    assert len(requests) == len(served) == 3 * REQUESTS
    assert sorted({r["tenant"] for r in requests}) == ["foreign", "stdlib"] and all(r["shareable"] for r in requests)
    assert all(s.steps >= 1 and s.tau >= 1.0 for s in served if s.tokens > 1)
    # The stdlib phase was drafted by the drafter vLLM started with (version 0); the bandit published the drafter
    # it starts from before the shift and vLLM swapped it in: the shifted phase's steps name that version.
    assert served[0].drafter_version == 0
    assert all(s.drafter_version >= 1 for s in served[REQUESTS:] if s.steps)
    assert {r["drafter_version"] for r in steps} >= {0, 1}
    # Both daemons consumed vLLM's log: the graft daemon published an adjacency (that vLLM cannot use), and the
    # bandit judged its version on live steps.
    assert read_current(tmp_path / "publish") is not None
    decisions = bandit_decisions(tmp_path)
    assert decisions and all(d["version"] >= 1 and d["tau"] >= 1.0 for d in decisions)
    rows = write_report(tmp_path, served, size=REQUESTS, note="vLLM cannot use an adjacency")
    assert [r["domain"] for r in rows] == ["stdlib", "foreign", "foreign"]
    assert rows[0]["drafter_versions"] == [0] and min(rows[-1]["drafter_versions"]) >= 1
    assert "vLLM cannot use an adjacency" in (tmp_path / "loop.md").read_text()
