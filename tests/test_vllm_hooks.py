"""The vLLM plugin's hooks against a fake runner (no vLLM needed): they fail open, refuse only at startup, take the
top-k before a grammar's mask, and check themselves on the first step. The same faults against a real vLLM engine:
tests/test_vllm_faults.py (marker vllm)."""

import errno
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainer.integrations.vllm import hooks
from trainer.integrations.vllm.config import PluginConfig, PluginError
from trainer.integrations.vllm.records import DeviceTop
from trainer.vlog import writer as writer_module
from trainer.vlog.reader import LogReader
from trainer.vlog.schema import RecordError, validate

V, K = 64, 8


@pytest.fixture(autouse=True)
def figures(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_VLLM_METRICS_DIR", str(tmp_path / "figures"))
    (tmp_path / "figures").mkdir()
    monkeypatch.setattr(hooks, "fix_cpu_expansion", lambda: False)
    monkeypatch.setattr(hooks, "REOPEN_SECONDS", 0.0)
    return tmp_path / "figures"


def params(**kw):
    base = dict(extra_args=None, max_tokens=100, min_tokens=0, stop_token_ids=[], ignore_eos=True, eos_token_id=2)
    return SimpleNamespace(**{**base, **kw})


def request(prompt: list[int], output: list[int], **kw) -> SimpleNamespace:
    tokens = prompt + output
    return SimpleNamespace(num_computed_tokens=len(tokens) - 1, num_prompt_tokens=len(prompt), num_tokens=len(tokens),
                           get_token_id=tokens.__getitem__, output_token_ids=output, prompt_token_ids=prompt,
                           sampling_params=params(**kw))  # fmt: skip


def runner(**requests: SimpleNamespace) -> SimpleNamespace:
    spec = SimpleNamespace(num_speculative_tokens=2, method="eagle3", model="drafters/eagle3")
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=list(requests)), requests=dict(requests),
                           use_async_scheduling=False, speculative_config=spec,
                           model_config=SimpleNamespace(get_vocab_size=lambda: V))  # fmt: skip


def started(tmp_path: Path, fake: SimpleNamespace, prefix: str = "p") -> hooks.Plugin:
    plugin = hooks.Plugin(PluginConfig(log_dir=tmp_path / "logs", prefix=prefix))
    plugin.runner_init(lambda r: None, fake)
    return plugin


def step(plugin: hooks.Plugin, fake: SimpleNamespace, logits: torch.Tensor | None = None) -> object:
    """One verification step of the fake batch: each request verified drafts [5, 6], accepted 5, bonus 7."""
    batch = len(fake.input_batch.req_ids)
    logits = torch.randn(3 * batch, V) if logits is None else logits
    meta = SimpleNamespace(num_draft_tokens=[2] * batch, draft_token_ids=torch.tensor([5, 6] * batch))
    output = SimpleNamespace(sampled_token_ids=torch.tensor([[5, 7, -1]] * batch))
    plugin.execute_model(lambda r, *a: None, fake, None)
    plugin.propose(lambda r, *a: None, fake)
    returned = plugin.sample(lambda r, lg, m: output, fake, logits, meta)
    assert returned is output, "the hook must hand vLLM its own sampler output"
    return output


def records(tmp_path: Path) -> list[dict]:
    out = []
    for item in LogReader(tmp_path / "logs", {}, vocab_size=V):
        assert not isinstance(item.record, RecordError), item.record
        out.append(item.record)
    return out


def errors(figures: Path) -> dict[str, int]:
    total: dict[str, int] = {}
    for f in figures.glob("figures-*.json"):
        for phase, n in json.loads(f.read_text())["errors"].items():
            total[phase] = total.get(phase, 0) + n
    return total


def test_a_step_is_logged_and_the_self_check_says_the_hooks_ran(tmp_path, figures, caplog):
    fake = runner(r0=request([1, 2, 3], [4]))
    plugin = started(tmp_path, fake)
    with caplog.at_level(logging.INFO, "trainer.integrations.vllm"):
        step(plugin, fake)
    plugin.writer.close()
    (record,) = records(tmp_path)
    assert (record["root"], record["tokens"], record["accepted"], record["bonus"]) == (4, [5, 6], [0], 7)
    assert record["drafter_version"] == 0 and record["tree"] == "vllm-eagle3"
    assert "self-check passed" in caplog.text
    assert json.loads(next(figures.glob("figures-*.json")).read_text())["hooks_active"] == 1


