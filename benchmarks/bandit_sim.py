"""Simulation: when should a served drafter be updated? Never, every N requests, when τ drops, or the bandit.

    OMP_NUM_THREADS=1 python benchmarks/bandit_sim.py --out runs/bandit_sim   # CPU, about 30 minutes

The tiny target (checkpoints/target_tiny) serves the shipped TreeFlash drafter (checkpoints/treeflash_tiny),
both trained on the standard library. The prompt stream starts with held-out standard-library modules
(data/prompts/stdlib_heldout.jsonl) and shifts to windows of the project's own test code (tests/*.py, or its
Markdown with ``--shift markdown``). What is served is the target's own greedy continuation, and on the tests
the target is more confident than on the standard library (mean top-1 probability at the root 0.64 vs 0.50)
while the drafter's τ falls (1.87 vs 2.12 on six prompts each): the drafter lags, the target does not, so an
update can pay. Before the policies run, an oracle check measures that: τ on held-out shifted prompts (never
in the stream) before and after one update of the bandit's ``full`` arm on what never-update served after the
shift. Every policy serves the same stream greedily, logging verifier records that the bandit daemon (and the
fixed schedules' τ trigger) read. The shifted windows are cut from the checkout's tests/, so runs compared with
``--reuse`` must come from the same checkout.

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
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from trainer.adapt.bandit import DEFAULT_ARMS, Arm, BanditConfig
from trainer.adapt.bandit_daemon import BanditDaemon
from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.engine import generate
from trainer.drafters import load_drafter
from trainer.paths import project_path
from trainer.snapshots import publish, read_current
from trainer.target import load_causal_lm
from trainer.vlog.recorder import StepRecorder
from trainer.vlog.writer import LogWriter

TARGET = "checkpoints/target_tiny"
DRAFTER = "checkpoints/treeflash_tiny"
TREE = "treeflash"
# The text the stream shifts to: the project's own files (not third-party packages).
SHIFTS = {"tests": lambda: sorted(project_path("tests").glob("*.py")),
          "markdown": lambda: [project_path("README.md"), *sorted(project_path("docs").glob("*.md"))]}  # fmt: skip


def prompt_stream(
    tokenizer, n_before: int, n_after: int, n_heldout: int, prompt_tokens: int, shift: str
) -> tuple[list[tuple[str, list[int]]], list[list[int]]]:
    """(phase, prompt ids) of the stream: ``n_before`` stdlib prompts, then ``n_after`` windows of the shifted
    text; and ``n_heldout`` other windows of that text for the oracle check (interleaved, never served)."""
    rows = [json.loads(line) for line in project_path("data/prompts/stdlib_heldout.jsonl").read_text().splitlines()]
    before = [tokenizer(r["prompt"])["input_ids"][-prompt_tokens:] for r in rows[:n_before]]
    ids = [tok for path in SHIFTS[shift]() for tok in tokenizer(path.read_text())["input_ids"]]
    n = n_after + n_heldout
    if n * prompt_tokens > len(ids):
        raise SystemExit(
            f"the {shift} text holds {len(ids)} tokens: {len(ids) // prompt_tokens} windows of {prompt_tokens} "
            f"tokens that do not overlap, fewer than --after + --heldout = {n}; ask for fewer or shorter prompts"
        )
    stride = max(prompt_tokens, (len(ids) - prompt_tokens) // max(n, 1))
    windows = [ids[i : i + prompt_tokens] for i in range(0, stride * n, stride)][:n]
    every = max(1, n // max(n_heldout, 1))
    heldout = [w for i, w in enumerate(windows) if i % every == every - 1][:n_heldout]
    after = [w for w in windows if all(w is not h for h in heldout)][:n_after]
    return [("stdlib", p) for p in before] + [(shift, p) for p in after], heldout


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
            self.target,
            session,
            BUILDERS[TREE],
            torch.tensor(prompt),
            self.new_tokens,
            self.budget,
            on_step=recorder,
            step_topk=recorder.k,
        )
        recorder.finish(prompt, g.tokens)
        self.writer.flush()
        seconds = [sum(s.seconds.values()) for s in g.steps]
        return len(g.tokens), len(g.steps), seconds


def run_policy(name: str, stream, args, target, drafter_dir: Path, step_cost: float) -> dict:
    """Serve the stream under one policy; returns tokens, simulated seconds, τ per request, updates."""
    root = Path(args.out) / name
    logs, publish_dir = root / "logs", root / "drafters"
    config = BanditConfig(horizon_requests=args.horizon, window_steps=args.window, shadow_acceptance="greedy")
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
            new = new_entries(journal, offset)
            spent = sum(e.get("update_seconds", 0.0) for e in new)
            update_seconds += spent
            clock += spent
            updates += sum(e.get("published") is not None for e in new if e["event"] == "decision")
            rollbacks += sum("rolled_back_to" in e for e in new)
            continue
        live = daemon._live(daemon.state.version)
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
            daemon.drafter, daemon.state.version = candidate, version
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


def new_entries(path: Path, offset: int) -> list[dict]:
    """The JSON lines appended to ``path`` (a daemon's decisions journal) after byte ``offset``."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        return [json.loads(line) for line in f.read().splitlines() if line.strip()]


def oracle_check(heldout: list[list[int]], args, target, drafter_dir: Path, full: Arm) -> dict:
    """Can an update pay at all? τ on the held-out shifted prompts with the served drafter, then with the
    candidate of one ``full``-arm update trained on never-update's replay (its latest requests: the shift)."""
    root = Path(args.out) / "oracle"
    (root / "logs").mkdir(parents=True, exist_ok=True)
    config = BanditConfig(window_steps=args.window)
    daemon = BanditDaemon(
        Path(args.out) / "never" / "logs", drafter_dir, root / "drafters", root / "state", TARGET, config
    )
    daemon.read()
    started = time.perf_counter()
    candidate = daemon.train(full)
    seconds = time.perf_counter() - started
    daemon.close()
    server = Server(target, root / "logs", root / "drafters", args.new_tokens, args.budget)
    taus = {}
    for label in ("before", "after"):
        if label == "after":
            publish(root / "drafters", candidate.save_pretrained, {"kind": "drafter", "oracle": full.name})
        served = [server.serve(i, prompt)[:2] for i, prompt in enumerate(heldout)]
        taus[label] = sum(n for n, _ in served) / sum(steps for _, steps in served)
    server.writer.close()
    return {"arm": full.name, "seconds": seconds, **taus}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bandit_sim")
    p.add_argument("--shift", choices=sorted(SHIFTS), default="tests", help="the project text the stream shifts to")
    p.add_argument("--before", type=int, default=48, help="stdlib requests before the shift")
    p.add_argument("--after", type=int, default=240, help="shifted requests")
    p.add_argument("--heldout", type=int, default=8, help="held-out shifted prompts of the oracle check")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--horizon", type=float, default=128.0, help="bandit horizon in requests")
    p.add_argument("--window", type=int, default=96, help="live window in steps")
    p.add_argument("--greedy-drop", type=float, default=0.1, help="greedy rule: update when τ drops this much")
    p.add_argument("--every", default="16,64", help="the two fixed schedules, in requests")
    p.add_argument("--policies", default=None, help="comma-separated subset (default: all)")
    p.add_argument("--step-cost", type=float, default=None, help="seconds per step instead of calibrating")
    reuse = "results.json of runs of other policies (`--policies none` runs nothing): shown too, their step cost used"
    p.add_argument("--reuse", type=Path, nargs="*", default=[], help=reuse)
    p.add_argument("--smoke", action="store_true", help="seconds, tiny sizes, no updates: checks that the script runs")
    args = p.parse_args()
    if args.smoke:
        smoke_out = tempfile.TemporaryDirectory()  # removed when main returns
        args.out, args.before, args.after, args.heldout = smoke_out.name, 2, 2, 0
        args.prompt_tokens, args.new_tokens, args.budget, args.policies, args.step_cost = 16, 4, 4, "never,bandit", 0.01
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(project_path(TARGET)))
    target = load_causal_lm(str(project_path(TARGET)), "float32")
    drafter_dir = project_path(DRAFTER)
    stream, heldout = prompt_stream(tokenizer, args.before, args.after, args.heldout, args.prompt_tokens, args.shift)

    reused = {"results": {}, "oracle": None, "step_cost": args.step_cost}
    for path in args.reuse:
        run = json.loads(path.read_text())
        if reused["step_cost"] not in (None, run["step_cost"]):
            raise SystemExit(f"{path} charged {run['step_cost']} s per step, not {reused['step_cost']}")
        reused = {"results": {**reused["results"], **run["results"]}, "oracle": run["oracle"] or reused["oracle"],
                  "step_cost": run["step_cost"]}  # fmt: skip
    step_cost = reused["step_cost"]
    if step_cost is None:
        step_cost = calibrate(stream, args, target, drafter_dir)
    print(f"step cost {step_cost * 1000:.1f} ms")

    every = [int(x) for x in args.every.split(",")]
    names = ["never", *[f"every-{n}" for n in every], "greedy", "bandit"]
    if args.policies:
        names = [n for n in names if n in args.policies.split(",")]
    full = next(a for a in DEFAULT_ARMS if a.params == "full")
    results, oracle = {}, reused["oracle"]
    for name in names:
        started = time.perf_counter()
        results[name] = run_policy(name, stream, args, target, drafter_dir, step_cost)
        r = results[name]
        print(f"{name:>9}: {r['tokens']} tokens in {r['seconds']:.1f} simulated s, {r['updates']} updates "
              f"({r['update_seconds']:.1f} s) [{time.perf_counter() - started:.0f} s wall]", flush=True)  # fmt: skip
        if name == "never" and args.heldout:
            oracle = oracle_check(heldout, args, target, drafter_dir, full)
            shown = f"{oracle['before']:.3f} -> {oracle['after']:.3f}"
            print(f"oracle: τ on {len(heldout)} held-out {args.shift} prompts {shown} after one {full.name} "
                  f"update ({oracle['seconds']:.1f} s)", flush=True)  # fmt: skip
        summary = {"step_cost": step_cost, "shift": args.shift, "oracle": oracle, "results": results}
        (out / "results.json").write_text(json.dumps(summary, indent=1))
    report({**reused["results"], **results}, out, args.shift)


