"""The target moved: drafters trained for the shipped tiny target, served on a fine-tuned release of it.

    OMP_NUM_THREADS=1 trainer fit --recipe target_tiny_moved                   # the moved target: runs/target_moved/hf
    OMP_NUM_THREADS=1 python benchmarks/target_moved.py check                  # is it different? -> check.json
    OMP_NUM_THREADS=1 python benchmarks/target_moved.py ceiling                # what updating can win -> ceiling.json
    python benchmarks/target_moved.py --smoke                                  # seconds: both run

In production a drafter goes stale when its target is updated. ``recipes/target_tiny_moved.yaml`` fine-tunes the
shipped target (lr 3e-3) on the installed torch's own Python (the train split of its modules, by the module hash);
this script measures what moved (docs/bandit.md, "The target moved"):

- ``check``: held-out loss of the shipped and the moved target on torch's held-out modules (the new domain) and
  the stdlib's (the old one), and the greedy τ (committed tokens per verification step, as ``trainer eval``) of
  each shipped drafter, with its own tree at ``--budget`` nodes, on the same prompts under either target:
  ``--prompts`` prompts cut from torch's held-out modules as ``trainer.tiny.prompts`` cuts the stdlib's, and as
  many of ``data/prompts/stdlib_heldout.jsonl``.
- ``ceiling``: benchmarks/bandit_trace.py's stream and machinery with the moved target behind the stale TreeFlash
  drafter. Per phase, a lineage of ``--depth`` successive updates of each of the bandit's arms
  (``DEFAULT_ARMS``, trained by ``BanditDaemon.train`` on the phase's logged traffic of the moved target, as the
  trace trains versions), each measured on the phase's held-out prompts; the ceiling is the trace's: the best
  version of each phase served from its first request, for free, in served tokens over never updating. The
  torch phase's prompts come from torch's validation and held-out modules, which the fine-tune never saw (the
  trace's own torch text spans every module).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import bandit_trace as trace
import numpy as np
import torch
import transformers
from transformers import AutoTokenizer

from trainer.adapt.bandit import DEFAULT_ARMS
from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.engine import generate
from trainer.drafters import load_drafter
from trainer.paths import project_path
from trainer.target import load_causal_lm
from trainer.tiny.corpus import list_modules, package_root, read_module
from trainer.tiny.pretrain import StdlibCorpus
from trainer.tiny.prompts import module_prompts
from trainer.tiny.report import heldout_loss

SHIPPED = "checkpoints/target_tiny"
MOVED = "runs/target_moved/hf"
# The fine-tune's new domain (recipes/target_tiny_moved.yaml, data.packages).
DOMAIN = "torch"
# Each shipped drafter with the tree it serves.
DRAFTERS = {"dflash_tiny": "ddtree", "eagle3_tiny": "eagle", "treeflash_tiny": "treeflash"}
# The trace's own phase text, for the phases the fine-tune did not touch.
TRACE_WINDOWS = trace.phase_windows


def unseen_modules(package: str) -> list:
    """The package's modules a fine-tune on its train split never saw (validation and held-out splits)."""
    root = package_root(package)
    return sorted(list_modules("validation", root, package) + list_modules("heldout", root, package),
                  key=lambda m: m.name)  # fmt: skip


def domain_prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """``count`` prompts (token ids) cut from held-out modules of the new domain, one per module, spread over
    them; cut as the stdlib prompt set is (``trainer.tiny.prompts``)."""
    root = package_root(DOMAIN)
    texts = [t for t in map(read_module, list_modules("heldout", root, DOMAIN)) if t]
    cut = [p for text in texts if (p := module_prompts(text, tokenizer, 1, tokens))]
    return [tokenizer(p[0], add_special_tokens=False)["input_ids"] for p in trace.spread(cut, count)]


def stdlib_prompts(tokenizer, count: int) -> list[list[int]]:
    rows = project_path("data/prompts/stdlib_heldout.jsonl").read_text().splitlines()
    texts = [json.loads(r)["prompt"] for r in trace.spread(rows, count)]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def greedy_tau(target, drafter, tree: str, prompts: list[list[int]], new_tokens: int, budget: int) -> float:
    """Committed tokens per verification step over ``prompts`` decoded greedily (``trainer eval``'s τ)."""
    committed = steps = 0
    for prompt in prompts:
        g = generate(target, make_session(tree, target, drafter), BUILDERS[tree], torch.tensor(prompt), new_tokens,
                     budget)  # fmt: skip
        committed += sum(s.committed for s in g.steps)
        steps += len(g.steps)
    return committed / steps


