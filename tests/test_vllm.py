"""vLLM with the plugin, in vLLM's own environment (marker ``vllm``; ``.ci/run`` runs them, the default suite does
not). Each test starts vLLM in a subprocess (one or two in-process engines, fp32, the shipped tiny models)::

    .ci/vllm_env .venv-vllm && .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm.py -x -q
"""

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import ROOT, TINY_TARGET

from trainer.vlog.reader import LogReader
from trainer.vlog.schema import RecordError

pytestmark = pytest.mark.vllm

VOCAB = json.loads((TINY_TARGET / "config.json").read_text())["vocab_size"]
PROMPTS, MAX_TOKENS = 4, 48


def vllm_env(logs: Path) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": "1",
        "TRAINER_VLLM_LOG_DIR": str(logs),
        "TRAINER_VLLM_LOG_PREFIX": "test-vllm",
    }


def run(args: list[str], logs: Path) -> str:
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=vllm_env(logs), capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout


def read_log(logs: Path) -> tuple[dict[str, list[dict]], dict[str, dict]]:
    """Step records per request (in order) and request records; every line must pass the validator."""
    steps, requests = defaultdict(list), {}
    for item in LogReader(logs, {}, vocab_size=VOCAB):
        record = item.record
        assert not isinstance(record, RecordError), f"{item.segment}@{item.start}: {record}"
        if record["kind"] == "step":
            steps[record["request"]].append(record)
        else:
            assert record["request"] not in requests, "two request records for one request"
            requests[record["request"]] = record
    assert not any(f.name.endswith(".part") for f in logs.iterdir()), "an unfinished segment after vLLM exited"
    return steps, requests


def check_greedy_steps(steps: list[dict], request: dict) -> None:
    """A greedy request's steps replay its output: positions advance by what was committed, each committed token
    is the argmax of its verified row, the drafts form a chain from the root."""
    out = request["output_ids"]
    committed = out[:1]  # the prefill's token (no verification step)
    for n, step in enumerate(steps):
        assert step["step"] == n
        assert step["pos"] == len(request["prompt_ids"]) + len(committed) - 1
        assert step["root"] == committed[-1]
        assert step["parents"] == list(range(-1, len(step["tokens"]) - 1))
        new = [step["tokens"][a] for a in step["accepted"]] + [step["bonus"]]
        rows = [0] + [a + 1 for a in step["accepted"]]
        assert [step["topk_ids"][r][0] for r in rows] == new
        committed += new
    assert committed[: len(out)] == out and len(committed) - len(out) <= len(steps[-1]["tokens"])


def parity(tmp_path: Path, drafter: str, formats: str) -> tuple[list[dict], dict, dict]:
    rows = tmp_path / "rows.json"
    logs = tmp_path / "logs"
    args = ["-m", "trainer.integrations.vllm.parity", "--drafter", drafter, "--formats", formats]
    args += ["--limit", str(PROMPTS), "--max-tokens", str(MAX_TOKENS), "--json", str(rows)]
    print(run(args, logs))
    steps, requests = read_log(logs)
    return json.loads(rows.read_text()), steps, requests


def check_parity_and_log(rows: list[dict], steps: dict, requests: dict) -> None:
    for row in rows:
        assert row["ours"] == row["vllm"], row
        assert row["ours_equal_plain"] and row["vllm_equal_plain"], row
        assert row["vllm"]["per_position"][0] > 0, "nothing accepted: the comparison would prove nothing"
    # The log agrees with vLLM's own counters, summed over the formats served.
    assert len(requests) == PROMPTS * len(rows)
    per_position = [0] * rows[0]["tokens"]
    drafts = 0
    for request, record in requests.items():
        check_greedy_steps(steps[request], record)
        for step in steps[request]:
            assert step["drafter"] is not None and step["drafter_version"] == 0
            assert len(step["topk_ids"][0]) >= 8 and step["budget"] == rows[0]["tokens"]
            drafts += bool(step["tokens"])
            for j in range(len(step["accepted"])):
                per_position[j] += 1
    assert drafts == sum(r["vllm"]["drafts"] for r in rows)
    assert per_position == [sum(c) for c in zip(*(r["vllm"]["per_position"] for r in rows), strict=True)]


def test_eagle3_exports_served_by_vllm_accept_like_our_engine_and_are_logged(tmp_path):
    check_parity_and_log(*parity(tmp_path, "checkpoints/eagle3_tiny", "speculators"))


def test_dflash_exports_served_by_vllm_accept_like_our_engine_and_are_logged(tmp_path):
    check_parity_and_log(*parity(tmp_path, "checkpoints/dflash_tiny", "dflash,speculators"))


NGRAM = """
import json, sys
from vllm import LLM, SamplingParams
spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
llm = LLM(sys.argv[1], dtype="float32", enforce_eager=True, async_scheduling=False, max_model_len=256,
          kv_cache_memory_bytes=1 << 28, speculative_config=spec, seed=0)
args = [{"tenant": "acme", "shareable": 0}, None]
params = [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, extra_args=a) for a in args]
out = llm.generate([{"prompt_token_ids": [7, 8, 9, 10, 7, 8, 9, 10, 7, 8]}, {"prompt_token_ids": [1, 2, 3, 4]}],
                   params, use_tqdm=False)
print(json.dumps([[list(o.prompt_token_ids), list(o.outputs[0].token_ids)] for o in out]))
"""


