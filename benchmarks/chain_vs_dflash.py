"""Single-request chain mode against the reference loop: our ``generate`` with the ``chain`` builder and the
``dflash`` package's ``dflash_generate`` on the same checkpoint and prompts, greedy, interleaved.

Each round times both loops on every prompt (alternating which goes first) and checks that their tokens are
identical; the result is the ratio of our time to the reference's per round (wall clock, and this process's CPU
time, which other processes on a shared machine disturb less), then the median and the spread over rounds.
Both times include the prefill. On CPU::

    OMP_NUM_THREADS=1 python benchmarks/chain_vs_dflash.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.engine import generate
from trainer.drafters import load_drafter


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="checkpoints/target_tiny")
    p.add_argument("--drafter", default="checkpoints/dflash_tiny")
    p.add_argument("--prompts", type=Path, default=Path("data/prompts/stdlib_heldout.jsonl"))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: checks that the script runs")
    args = p.parse_args()
    if args.smoke:
        args.num_prompts, args.max_new_tokens, args.rounds = 1, 8, 1

    from dflash import model as reference  # the reference loop; README: pip install --no-deps dflash==0.1.0

    # The reference times with CUDA synchronisation; this benchmark times both loops with the wall clock.
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    ours = load_drafter(args.drafter)
    theirs = reference.DFlashDraftModel.from_pretrained(args.drafter, dtype=torch.float32).eval()
    budget = ours.block_size - 1
    lines = args.prompts.read_text().splitlines()[: args.num_prompts]
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"][-96:]  # noqa: E731
    prompts = [torch.tensor(encode(json.loads(x)["prompt"])) for x in lines]

    def run_ours(prompt: torch.Tensor) -> list[int]:
        session = make_session("chain", target, ours)
        return generate(target, session, BUILDERS["chain"], prompt, args.max_new_tokens, budget).tokens

    def run_theirs(prompt: torch.Tensor) -> list[int]:
        ids = reference.dflash_generate(theirs, target, prompt[None], args.max_new_tokens, stop_token_ids=None)
        return ids[0, prompt.numel() :].tolist()

    run_ours(prompts[0]), run_theirs(prompts[0])  # warm-up
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    ratios: dict[str, list[float]] = {c: [] for c in clocks}
    print(f"{'round':>5} {'ours wall s':>11} {'dflash wall s':>13} {'wall ratio':>10} {'cpu ratio':>9}")
    for r in range(args.rounds):
        totals = {(name, c): 0.0 for name in ("ours", "theirs") for c in clocks}
        for i, prompt in enumerate(prompts):
            order = (("ours", run_ours), ("theirs", run_theirs))
            results = {}
            for name, run in order if (r + i) % 2 == 0 else order[::-1]:
                start = {c: clock() for c, clock in clocks.items()}
                results[name] = run(prompt)
                for c, clock in clocks.items():
                    totals[name, c] += clock() - start[c]
            if results["ours"] != results["theirs"]:
                raise SystemExit(f"prompt {i}: outputs differ\nours   {results['ours']}\ntheirs {results['theirs']}")
        for c in clocks:
            ratios[c].append(totals["ours", c] / totals["theirs", c])
        print(
            f"{r:>5} {totals['ours', 'wall']:>11.3f} {totals['theirs', 'wall']:>13.3f} {ratios['wall'][-1]:>10.3f} "
            f"{ratios['cpu'][-1]:>9.3f}"
        )
    for c, values in ratios.items():
        print(
            f"ours / dflash_generate ({c} time) over {args.rounds} rounds: median {statistics.median(values):.3f}, "
            f"min {min(values):.3f}, max {max(values):.3f} (identical outputs on {len(prompts)} prompts)"
        )


if __name__ == "__main__":
    main()
