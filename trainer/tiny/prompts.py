"""The held-out prompt set: code prefixes cut from held-out stdlib modules, for evaluation.

Each prompt starts at a top-level ``def`` or ``class`` line of a held-out module and runs for whole lines up
to about ``target_tokens`` tokens, so a continuation is ordinary in-distribution code the target never saw.

    python -m trainer.tiny.prompts --tokenizer checkpoints/target_tiny --out data/prompts/stdlib_heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from trainer.paths import project_path
from trainer.tiny.corpus import list_modules, read_module


def module_prompts(text: str, tokenizer: PreTrainedTokenizerBase, per_module: int, target_tokens: int) -> list[str]:
    lines = text.splitlines(keepends=True)
    starts = [i for i, ln in enumerate(lines) if ln.startswith(("def ", "class "))]
    prompts: list[str] = []
    for start in starts[:: max(1, len(starts) // max(1, per_module))][:per_module]:
        chunk, n_tokens = "", 0
        for line in lines[start:]:
            if n_tokens >= target_tokens:
                break
            chunk += line
            n_tokens = len(tokenizer(chunk, add_special_tokens=False)["input_ids"])
        if n_tokens >= target_tokens // 2:
            prompts.append(chunk)
    return prompts


def build_prompts(tokenizer: PreTrainedTokenizerBase, per_module: int = 1, target_tokens: int = 96) -> list[dict]:
    rows = []
    for module in list_modules("heldout"):
        text = read_module(module)
        if not text:
            continue
        for j, prompt in enumerate(module_prompts(text, tokenizer, per_module, target_tokens)):
            rows.append({"id": f"{module.name}#{j}", "prompt": prompt, "module": module.name})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="checkpoints/target_tiny")
    parser.add_argument("--out", type=Path, default=Path("data/prompts/stdlib_heldout.jsonl"))
    parser.add_argument("--per-module", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=96, help="approximate prompt length in tokens")
    args = parser.parse_args()
    rows = build_prompts(AutoTokenizer.from_pretrained(project_path(args.tokenizer)), args.per_module, args.tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts from {len({r['module'] for r in rows})} held-out modules -> {args.out}")


if __name__ == "__main__":
    main()
