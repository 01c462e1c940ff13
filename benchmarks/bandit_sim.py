"""Simulation: when should a served drafter be updated? Never, every N requests, when τ drops, or the bandit.

    OMP_NUM_THREADS=1 python benchmarks/bandit_sim.py --out runs/bandit_sim   # CPU, about 20 minutes

The tiny target (checkpoints/target_tiny) serves a TreeFlash drafter made from the DFlash backbone trained on
the standard library (checkpoints/dflash_tiny, approximator zero-initialised). The prompt stream starts with
held-out standard-library modules (data/prompts/stdlib_heldout.jsonl) and shifts to the project's own Markdown
(README.md, docs/*.md): prose and tables the drafter never saw; the τ measured per phase under never-update
shows the shift. Every policy serves the same stream greedily, logging verifier records that the bandit
daemon (and the fixed schedules' τ trigger) read.

Simulated clock: a verification step costs the median step seconds measured here in a calibration pass (one
figure for every policy, so timing noise on a shared machine does not decide the comparison); an update costs
the seconds it measurably took. Score: served tokens per simulated second, as a ratio to never-update (the same
tokens in less time is the same as more tokens served in the same time). Fixed schedules and the greedy rule
use the bandit's ``full`` arm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from trainer.adapt.bandit import DEFAULT_ARMS, BanditConfig
from trainer.adapt.bandit_daemon import BanditDaemon
from trainer.adapt.publish import publish, read_current
from trainer.drafters.dflash import DFlashDraftModel
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.paths import project_path
from trainer.spec.drafting import load_drafter
from trainer.spec.engine import BUILDERS, generate, make_session
from trainer.target import load_causal_lm
from trainer.vlog.recorder import StepRecorder
from trainer.vlog.writer import LogWriter

TARGET = "checkpoints/target_tiny"
BACKBONE = "checkpoints/dflash_tiny"
TREE = "treeflash"


def prompt_stream(tokenizer, n_before: int, n_after: int, prompt_tokens: int) -> list[tuple[str, list[int]]]:
    """(phase, prompt ids): ``n_before`` stdlib prompts, then ``n_after`` windows of the project's Markdown."""
    rows = [json.loads(line) for line in project_path("data/prompts/stdlib_heldout.jsonl").read_text().splitlines()]
    before = [tokenizer(r["prompt"])["input_ids"][-prompt_tokens:] for r in rows[:n_before]]
    docs = [project_path("README.md"), *sorted(project_path("docs").glob("*.md"))]
    ids = [tok for path in docs for tok in tokenizer(path.read_text())["input_ids"]]
    stride = max(prompt_tokens, (len(ids) - prompt_tokens) // max(n_after, 1))
    after = [ids[i : i + prompt_tokens] for i in range(0, stride * n_after, stride)][:n_after]
    return [("stdlib", p) for p in before] + [("markdown", p) for p in after]


class Server:
    """Serves the stream with the drafter currently published under ``publish_dir``, logging every step."""

    def __init__(self, target, logs: Path, publish_dir: Path, new_tokens: int, budget: int) -> None:
        self.target, self.publish_dir, self.new_tokens, self.budget = target, publish_dir, new_tokens, budget
        self.writer = LogWriter(logs, "sim", vocab_size=target.config.vocab_size)
        self.version, self.drafter = None, None

    def serve(self, i: int, prompt: list[int]) -> tuple[int, int, list[float]]:
        """(tokens, steps, measured step seconds) of one request with the current version."""
        version, path = read_current(self.publish_dir)
        if version != self.version:
            self.version, self.drafter = version, load_drafter(path)
        recorder = StepRecorder(
            self.writer, server="sim", request=f"r{i}", tenant=None, shareable=True, drafter="sim",
            drafter_version=version,
        )  # fmt: skip
        session = make_session(TREE, self.target, self.drafter)
        g = generate(
            self.target, session, BUILDERS[TREE], torch.tensor(prompt), self.new_tokens, self.budget, on_step=recorder
        )
        recorder.finish(prompt, g.tokens)
        self.writer.flush()
        seconds = [sum(s.seconds.values()) for s in g.steps]
        return len(g.tokens), len(g.steps), seconds


def run_policy(name: str, stream, args, target, drafter_dir: Path, step_cost: float) -> dict:
    """Serve the stream under one policy; returns tokens, simulated seconds, τ per request, updates."""
    root = Path(args.out) / name
    logs, publish_dir = root / "logs", root / "drafters"
    config = BanditConfig(horizon_requests=args.horizon, window_steps=args.window)
    logs.mkdir(parents=True, exist_ok=True)
    daemon = BanditDaemon(logs, drafter_dir, publish_dir, root / "state", TARGET, config)
    server = Server(target, logs, publish_dir, args.new_tokens, args.budget)
    full = next(a for a in DEFAULT_ARMS if a.params == "full")
    tokens, clock, updates, rollbacks, update_seconds, taus = 0, 0.0, 0, 0, 0.0, []
    ref, since_update = None, 0
    for i, (phase, prompt) in enumerate(stream):
        n, steps, _ = server.serve(i, prompt)
        tokens += n
        clock += steps * step_cost
        taus.append({"request": i, "phase": phase, "tau": n / steps, "version": server.version})
        since_update += 1
        daemon.read()
        if name == "bandit":
            journal = daemon.state_dir / "decisions.jsonl"
            offset = journal.stat().st_size if journal.exists() else 0
            daemon.decide()
            daemon.commit()
            new = _new_entries(journal, offset)
            spent = sum(e.get("update_seconds", 0.0) for e in new)
            update_seconds += spent
            clock += spent
            updates += sum(e.get("published") is not None for e in new if e["event"] == "decision")
            rollbacks += sum("rolled_back_to" in e for e in new)
            continue
        live = daemon._live(daemon.state["version"])
        if live.full and ref is None:
            ref = live.tau
        due = (name.startswith("every-") and since_update >= int(name.split("-")[1])) or (
            name == "greedy" and live.full and ref is not None and live.tau < ref * (1 - args.greedy_drop)
        )
        if due:
            started = time.perf_counter()
            candidate = daemon.train(full)
            spent = time.perf_counter() - started
            version = publish(publish_dir, candidate.save_pretrained, {"kind": "drafter", "policy": name})
            daemon.drafter, daemon.state["version"] = candidate, version
            update_seconds += spent
            clock += spent
            updates += 1
            since_update = 0
            ref = None if name == "greedy" else ref
        daemon.commit()
    server.writer.close()
    daemon.close()
    return {
        "tokens": tokens,
        "seconds": clock,
        "updates": updates,
        "rollbacks": rollbacks,
        "update_seconds": update_seconds,
        "taus": taus,
    }


def _new_entries(path: Path, offset: int) -> list[dict]:
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        return [json.loads(line) for line in f.read().splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bandit_sim")
    p.add_argument("--before", type=int, default=12, help="stdlib requests before the shift")
    p.add_argument("--after", type=int, default=36, help="Markdown requests after the shift")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--horizon", type=float, default=24.0, help="bandit horizon in requests")
    p.add_argument("--window", type=int, default=48, help="live window in steps")
    p.add_argument("--greedy-drop", type=float, default=0.1, help="greedy rule: update when τ drops this much")
    p.add_argument("--every", default="4,12", help="the two fixed schedules, in requests")
    p.add_argument("--policies", default=None, help="comma-separated subset (default: all)")
    args = p.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(project_path(TARGET)))
    target = load_causal_lm(str(project_path(TARGET)), "float32")
    drafter_dir = out / "treeflash_from_dflash_tiny"
    if not (drafter_dir / "config.json").exists():
        TreeFlashDraftModel.from_dflash(DFlashDraftModel.from_pretrained(str(project_path(BACKBONE)))).save_pretrained(
            drafter_dir
        )
    stream = prompt_stream(tokenizer, args.before, args.after, args.prompt_tokens)

    # Calibration: the median verification-step seconds of this machine, charged to every policy alike.
    calib = Server(target, out / "calibration" / "logs", out / "calibration" / "drafters", args.new_tokens, args.budget)
    (out / "calibration" / "logs").mkdir(parents=True, exist_ok=True)
    if read_current(out / "calibration" / "drafters") is None:
        publish(out / "calibration" / "drafters", load_drafter(drafter_dir).save_pretrained, {"kind": "drafter"})
    measured = [s for i, (_, prompt) in enumerate(stream[:4]) for s in calib.serve(i, prompt)[2]]
    calib.writer.close()
    step_cost = statistics.median(measured)
    print(f"step cost {step_cost * 1000:.1f} ms (median of {len(measured)} measured steps)")

    every = [int(x) for x in args.every.split(",")]
    names = ["never", *[f"every-{n}" for n in every], "greedy", "bandit"]
    if args.policies:
        names = [n for n in names if n in args.policies.split(",")]
    results = {}
    for name in names:
        started = time.perf_counter()
        results[name] = run_policy(name, stream, args, target, drafter_dir, step_cost)
        r = results[name]
        print(f"{name:>9}: {r['tokens']} tokens in {r['seconds']:.1f} simulated s, {r['updates']} updates "
              f"({r['update_seconds']:.1f} s) [{time.perf_counter() - started:.0f} s wall]", flush=True)  # fmt: skip
        (out / "results.json").write_text(json.dumps({"step_cost": step_cost, "results": results}, indent=1))
    report(results, out)


def report(results: dict, out: Path) -> None:
    base = results.get("never")
    print(f"\n{'policy':>9} | tok/sim-s | vs never | updates | rollbacks | τ stdlib | τ markdown")
    for name, r in results.items():
        rate = r["tokens"] / r["seconds"]
        ratio = rate / (base["tokens"] / base["seconds"]) if base else float("nan")
        by_phase = {
            ph: statistics.mean(t["tau"] for t in r["taus"] if t["phase"] == ph) for ph in ("stdlib", "markdown")
        }
        print(f"{name:>9} | {rate:9.2f} | {ratio:7.3f}x | {r['updates']:7d} | {r['rollbacks']:9d} | "
              f"{by_phase['stdlib']:8.2f} | {by_phase['markdown']:10.2f}")  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, r in results.items():
        taus = [t["tau"] for t in r["taus"]]
        smooth = [statistics.mean(taus[max(0, i - 3) : i + 1]) for i in range(len(taus))]
        ax.plot(smooth, label=name)
    shift = next((t["request"] for t in next(iter(results.values()))["taus"] if t["phase"] == "markdown"), None)
    if shift is not None:
        ax.axvline(shift - 0.5, color="grey", linestyle="--", label="shift to Markdown")
    ax.set_xlabel("request")
    ax.set_ylabel("τ (tokens per step, mean of last 4 requests)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "tau.png", dpi=120)
    print(f"τ over time -> {out / 'tau.png'}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
