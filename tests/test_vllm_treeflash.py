"""TreeFlash served by vLLM (marker ``vllm``; trainer/integrations/vllm/treeflash.py): one in-process engine serves
the tiny TreeFlash drafter's ``--format treeflash`` export, greedy, fp32, then hot-loads a published TreeFlash
version whose approximator is random; both must decode like the target and accept, per position, exactly what our
engine's ``treeflash-chain`` accepts with those weights::

    .venv-vllm/bin/python -m pytest -m vllm -q -p no:cacheprovider tests/test_vllm_treeflash.py
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY_TARGET

pytestmark = pytest.mark.vllm

PROMPTS, MAX_TOKENS = 4, 48
TREEFLASH_TINY = ROOT / "checkpoints" / "treeflash_tiny"

SERVE = """
import json, sys
from pathlib import Path
from vllm import LLM, SamplingParams
from trainer.drafters import load_drafter
from trainer.integrations.vllm import hooks
from trainer.snapshots import publish

target, export, pub, perturbed, tokens = sys.argv[1:6]
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[6])]
llm = LLM(target, dtype="float32", enforce_eager=True, async_scheduling=False, max_model_len=512, seed=0,
          disable_log_stats=False, kv_cache_memory_bytes=1 << 28,
          speculative_config={"model": export, "method": "dflash", "num_speculative_tokens": int(tokens)})
params = SamplingParams(max_tokens=int(sys.argv[7]), temperature=0, ignore_eos=True)
reloader = hooks._installed.reloader

def counts():
    m = {x.name: x for x in llm.get_metrics()}
    return [m["vllm:spec_decode_num_drafts"].value, *m["vllm:spec_decode_num_accepted_tokens_per_pos"].values]

def phase():
    before = counts()
    outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    return {"outputs": outputs, "counts": [a - b for a, b in zip(counts(), before)]}

result = {"shipped": phase()}
version = publish(Path(pub), load_drafter(perturbed).save_pretrained, {"kind": "drafter"})
while reloader.version != version and version not in reloader.refused:
    llm.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
result["perturbed"] = phase()
result["swaps"], result["refused"] = reloader.swaps, sorted(reloader.refused)
result["proposer"] = type(reloader.runner.drafter).__name__
print(json.dumps(result))
"""


def test_treeflash_export_drafts_treeflash_s_chain_in_vllm_and_hot_loads_its_approximator(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.drafters import load_drafter
    from trainer.evaluate import read_prompts
    from trainer.export import write_export
    from trainer.export.dflash import as_dflash
    from trainer.integrations.vllm.parity import ours, plain

    shipped = load_drafter(TREEFLASH_TINY)
    k = shipped.block_size - 1
    # A version with a non-trivial approximator, whatever the shipped one learnt.
    perturbed = load_drafter(TREEFLASH_TINY)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        d = perturbed.ar_approximation.d.weight
        d.copy_(0.05 * torch.randn(d.shape, generator=generator))
    perturbed.save_pretrained(tmp_path / "perturbed")
    export = write_export(shipped, "treeflash", tmp_path / "export", str(TINY_TARGET))
    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    rows = read_prompts(ROOT / "data/prompts/stdlib_heldout.jsonl")[:PROMPTS]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "TRAINER_VLLM_WATCH": str(tmp_path / "pub"), "TRAINER_VLLM_POLL_SECONDS": "0.001"}  # fmt: skip
    args = [str(TINY_TARGET), str(export), str(tmp_path / "pub"), str(tmp_path / "perturbed"), str(k)]
    result = subprocess.run([sys.executable, "-c", SERVE, *args, json.dumps(prompts), str(MAX_TOKENS)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    served = json.loads(result.stdout.strip().splitlines()[-1])
    assert served["proposer"] == "TreeFlashProposer"
    assert served["swaps"] == 1 and served["refused"] == [], served

    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    reference = plain(target, prompts, MAX_TOKENS)
    dflash_counts = ours(target, as_dflash(shipped), prompts, k, MAX_TOKENS)[1]
    for name, drafter in (("shipped", shipped), ("perturbed", load_drafter(tmp_path / "perturbed"))):
        outputs, counts = ours(target, drafter, prompts, k, MAX_TOKENS)
        assert outputs == reference and served[name]["outputs"] == reference, name
        assert served[name]["counts"] == [counts.drafts, *counts.per_position], name
        assert counts.per_position[1] > 0, f"{name}: no second position accepted, the chain's wiring is untested"
        # TreeFlash's chain is not DFlash's: the backbone alone drafts and accepts otherwise.
        assert [counts.drafts, *counts.per_position] != [dflash_counts.drafts, *dflash_counts.per_position], name
    assert served["perturbed"]["counts"] != served["shipped"]["counts"], "the swap changed nothing vLLM drafts"