def test_ngram_drafting_is_logged_drafter_free_with_each_requests_tenant(tmp_path):
    logs = tmp_path / "logs"
    served = json.loads(run(["-c", NGRAM, str(TINY_TARGET)], logs).strip().splitlines()[-1])
    steps, requests = read_log(logs)
    by_prompt = {tuple(r["prompt_ids"]): r for r in requests.values()}
    assert sorted(by_prompt) == sorted(tuple(p) for p, _ in served)
    for (prompt, output), identity in zip(served, [("acme", False), (None, True)], strict=True):
        record = by_prompt[tuple(prompt)]
        assert record["output_ids"] == output
        assert (record["tenant"], record["shareable"]) == identity
        check_greedy_steps(steps[record["request"]], record)
        for step in steps[record["request"]]:
            assert (step["tenant"], step["shareable"]) == identity
            assert step["drafter"] is None and step["drafter_version"] is None and step["tree"] == "vllm-ngram"
    # The repeating prompt gives n-gram matches: some steps drafted and some drafts were accepted.
    assert any(s["accepted"] for s in steps[by_prompt[tuple(served[0][0])]["request"]])


def test_the_plugin_refuses_another_vllm_release(monkeypatch):
    import vllm

    from trainer.integrations.vllm.config import PluginError
    from trainer.integrations.vllm.hooks import check_version

    check_version()
    monkeypatch.setattr(vllm, "__version__", "0.33.0")  # read and found to hook the same interfaces
    check_version()
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(PluginError, match=r"0\.32\.0 and 0\.33\.0; this is vLLM 0\.34\.0"):
        check_version()


RELOAD = """
import json, sys
from pathlib import Path
import torch
from vllm import LLM, SamplingParams
from trainer.snapshots import publish
from trainer.integrations.vllm import hooks
from trainer.drafters import load_drafter

target, export, pub = sys.argv[1:4]
shipped = load_drafter("checkpoints/eagle3_tiny")
perturbed = load_drafter("checkpoints/eagle3_tiny")
with torch.no_grad():
    perturbed.fc.weight.mul_(0.5)
publish(Path(pub), perturbed.save_pretrained, {"kind": "drafter"})
llm = LLM(target, dtype="float32", enforce_eager=True, async_scheduling=False, max_model_len=512, seed=0,
          kv_cache_memory_bytes=1 << 28, speculative_config={"model": export, "method": "eagle3",
                                                             "num_speculative_tokens": 3})
params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[4])]
reloader = hooks._installed.reloader

def settle(version):  # versions are prepared off the engine thread and copied in between steps
    while reloader.version != version and version not in reloader.refused:
        llm.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)

settle(1)
phases = {"v1": [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]}
settle(publish(Path(pub), load_drafter("checkpoints/dflash_tiny").save_pretrained, {"kind": "drafter"}))
phases["v2"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[:1], params, use_tqdm=False)]
settle(publish(Path(pub), lambda d: (d / "config.json").write_text("{"), {"kind": "drafter"}))
phases["v3"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts[:1], params, use_tqdm=False)]
settle(publish(Path(pub), shipped.save_pretrained, {"kind": "drafter"}))
phases["v4"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
print(json.dumps({"outputs": phases, "swaps": reloader.swaps, "refused": sorted(reloader.refused),
                  "swap_ms": reloader.swap_ms}))
"""


