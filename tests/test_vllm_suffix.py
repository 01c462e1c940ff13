"""vLLM's ``suffix`` speculative method (suffix decoding, the arctic-inference package of the ``vllm-cpu`` extra)
served with the plugin (marker ``vllm``, vLLM's environment): greedy outputs equal plain decoding and its
variable-length drafts are logged drafter-free, valid and in agreement with vLLM's own counters. One in-process
engine, fp32, the shipped tiny target::

    .venv-vllm/bin/python -m pytest -m vllm -q -p no:cacheprovider tests/test_vllm_suffix.py
"""

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY_TARGET
from test_vllm import check_greedy_steps, read_log, run

pytestmark = pytest.mark.vllm

PROMPTS, MAX_TOKENS, BUDGET = 8, 64, 8

SUFFIX = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", enforce_eager=True, async_scheduling=False, max_model_len=512, seed=0,
          kv_cache_memory_bytes=1 << 28, disable_log_stats=False,
          speculative_config={"method": "suffix", "num_speculative_tokens": int(sys.argv[3])})
params = SamplingParams(max_tokens=int(sys.argv[4]), temperature=0, ignore_eos=True)
out = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])], params, use_tqdm=False)
metrics = {m.name: getattr(m, "values", getattr(m, "value", None)) for m in llm.get_metrics()}
print(json.dumps({"outputs": [list(o.outputs[0].token_ids) for o in out],
                  "drafts": metrics["vllm:spec_decode_num_drafts"],
                  "draft_tokens": metrics["vllm:spec_decode_num_draft_tokens"],
                  "per_position": metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]}))
"""


@torch.no_grad()
def plain_greedy(target: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """``n`` argmax tokens after ``prompt``, end-of-text included like vLLM's ``ignore_eos`` (HF's
    ``min_new_tokens`` would instead mask it)."""
    ids, past, out = torch.tensor([prompt]), None, []
    for _ in range(n):
        step = target(ids, past_key_values=past, use_cache=True)
        past, ids = step.past_key_values, step.logits[:, -1:].argmax(-1)
        out.append(ids.item())
    return out


def test_suffix_decoding_is_lossless_and_logged_drafter_free(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.evaluate import read_prompts

    tokenizer = AutoTokenizer.from_pretrained(TINY_TARGET)
    rows = read_prompts(ROOT / "data/prompts/stdlib_heldout.jsonl")[:PROMPTS]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    args = ["-c", SUFFIX, str(TINY_TARGET), json.dumps(prompts), str(BUDGET), str(MAX_TOKENS)]
    served = json.loads(run(args, tmp_path / "logs").strip().splitlines()[-1])

    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, served["outputs"], strict=True):
        assert output == plain_greedy(target, prompt, MAX_TOKENS)

    steps, requests = read_log(tmp_path / "logs")
    by_prompt = {tuple(r["prompt_ids"]): r for r in requests.values()}
    assert sorted(by_prompt) == sorted(map(tuple, prompts))
    per_position, drafts, draft_tokens, short = [0] * BUDGET, 0, 0, 0
    for prompt, output in zip(prompts, served["outputs"], strict=True):
        record = by_prompt[tuple(prompt)]
        assert record["output_ids"] == output
        check_greedy_steps(steps[record["request"]], record)
        for step in steps[record["request"]]:
            assert step["drafter"] is None and step["drafter_version"] is None
            assert step["tree"] == "vllm-suffix" and step["budget"] == BUDGET
            drafts += bool(step["tokens"])
            draft_tokens += len(step["tokens"])
            short += 0 < len(step["tokens"]) < BUDGET
            for j in range(len(step["accepted"])):
                per_position[j] += 1
    # The log agrees with vLLM's counters; suffix drafts vary in length, so some drafted steps are below budget.
    assert (drafts, draft_tokens, per_position) == (served["drafts"], served["draft_tokens"], served["per_position"])
    assert per_position[0] > 0 and short > 0, (per_position, short)
