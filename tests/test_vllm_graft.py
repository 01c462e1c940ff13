"""Graft's table in vLLM (marker ``vllm``, vLLM's environment): the ``custom_class`` graft proposer drafts, from a
fixed published adjacency, exactly the chains our engine's ``recycling-chain`` builder drafts, step by step; a
version published mid-stream is switched in between steps and logged as ``adjacency_version``; a version that does
not fit the target is refused while vLLM goes on serving. One in-process engine serves every phase::

    .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_graft.py -x -q
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY_TARGET
from safetensors.torch import save_file
from test_vllm import read_log

from trainer.snapshots import ADJACENCY, ADJACENCY_TENSOR, publish

pytestmark = pytest.mark.vllm
DEPTH = 4
MAX_TOKENS = 32

SERVE = """
import json, sys, time
import torch
from pathlib import Path
from vllm import LLM, SamplingParams
from trainer.integrations.vllm import hooks
from trainer.snapshots import publish, ADJACENCY, ADJACENCY_TENSOR
from safetensors.torch import load_file, save_file

target, pub, depth, max_tokens = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[5])]
llm = LLM(target, dtype="float32", enforce_eager=True, async_scheduling=False, max_model_len=512, seed=0,
          kv_cache_memory_bytes=1 << 28, speculative_config={"method": "custom_class", "num_speculative_tokens": depth,
          "model": "trainer.integrations.vllm.graft.GraftProposer"})
plugin = hooks._installed
graft = plugin.graft
greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
out = {"outputs": {}, "versions": {}}

def settle(version):
    deadline = time.monotonic() + 120
    while graft.version != version and version not in graft.refused:
        assert time.monotonic() < deadline, f"adjacency version {version} was neither switched in nor refused"
        llm.generate([{"prompt_token_ids": [7, 7, 7]}], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        time.sleep(0.02)

def phase(name):
    out["outputs"][name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    plugin.writer.flush()
    out["versions"][name] = graft.version

def publish_table(table):
    return publish(pub, lambda d: save_file({ADJACENCY_TENSOR: table}, d / ADJACENCY), {"kind": "adjacency"})

settle(1)
phase("v1")
first = load_file(pub / "v000001" / ADJACENCY)[ADJACENCY_TENSOR]
# Version 2: ranks 0 and 1 swapped, so every row with two known successors drafts another chain.
settle(publish_table(first[:, [1, 0, *range(2, first.shape[1])]].contiguous()))
phase("v2")
# Version 3 does not fit the target (one row too many): refused, version 2 stays.
bad = publish_table(torch.cat([first, first[:1]]))
settle(bad)
phase("refused")
out["refused"] = sorted(graft.refused)
out["errors"] = dict(plugin.errors)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A learnt table published as version 1, then vLLM serving the graft proposer through three phases."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.decoding.builders import BUILDERS, make_session
    from trainer.decoding.engine import generate
    from trainer.decoding.options import TreeOptions
    from trainer.evaluate import read_prompts
    from trainer.integrations.vllm.parity import plain

    tmp = tmp_path_factory.mktemp("graft")
    tok = AutoTokenizer.from_pretrained(TINY_TARGET)
    rows = read_prompts(ROOT / "data/prompts/stdlib_heldout.jsonl")
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows[:4]]
    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    # Version 1: what our engine's recycling learnt on other prompts (a realistic table, many rows known).
    options = TreeOptions()
    learner = make_session("recycling", target, None, options)
    with torch.no_grad():
        for r in rows[8:12]:
            ids = torch.tensor(tok(r["prompt"], add_special_tokens=False)["input_ids"])
            generate(target, learner, BUILDERS["recycling"], ids, 32, 8, options=options)
    table = learner.adjacency.to(torch.int32)
    pub = tmp / "adjacency"
    publish(pub, lambda d: save_file({ADJACENCY_TENSOR: table}, d / ADJACENCY), {"kind": "adjacency"})
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TRAINER_VLLM_LOG_DIR": str(tmp / "logs"),
           "TRAINER_VLLM_WATCH": str(pub), "TRAINER_VLLM_POLL_SECONDS": "0.05",
           "TRAINER_VLLM_GRAFT_LEARN": "0"}  # fmt: skip
    command = [sys.executable, "-c", SERVE, str(TINY_TARGET), str(pub), str(DEPTH), str(MAX_TOKENS),
               json.dumps(prompts)]  # fmt: skip
    run = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    with torch.no_grad():
        result["plain"] = plain(target, prompts, MAX_TOKENS)
    result.update(target=target, prompts=prompts, table=table, logs=tmp / "logs")
    return result