def test_published_drafter_versions_are_hot_loaded_and_bad_ones_refused(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.decoding.builders import BUILDERS, make_session
    from trainer.decoding.engine import generate
    from trainer.decoding.options import TreeOptions
    from trainer.drafters import load_drafter
    from trainer.export import write_export

    shipped = load_drafter(ROOT / "checkpoints/eagle3_tiny")
    export = write_export(shipped, "speculators", tmp_path / "export", str(TINY_TARGET))
    logs, pub = tmp_path / "logs", tmp_path / "pub"
    prompts = [list(range(3, 40)), [5, 9, 11, 5, 9, 11, 5, 9]]
    env_args = ["-c", RELOAD, str(TINY_TARGET), str(export), str(pub), json.dumps(prompts)]
    os.environ["TRAINER_VLLM_WATCH"], os.environ["TRAINER_VLLM_POLL_SECONDS"] = str(pub), "0.001"
    try:
        result = json.loads(run(env_args, logs).strip().splitlines()[-1])
    finally:
        del os.environ["TRAINER_VLLM_WATCH"], os.environ["TRAINER_VLLM_POLL_SECONDS"]
    assert result["swaps"] == 2 and result["refused"] == [2, 3], result
    steps, requests = read_log(logs)
    # Which drafter drafted each logged step: the versions' drafts are exactly our engine's with those weights.
    perturbed = load_drafter(ROOT / "checkpoints/eagle3_tiny")
    with torch.no_grad():
        perturbed.fc.weight.mul_(0.5)
    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    options = TreeOptions(eagle_top_k=1, eagle_depth=3)

    def drafts(drafter, prompt: list[int]) -> tuple[list[int], list[list[int]]]:
        trees = []
        session = make_session("eagle", target, drafter, options)
        g = generate(target, session, BUILDERS["eagle"], torch.tensor(prompt), 24 + 3, 3, options=options,
                     on_step=lambda e: trees.append(e.tree.tokens[1:].tolist()))  # fmt: skip
        return g.tokens[:24], trees

    differs = False
    for request, record in requests.items():
        if len(record["output_ids"]) == 1:  # the one-token requests that wait for a swap: no verification step
            continue
        check_greedy_steps(steps[request], record)
        versions = {s["drafter_version"] for s in steps[request]}
        assert len(versions) == 1, versions
        version = versions.pop()
        tokens, trees = drafts({1: perturbed, 4: shipped}[version], record["prompt_ids"])
        assert tokens == record["output_ids"]
        logged = [s["tokens"] for s in steps[request]]
        assert logged == trees[: len(logged)], (version, request)
        if version == 4:
            differs |= drafts(perturbed, record["prompt_ids"])[1][: len(logged)] != logged
    assert differs, "the perturbed version drafts like the shipped one: the test would not see a missed swap"
    assert {s["drafter_version"] for r in steps.values() for s in r} == {1, 4}


SAMPLED = """
import json, sys
from vllm import LLM, SamplingParams
target, export = sys.argv[1:3]
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[3])]
llm = LLM(target, dtype="float32", enforce_eager=True, async_scheduling=False, max_model_len=512, seed=0,
          disable_log_stats=False, kv_cache_memory_bytes=1 << 28,
          speculative_config={"model": export, "method": "eagle3", "num_speculative_tokens": 3})
runs = []
for _ in range(2):
    params = [SamplingParams(max_tokens=48, temperature=0.7, ignore_eos=True, seed=i) for i in range(len(prompts))]
    runs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
metrics = {m.name: m for m in llm.get_metrics()}
print(json.dumps({"runs": runs, "drafted": metrics["vllm:spec_decode_num_draft_tokens"].value,
                  "accepted": metrics["vllm:spec_decode_num_accepted_tokens"].value}))
"""


def test_sampled_speculation_accepts_like_our_engine_and_repeats_under_a_seed(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.decoding.builders import BUILDERS, make_session
    from trainer.decoding.engine import generate
    from trainer.decoding.options import TreeOptions
    from trainer.decoding.verify import Sampling
    from trainer.drafters import load_drafter
    from trainer.evaluate import read_prompts
    from trainer.export import write_export

    drafter = load_drafter(ROOT / "checkpoints/eagle3_tiny")
    export = write_export(drafter, "speculators", tmp_path / "export", str(TINY_TARGET))
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    rows = read_prompts(ROOT / "data/prompts/stdlib_heldout.jsonl")[:PROMPTS]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    result = json.loads(run(["-c", SAMPLED, str(TINY_TARGET), str(export), json.dumps(prompts)], tmp_path / "logs")
                        .strip().splitlines()[-1])  # fmt: skip
    assert result["runs"][0] == result["runs"][1], "the same seeds gave different samples"
    vllm_rate = result["accepted"] / result["drafted"]
    # Our engine's sampled acceptance of the same chain: the rate vLLM's verification must come near.
    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    options = TreeOptions(eagle_top_k=1, eagle_depth=3)
    accepted = drafted = 0
    for seed, prompt in enumerate(prompts):
        session = make_session("eagle", target, drafter, options)
        g = generate(target, session, BUILDERS["eagle"], torch.tensor(prompt), 48, 3, Sampling(0.7),
                     torch.Generator().manual_seed(seed), options=options)  # fmt: skip
        accepted += sum(s.accepted for s in g.steps)
        drafted += sum(s.tree_size for s in g.steps)
    ours_rate = accepted / drafted
    assert ours_rate > 0.05, ours_rate
    print(f"sampled acceptance at T = 0.7: vLLM {vllm_rate:.3f}, ours {ours_rate:.3f}")
    assert 0.5 * ours_rate < vllm_rate < 2 * ours_rate, (vllm_rate, ours_rate)


def test_the_plugin_benchmark_runs_in_smoke_mode(tmp_path):
    """benchmarks/vllm_plugin.py (logging overhead, hook cost per step, the synthetic top-k at a real vocabulary,
    swap stall) stays alive: one pair of two repetitions and one swap."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "benchmarks/vllm_plugin.py", "--smoke"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-5000:]
    for line in ("logging overhead: median ratio", "hook cost per step", "synthetic V=151936", "swap: 1 published"):
        assert line in out, f"no {line!r} in:\n{out}"
    assert "same tokens" in out, out  # greedy: both processes of the pair decoded the same tokens in the same steps