def check(args) -> None:
    """Held-out losses and the shipped drafters' τ under the shipped and the moved target."""
    tokenizer = AutoTokenizer.from_pretrained(str(project_path(SHIPPED)))
    targets = {"shipped": load_causal_lm(str(project_path(SHIPPED)), "float32"),
               "moved": load_causal_lm(str(project_path(args.moved)), "float32")}  # fmt: skip
    corpora = {DOMAIN: StdlibCorpus(packages=[DOMAIN], max_files=args.max_files),
               "stdlib": StdlibCorpus(max_files=args.max_files)}  # fmt: skip
    result: dict = {"moved": args.moved, "loss": {}, "tau": {}, "settings": vars(args)}
    for name, corpus in corpora.items():
        held = np.asarray(corpus.tokens("heldout")[: args.loss_tokens])
        result["loss"][name] = {t: heldout_loss(m, held, seq_len=256) for t, m in targets.items()}
        print(f"held-out loss on {name} ({len(held)} tokens): shipped {result['loss'][name]['shipped']:.3f}, "
              f"moved {result['loss'][name]['moved']:.3f} nats", flush=True)  # fmt: skip
    prompts = {DOMAIN: domain_prompts(tokenizer, args.prompts, args.prompt_tokens),
               "stdlib": stdlib_prompts(tokenizer, args.prompts)}  # fmt: skip
    for drafter_name, tree in DRAFTERS.items():
        drafter = load_drafter(project_path(f"checkpoints/{drafter_name}")).eval()
        for domain, rows in prompts.items():
            taus = {t: greedy_tau(m, drafter, tree, rows, args.new_tokens, args.budget) for t, m in targets.items()}
            result["tau"].setdefault(drafter_name, {})[domain] = {**taus, "tree": tree, "prompts": len(rows)}
            change = 100 * (taus["moved"] / taus["shipped"] - 1)
            print(f"{drafter_name} ({tree}@{args.budget}) on {len(rows)} {domain} prompts: τ shipped "
                  f"{taus['shipped']:.3f} -> moved {taus['moved']:.3f} ({change:+.1f}%)", flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "check.json").write_text(json.dumps(result, indent=1, default=str))