def test_a_plugin_that_raises_never_reaches_vllm_and_says_so_once(tmp_path, figures, caplog, monkeypatch):
    fake = runner(r0=request([1, 2, 3], [4]))
    plugin = started(tmp_path, fake)
    monkeypatch.setattr(plugin.recorder, "step_fields", lambda *a: 1 / 0)
    monkeypatch.setattr(plugin.recorder, "request_record", lambda *a: 1 / 0)
    with caplog.at_level(logging.ERROR, "trainer.integrations.vllm"):
        for _ in range(3):
            step(plugin, fake)
    freed = []
    result = plugin.free_request(lambda s, r: freed.append(r.request_id) or "freed", None,
                                 SimpleNamespace(request_id="r0", sampling_params=params(), prompt_token_ids=[1],
                                                 output_token_ids=[4]))  # fmt: skip
    assert result == "freed" and freed == ["r0"], "vLLM's own free must run whatever the plugin does"
    plugin.figures.flush()
    assert plugin.errors == {"log": 3, "finish": 1} and errors(figures) == {"log": 3, "finish": 1}
    assert caplog.text.count("failed (ZeroDivisionError") == 2  # one line per phase and kind, with its cause


def test_vllms_free_runs_before_the_request_record_is_written(tmp_path, monkeypatch):
    fake = runner(r0=request([1, 2, 3], [4]))
    plugin = started(tmp_path, fake)
    plugin.runner_here = True
    order = []
    monkeypatch.setattr(plugin, "write", lambda record: order.append("write"))
    req = SimpleNamespace(request_id="r0", sampling_params=params(), prompt_token_ids=[1], output_token_ids=[4])
    plugin.free_request(lambda s, r: order.append("free"), None, req)
    assert order == ["free", "write"]


def test_records_the_validator_refuses_are_dropped_and_counted(tmp_path, monkeypatch):
    fake = runner(**{f"r{i}": request([1, 2, 3], [4]) for i in range(4)})
    plugin = started(tmp_path, fake)
    calls = []

    def picky(record, vocab_size=None):
        calls.append(record)
        if len(calls) % 2:
            raise RecordError("refused for the test")
        validate(record, vocab_size)

    monkeypatch.setattr(writer_module, "validate", picky)
    step(plugin, fake)
    plugin.writer.close()
    assert len(records(tmp_path)) == 2 and plugin.errors == {"write": 2}


def test_a_full_disk_drops_records_counts_them_and_logging_resumes(tmp_path, monkeypatch):
    fake = runner(r0=request([1, 2, 3], [4]))
    plugin = started(tmp_path, fake)
    real = writer_module.LogWriter._append

    def full(self, item):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module.LogWriter, "_append", full)
    step(plugin, fake)
    plugin.writer.flush()
    monkeypatch.setattr(writer_module.LogWriter, "_append", real)
    step(plugin, fake)
    plugin.writer.close()
    assert plugin.errors == {"write": 1} and len(records(tmp_path)) == 1


def test_a_stopped_writer_thread_is_replaced(tmp_path):
    fake = runner(r0=request([1, 2, 3], [4]))
    plugin = started(tmp_path, fake)
    step(plugin, fake)
    first = plugin.writer
    first._queue.append(None)  # what a killed writer thread looks like: it ends, the writer is not closed
    first._wake.put(None)
    first._thread.join()
    step(plugin, fake)
    assert plugin.writer is not first and plugin.writer.alive
    plugin.writer.close()
    assert len(records(tmp_path)) == 2


def test_an_unwritable_log_directory_is_counted_at_startup_and_logging_starts_once_it_is_writable(tmp_path):
    (tmp_path / "logs").write_text("a file where the log directory should be")
    fake = runner(r0=request([1, 2, 3], [4]))
    plugin = started(tmp_path, fake)  # no raise: vLLM starts and serves without a log
    step(plugin, fake)
    assert plugin.writer is None and plugin.errors == {"open": 2, "write": 1}
    (tmp_path / "logs").unlink()
    step(plugin, fake)
    plugin.writer.close()
    assert len(records(tmp_path)) == 1


