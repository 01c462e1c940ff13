"""Graft against its parts, on held-out prompts: τ and drafter forwards per step for the dense drafter tree,
the pruned tree alone, Graft with a cold adjacency matrix and Graft with a warm one, for EAGLE-3 and DFlash;
plus restart warm-up; or (``--sweep``) Graft, cold, under several pruning confidences and thresholds. On CPU::

    OMP_NUM_THREADS=1 python benchmarks/graft.py --eagle checkpoints/eagle3_tiny --limit 12 --first-pass 12 \\
        --out runs/graft_bench
    OMP_NUM_THREADS=1 python benchmarks/graft.py --eagle checkpoints/eagle3_tiny --limit 4 --sweep \\
        mass:0.5,0.4,0.2 best:0.3,0.2,0.05 --out runs/graft_sweep

Measured prompts are the first ``--limit`` of ``--prompts``; the warm matrix comes from a Graft pass over the
last ``--first-pass`` prompts (different ones), published in the snapshot layout and loaded back the way
``trainer eval --adjacency`` loads it, or from ``--adjacency PUB``, e.g. what ``trainer adapt graft``
published from the logs of ``trainer eval --logs`` over those prompts. Every run draws prompt ``i``'s sampling
from seed ``i``. Each run's cost is also modelled as ``τ / (1 + r · forwards)``: ``r``, a drafter forward's
time over a verification's, is measured on the dense tree of the same run, so the ratio needs no wall clock
comparison across runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.drafting import GraftSession, RecyclingSession
from trainer.decoding.engine import generate
from trainer.decoding.options import TreeOptions
from trainer.decoding.verify import Sampling
from trainer.drafters import load_drafter
from trainer.evaluate import Totals, read_prompts, refresh_adjacency
from trainer.snapshots import ADJACENCY, ADJACENCY_TENSOR, publish
from trainer.target import load_causal_lm


def decode_all(target, drafter, tree, encoded, args, options, memory=None) -> dict:
    """Decode every prompt with builder ``tree`` (one ``memory`` across the prompts for graft). The run's figures."""
    totals = Totals()
    stages: dict[int, int] = {}
    taus = []
    for i, prompt in enumerate(encoded):
        session = make_session(tree, target, drafter, options, memory)
        gen = torch.Generator().manual_seed(i)
        sampling = Sampling(args.temperature)
        g = generate(target, session, BUILDERS[tree], prompt, args.max_new_tokens, args.budget, sampling, gen,
                     options=options)  # fmt: skip
        totals.add(g)
        if g.tau is not None:  # a request that ended at its first token has no τ
            taus.append(g.tau)
        if isinstance(session, GraftSession):
            for stage, n in session.stages.items():
                stages[stage] = stages.get(stage, 0) + n
    summary = totals.summary()
    return {
        "tau": summary["tau"],
        "forwards_per_step": summary["drafter_forwards_per_step"],
        "mean_tree_size": summary["mean_tree_size"],
        "ms_per_forward": summary["ms_per_step"]["draft"] / max(summary["drafter_forwards_per_step"], 1e-9),
        "verify_ms_per_step": summary["ms_per_step"]["verify"],
        "stage_share": {str(k): v / totals.steps for k, v in sorted(stages.items())},
        "per_request_tau": taus,
    }


def publish_first_pass(memory: RecyclingSession, root: Path) -> None:
    """The first pass's matrix as a published snapshot under ``root``, as the graft daemon publishes one."""
    matrix = {ADJACENCY_TENSOR: memory.adjacency.cpu().contiguous()}
    publish(root, lambda d: save_file(matrix, str(d / ADJACENCY)), {"source": "benchmarks/graft.py first pass"})


def warm_up_requests(cold: list[float], warm: list[float], window: int = 3) -> int | None:
    """Requests a cold engine needs before its τ (mean over a sliding ``window``) reaches the warm engine's τ
    over its first ``window`` requests; None if it never does within the run."""
    goal = sum(warm[:window]) / len(warm[:window])
    for n in range(window, len(cold) + 1):
        if sum(cold[n - window : n]) / window >= goal:
            return n
    return None


def row(name: str, r: dict, ratio: float) -> str:
    stages = " ".join(f"{k}:{v:.2f}" for k, v in r["stage_share"].items()) or "–"
    modelled = r["tau"] / (1 + ratio * r["forwards_per_step"])
    return (f"| {name} | {r['tau']:.3f} | {r['forwards_per_step']:.2f} | {r['mean_tree_size']:.1f} | {modelled:.3f} "
            f"| {stages} |")  # fmt: skip


