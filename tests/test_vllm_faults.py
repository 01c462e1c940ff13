"""Faults injected into the vLLM plugin inside a real vLLM engine (marker ``vllm``, vLLM's environment): vLLM keeps
answering, its greedy outputs equal plain decoding, the plugin counts what it dropped, and structured-output
requests under speculation are served and logged. One in-process engine serves every phase::

    .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_faults.py -x -q
"""

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest
import torch
from conftest import ROOT, TINY_TARGET

from trainer.vlog.reader import LogReader
from trainer.vlog.schema import RecordError

pytestmark = pytest.mark.vllm
VOCAB = json.loads((TINY_TARGET / "config.json").read_text())["vocab_size"]
MAX_TOKENS = 24

FAULTS = """
import dataclasses, errno, json, sys, threading, time
from pathlib import Path
import torch
from vllm import LLM, SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from trainer.drafters import load_drafter
from trainer.integrations.vllm import hooks, reload
from trainer.snapshots import publish
from trainer.vlog import writer as writer_module

target, export, pub, bad = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[5])]
llm = LLM(target, dtype="float32", enforce_eager=True, async_scheduling=False, max_model_len=512, seed=0,
          kv_cache_memory_bytes=1 << 28, speculative_config={"model": export, "method": "eagle3",
                                                             "num_speculative_tokens": 3})
plugin = hooks._installed
hooks.REOPEN_SECONDS = 0.0  # retry opening the log at every record: the test's phases last seconds
greedy = SamplingParams(max_tokens=int(sys.argv[6]), temperature=0, ignore_eos=True)
out = {"outputs": {}, "errors": {}}

def phase(name):
    out["outputs"][name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    if plugin.writer is not None:
        plugin.writer.flush()
    out["errors"][name] = dict(plugin.errors)

def settle(version):
    deadline = time.monotonic() + 120
    while plugin.reloader.version != version and version not in plugin.reloader.refused:
        assert time.monotonic() < deadline, f"version {version} was neither swapped in nor refused"
        llm.generate([{"prompt_token_ids": [7, 7, 7]}], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)

phase("clean")
# 1. The validator refuses every other record.
validate, seen = writer_module.validate, []
def picky(record, vocab_size=None):
    seen.append(1)
    if len(seen) % 2:
        raise writer_module.RecordError("refused by the fault injection")
    validate(record, vocab_size)
writer_module.validate = picky
phase("refused_records")
writer_module.validate = validate
# 2. The disk fills: every write of the writer thread fails with ENOSPC.
append = writer_module.LogWriter._append
def full(self, item):
    raise OSError(errno.ENOSPC, "No space left on device")
writer_module.LogWriter._append = full
phase("disk_full")
writer_module.LogWriter._append = append
# 3. The writer thread dies (it ends without the writer being closed).
dead = plugin.writer
dead._queue.append(None); dead._wake.put(None); dead._thread.join()
phase("writer_dead")
out["writer_replaced"] = plugin.writer is not dead and plugin.writer.alive
# 4. The log directory becomes unwritable (a path under a regular file), then writable again.
config = plugin.config
plugin.writer.close(); plugin.writer = None
plugin.config = dataclasses.replace(config, log_dir=bad)
phase("unwritable")
plugin.config = config
# 5. A published version whose in-place copy raises: refused, the served weights restored.
copy, calls = reload.reload_in_place, []
def failing(*args, **kwargs):
    calls.append(1)
    if len(calls) == 1:
        raise RuntimeError("in-place copy failed (fault injection)")
    return copy(*args, **kwargs)
reload.reload_in_place = failing
perturbed = load_drafter("checkpoints/eagle3_tiny")
with torch.no_grad():
    perturbed.fc.weight.mul_(0.5)
settle(publish(pub, perturbed.save_pretrained, {"kind": "drafter"}))
phase("swap_failed")
reload.reload_in_place = copy
# 6. Structured outputs (choice and JSON) under speculation, in one batch with plain requests.
choice = ["yes", "no", "maybe so"]
structured = [SamplingParams(max_tokens=16, temperature=0, structured_outputs=StructuredOutputsParams(choice=choice)),
              SamplingParams(max_tokens=24, temperature=0,
                             structured_outputs=StructuredOutputsParams(json_object=True))]
got = llm.generate(prompts + prompts[:2], [greedy] * len(prompts) + structured, use_tqdm=False)
out["outputs"]["with_structured"] = [list(o.outputs[0].token_ids) for o in got[: len(prompts)]]
out["structured_text"] = [o.outputs[0].text for o in got[len(prompts):]]
out["structured_prompts"] = [list(o.prompt_token_ids) for o in got[len(prompts):]]
# 7. A swap while requests run: the next version is published while a batch decodes.
def later():
    time.sleep(1.0)
    out["swapped_version"] = publish(pub, load_drafter("checkpoints/eagle3_tiny").save_pretrained, {"kind": "drafter"})
thread = threading.Thread(target=later)
thread.start()
long = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
out["outputs"]["during_swap"] = [list(o.outputs[0].token_ids)[: greedy.max_tokens]
                                 for o in llm.generate(prompts, long, use_tqdm=False)]
thread.join()
settle(out["swapped_version"])
plugin.writer.flush()
out["errors"]["end"] = dict(plugin.errors)
out["refused"] = sorted(plugin.reloader.refused)
out["version"] = plugin.reloader.version
print(json.dumps(out))
"""