def calibrate(stream, args, target, drafter_dir: Path) -> float:
    """The median verification-step seconds of this machine, charged to every policy alike."""
    out = Path(args.out)
    calib = Server(target, out / "calibration" / "logs", out / "calibration" / "drafters", args.new_tokens, args.budget)
    (out / "calibration" / "logs").mkdir(parents=True, exist_ok=True)
    if read_current(out / "calibration" / "drafters") is None:
        publish(out / "calibration" / "drafters", load_drafter(drafter_dir).save_pretrained, {"kind": "drafter"})
    measured = [s for i, (_, prompt) in enumerate(stream[:4]) for s in calib.serve(i, prompt)[2]]
    calib.writer.close()
    return statistics.median(measured)


def report(results: dict, out: Path, shift: str) -> None:
    base = results.get("never")
    print(f"\n{'policy':>9} | tok/sim-s | vs never | updates | update s | rollbacks | τ stdlib | τ {shift}")
    for name, r in results.items():
        rate = r["tokens"] / r["seconds"]
        ratio = rate / (base["tokens"] / base["seconds"]) if base else float("nan")
        by_phase = {ph: statistics.mean(t["tau"] for t in r["taus"] if t["phase"] == ph) for ph in ("stdlib", shift)}
        print(f"{name:>9} | {rate:9.2f} | {ratio:7.3f}x | {r['updates']:7d} | {r['update_seconds']:8.1f} | "
              f"{r['rollbacks']:9d} | {by_phase['stdlib']:8.3f} | {by_phase[shift]:.3f}")  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, r in results.items():
        taus = [t["tau"] for t in r["taus"]]
        smooth = [statistics.mean(taus[max(0, i - 7) : i + 1]) for i in range(len(taus))]
        ax.plot(smooth, label=name, linewidth=1.2)
    shift_at = next((t["request"] for t in next(iter(results.values()))["taus"] if t["phase"] == shift), None)
    if shift_at is not None:
        ax.axvline(shift_at - 0.5, color="grey", linestyle="--", label=f"shift to {shift}")
    ax.set_xlabel("request")
    ax.set_ylabel("τ (tokens per step, mean of last 8 requests)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tau.png", dpi=100)
    print(f"τ over time -> {out / 'tau.png'}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
