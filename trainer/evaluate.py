"""``trainer eval``: a drafter inside lossless speculative decoding, against plain decoding in the same run.

For every condition (the requested temperature and, beside a sampled run, greedy), every tree builder and
every budget, each prompt is decoded by the engine, and so is plain decoding of the same target (the engine
with the empty tree). Every configuration, plain included, is warmed up on the first prompt before any is
timed; then each prompt is decoded by every configuration in turn (the order rotated from prompt to prompt),
so machine drift hits all alike. Reports τ (tokens per verification), tokens/s, speed-up (over all prompts,
and its spread over the per-prompt ratios), acceptance by depth, drafter forwards and the split of time
between drafting, tree building and verification, plus the loop fraction and 4-gram repetition of the
outputs (a looping target inflates τ). With ``--check-lossless`` every output is compared with plain
decoding: exactly for greedy and, for sampling, under the same seed — verification draws one target sample
per committed position from the same generator as plain sampling, so a lossless engine reproduces plain
sampling token for token.

Writes ``summary.json``, ``summary.md`` and PNG plots to ``--out``. On CPU with the shipped tiny models::

    trainer eval --drafter runs/treeflash_tiny --prompts data/prompts/stdlib_heldout.jsonl \\
        --tree ddtree,treeflash --budget 16,64 --max-new-tokens 64 --temperature 0.7 --out runs/eval --check-lossless
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from transformers import AutoTokenizer, PreTrainedModel

from trainer.decoding.builders import BUILDERS, DEFAULT_OPTIONS, make_session
from trainer.decoding.drafting import RecyclingSession
from trainer.decoding.engine import generate
from trainer.decoding.events import Generation
from trainer.decoding.options import TreeOptions
from trainer.decoding.verify import Sampling
from trainer.devices import add_device_arguments, parse_device, parse_dtype
from trainer.drafters import load_drafter
from trainer.errors import ArgumentParser, UserError
from trainer.io import write_text_atomic
from trainer.paths import project_path
from trainer.runs import resolve_drafter
from trainer.snapshots import load_adjacency, read_current
from trainer.target import load_causal_lm
from trainer.textstats import ends_in_loop, ngram_repetition
from trainer.vlog.recorder import StepRecorder
from trainer.vlog.writer import LogWriter

PHASES = ("draft", "tree", "verify", "commit")
# Plain decoding: the engine with the empty tree.
PLAIN = "none"


# ---- inputs ---------------------------------------------------------------------------------------------------
def read_prompts(path: Path) -> list[dict]:
    """``{"id", "prompt"}`` rows of a JSONL file; a bad row is an error naming its line."""
    if not path.is_file():
        raise UserError(f"prompts file {path} does not exist")
    rows, ids = [], set()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or "id" not in row:
            raise UserError(f'{path}:{n}: a prompts row is {{"id": ..., "prompt": "text"}}')
        if row["id"] in ids:
            raise UserError(f"{path}:{n}: duplicate id {row['id']!r}")
        ids.add(row["id"])
        rows.append(row)
    if not rows:
        raise UserError(f"{path} holds no prompts")
    return rows




def refresh_adjacency(memory: RecyclingSession, publish_dir: Path) -> None:
    """Load the published snapshot into ``memory`` if it is newer than the one ``memory`` holds."""
    current = read_current(publish_dir)
    if current is not None and (memory.version is None or current[0] > memory.version):
        memory.set_adjacency(load_adjacency(current[1]), current[0])


def parse_list(text: str, kind: type, name: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--{name} takes a comma-separated list of {kind.__name__}, got {text!r}") from None
    if not values:
        raise UserError(f"--{name} is empty")
    return values


# ---- measurement ----------------------------------------------------------------------------------------------
@dataclass
class Totals:
    """Sums over the prompts of one (condition, tree, budget) run."""

    tokens: int = 0
    steps: int = 0
    committed: int = 0
    decode_seconds: float = 0.0
    forwards: int = 0
    tree_nodes: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # accepted_hist[a] = steps that accepted exactly a drafts.
    accepted_hist: list[int] = field(default_factory=list)

    def add(self, g: Generation) -> None:
        self.tokens += len(g.tokens) - 1
        self.steps += len(g.steps)
        self.decode_seconds += g.decode_seconds
        for s in g.steps:
            self.committed += s.committed
            self.forwards += s.forwards
            self.tree_nodes += s.tree_size
            for phase, sec in s.seconds.items():
                self.seconds[phase] = self.seconds.get(phase, 0.0) + sec
            if s.accepted >= len(self.accepted_hist):
                self.accepted_hist += [0] * (s.accepted + 1 - len(self.accepted_hist))
            self.accepted_hist[s.accepted] += 1

    def summary(self) -> dict:
        steps = max(self.steps, 1)
        hist = np.array(self.accepted_hist or [0], dtype=np.float64)
        # P(accepted >= d) for d = 1..max: the acceptance rate by depth.
        at_least = hist[::-1].cumsum()[::-1][1:] / steps
        return {
            "tau": self.committed / steps,
            "tokens_per_s": self.tokens / self.decode_seconds if self.decode_seconds else 0.0,
            "steps": self.steps,
            "tokens": self.tokens,
            "mean_tree_size": self.tree_nodes / steps,
            "drafter_forwards_per_step": self.forwards / steps,
            "ms_per_step": {k: 1000 * v / steps for k, v in self.seconds.items()},
            "acceptance_by_depth": at_least.tolist(),
        }


def prompt_speedup(run: Generation, plain: Generation) -> float | None:
    """One prompt's speed-up: the run's decoded tokens per second over plain decoding's on the same prompt;
    None when either decoded nothing after its first token (it stopped at once: no rate to compare)."""
    if len(run.tokens) < 2 or len(plain.tokens) < 2 or run.decode_seconds <= 0 or plain.decode_seconds <= 0:
        return None
    return ((len(run.tokens) - 1) / run.decode_seconds) / ((len(plain.tokens) - 1) / plain.decode_seconds)


def spread(ratios: list[float | None]) -> dict:
    """The spread over prompts of per-prompt speed-ups: their count, mean, standard error of that mean
    (None below 2 prompts), median and 10% / 90% quantiles (linear interpolation). Prompts without a
    ratio (:func:`prompt_speedup`) are left out and not counted."""
    values = np.array([r for r in ratios if r is not None], dtype=np.float64)
    if values.size == 0:
        return {"n": 0, "mean": None, "stderr": None, "median": None, "q10": None, "q90": None}
    q10, median, q90 = np.quantile(values, [0.1, 0.5, 0.9]).tolist()
    stderr = float(values.std(ddof=1) / np.sqrt(values.size)) if values.size > 1 else None
    return {"n": int(values.size), "mean": float(values.mean()), "stderr": stderr, "median": median, "q10": q10,
            "q90": q90}  # fmt: skip


def degeneration(outputs: list[list[int]]) -> dict:
    return {
        "loop_fraction": float(np.mean([ends_in_loop(o) for o in outputs])),
        "repetition_4gram": float(np.mean([ngram_repetition(o, 4) for o in outputs])),
    }


def evaluate(
    target: PreTrainedModel,
    drafter: torch.nn.Module | None,
    prompts: list[dict],
    encoded: list[torch.Tensor],
    trees: list[str],
    budgets: list[int],
    conditions: dict[str, Sampling],
    max_new_tokens: int,
    seed: int,
    check_lossless: bool,
    stop_token_ids: set[int],
    options: TreeOptions = DEFAULT_OPTIONS,
    log: LogWriter | None = None,
    drafter_name: str | None = None,
    publish_dir: Path | None = None,
    now: Callable[[], float] = time.perf_counter,
) -> dict:
    """Every (condition, tree, budget) over every prompt, with plain decoding beside it. The summary dict.
    With ``log``, every measured speculative run writes its verifier log (request id ``cond/tree/budget/id``).

    ``publish_dir``: Token Recycling and Graft start from its current adjacency snapshot and load every newer
    one that appears between requests. ``now``: the clock every decoding time is read from (``generate``'s)."""
    runs = [(c, t, b) for c in conditions for t in trees for b in budgets]
    # Token Recycling and Graft keep their adjacency matrix across requests ("hot start"): one per run.
    memories: dict[tuple, RecyclingSession] = {}

    def memory(key: tuple) -> RecyclingSession:
        if key not in memories:
            memories[key] = RecyclingSession(target.config.vocab_size, options.recycling_width, target.device)
        if publish_dir is not None:
            refresh_adjacency(memories[key], publish_dir)
        return memories[key]

    per_prompt: dict[tuple, list[dict]] = {key: [] for key in runs}
    totals: dict[tuple, Totals] = {key: Totals() for key in runs}
    baseline = {c: Totals() for c in conditions}
    baseline_outputs: dict[str, list[list[int]]] = {c: [] for c in conditions}

    def run(cond: str, tree: str, budget: int, i: int, logged: bool = False) -> Generation:
        key = (cond, tree, budget)
        shared = memory(key) if BUILDERS[tree].uses_adjacency else None
        session = make_session(tree, target, drafter, options, shared)
        gen = torch.Generator(device=target.device).manual_seed(seed + i)
        recorder = None
        if logged and log is not None:
            recorder = StepRecorder(
                log, server="eval", request=f"{cond}/{tree}/{budget}/{prompts[i]['id']}", tenant=None,
                shareable=True, drafter=drafter_name if BUILDERS[tree].uses_drafter else None, drafter_version=None,
            )  # fmt: skip
        g = generate(
            target, session, BUILDERS[tree], encoded[i], max_new_tokens, budget, conditions[cond], gen, stop_token_ids,
            options, recorder, now, step_topk=recorder.k if recorder is not None else 0,
        )  # fmt: skip
        if recorder is not None:
            recorder.finish(encoded[i].tolist(), g.tokens)
        return g

    # Every configuration, plain decoding included, runs once unmeasured before any is timed: a first call pays
    # for the allocator, kernel selection at its shapes and lazy imports, and must not land in one side of a ratio.
    configurations = [(c, PLAIN, 0) for c in conditions] + runs
    for cond, tree, budget in configurations:
        run(cond, tree, budget, 0)
    memories.clear()

    with Progress(transient=True) as progress:
        task = progress.add_task("decoding", total=len(prompts) * len(configurations))
        for i, row in enumerate(prompts):
            # Interleaved per prompt, in an order rotated from prompt to prompt, so that drift (clock boost,
            # thermal state, a neighbour's load) hits every configuration alike and none always runs first.
            shift = i % len(configurations)
            outputs = {}
            for cond, tree, budget in configurations[shift:] + configurations[:shift]:
                outputs[cond, tree, budget] = run(cond, tree, budget, i, logged=tree != PLAIN)
                progress.advance(task)
            for cond in conditions:
                plain = outputs[cond, PLAIN, 0]
                baseline[cond].add(plain)
                baseline_outputs[cond].append(plain.tokens)
            for key in runs:
                g, plain = outputs[key], outputs[key[0], PLAIN, 0]
                totals[key].add(g)
                record = {"id": row["id"], "tau": g.tau, "speedup": prompt_speedup(g, plain), "tokens": g.tokens}
                if check_lossless:
                    record["lossless"] = g.tokens == plain.tokens
                per_prompt[key].append(record)

    summary: dict = {"conditions": {}}
    for cond, sampling in conditions.items():
        base = baseline[cond].summary()
        entry = {
            "sampling": asdict(sampling),
            "plain": {**base, **degeneration(baseline_outputs[cond])},
            "runs": {},
        }
        for tree in trees:
            for budget in budgets:
                key = (cond, tree, budget)
                result = totals[key].summary()
                result["speedup"] = result["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
                result["speedup_prompts"] = spread([p["speedup"] for p in per_prompt[key]])
                result.update(degeneration([p["tokens"] for p in per_prompt[key]]))
                if check_lossless:
                    result["lossless"] = all(p["lossless"] for p in per_prompt[key])
                result["prompts"] = per_prompt[key]
                entry["runs"].setdefault(tree, {})[str(budget)] = result
        summary["conditions"][cond] = entry
    return summary


# ---- reports --------------------------------------------------------------------------------------------------
def markdown(summary: dict) -> str:
    lines = []
    for cond, entry in summary["conditions"].items():
        plain = entry["plain"]
        lines += [
            f"## {cond}: {entry['sampling']}",
            "",
            f"Plain decoding: {plain['tokens_per_s']:.1f} tokens/s, loop fraction {plain['loop_fraction']:.2f}, "
            f"4-gram repetition {plain['repetition_4gram']:.3f}.",
            "",
            "Speed-up: tokens/s over plain decoding's, all prompts together, ± the standard error of the mean "
            "per-prompt ratio; then the 10% and 90% quantiles of the per-prompt ratios.",
            "",
            "| tree | budget | τ | tokens/s | speed-up | per prompt q10–q90 | drafter fwd/step | draft ms | tree ms "
            "| verify ms | accept@1 | accept@4 | loop frac | lossless |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for tree, by_budget in entry["runs"].items():
            for budget, r in by_budget.items():
                acc = r["acceptance_by_depth"] + [0.0] * 4
                ms = r["ms_per_step"]
                lossless = {True: "yes", False: "**NO**"}.get(r.get("lossless"), "–")
                per = r["speedup_prompts"]
                error = f" ± {per['stderr']:.2f}" if per["stderr"] is not None else ""
                quantiles = f"{per['q10']:.2f}–{per['q90']:.2f}" if per["n"] else "–"
                lines.append(
                    f"| {tree} | {budget} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}×{error} "
                    f"| {quantiles} | {r['drafter_forwards_per_step']:.2f} | {ms.get('draft', 0):.2f} "
                    f"| {ms.get('tree', 0):.2f} | {ms.get('verify', 0):.2f} | {acc[0]:.2f} | {acc[3]:.2f} "
                    f"| {r['loop_fraction']:.2f} | {lossless} |"
                )
        lines.append("")
    return "\n".join(lines)


def plots(summary: dict, out: Path) -> list[Path]:
    """τ vs budget per tree, and acceptance by depth per run; one PNG each, a line per condition × tree."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def figure(name: str, xlabel: str, ylabel: str, lines: list[tuple[list, list, str]], log_x: bool) -> Path:
        fig, ax = plt.subplots(figsize=(6, 4))
        for xs, ys, label in lines:
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        if log_x:
            ax.set_xscale("log", base=2)
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        return out / name

    tau_lines, acceptance_lines = [], []
    for cond, entry in summary["conditions"].items():
        for tree, by_budget in entry["runs"].items():
            budgets = sorted(by_budget, key=int)
            tau_lines.append(([int(b) for b in budgets], [by_budget[b]["tau"] for b in budgets], f"{tree} ({cond})"))
            for budget in budgets:
                acc = by_budget[budget]["acceptance_by_depth"]
                acceptance_lines.append((list(range(1, len(acc) + 1)), acc, f"{tree}@{budget} ({cond})"))
    return [
        figure("tau_vs_budget.png", "node budget", "τ (tokens per verification)", tau_lines, log_x=True),
        figure("acceptance_by_depth.png", "depth d", "P(accepted ≥ d)", acceptance_lines, log_x=False),
    ]


# ---- command --------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="trainer eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", type=Path, help="training run directory or exported HF drafter directory")
    p.add_argument("--prompts", type=Path, required=True, help='JSONL, one {"id", "prompt"} per line')
    p.add_argument("--tree", default="ddtree", help=f"comma-separated builders: {', '.join(sorted(BUILDERS))}")
    p.add_argument("--budget", default="16", help="comma-separated node budgets (draft nodes, root excluded)")
    p.add_argument(
        "--tree-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a tree hyperparameter, repeatable: treeflash_top_m, treeflash_top_k, eagle_top_k, eagle_depth, "
        "specblock_branch (4 widths: 2,4,10,0), specblock_root_width, specblock_stop (branching|chain), "
        "specblock_launch_greedy, specblock_rounds, specblock_blocks_per_round, recycling_width, "
        "recycling_decay, recycling_max_depth, graft_checkpoints (0,1,5), graft_thresholds (0.3,0.1,0.02), "
        "graft_confidence (best|mass|top1), graft_draft_share (0.25,0.5,0.75,1), graft_retrieval "
        "(trainer/decoding/options.py)",
    )
    p.add_argument(
        "--adjacency",
        type=Path,
        metavar="PUBLISH_DIR",
        help="start recycling and graft warm from the adjacency snapshot PUBLISH_DIR/current names (as "
        "`trainer adapt graft --publish` writes it) and load newer ones between requests",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 = lossless speculative sampling")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument(
        "--no-greedy-beside",
        action="store_true",
        help="with --temperature > 0, skip the greedy run reported beside the sampled one",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory (summary.json, summary.md, PNGs)")
    p.add_argument("--check-lossless", action="store_true", help="compare every output with plain decoding")
    p.add_argument(
        "--logs",
        type=Path,
        help="write the verifier log of every speculative run into this directory (docs/verifier_log.md); "
        "the measured times then include logging",
    )
    p.add_argument("--target", help="target HF directory or hub id (default: the drafter run's recipe target)")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N prompts only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="decode max-new-tokens even past end-of-text")
    add_device_arguments(p, "the target and the drafter")
    return p


def main(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    trees = parse_list(args.tree, str, "tree")
    for tree in trees:
        if tree not in BUILDERS or tree == "none":
            raise UserError(f"unknown tree builder {tree!r}; choose from {sorted(set(BUILDERS) - {'none'})}")
    budgets = parse_list(args.budget, int, "budget")
    if min(budgets) < 1:
        raise UserError("--budget values must be at least 1 node")
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if args.limit is not None and args.limit < 1:
        raise UserError("--limit must be at least 1 prompt")
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    try:
        headline = Sampling(args.temperature, args.top_p, args.top_k)
    except ValueError as e:
        raise UserError(str(e)) from None
    options = TreeOptions.parse(args.tree_opt)
    prompts = read_prompts(project_path(args.prompts))[: args.limit]
    snapshot = None
    if args.adjacency is not None:
        if not args.adjacency.is_dir():
            raise UserError(f"--adjacency {args.adjacency} is not a directory of published snapshots")
        snapshot = read_current(args.adjacency)

    drafter, target_name = None, args.target
    if args.drafter is not None:
        hf, run_target = resolve_drafter(args.drafter)
        if target_name is None:
            if run_target is None:
                raise UserError(f"{hf} comes without a run recipe naming its target; pass --target")
            target_name = run_target
        drafter = load_drafter(hf, dtype).to(device)
    elif any(BUILDERS[t].session is not RecyclingSession for t in trees):
        raise UserError(f"trees {trees} need a drafter: pass --drafter")
    if target_name is None:
        raise UserError("pass --target (no drafter run to take it from)")
    target = load_causal_lm(target_name, dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(str(project_path(target_name)))
    encoded = [torch.tensor(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in prompts]
    if any(e.numel() == 0 for e in encoded):
        empty = next(r["id"] for r, e in zip(prompts, encoded, strict=True) if e.numel() == 0)
        raise UserError(f"{args.prompts}: prompt {empty!r} encodes to no tokens")
    stops = set() if args.ignore_eos or tokenizer.eos_token_id is None else {tokenizer.eos_token_id}

    conditions = {"greedy": headline} if headline.greedy else {f"T={args.temperature:g}": headline}
    if not headline.greedy and not args.no_greedy_beside:
        conditions["greedy"] = Sampling()
    start = time.perf_counter()
    log = LogWriter(args.logs, "eval", vocab_size=target.config.vocab_size) if args.logs else None
    try:
        summary = evaluate(
            target, drafter, prompts, encoded, trees, budgets, conditions, args.max_new_tokens, args.seed,
            args.check_lossless, stops, options, log, str(args.drafter) if args.drafter else None, args.adjacency,
        )  # fmt: skip
    finally:
        if log is not None:
            log.close()
    summary.update(
        drafter=str(args.drafter) if args.drafter else None,
        target=target_name,
        prompts=str(args.prompts),
        n_prompts=len(prompts),
        max_new_tokens=args.max_new_tokens,
        device=str(device),
        dtype=args.dtype,
        tree_options=asdict(options),
        adjacency=str(args.adjacency) if args.adjacency else None,
        # The snapshot version the runs started from (None: cold, learnt in this process only).
        adjacency_version=snapshot[0] if snapshot else None,
        seconds=time.perf_counter() - start,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / "summary.json", json.dumps(summary, indent=1) + "\n")
    report = markdown(summary)
    (args.out / "summary.md").write_text(report + "\n")
    console = Console()
    console.print(report)
    try:
        written = [p.name for p in plots(summary, args.out)]
    except Exception as e:  # the plots only restate summary.json: losing them must not lose a finished run
        written = []
        console.print(f"[yellow]warning:[/] plots not written ({type(e).__name__}: {e})", soft_wrap=True)
    console.print(f"wrote {args.out / 'summary.json'}, summary.md{''.join(', ' + n for n in written)}")
    failed = [
        f"{cond} {tree}@{budget}"
        for cond, entry in summary["conditions"].items()
        for tree, by_budget in entry["runs"].items()
        for budget, r in by_budget.items()
        if r.get("lossless") is False
    ]
    if failed:
        raise UserError(f"outputs differ from plain decoding: {', '.join(failed)} (see summary.json)")
