"""The server in process (no subprocess): the worker's step records name the drafter and version that drafted
each step, every request ends (an engine failure is an OpenAI-shaped 5xx, streamed or not, and the server serves
on), generation stops at the chat template's own end-of-turn token, and ``--drafter`` takes a training run."""

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY_TARGET, make_run
from fastapi.testclient import TestClient
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.data.render import end_of_text_ids, stop_token_ids
from trainer.decoding.batch import BatchEngine, BatchRequest, Fixed
from trainer.drafters import load_drafter
from trainer.serve.app import Limits, build_app, stop_ids_of
from trainer.serve.cli import load_models, parser
from trainer.serve.metrics import Metrics
from trainer.serve.worker import Identity, Worker
from trainer.snapshots import publish
from trainer.vlog.schema import validate
from trainer.vlog.writer import LogWriter

MODEL = "target_tiny"
DRAFTER = ROOT / "checkpoints" / "dflash_tiny"
PROMPTS = ["def main(", "import os\nimport sys\n\n", "class Queue:\n    def __init__(self, maxsize=0):\n"]


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TARGET)


class Rotation:
    """DDTree, recycling and plain decoding in turn (each when every row can), as the controller mixes them."""

    arms = (("ddtree", 8), ("recycling", 8), ("none", 0))

    def __init__(self) -> None:
        self.n = 0

    def choose(self, batch_size, available=None):
        arms = [a for a in self.arms if available is None or a[0] in available]
        self.n += 1
        return arms[self.n % len(arms)]

    def observe(self, tree, budget, batch_size, rows, seconds):
        return None

    def ready(self, tree):
        return True

    def speculating(self):
        return True


def publish_drafter(directory: Path) -> int:
    def copy(out: Path) -> None:
        for name in ("config.json", "model.safetensors"):
            shutil.copy(DRAFTER / name, out / name)

    return publish(directory, copy, {"kind": "drafter"})


def test_each_step_names_the_drafter_and_version_that_drafted_it(target, tokenizer, tmp_path):
    """A request admitted before a new drafter version is loaded is drafted by its old version to the end, and its
    steps say so; drafter-free steps (recycling, plain) name no drafter and no drafter version, and the steps that
    read the shared adjacency carry its version apart."""
    adjacency, drafters = tmp_path / "adjacency", tmp_path / "drafters"
    torch.manual_seed(0)
    matrix = torch.randint(0, 8192, (8192, 8))
    publish(adjacency, lambda d: save_file({"adjacency": matrix}, str(d / "adjacency.safetensors")), {})
    publish_drafter(drafters)
    engine = BatchEngine(target, load_drafter(DRAFTER), ("none", "recycling", "ddtree"), Rotation())
    writer = LogWriter(tmp_path / "logs", "w", vocab_size=8192)
    worker = Worker(engine, Metrics(), "s", "dflash_tiny", "ddtree", writer, watch=(adjacency, drafters))
    worker.reload()
    prompt = [torch.tensor(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS]
    old = BatchRequest(prompt[0], 32)
    worker.submit(old, Identity("old", None))
    for _ in range(3):
        engine.step()
    assert publish_drafter(drafters) == 2
    worker.reload()
    new = BatchRequest(prompt[1], 16)
    worker.submit(new, Identity("new", None))
    while engine.busy:
        engine.step()
    writer.close()
    steps = [
        record
        for segment in sorted((tmp_path / "logs").glob("*.jsonl"))
        for line in segment.read_text().splitlines()
        if (record := validate(json.loads(line), vocab_size=8192))["kind"] == "step"
    ]
    trees = {r["tree"] for r in steps}
    assert trees == {"ddtree", "recycling", "none"}
    mine = {"old": 1, "new": 2}
    for r in steps:
        if r["tree"] == "ddtree":
            assert (r["drafter"], r["drafter_version"]) == ("dflash_tiny", mine[r["request"]]), r["step"]
        else:
            assert r["drafter"] is None and r["drafter_version"] is None
        assert r.get("adjacency_version") == (1 if r["tree"] == "recycling" else None)
    # The old request kept drafting after version 2 was loaded: those steps are version 1's.
    assert any(r["request"] == "old" and r["tree"] == "ddtree" and r["step"] >= 3 for r in steps)


@pytest.fixture
def served(target, tokenizer, tmp_path):
    """The app over a started worker, plain decoding, watching a directory whose one snapshot is bad (a wrong
    vocabulary: quarantined); ``fail`` names phases whose next run raises."""
    bad = torch.zeros(17, 8, dtype=torch.long)
    publish(tmp_path / "watch", lambda d: save_file({"adjacency": bad}, str(d / "adjacency.safetensors")), {})
    engine = BatchEngine(target, None, ("none",), Fixed("none", 0))
    fail: set[str] = set()

    def fault(phase, requests):
        if phase in fail:
            fail.discard(phase)
            raise RuntimeError(f"injected {phase} failure")

    engine.fault = fault
    worker = Worker(engine, Metrics(), MODEL, None, None, watch=(tmp_path / "watch",), reload_seconds=0.1)
    worker.start()
    yield worker, fail
    worker.stop()


def metric(client: TestClient, line: str) -> float:
    text = client.get("/metrics").text
    return sum(float(row.split()[-1]) for row in text.splitlines() if row.startswith(line + " "))


def test_an_engine_failure_ends_its_request_with_a_5xx_and_the_server_serves_on(served, tokenizer):
    worker, fail = served
    client = TestClient(build_app(worker, tokenizer, MODEL, Limits(context=2048, max_tokens=64)))
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}

    fail.add("prefill")
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    # The failure's own cause, not the quarantined snapshot's.
    assert "injected prefill failure" in error["message"] and "adjacency" not in error["message"]

    fail.add("step")
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
        events = [line.removeprefix("data: ") for line in streamed.iter_lines() if line]
    assert events[-1] == "[DONE]"
    assert "injected step failure" in json.loads(events[-2])["error"]["message"]

    ok = client.post("/v1/completions", json=body)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert client.get("/health").json()["status"] == "ok"
    assert metric(client, 'trainer_engine_errors_total{phase="prefill"}') == 1
    assert metric(client, 'trainer_engine_errors_total{phase="step"}') == 1
    assert metric(client, "trainer_quarantined_snapshots_total") == 1
    assert metric(client, 'trainer_requests_total{status="error"}') == 2
    # Every request ended, so the worker forgot every identity.
    assert worker.identities == {}