def plain_outputs(prompts: list[list[int]]) -> list[list[int]]:
    """Greedy decoding of the target in fp32, EOS not stopping it (``ignore_eos`` as the vLLM requests)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(MAX_TOKENS):
                ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(p) :])
    return outs


def test_faults_in_the_plugin_never_take_vllm_down(tmp_path):
    from trainer.drafters import load_drafter
    from trainer.export import write_export

    export = write_export(load_drafter(ROOT / "checkpoints/eagle3_tiny"), "speculators", tmp_path / "export",
                          str(TINY_TARGET))  # fmt: skip
    (tmp_path / "file").write_text("not a directory")
    logs, pub = tmp_path / "logs", tmp_path / "pub"
    prompts = [list(range(3, 40)), [5, 9, 11, 5, 9, 11, 5, 9], list(range(100, 130))]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "TRAINER_VLLM_LOG_DIR": str(logs), "TRAINER_VLLM_LOG_PREFIX": "faults", "TRAINER_VLLM_WATCH": str(pub),
           "TRAINER_VLLM_POLL_SECONDS": "0.01"}  # fmt: skip
    args = [sys.executable, "-c", FAULTS, str(TINY_TARGET), str(export), str(pub), str(tmp_path / "file" / "logs"),
            json.dumps(prompts), str(MAX_TOKENS)]  # fmt: skip
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(out["errors"], indent=1))

    plain = plain_outputs(prompts)
    for name, outputs in out["outputs"].items():
        assert outputs == plain, f"phase {name}: vLLM's output differs from plain decoding"
    errors = out["errors"]
    assert errors["clean"] == {}
    assert errors["refused_records"]["write"] > 0
    assert errors["disk_full"]["write"] > errors["refused_records"]["write"]
    assert out["writer_replaced"]
    assert errors["unwritable"]["open"] >= 1 and errors["unwritable"]["write"] > errors["writer_dead"]["write"]
    assert errors["end"]["write"] == errors["unwritable"]["write"], "records dropped once the log could be opened"
    assert errors["swap_failed"]["swap"] == 1 and "restore" not in errors["end"]
    assert out["refused"] == [1] and out["version"] == out["swapped_version"] == 2
    assert set(errors["end"]) <= {"write", "open", "swap"}, "an error outside the injected faults"
    assert out["structured_text"][0] in ("yes", "no", "maybe so")
    assert out["structured_text"][1].lstrip().startswith("{"), out["structured_text"][1]

    # What was logged is valid; the structured requests' steps are there with finite rows; versions per step.
    steps, requests = defaultdict(list), {}
    for item in LogReader(logs, {}, vocab_size=VOCAB):
        assert not isinstance(item.record, RecordError), item.record
        record = item.record
        if record["kind"] == "step":
            steps[record["request"]].append(record)
        else:
            requests[record["request"]] = record
    # The structured requests: prompts of the batch whose output is not the plain one (and is no longer than theirs).
    structured = [r for r, record in requests.items() if record["prompt_ids"] in out["structured_prompts"]
                  and len(record["output_ids"]) <= MAX_TOKENS and record["output_ids"] not in plain]  # fmt: skip
    assert len(structured) == 2 and all(steps[r] for r in structured), "structured-output requests were not logged"
    versions = [[s["drafter_version"] for s in steps[r]] for r in requests if steps[r]]
    assert all(v == sorted(v) for v in versions), "a request's steps went back to an older version"
    mixed = [v for v in versions if len(set(v)) > 1]
    assert mixed and all(set(v) == {0, 2} for v in mixed), "no request ran through the swap: the test saw no mix"