HEADER = [
    "| run | τ | drafter fwd/step | nodes/step | τ/(1+r·fwd) | pruning stage shares |",
    "|---|---|---|---|---|---|",
]


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="checkpoints/target_tiny")
    p.add_argument("--eagle", type=Path, default=Path("checkpoints/eagle3_tiny"), help="EAGLE-3 drafter (HF dir)")
    p.add_argument("--dflash", type=Path, default=Path("checkpoints/dflash_tiny"))
    p.add_argument("--prompts", type=Path, default=Path("data/prompts/stdlib_heldout.jsonl"))
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--first-pass", type=int, default=12, help="prompts, from the end of the file, that warm M")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--tree-opt", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--adjacency", type=Path, help="warm M from this publish directory instead of a first pass")
    p.add_argument("--variants", default="eagle,dflash", help="drafter variants to run: eagle, dflash")
    p.add_argument("--sweep", nargs="+", metavar="KIND:T0,T1,T5", help="confidence:thresholds settings to compare")
    p.add_argument("--out", type=Path, help="required (--smoke: a temporary directory)")
    p.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: checks that the script runs")
    args = p.parse_args()
    if args.smoke:
        smoke_out = tempfile.TemporaryDirectory()  # removed when main returns
        args.out, args.limit, args.first_pass, args.max_new_tokens, args.budget = Path(smoke_out.name), 1, 1, 8, 8
    if args.out is None:
        p.error("the following arguments are required: --out")
    options = TreeOptions.parse(args.tree_opt)
    target = load_causal_lm(args.target)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    rows = read_prompts(args.prompts)
    encode = lambda r: torch.tensor(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"])  # noqa: E731
    measured = [encode(r) for r in rows[: args.limit]]
    first = [encode(r) for r in rows[len(rows) - args.first_pass :]] if args.first_pass else []
    if len(rows) - args.first_pass < args.limit:
        raise SystemExit("--limit and --first-pass overlap: the warm matrix must come from different prompts")
    drafters = {"eagle": lambda: load_drafter(args.eagle), "dflash": lambda: load_drafter(args.dflash)}
    builders = {"eagle": ("eagle", "graft"), "dflash": ("ddtree", "graft-dflash")}
    variants = {v: builders[v] for v in args.variants.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "options": dataclasses.asdict(options)}
    lines = [f"{len(measured)} prompts, budget {args.budget}, T = {args.temperature}, {args.max_new_tokens} tokens", ""]

    def fresh() -> RecyclingSession:
        return RecyclingSession(target.config.vocab_size, options.recycling_width)

    recycling = None
    for variant, (dense, graft) in variants.items():
        drafter = drafters[variant]()
        out = {dense: decode_all(target, drafter, dense, measured, args, options)}
        ratio = out[dense]["ms_per_forward"] / out[dense]["verify_ms_per_step"]
        lines += [f"## {variant} (r = {ratio:.3f}: a drafter forward / a verification)", "", *HEADER]
        lines.append(row(dense, out[dense], ratio))
        if args.sweep:
            for setting in args.sweep:
                kind, _, thresholds = setting.partition(":")
                swept = dataclasses.replace(
                    options, graft_confidence=kind, graft_thresholds=tuple(float(t) for t in thresholds.split(","))
                )
                out[setting] = decode_all(target, drafter, graft, measured, args, swept, fresh())
                lines.append(row(f"{graft} {setting}", out[setting], ratio))
                print(lines[-1], flush=True)
        else:
            pruned = dataclasses.replace(options, graft_retrieval=False)
            out["pruned"] = decode_all(target, drafter, graft, measured, args, pruned, fresh())
            out["graft cold"] = decode_all(target, drafter, graft, measured, args, options, fresh())
            # Retrieval alone from a cold matrix (no drafter, the same in both variants): what the drafter adds.
            if recycling is None:
                recycling = decode_all(target, None, "recycling", measured, args, options, fresh())
            out["recycling cold"] = recycling
            # Warm M: published by the daemon from a first pass's logs (--adjacency), or learnt in-process by a
            # first pass over different prompts here, published in the same layout and loaded back.
            publish_dir = args.adjacency
            if publish_dir is None:
                first_memory = fresh()
                decode_all(target, drafter, graft, first, args, options, first_memory)
                publish_dir = args.out / f"publish_{variant}"
                publish_first_pass(first_memory, publish_dir)
            warm_memory = fresh()
            refresh_adjacency(warm_memory, publish_dir)
            out["graft warm"] = decode_all(target, drafter, graft, measured, args, options, warm_memory)
            for name in ("pruned", "recycling cold", "graft cold", "graft warm"):
                lines.append(row(name, out[name], ratio))
            cold, warm = out["graft cold"]["per_request_tau"], out["graft warm"]["per_request_tau"]
            needed = warm_up_requests(cold, warm)
            lines += [
                "",
                f"restart warm-up: a cold engine reaches the warm engine's first-3-request τ after "
                f"{needed if needed is not None else f'more than {len(cold)}'} requests (3-request sliding mean)",
                f"per-request τ cold: {' '.join(f'{t:.2f}' for t in cold)}",
                f"per-request τ warm: {' '.join(f'{t:.2f}' for t in warm)}",
            ]
        lines.append("")
        results[variant] = {"drafter_forward_over_verify": ratio, "runs": out}
        print("\n".join(lines), flush=True)
        (args.out / "graft.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / "graft.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