def llama3_style(tmp_path: Path):
    """The tiny tokenizer with Llama 3's special tokens and turn layout: a turn ends with ``<|eot_id|>`` (the id
    of the Qwen-style ``<|im_end|>``, which this tokenizer no longer has)."""
    out = tmp_path / "llama3"
    AutoTokenizer.from_pretrained(TINY_TARGET).save_pretrained(out)
    renames = (("<|im_end|>", "<|eot_id|>"), ("<|im_start|>", "<|start_header_id|>"), ("<think>", "<|end_header_id|>"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (out / name).read_text()
        for old, new in renames:
            text = text.replace(old, new)
        (out / name).write_text(text)
    (out / "chat_template.jinja").write_text(
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
        "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    return AutoTokenizer.from_pretrained(out)


def test_chat_requests_stop_at_the_templates_own_end_of_turn_token(served, tmp_path, monkeypatch):
    worker, _ = served
    seen: list[BatchRequest] = []
    submit = worker.submit
    monkeypatch.setattr(worker, "submit", lambda request, identity: seen.append(request) or submit(request, identity))
    tokenizer = llama3_style(tmp_path)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") is None
    client = TestClient(build_app(worker, tokenizer, MODEL, Limits(context=2048, max_tokens=64)))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert seen[-1].stop_token_ids == frozenset({eot, tokenizer.eos_token_id})
    # The one helper regeneration and the server share: the template's marker, the end-of-text token, and the
    # generation config's end-of-sequence ids.
    assert stop_token_ids(tokenizer) == [eot, tokenizer.eos_token_id]
    assert stop_token_ids(tokenizer, [tokenizer.eos_token_id, 5]) == [eot, tokenizer.eos_token_id, 5]


def test_a_request_ends_when_the_engine_thread_is_gone(target, tokenizer):
    """The handler watches the engine thread while it waits: a server whose engine thread is not running answers
    503 instead of waiting forever."""
    worker = Worker(BatchEngine(target, None, ("none",), Fixed("none", 0)), Metrics(), MODEL, None, None)
    client = TestClient(build_app(worker, tokenizer, MODEL, Limits(context=2048, max_tokens=64)))
    answers = []
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4}
    thread = threading.Thread(target=lambda: answers.append(client.post("/v1/completions", json=body)), daemon=True)
    thread.start()
    thread.join(60)
    assert answers, "the request was still waiting after 60 s"
    assert answers[0].status_code == 503 and answers[0].json()["error"]["code"] == "engine_stopped"


class BrokenLog:
    """A verifier-log writer whose disk is full: every record raises, as ``LogWriter.write`` re-raises a failure
    of its writer thread."""

    def write(self, record: dict) -> None:
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        pass


def test_a_log_that_cannot_take_records_never_keeps_a_request_waiting(target, tokenizer):
    """A failed step or request record is counted (phase "log") and the request still ends with its output, the
    next one too: logging is never why a client waits or gets an error."""
    engine = BatchEngine(target, None, ("none",), Fixed("none", 0))
    worker = Worker(engine, Metrics(), MODEL, None, None, writer=BrokenLog())
    worker.start()
    try:
        client = TestClient(build_app(worker, tokenizer, MODEL, Limits(context=2048, max_tokens=64)))
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        answers: list = []
        post = lambda: client.post("/v1/completions", json=body)  # noqa: E731
        thread = threading.Thread(target=lambda: answers.extend(post() for _ in "ab"))
        thread.start()
        thread.join(60)
        assert len(answers) == 2, "a request was still waiting after 60 s"
        assert [a.status_code for a in answers] == [200, 200]
        assert {a.json()["choices"][0]["finish_reason"] for a in answers} == {"length"}
        # Two requests: at least one step record and one request record each failed and were counted.
        assert metric(client, 'trainer_engine_errors_total{phase="log"}') >= 4
        assert worker.identities == {}
    finally:
        worker.stop()


def test_a_template_without_a_one_token_end_of_turn_still_serves(caplog):
    """A chat template that puts nothing after an assistant turn has no end-of-turn token: the server stops at
    end-of-text tokens, says so in its log, and starts (it refused to start)."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with caplog.at_level("WARNING", logger="trainer.serve"):
        stops = stop_ids_of(tokenizer, None)
    assert stops == frozenset(end_of_text_ids(tokenizer, None)) and tokenizer.eos_token_id in stops
    assert "end-of-text tokens only" in caplog.text


def test_the_drafter_of_a_training_run_is_served(tmp_path):
    """``trainer serve --drafter RUN`` serves the run's HF export, as ``trainer eval --drafter RUN`` evaluates it."""
    run = make_run(tmp_path / "run", DRAFTER)
    _, drafter = load_models(parser().parse_args(["--drafter", str(run), "--device", "cpu"]))
    shipped = load_drafter(DRAFTER).state_dict()
    assert drafter.state_dict().keys() == shipped.keys()
    assert all(torch.equal(v, shipped[k]) for k, v in drafter.state_dict().items())
