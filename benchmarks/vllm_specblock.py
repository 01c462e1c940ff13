"""vLLM serving SpecBlock's chain beside vLLM serving EAGLE-3's chain at the same ``num_speculative_tokens``: τ
(vLLM's own counters: accepted drafts per drafting step + 1), per-position acceptance, and drafter forwards counted
on the drafter module itself (a forward hook): per request-step (over the requests of every proposer call) and per
engine step (over the calls). Both draft a step's requests together: vLLM's EAGLE-3 in ``num_speculative_tokens``
forwards, the SpecBlock proposer in one forward per block of K.

One in-process engine per drafter, one after the other, the shipped tiny models (fp32, greedy, eager, no async
scheduling, no prefix caching); the drafters are exported as vLLM loads them (``specblock``, ``speculators``).
In vLLM's environment (``.ci/vllm_env``), about 3 minutes on 2 cores::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/vllm_specblock.py \\
        --tokens 8 --limit 8 --max-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from trainer.drafters import load_drafter
from trainer.evaluate import read_prompts
from trainer.export import write_export
from trainer.integrations.vllm.parity import DEFAULT_PROMPTS
from trainer.paths import project_path

TARGET = "checkpoints/target_tiny"
# Label, checkpoint, export format; both are served with vLLM's eagle3 method.
DRAFTERS = (
    ("EAGLE-3", "checkpoints/eagle3_tiny", "speculators"),
    ("SpecBlock", "checkpoints/specblock_tiny", "specblock"),
)


def count_drafting(worker: Any) -> None:
    """For ``collective_rpc``: count the served drafter module's forwards and the proposer's calls from now on."""
    drafter = worker.model_runner.drafter
    module = getattr(drafter.model, "drafter", drafter.model)  # the SpecBlock wrapper holds our drafter
    drafter.bench = {"forwards": 0, "calls": 0, "rows": 0}

    def forward_hook(*args: Any) -> None:
        drafter.bench["forwards"] += 1

    module.register_forward_hook(forward_hook)
    propose = drafter.propose

    def counted(*args: Any, **kwargs: Any) -> Any:
        drafter.bench["calls"] += 1
        drafter.bench["rows"] += kwargs["common_attn_metadata"].num_reqs
        return propose(*args, **kwargs)

    drafter.propose = counted


def drafting_counts(worker: Any) -> dict[str, int]:
    return worker.model_runner.drafter.bench


def serve(label: str, export: Path, prompts: list[list[int]], tokens: int, max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    spec = {"method": "eagle3", "model": str(export), "num_speculative_tokens": tokens}
    llm = LLM(str(project_path(TARGET)), dtype="float32", enforce_eager=True, async_scheduling=False, max_model_len=512,
              kv_cache_memory_bytes=1 << 28, enable_prefix_caching=False, disable_log_stats=False,
              speculative_config=spec, seed=0)  # fmt: skip
    try:
        llm.collective_rpc(count_drafting)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        metrics = {m.name: m for m in llm.get_metrics()}
        counts = llm.collective_rpc(drafting_counts)[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    drafts = int(metrics["vllm:spec_decode_num_drafts"].value)
    per_position = [int(v) for v in metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values]
    return {
        "drafter": label,
        "tokens": tokens,
        "drafts": drafts,
        "per_position": per_position,
        "tau": 1 + sum(per_position) / drafts,
        # Every proposer call drafts a chain per request (a request's last one is never verified).
        "forwards_per_request_step": counts["forwards"] / counts["rows"],
        "forwards_per_engine_step": counts["forwards"] / counts["calls"],
        "requests_per_engine_step": counts["rows"] / counts["calls"],
        "outputs": [list(r.outputs[0].token_ids) for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8, help="num_speculative_tokens of both")
    parser.add_argument("--limit", type=int, default=8, help="first N held-out prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise SystemExit("run with VLLM_ENABLE_V1_MULTIPROCESSING=0 (the engine in this process)")
    tokenizer = AutoTokenizer.from_pretrained(project_path(TARGET))
    rows = read_prompts(project_path(DEFAULT_PROMPTS))[: args.limit]
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, checkpoint, fmt in DRAFTERS:
            export = write_export(load_drafter(checkpoint), fmt, Path(tmp) / fmt, str(project_path(TARGET)))
            results.append(serve(label, export, prompts, args.tokens, args.max_tokens))
    same = results[0]["outputs"] == results[1]["outputs"]
    print(f"{args.limit} prompts, {args.max_tokens} tokens, num_speculative_tokens {args.tokens}; "
          f"outputs of both equal: {same}\n")  # fmt: skip
    print("| drafter | drafting steps | accepted per position | τ | forwards / request-step | forwards / engine step "
          "(requests per engine step) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in results:
        per_request, per_step = r["forwards_per_request_step"], r["forwards_per_engine_step"]
        print(f"| {r['drafter']} | {r['drafts']} | {r['per_position']} | {r['tau']:.3f} | {per_request:.2f} | "
              f"{per_step:.2f} ({r['requests_per_engine_step']:.2f}) |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in results], indent=1))


if __name__ == "__main__":
    main()
