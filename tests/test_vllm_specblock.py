"""SpecBlock served by vLLM through the plugin (marker ``vllm``, vLLM's own environment): ONE engine, in a subprocess
with the verifier log on, serves ``checkpoints/specblock_tiny``'s ``--format specblock`` export, greedy, fp32,
chains of two blocks. Its outputs equal plain decoding, every step's drafts equal our engine's ``specblock-chain``
step for step (so its acceptance too), it drafts with one forward per block for all requests of a step, a
published version is hot-reloaded and drafts as ours does with it, and a failing drafter drafts nothing while vLLM
serves on::

    .venv-vllm/bin/python -m pytest -m vllm -q -p no:cacheprovider tests/test_vllm_specblock.py
"""

import copy
import json
from collections import defaultdict

import pytest
import torch
from conftest import ROOT, TINY_TARGET
from test_vllm import check_greedy_steps, read_log, run
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.engine import generate
from trainer.drafters import load_drafter
from trainer.evaluate import read_prompts
from trainer.export import write_export
from trainer.integrations.vllm.parity import DEFAULT_PROMPTS, ours, plain

pytestmark = pytest.mark.vllm

DRAFTER = ROOT / "checkpoints" / "specblock_tiny"
PROMPTS, MAX_TOKENS = 4, 48
# Two blocks of K = 4: every step launches one block from the root block's last slot.
TOKENS = 8

SERVE = """
import json, os, sys, time
from pathlib import Path
import torch
from vllm import LLM, SamplingParams
from trainer.integrations.vllm import hooks
from trainer.integrations.vllm.specblock_proposer import drafter_stats
from trainer.drafters import load_drafter
from trainer.snapshots import publish

target, export, prompts, max_tokens, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), *map(int, sys.argv[4:])
spec = {"method": "eagle3", "model": export, "num_speculative_tokens": tokens}
llm = LLM(target, dtype="float32", enforce_eager=True, async_scheduling=False, max_model_len=512,
          kv_cache_memory_bytes=1 << 28, enable_prefix_caching=False, disable_log_stats=False,
          speculative_config=spec, seed=0)
params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def counters():
    metrics = {m.name: m for m in llm.get_metrics()}
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    return {"drafts": metrics["vllm:spec_decode_num_drafts"].value, "per_position": list(per_position),
            **llm.collective_rpc(drafter_stats)[0]}


def fail(*args, **kwargs):
    raise RuntimeError("injected drafter failure")


def break_drafter(worker):
    worker.model_runner.drafter.model.drafter.project_features = fail


def outputs():
    return [list(r.outputs[0].token_ids) for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                               use_tqdm=False)]


served = outputs()
before = counters()
# A published version (the drafter with its fuse halved) is swapped in between steps; the prompts again.
perturbed = load_drafter(export)
with torch.no_grad():
    perturbed.fuse.weight.mul_(0.5)
version = publish(Path(os.environ["TRAINER_VLLM_WATCH"]), perturbed.save_pretrained, {"kind": "drafter"})
reloader, deadline = hooks._installed.reloader, time.monotonic() + 120
while reloader.version != version and version not in reloader.refused and time.monotonic() < deadline:
    llm.generate([{"prompt_token_ids": [7, 7, 7]}], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
swapped = outputs()
swapped_counters = counters()
llm.collective_rpc(break_drafter)
broken = list(llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0].outputs[0].token_ids)
print(json.dumps({"served": served, "before": before, "swapped": swapped, "version": reloader.version,
                  "swapped_counters": swapped_counters, "broken": broken, "after": counters()}))
"""


@pytest.fixture(scope="module")
def models():
    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    rows = read_prompts(ROOT / DEFAULT_PROMPTS)[:PROMPTS]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    return target, load_drafter(DRAFTER), prompts


def perturbed(drafter):
    """The version the engine publishes: the drafter with its fuse halved."""
    version = copy.deepcopy(drafter)
    with torch.no_grad():
        version.fuse.weight.mul_(0.5)
    return version


def our_drafts(target, drafter, prompt: list[int]) -> list[list[int]]:
    """Our engine's chain at every step vLLM runs (those that start before ``MAX_TOKENS``), drafted in full."""
    events = []
    session = make_session("specblock-chain", target, drafter)
    generate(target, session, BUILDERS["specblock-chain"], torch.tensor(prompt), MAX_TOKENS + TOKENS, TOKENS,
             on_step=events.append)  # fmt: skip
    drafts, done = [], 1
    for event in events:
        if done >= MAX_TOKENS:
            break
        drafts.append(event.tree.tokens[1:].tolist())
        done += len(event.path)  # the root and the accepted drafts: what the step committed
    return drafts


def test_specblock_served_by_vllm_drafts_our_chain(models, tmp_path, monkeypatch):
    target, drafter, prompts = models
    export = write_export(drafter, "specblock", tmp_path / "export", str(TINY_TARGET))
    logs = tmp_path / "logs"
    monkeypatch.setenv("TRAINER_VLLM_WATCH", str(tmp_path / "published"))
    args = ["-c", SERVE, str(TINY_TARGET), str(export), json.dumps(prompts), str(MAX_TOKENS), str(TOKENS)]
    result = json.loads(run(args, logs).strip().splitlines()[-1])
    reference = plain(target, prompts, MAX_TOKENS)
    our_outputs, acceptance = ours(target, drafter, prompts, TOKENS, MAX_TOKENS)
    assert result["served"] == reference == our_outputs

    before = result["before"]
    assert (before["drafts"], before["per_position"]) == (acceptance.drafts, acceptance.per_position)
    assert acceptance.per_position[1] > 0, "no draft past depth 1 accepted: the comparison would prove little"
    # One forward per block for all requests of a step; every request's last step drafts a chain vLLM never
    # verifies.
    assert (before["errors"], before["lost"]) == (0, 0)
    assert before["forwards"] == 2 * before["calls"]
    assert before["steps"] == before["drafts"] + PROMPTS
    assert before["calls"] < before["steps"], "every step drafted one request: the batching went untested"

    steps, requests = read_log(logs)
    by_prompt = defaultdict(list)
    for request, record in requests.items():
        by_prompt[tuple(record["prompt_ids"])].append(record)
        check_greedy_steps(steps[request], record)
        assert {s["tree"] for s in steps[request]} == {"vllm-specblock"}
    # The version swapped in drafts the prompts again, losslessly.
    assert result["version"] == 1 and result["swapped"] == reference
    version = perturbed(drafter)
    changed = False
    for prompt in prompts:
        first, second = by_prompt[tuple(prompt)][:2]
        # vLLM's drafts, step for step, including those of the blocks launched from the root block's last slot;
        # after the swap, the published version's.
        drafts = [s["tokens"] for s in steps[first["request"]]]
        assert drafts == our_drafts(target, drafter, prompt)
        assert {s["drafter_version"] for s in steps[second["request"]]} == {1}
        assert [s["tokens"] for s in steps[second["request"]]] == our_drafts(target, version, prompt)
        changed |= drafts != [s["tokens"] for s in steps[second["request"]]]
    assert changed, "the published version drafts as the first did: the swap would go unnoticed"

    # The failing drafter: its request is served without drafts, the failure counted once, nothing raised.
    assert result["broken"] == reference[0]
    after, swapped = result["after"], result["swapped_counters"]
    assert (swapped["errors"], after["errors"], after["drafts"]) == (0, 1, swapped["drafts"])
    failed = by_prompt[tuple(prompts[0])][2]
    assert failed["output_ids"] == reference[0]
    assert all(s["tokens"] == [] for s in steps[failed["request"]])
