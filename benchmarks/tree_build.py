"""Tree-building time of every builder as a ratio to the target's verification forward of that tree.

Drafts come from the shipped tiny drafters on a held-out prompt; each builder's pure function is timed
alone (median of repeats) and so is one verification forward of the tree it built, both in this process,
side by side. Ratios, not absolute times, are the result (the machine is noisy). On CPU::

    OMP_NUM_THREADS=1 python benchmarks/tree_build.py --budgets 16,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from trainer.decoding.drafting import RecyclingSession, TreeFlashSession
from trainer.decoding.options import TreeOptions
from trainer.decoding.tree import Tree, chain, ddtree, recycling_template, retrieval, treeflash
from trainer.decoding.verify import tree_attention_mask
from trainer.drafters.treeflash import TreeFlashDraftModel


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="checkpoints/target_tiny")
    p.add_argument("--drafter", default="checkpoints/dflash_tiny", help="DFlash backbone for the TreeFlash drafter")
    p.add_argument("--prompts", type=Path, default=Path("data/prompts/stdlib_heldout.jsonl"))
    p.add_argument("--budgets", default="16,64")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: checks that the script runs")
    args = p.parse_args()
    if args.smoke:
        args.budgets, args.repeats = "16", 2

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    drafter = TreeFlashDraftModel.from_dflash(args.drafter).eval()
    prompt_text = json.loads(args.prompts.read_text().splitlines()[0])["prompt"]
    prompt = torch.tensor(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])

    # One prefill feeds the drafter session and the recycling table, as in the engine.
    cache = DynamicCache(config=target.config)
    out = target(input_ids=prompt[None], cache=cache, use_cache=True, output_hidden_states=True)
    layer_ids = TreeFlashSession(drafter, target).layer_ids
    features = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    root = int(out.logits[0, -1].argmax())
    depth = drafter.block_size - 1

    def session() -> TreeFlashSession:
        fresh = TreeFlashSession(drafter, target)
        fresh.start(prompt, features, out.logits[0])
        return fresh

    options = TreeOptions()
    fresh = session()
    tables = fresh.transitions(root, depth, fresh.candidate_tokens, options.treeflash_top_k)
    marginal = session().depth_logits(root, depth).log_softmax(-1)
    recycling = RecyclingSession(target.config.vocab_size)
    recycling.start(prompt, None, out.logits[0].float())
    past = prompt.numel()

    def verify_seconds(tree: Tree) -> float:
        mask = tree_attention_mask(tree, past, torch.float32, torch.device("cpu"))
        positions = (past + tree.depths())[None]

        def forward() -> None:
            target(input_ids=tree.tokens[None], position_ids=positions, attention_mask=mask, cache=cache)
            cache.crop(-tree.tokens.numel())

        return median_seconds(forward, args.repeats)

    print(
        f"target {args.target}: {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M parameters, "
        f"vocab {target.config.vocab_size}, prompt {past} tokens, torch threads {torch.get_num_threads()}"
    )
    print(f"{'builder':<10} {'budget':>6} {'nodes':>6} {'build ms':>9} {'verify ms':>10} {'build/verify':>13}")
    for budget in [int(b) for b in args.budgets.split(",")]:
        builders = {
            "chain": lambda b=budget: chain(root, marginal.argmax(-1), b),
            "ddtree": lambda b=budget: ddtree(marginal, root, b),
            "treeflash": lambda b=budget: treeflash(tables, root, b),
            "recycling": lambda b=budget: retrieval(recycling.adjacency, root, recycling_template(b)),
        }
        for name, build in builders.items():
            tree = build()
            build_s = median_seconds(build, args.repeats)
            verify_s = verify_seconds(tree)
            print(f"{name:<10} {budget:>6} {tree.size:>6} {1000 * build_s:>9.3f} {1000 * verify_s:>10.3f} "
                  f"{build_s / verify_s:>13.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