def test_graft_is_lossless_and_refuses_a_table_that_does_not_fit(served):
    for phase in ("v1", "v2", "refused"):
        assert served["outputs"][phase] == served["plain"], phase
    assert served["versions"] == {"v1": 1, "v2": 2, "refused": 2}
    assert served["refused"] == [3]
    assert served["errors"] == {"graft": 1}, "the refusal is counted once, nothing else failed"


def test_graft_chains_equal_our_engines_per_step(served):
    """Each phase's requests (the four prompts, greedy): vLLM's chain at every step equals our engine's
    ``recycling-chain`` of the same depth over the version that drafted it, and the first version's requests
    take the same steps as our engine decoding them with the table frozen."""
    from trainer.decoding.builders import BUILDERS
    from trainer.decoding.drafting import RecyclingSession
    from trainer.decoding.engine import generate
    from trainer.decoding.events import Clock
    from trainer.decoding.options import TreeOptions

    table = served["table"].long()
    tables = {1: table, 2: table[:, [1, 0, *range(2, table.shape[1])]]}
    options = TreeOptions()
    build = BUILDERS["recycling-chain"].build
    steps, requests = read_log(served["logs"])
    prompts = {r: record["prompt_ids"] for r, record in requests.items()}
    graft_steps = [s for request in steps.values() for s in request]
    assert graft_steps and all(s["tree"] == "vllm-graft" and s["drafter"] is None for s in graft_steps)
    def chain(version: int, root: int) -> list[int]:
        session = RecyclingSession(table.shape[0])
        session.set_adjacency(tables[version], version)
        return build(session, root, DEPTH, DEPTH, Clock(torch.device("cpu")), options).tokens[1:].tolist()

    drafted = switched = 0
    for s in graft_steps:
        if "adjacency_version" not in s:
            continue  # a warm-up request before version 1 was switched in
        assert s["tokens"] == chain(s["adjacency_version"], s["root"]), (s["request"], s["step"])
        drafted += len(s["tokens"])
        switched += s["adjacency_version"] == 2 and s["tokens"] != chain(1, s["root"])
    assert drafted > 10 * len(served["prompts"])
    assert switched > 10, "version 2 drafts other chains than version 1 (else the switch would go unseen)"
    # Our engine with the frozen version-1 table decodes the same prompts: the same chains, step for step.
    frozen = RecyclingSession(table.shape[0])
    frozen.set_adjacency(table, 1)
    frozen.learn = frozen.learn_top = lambda *a: None  # the table vLLM drafted from does not learn
    for prompt in served["prompts"]:
        (request,) = [r for r, p in prompts.items() if p == prompt and steps[r][0].get("adjacency_version") == 1]
        events = []
        generate(served["target"], frozen, BUILDERS["recycling-chain"], torch.tensor(prompt), MAX_TOKENS + DEPTH,
                 DEPTH, options=options, on_step=events.append)  # fmt: skip
        ours = [(e.tree.tokens[0].item(), e.tree.tokens[1:].tolist()) for e in events]
        theirs = [(s["root"], s["tokens"]) for s in steps[request]]
        assert len(theirs) > 3 and theirs == ours[: len(theirs)]


def test_the_side_by_side_benchmark_runs_graft_and_its_control(tmp_path):
    """``benchmarks/vllm_methods.py --smoke`` with plain decoding, the graft proposer beside its daemon, and the
    frozen control: each served losslessly, the daemon's version switched in before the shift."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(ROOT / "benchmarks/vllm_methods.py"), "--smoke", "--out", str(tmp_path),
               "--vllm-python", sys.executable, "--methods", "plain", "graft", "graft-frozen"]  # fmt: skip
    run = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "methods.json").read_text())
    assert result["graft"]["version_at_shift"] >= 1
    assert {w["version"] for w in result["graft-frozen"]["windows"]} == {1}
    for method in ("graft", "graft-frozen"):
        assert result[method]["outputs"] == result["plain"]["outputs"], method
    assert "| graft-frozen |" in (tmp_path / "methods.md").read_text()