def moved_windows(tokenizer, phase: str, heldout: int, traffic: int, prompt_tokens: int) -> tuple[list, list]:
    """The trace's phase text (``bandit_trace.phase_windows``), but the new domain's from its modules the fine-tune
    never saw: held-out and traffic windows spread over them as the trace spreads its own."""
    if phase != DOMAIN:
        return TRACE_WINDOWS(tokenizer, phase, heldout, traffic, prompt_tokens)
    ids = [t for m in unseen_modules(DOMAIN) if (text := read_module(m)) for t in tokenizer(text)["input_ids"]]
    stride = max(prompt_tokens, (len(ids) - prompt_tokens) // (heldout + traffic))
    windows = [ids[i : i + prompt_tokens] for i in range(0, len(ids) - prompt_tokens, stride)]
    every = len(windows) // heldout
    held = [w for i, w in enumerate(windows) if i % every == every - 1][:heldout]
    rest = [w for i, w in enumerate(windows) if i % every != every - 1 or i >= every * heldout]
    return held, [rest[i % len(rest)] for i in range(traffic)]


def ceiling(args) -> None:
    """The best version per phase of the stale drafter's update lineages on the moved target (bandit_trace's
    ``ceiling``), and every version's τ, to ``OUT/ceiling.json``."""
    # bandit_trace reads its target and phase text through module globals when it trains and measures: the
    # daemon's target features and the decodes are the moved target's, the torch phase its unseen modules.
    trace.TARGET = args.moved
    trace.phase_windows = moved_windows
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(project_path(args.moved)))
    target = load_causal_lm(str(project_path(args.moved)), "float32")
    versions = trace.Versions(args.out, args, target, tokenizer)
    shipped = versions.shipped
    for phase in trace.PHASES:
        versions.heldout(shipped, phase)
        for arm in DEFAULT_ARMS:
            version = shipped
            for _ in range(args.depth):
                version = versions.child(version, phase, arm)
                print(f"  {version.name} {trace._label(version.history)}: τ "
                      f"{trace._tau(versions.heldout(version, phase)):.3f} on {phase}", flush=True)  # fmt: skip
    measured = list(versions.by_key.values())
    trace.ceiling(shipped, measured, args)
    shares = {phase: 0.0 for phase in trace.PHASES}
    for (start, phase), (end, _) in zip(trace.SCHEDULE, [*trace.SCHEDULE[1:], (1.0, "")], strict=True):
        shares[phase] += end - start
    best = {ph: max(trace._tau(v.heldout[ph]) for v in measured if ph in v.heldout) for ph in trace.PHASES}
    first = {ph: trace._tau(shipped.heldout[ph]) for ph in trace.PHASES}
    body = {
        "moved": args.moved,
        "ceiling": sum(shares[ph] * best[ph] / first[ph] for ph in trace.PHASES),
        "shares": shares,
        "stale_tau": first,
        "best_tau": best,
        "versions": {
            trace._label(v.history): {ph: trace._tau(rows) for ph, rows in v.heldout.items()} for v in measured
        },
        "train_seconds_median": statistics.median(v.train_seconds for v in measured if v.history),
        "wall_seconds": time.perf_counter() - started,
        "settings": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "ceiling.json").write_text(json.dumps(body, indent=1))
    print(f"-> {args.out / 'ceiling.json'}; wall {body['wall_seconds']:.0f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", choices=("check", "ceiling"), help="both, with --smoke alone")
    p.add_argument("--moved", default=MOVED, help="the moved target (HF directory)")
    p.add_argument("--out", type=Path, default=None, help="default: runs/target_moved (check), .../ceiling")
    p.add_argument("--budget", type=int, default=None, help="draft nodes per step (check 16, ceiling 8: the trace's)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens decoded per prompt (check 64, ceiling 40)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (check ~96, ceiling 64)")
    p.add_argument("--prompts", type=int, default=16, help="check: prompts per domain")
    p.add_argument("--loss-tokens", type=int, default=65536, help="check: held-out tokens per domain for the loss")
    p.add_argument("--max-files", type=int, default=None, help="check: modules per split (a slice)")
    p.add_argument("--depth", type=int, default=2, help="ceiling: successive updates per (phase, arm) lineage")
    p.add_argument("--heldout", type=int, default=12, help="ceiling: held-out prompts per (version, phase)")
    p.add_argument("--traffic", type=int, default=64, help="ceiling: logged requests an update trains on")
    p.add_argument("--slices", type=int, default=3, help="ceiling: traffic parts (successive updates' data)")
    p.add_argument("--smoke", action="store_true", help="seconds, tiny sizes, the shipped target as 'moved'")
    args = p.parse_args()
    if args.command is None:
        if not args.smoke:
            p.error("name the command: check or ceiling")
        for command in ("check", "ceiling"):
            run(p.parse_args([command, *sys.argv[1:]]))
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    defaults = {"check": (16, 64, 96), "ceiling": (8, 40, 64)}[args.command]
    for key, value in zip(("budget", "new_tokens", "prompt_tokens"), defaults, strict=True):
        if getattr(args, key) is None:
            setattr(args, key, value)
    # The trace's Versions reads these settings; the ceiling decodes no live sample.
    args.live = 0
    smoke_dir = None
    if args.smoke:
        smoke_dir = tempfile.TemporaryDirectory()  # removed when main returns
        args.out, args.moved, args.prompts, args.loss_tokens, args.max_files = Path(smoke_dir.name), SHIPPED, 2, 600, 3
        args.new_tokens, args.depth, args.heldout, args.traffic, args.slices = 6, 1, 2, 4, 1
        args.prompt_tokens = min(args.prompt_tokens, 32)
    if args.out is None:
        args.out = Path(MOVED).parent / ("ceiling" if args.command == "ceiling" else "")
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    {"check": check, "ceiling": ceiling}[args.command](args)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