def test_refusals_happen_at_startup(tmp_path):
    config = PluginConfig(log_dir=tmp_path / "logs", prefix="p")
    with pytest.raises(PluginError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        hooks.Plugin(config).worker_init(lambda w: None, SimpleNamespace(use_v2_model_runner=True))
    hooks.Plugin(config).worker_init(lambda w: None, SimpleNamespace(use_v2_model_runner=False))
    fake = runner(r0=request([1, 2, 3], [4]))
    fake.use_async_scheduling = True
    with pytest.raises(PluginError, match="--no-async-scheduling"):
        hooks.Plugin(config).runner_init(lambda r: None, fake)
    fake.use_async_scheduling = False
    first = started(tmp_path, fake)
    with pytest.raises(PluginError, match="its own TRAINER_VLLM_LOG_PREFIX"):
        started(tmp_path, fake)
    first.writer.close()


def test_a_grammar_masked_batch_logs_the_targets_own_top_k(tmp_path):
    """A structured-output request's logits carry its grammar's -inf mask when vLLM samples; the plugin takes the
    top-k before the mask, so every logged row is finite and is the target's distribution."""
    fake = runner(r0=request([1, 2, 3], [4]))
    plugin = started(tmp_path, fake)
    logits = torch.randn(3, V)
    raw = logits.clone()

    def mask(scheduler_output, grammar_output, input_batch, lg):
        lg[:, 3:] = float("-inf")  # two allowed tokens per row: fewer than k

    plugin.execute_model(lambda r, *a: None, fake, None)
    plugin.grammar_bitmask(mask, None, None, fake.input_batch, logits)
    assert torch.isinf(logits).any()
    meta = SimpleNamespace(num_draft_tokens=[2], draft_token_ids=torch.tensor([5, 6]))
    output = SimpleNamespace(sampled_token_ids=torch.tensor([[1, 2, -1]]))
    plugin.sample(lambda r, lg, m: output, fake, logits, meta)
    plugin.writer.close()
    (record,) = records(tmp_path)
    assert record["topk_ids"] == raw.topk(K).indices.tolist()
    expected = raw.log_softmax(-1).topk(K).values
    assert np.allclose(record["topk_logprobs"], expected.numpy(), atol=1e-4)
    assert plugin.errors == {}


def test_a_malformed_shareable_warns_once_per_request(tmp_path, caplog):
    fake = runner(r0=request([1, 2, 3], [4], extra_args={"shareable": "maybe"}))
    plugin = started(tmp_path, fake)
    with caplog.at_level(logging.WARNING, "trainer.integrations.vllm"):
        for _ in range(3):
            step(plugin, fake)
    plugin.writer.close()
    assert caplog.text.count("not shareable") == 1
    assert [r["shareable"] for r in records(tmp_path)] == [False] * 3


@pytest.mark.parametrize("vocab", [V, 151_936])
def test_the_device_top_k_is_the_log_softmax_top_k(vocab):
    logits = torch.randn(5, vocab) * 4
    top = DeviceTop(logits, K).rows(slice(1, 4))
    want = logits[1:4].log_softmax(-1).topk(K)
    assert top["topk_ids"].tolist() == want.indices.tolist()
    assert np.allclose(top["topk_logprobs"], want.values.numpy(), atol=1e-4)


def test_a_non_finite_row_refuses_its_record_not_the_batch():
    logits = torch.randn(4, V)
    logits[2, 0] = float("nan")
    top = DeviceTop(logits, K)
    top.rows(slice(0, 2))
    with pytest.raises(RecordError, match="non-finite"):
        top.rows(slice(2, 4))


def test_cpu_logits_are_copied_and_reduced_later_within_a_bounded_number_of_copies():
    """On the CPU the engine thread only copies the logits; the writer thread reduces them, unaffected by the
    sampler changing the logits in place afterwards. A copy holds one of ``slots`` until its top-k object is gone;
    without a free slot the reduction runs at once."""
    import gc
    import threading

    slots = threading.BoundedSemaphore(1)
    logits = torch.randn(3, V)
    want = logits.log_softmax(-1).topk(K)
    top = DeviceTop(logits, K, slots)
    logits.div_(0.1)  # what a temperature does to vLLM's logits after the hook
    assert not slots.acquire(blocking=False), "the copy should hold the one slot"
    second = DeviceTop(logits, K, slots)  # no slot: reduced now, from the logits as they are
    assert second._pending is None
    rows = top.rows(slice(0, 3))
    assert rows["topk_ids"].tolist() == want.indices.tolist()
    assert np.allclose(rows["topk_logprobs"], want.values.numpy(), atol=1e-4)
    del top
    gc.collect()
    assert slots.acquire(blocking=False), "the slot must come back once the copy's owner is gone"
