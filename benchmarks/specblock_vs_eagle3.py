"""SpecBlock against EAGLE-3: τ, drafter forwards per step and drafting milliseconds per step, side by side.

Every row (a drafter, its builder, tree options, budgets) decodes every prompt, the rows taking turns prompt by
prompt, so that all rows see the same machine load; the table gives each row's drafting time as a ratio to the
first row's (EAGLE-3) at the same budget, or at the budget paired with it by ``--pair`` (the authors compare
SpecBlock at 90 nodes with EAGLE-3 at 60). Sampling is lossless speculative sampling at ``--temperature``. A row
is ``LABEL|DRAFTER|BUDGETS[|KEY=VALUE;KEY=VALUE]``, the options being ``trainer eval --tree-opt`` ones. Shards
(``--shard i/n``) run in separate processes and ``--merge`` adds their JSON files up. On CPU::

    OMP_NUM_THREADS=1 python benchmarks/specblock_vs_eagle3.py --limit 8 --out runs/eval/sb_vs_e3.json \\
        --row 'EAGLE-3|checkpoints/eagle3_tiny|16,60,64' --row 'SpecBlock|checkpoints/specblock_tiny|16,64,90' \\
        --row 'SpecBlock, class 3 ends the chain|checkpoints/specblock_tiny|16,64|specblock_stop=chain'
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, fields
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.decoding.builders import BUILDERS, make_session, native_tree
from trainer.decoding.engine import generate
from trainer.decoding.options import TreeOptions
from trainer.decoding.verify import Sampling
from trainer.drafters import load_drafter
from trainer.evaluate import Totals, read_prompts


def parse_row(text: str) -> dict:
    parts = text.split("|")
    if len(parts) not in (3, 4):
        raise SystemExit(f"--row {text!r}: expected LABEL|DRAFTER|BUDGETS[|KEY=VALUE;...]")
    options = parts[3].split(";") if len(parts) == 4 and parts[3] else []
    return {"label": parts[0], "drafter": parts[1], "budgets": [int(b) for b in parts[2].split(",")], "opts": options}


def add(totals: list[dict]) -> dict:
    """The field-wise sum of ``Totals`` dicts."""
    out = asdict(Totals())
    for t in totals:
        for f in fields(Totals):
            value = t[f.name]
            if isinstance(value, dict):
                out[f.name] = {k: out[f.name].get(k, 0.0) + v for k, v in value.items()}
            elif isinstance(value, list):
                longer = max(len(out[f.name]), len(value))
                a, b = out[f.name] + [0] * (longer - len(out[f.name])), value + [0] * (longer - len(value))
                out[f.name] = [x + y for x, y in zip(a, b, strict=True)]
            else:
                out[f.name] += value
    return out


@torch.no_grad()
def run(args: argparse.Namespace) -> dict:
    rows = [parse_row(r) for r in args.row]
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = read_prompts(Path(args.prompts))[: args.limit]
    index, count = (int(v) for v in args.shard.split("/"))
    mine = list(range(len(prompts)))[index::count]
    drafters = {r["drafter"]: load_drafter(r["drafter"]) for r in rows}
    sampling = Sampling(temperature=args.temperature)
    totals = {(r["label"], b): Totals() for r in rows for b in r["budgets"]}
    for i in mine:
        prompt = torch.tensor(tokenizer(prompts[i]["prompt"], add_special_tokens=False)["input_ids"])
        for r in rows:
            drafter = drafters[r["drafter"]]
            tree = native_tree(drafter)
            options = TreeOptions.parse(r["opts"])
            for budget in r["budgets"]:
                session = make_session(tree, target, drafter, options)
                gen = torch.Generator().manual_seed(args.seed + i)
                g = generate(
                    target, session, BUILDERS[tree], prompt, args.max_new_tokens, budget, sampling, gen,
                    {tokenizer.eos_token_id}, options,
                )  # fmt: skip
                totals[(r["label"], budget)].add(g)
        print(f"prompt {i} done", flush=True)
    return {
        "rows": [{**r, "totals": {str(b): asdict(totals[(r["label"], b)]) for b in r["budgets"]}} for r in rows],
        "prompts": mine,
    }


def table(results: list[dict], pairs: dict[int, int]) -> str:
    rows = results[0]["rows"]
    merged = [
        {**r, "totals": {b: add([res["rows"][n]["totals"][b] for res in results]) for b in r["totals"]}}
        for n, r in enumerate(rows)
    ]
    n_prompts = sum(len(res["prompts"]) for res in results)

    def summary(row: dict, budget: str) -> dict:
        t = Totals(**row["totals"][budget])
        return t.summary()

    first = merged[0]
    lines = [
        f"{n_prompts} prompts; drafting ms ratio against {first['label']} at the same (or paired) budget",
        "",
        "| row | budget | τ | drafter forwards / step | drafting ms / step | drafting ratio | tree ms / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in merged:
        for budget in row["totals"]:
            s = summary(row, budget)
            base_budget = str(pairs.get(int(budget), int(budget)))
            ratio = ""
            if base_budget in first["totals"]:
                base = summary(first, base_budget)["ms_per_step"]["draft"]
                ratio = f"{s['ms_per_step']['draft'] / base:.2f} (vs {base_budget})" if base else ""
            lines.append(
                f"| {row['label']} | {budget} | {s['tau']:.3f} | {s['drafter_forwards_per_step']:.2f} | "
                f"{s['ms_per_step']['draft']:.1f} | {ratio} | {s['ms_per_step']['tree']:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="checkpoints/target_tiny")
    p.add_argument("--prompts", default="data/prompts/stdlib_heldout.jsonl")
    p.add_argument("--row", action="append", default=[], help="LABEL|DRAFTER|BUDGETS[|KEY=VALUE;...], repeatable")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--shard", default="0/1", help="i/n: this process decodes prompts i, i+n, ...")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pair", action="append", default=["90=60"], help="BUDGET=FIRST_ROW_BUDGET, repeatable")
    p.add_argument("--out", help="write this shard's sums as JSON")
    p.add_argument("--merge", nargs="+", help="print the table of these shard JSON files")
    p.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: checks that the script runs")
    args = p.parse_args()
    if args.smoke:
        args.row = args.row or ["EAGLE-3|checkpoints/eagle3_tiny|8", "SpecBlock|checkpoints/specblock_tiny|8"]
        args.limit, args.max_new_tokens = 1, 8
    pairs = {int(a): int(b) for a, b in (item.split("=") for item in args.pair)}
    if args.merge:
        print(table([json.loads(Path(f).read_text()) for f in args.merge], pairs))
        return
    result = run(args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result) + "\n")
    print(table([result], pairs))


if __name__ == "__main__":
    main()
