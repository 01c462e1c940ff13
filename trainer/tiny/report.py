"""Quality report of a tiny target: held-out loss against a unigram baseline, and degeneration of its outputs.

Held-out loss is the mean next-token cross-entropy (nats) over the held-out modules in windows of
``seq_len``; the unigram baseline is the cross-entropy of add-one-smoothed train-split token frequencies on
the same tokens. Generation runs on the held-out prompt set, greedy and sampled, and reports the fraction of
outputs that end in a verbatim loop and the 4-gram repetition rate (``trainer.textstats``). On CPU::

    python -m trainer.tiny.report --target checkpoints/target_tiny --out checkpoints/target_tiny/report.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from trainer.paths import project_path
from trainer.textstats import ends_in_loop, ngram_repetition
from trainer.tiny.pretrain import StdlibCorpus


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, tokens: np.ndarray, seq_len: int, batch_size: int = 8) -> float:
    n = (len(tokens) - 1) // seq_len
    windows = torch.from_numpy(tokens[: n * seq_len + 1].astype(np.int64))
    total, count = 0.0, 0
    for start in range(0, n, batch_size):
        idx = torch.arange(start, min(n, start + batch_size))[:, None] * seq_len + torch.arange(seq_len + 1)
        batch = windows[idx]
        logits = model(input_ids=batch[:, :-1]).logits
        total += F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count


def unigram_loss(train: np.ndarray, heldout: np.ndarray, vocab_size: int) -> float:
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    log_probs = np.log(counts / counts.sum())
    return float(-log_probs[heldout[1:]].mean())


@torch.no_grad()
def generation_stats(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float, seed: int) -> dict:
    torch.manual_seed(seed)
    loops, reps = 0, []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        out = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=0 if temperature > 0 else None,
            top_p=1.0 if temperature > 0 else None,
            pad_token_id=tokenizer.pad_token_id,
        )[0, ids.shape[1] :].tolist()
        loops += ends_in_loop(out)
        reps.append(ngram_repetition(out, 4))
    return {"loop_fraction": loops / len(prompts), "repetition_4gram": float(np.mean(reps)), "n": len(prompts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="checkpoints/target_tiny")
    parser.add_argument("--prompts", type=Path, default=Path("data/prompts/stdlib_heldout.jsonl"))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    target = str(project_path(args.target))
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    data = StdlibCorpus(tokenizer=target)
    data.setup()
    start = time.perf_counter()
    report = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "heldout_loss": heldout_loss(model, data.tokens("heldout"), args.seq_len),
        "unigram_loss": unigram_loss(data.tokens("train"), data.tokens("heldout"), model.config.vocab_size),
    }
    report["heldout_perplexity"] = math.exp(report["heldout_loss"])
    lines = project_path(args.prompts).read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    report["greedy"] = generation_stats(model, data.tokenizer, prompts, args.max_new_tokens, 0.0, seed=0)
    report["sampled_t0.7"] = generation_stats(model, data.tokenizer, prompts, args.max_new_tokens, 0.7, seed=0)
    report["report_seconds"] = time.perf_counter() - start
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
