"""docs/vllm.md's deployment block, run as written (marker ``vllm``, in vLLM's environment): vLLM's OpenAI server
with the plugin, a request with ``vllm_xargs``, both daemons beside it. Then a drafter of another architecture is
published into the watched directory: vLLM refuses it, says so on ``/metrics``, and keeps serving::

    .ci/vllm_env .venv-vllm && .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_server.py -x -q
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, TINY_TARGET

from trainer.drafters import load_drafter
from trainer.integrations.vllm.process import free_port, stop_group
from trainer.snapshots import publish, read_current
from trainer.vlog.reader import LogReader
from trainer.vlog.schema import RecordError
from trainer.vlog.writer import LogWriter

pytestmark = pytest.mark.vllm
DOC = ROOT / "docs" / "vllm.md"
VOCAB = json.loads((TINY_TARGET / "config.json").read_text())["vocab_size"]


def bash_blocks() -> list[str]:
    """The ``bash`` blocks of docs/vllm.md: the deployment, then the parity gate."""
    return re.findall(r"^```bash\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def commands(block: str) -> list[str]:
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def metric(url: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{url}/metrics", timeout=30).text, re.M)
    return float(found.group(1)) if found else -1.0


def complete(url: str, i: int) -> httpx.Response:
    body = {"model": "checkpoints/target_tiny", "prompt": f"def f{i}(x):", "max_tokens": 16, "temperature": 0,
            "vllm_xargs": {"tenant": "acme", "shareable": 1}}  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def log_records(logs: Path) -> list[dict]:
    """Every record in ``logs``, each valid (an unfinished ``.part`` is read up to its last whole line)."""
    records = [item.record for item in LogReader(logs, {}, vocab_size=VOCAB)]
    assert not [r for r in records if isinstance(r, RecordError)], records
    return records


def request_records(logs: Path) -> int:
    return sum(record["kind"] == "request" for record in log_records(logs))


def wait_while_serving(url: str, done, what: str, seconds: float = 240) -> int:
    """Send requests (every one must succeed) until ``done()``; the number sent."""
    deadline, sent = time.monotonic() + seconds, 0
    while not done():
        assert time.monotonic() < deadline, f"{what} within {seconds:.0f} s"
        response = complete(url, sent)
        assert response.status_code == 200, response.text
        sent += 1
    return sent


def test_the_documented_deployment_runs_and_refuses_a_mismatched_drafter(tmp_path):
    port = free_port()
    script = bash_blocks()[0].replace(".venv-vllm/bin/python", sys.executable).replace("8000", str(port))
    (tmp_path / "checkpoints").symlink_to(ROOT / "checkpoints")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    for name in [n for n in env if n.startswith("TRAINER_VLLM_") or n == "VLLM_ENABLE_V1_MULTIPROCESSING"]:
        del env[name]
    # A file, not a pipe: the block's background jobs (vLLM, the daemons) keep their stdout open after bash exits.
    out = tmp_path / "block.out"
    with open(out, "wb") as sink:
        shell = subprocess.Popen(["bash", "-e", "-c", script], cwd=tmp_path, env=env, stdout=sink,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        shell.wait(timeout=600)
        output = out.read_text(errors="replace")
        assert shell.returncode == 0, output[-4000:]
        # The block's completion answered, and /metrics has the plugin's lines (nothing swapped or refused yet).
        assert '"object":"text_completion"' in output.replace(" ", "")
        assert re.search(r"^trainer_vllm_drafter_refused_total 0\.0$", output, re.M), output[-3000:]
        # The structured-output request of the block was answered with one of its choices; the plugin checked
        # itself on the first step and says so in vLLM's log; nothing failed inside it.
        assert re.search(r'"text":\s*"(yes|no)"', output), output[-3000:]
        assert re.search(r"^trainer_vllm_hooks_active 1\.0$", output, re.M), output[-3000:]
        vllm_log = (tmp_path / "runs" / "vllm.log").read_text(errors="replace")
        assert "trainer plugin: self-check passed" in vllm_log, vllm_log[-3000:]
        # Structured outputs alternating with plain requests under speculation (once, a third such request took
        # vLLM's engine down): all answered, and vLLM answers plain requests after them.
        for i in range(6):
            shape = [{"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
                     {"response_format": {"type": "json_object"}}, {}][i % 3]  # fmt: skip
            body = {"model": "checkpoints/target_tiny", "prompt": f"Q{i}: ", "max_tokens": 12, **shape}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
        errors = re.findall(r"^trainer_vllm_errors_total\{.*$", httpx.get(f"{url}/metrics", timeout=30).text, re.M)
        assert not errors, errors
        answered = 2 + 6  # the block's two requests and these
        # The bandit daemon publishes the drafter it starts from; vLLM swaps it in between steps.
        drafters = tmp_path / "runs" / "drafters"
        sent = wait_while_serving(url, lambda: metric(url, "trainer_vllm_drafter_swaps_total") >= 1,
                                  "version 1 swapped in")  # fmt: skip
        assert metric(url, "trainer_vllm_drafter_version") == 1
        # A DFlash drafter published where an EAGLE-3 one is served: refused, counted, the old weights serve on.
        version = publish(drafters, load_drafter(ROOT / "checkpoints" / "dflash_tiny").save_pretrained,
                          {"kind": "drafter"})  # fmt: skip
        assert read_current(drafters)[0] == version
        sent += wait_while_serving(url, lambda: metric(url, "trainer_vllm_drafter_refused_total") >= 1,
                                   "refusal counted")  # fmt: skip
        assert metric(url, "trainer_vllm_drafter_version") == 1
        # The graft daemon read the same log and published an adjacency (which vLLM cannot use).
        adjacency = tmp_path / "runs" / "publish"
        sent += wait_while_serving(url, lambda: read_current(adjacency) is not None, "the graft daemon published")
        # Every line vLLM wrote passes the validator; the steps name the versions that drafted them, never the
        # refused one.
        logs = tmp_path / "runs" / "logs"
        versions = set()
        for record in log_records(logs):
            if record["kind"] == "step":
                versions.add(record["drafter_version"])
        assert {0, 1} <= versions and version not in versions
        # The plugin writes on a thread of its own and vLLM kills its worker on the way out, so a record still
        # queued at a stop is lost: stop only once every request (the block's one and ours) has its record.
        deadline = time.monotonic() + 60
        while request_records(logs) < answered + sent:
            assert time.monotonic() < deadline, f"{request_records(logs)} records for {answered + sent} requests"
            time.sleep(0.5)
    finally:
        stop_group(shell)
    # The segment stays .part with every flushed record; the next writer of that prefix (the next start) finishes it.
    assert list(logs.glob("*.part"))
    LogWriter(logs, "replica-0").close()
    assert not list(logs.glob("*.part"))
    assert request_records(logs) == answered + sent
