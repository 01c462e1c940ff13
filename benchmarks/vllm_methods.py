"""Side by side in one vLLM: every way this toolkit drafts inside vLLM, beside vLLM's own methods, on one stream
that shifts domain.

The stream (``closed_loop.prompts``): held-out stdlib prompts (the tiny target's own domain), then the source of
third-party packages (out of its domain), then stdlib again; sent in windows of ``--window`` requests, each window
one ``generate`` batch. Every method is served by a fresh vLLM process with the same settings (the shipped tiny
target, fp32, greedy, eager, no async scheduling, no prefix caching (SpecBlock's features and the graft proposer's
prompt evidence need every prompt position computed), the same ``max_model_len`` and KV cache, the plugin logging
every step):

- ``plain``: no speculation (served first and again last: the two runs' wall times bound the process-to-process
  spread on this machine);
- ``ngram`` (prompt lookup, 2..4-grams) and ``suffix`` (suffix decoding, ``arctic-inference``): vLLM's own
  drafter-free methods, ``--depth`` tokens;
- ``eagle3``, ``dflash``, ``treeflash``, ``specblock``: the shipped tiny drafters, exported in the layout vLLM
  loads (speculators, dflash, treeflash, specblock); EAGLE-3 and SpecBlock draft ``--drafter-depth`` tokens, the
  block drafters their block less the root;
- ``graft``: the graft proposer (``custom_class``, trainer/integrations/vllm/graft.py) learning online, beside
  ``trainer adapt graft`` reading vLLM's log and publishing adjacency versions that vLLM switches in;
- ``graft-frozen``, the control: the same proposer serving the version ``graft`` had in use when the shift began,
  learning nothing.

Reported per method: τ per window (vLLM's own counters: accepted drafts per drafting step + 1), drafter forwards
per engine step that drafts (a forward hook on the drafter module over the proposer's calls; every call drafts
all the step's requests at once), wall time as a ratio to the first plain run, and whether every output equals plain
decoding's. Writes ``OUT/methods.md`` and ``OUT/methods.json``. In the main environment, with vLLM's at
``.venv-vllm`` (``.ci/vllm_env``); about 15 minutes on 2 cores::

    OMP_NUM_THREADS=1 python benchmarks/vllm_methods.py --out runs/vllm-methods
    OMP_NUM_THREADS=1 python benchmarks/vllm_methods.py --out /tmp/m --smoke   # seconds per method, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from closed_loop import prompts
from transformers import AutoTokenizer

from trainer.drafters import load_drafter
from trainer.export import write_export
from trainer.integrations.vllm.parity import chain_length
from trainer.paths import project_path
from trainer.serve.process import python_process
from trainer.snapshots import publish, read_current

ROOT = Path(__file__).resolve().parents[1]
TARGET = project_path("checkpoints/target_tiny")
ADAPT = "import sys; from trainer.adapt.cli import main; main(sys.argv[1:])"
# Drafter methods: (checkpoint, export layout, vLLM method).
DRAFTERS = {
    "eagle3": ("checkpoints/eagle3_tiny", "speculators", "eagle3"),
    "dflash": ("checkpoints/dflash_tiny", "dflash", "dflash"),
    "treeflash": ("checkpoints/treeflash_tiny", "treeflash", "dflash"),
    "specblock": ("checkpoints/specblock_tiny", "specblock", "eagle3"),
}
GRAFT = "trainer.integrations.vllm.graft.GraftProposer"
WARM_UP = "def warm_up(values):\n    total = 0\n    for value in values:\n        total += value\n    return total\n"
METHODS = ("plain", "ngram", "suffix", *DRAFTERS, "graft", "graft-frozen", "plain-again")

# One vLLM process: the stream window by window; at the shift (``shift``), for the graft proposer, the version in
# use is reported (waiting for the daemon's first one) and, when ``freeze``, learning stops.
CHILD = """
import json, sys, time
import torch
from vllm import LLM, SamplingParams
from trainer.snapshots import read_current
cfg = json.loads(sys.argv[1])
llm = LLM(cfg["target"], dtype="float32", enforce_eager=True, async_scheduling=False,
          max_model_len=cfg["max_model_len"], seed=0, kv_cache_memory_bytes=1 << 28, disable_log_stats=False,
          enable_prefix_caching=False, speculative_config=cfg["spec"])
from trainer.integrations.vllm import hooks
plugin = hooks._installed
params = SamplingParams(max_tokens=cfg["max_tokens"], temperature=0, ignore_eos=True)
tiny = SamplingParams(max_tokens=2, temperature=0)
# Warm-up: a prompt outside the stream, long enough that every proposer drafts (vLLM's n-gram matcher compiles on
# its first use).
llm.generate([{"prompt_token_ids": cfg["warm_up"]}], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
             use_tqdm=False)

def counters():
    found = {m.name: m for m in llm.get_metrics()}
    names = ("drafts", "draft_tokens", "accepted_tokens")
    return [int(getattr(found.get(f"vllm:spec_decode_num_{n}"), "value", 0) or 0) for n in names]

def count_drafting(worker):
    # The drafter module's forwards (SpecBlock's proposer holds our drafter as ``model.drafter``) and the proposer's
    # calls (one per engine step that drafts).
    drafter = worker.model_runner.drafter
    model = getattr(drafter, "model", None)
    if not isinstance(model, torch.nn.Module):
        return False
    drafter.bench = {"forwards": 0, "calls": 0}
    getattr(model, "drafter", model).register_forward_hook(lambda *a: drafter.bench.__setitem__(
        "forwards", drafter.bench["forwards"] + 1))
    propose = drafter.propose
    def counted(*args, **kwargs):
        drafter.bench["calls"] += 1
        return propose(*args, **kwargs)
    drafter.propose = counted
    return True

counting = cfg["spec"] is not None and llm.collective_rpc(count_drafting)[0]

def drafter_forwards():
    if not counting:
        return None
    bench = llm.collective_rpc(lambda worker: worker.model_runner.drafter.bench)[0]
    return bench["forwards"], bench["calls"]

out = {"windows": [], "outputs": [], "version_at_shift": None}
for i, window in enumerate(cfg["windows"]):
    graft = plugin.graft if plugin is not None else None
    if i == cfg["shift"] and graft is not None:
        # The daemon's next version after the log so far is on disk holds the first phase (the graft run); the
        # control waits for its one version.
        floor = -1
        if cfg["fresh"]:
            plugin.writer.flush()
            current = read_current(graft.watch)
            floor = -1 if current is None else current[0]
        deadline = time.monotonic() + 120
        while (graft.version is None or graft.version <= floor) and time.monotonic() < deadline:
            llm.generate([{"prompt_token_ids": [7, 7, 7]}], tiny, use_tqdm=False)
            time.sleep(0.2)
        out["version_at_shift"] = graft.version
    before, forwards = counters(), drafter_forwards()
    start = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in window], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after, forwards_after = counters(), drafter_forwards()
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before))
    counted = forwards is not None
    out["windows"].append({"seconds": seconds, "drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
                           "forwards": forwards_after[0] - forwards[0] if counted else None,
                           "proposer_calls": forwards_after[1] - forwards[1] if counted else None,
                           "version": None if graft is None else graft.version})
    out["outputs"] += [list(r.outputs[0].token_ids) for r in results]
out["errors"] = {} if plugin is None else dict(plugin.errors)
print("RESULT " + json.dumps(out), flush=True)
"""


def speculative(method: str, out: Path, depth: int, drafter_depth: int) -> dict | None:
    """vLLM's ``speculative_config`` of ``method`` (exporting its drafter under ``out``)."""
    if method.startswith("plain"):
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": depth, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": depth}
    if method.startswith("graft"):
        return {"method": "custom_class", "model": GRAFT, "num_speculative_tokens": depth}
    checkpoint, layout, vllm_method = DRAFTERS[method]
    source = load_drafter(str(project_path(checkpoint)))
    export = write_export(source, layout, out / "exports" / method, str(TARGET))
    tokens = chain_length(source, drafter_depth if vllm_method == "eagle3" else None)
    return {"method": vllm_method, "model": str(export), "num_speculative_tokens": tokens}


def serve(method: str, cfg: dict, out: Path, logs: Path, python: str, env: dict[str, str]) -> dict:
    """One fresh vLLM process serving the stream, its verifier log in ``logs``; its result (``CHILD``)."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRAINER_VLLM_LOG_DIR": str(logs), "TRAINER_VLLM_LOG_PREFIX": method, **env}  # fmt: skip
    with open(out / f"{method}.log", "w") as log:
        run = subprocess.run([python, "-c", CHILD, json.dumps(cfg)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=log, text=True, check=False)  # fmt: skip
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode or not lines:
        raise SystemExit(f"{method}: vLLM exited with {run.returncode}; see {out / f'{method}.log'}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def freeze(source: Path, version: int, frozen: Path) -> None:
    """Publish ``source``'s ``version`` as the control's only version."""
    shutil.rmtree(frozen, ignore_errors=True)
    directory = source / f"v{version:06d}"
    publish(frozen, lambda d: [shutil.copy(f, d / f.name) for f in directory.iterdir() if f.name != "manifest.json"],
            {"kind": "adjacency", "frozen_from": version})  # fmt: skip


def tau(window: dict) -> float:
    return 1.0 + window["accepted"] / window["drafts"] if window["drafts"] else 1.0


def report(results: dict[str, dict], domains: list[str], shift: int, out: Path, command: str) -> str:
    plain = results["plain"]
    base = sum(w["seconds"] for w in plain["windows"])
    columns = [f"w{i} {d}" for i, d in enumerate(domains)]
    tail = "τ after shift | wall / plain | drafter forwards / engine step | lossless"
    header = f"| method | {' | '.join(columns)} | {tail} |"
    lines = [f"Command: `{command}`", "", header, "|---" * (len(domains) + 5) + "|"]
    for method, result in results.items():
        windows = result["windows"]
        after = windows[shift:]
        drafts = sum(w["drafts"] for w in after)
        after_tau = 1.0 + sum(w["accepted"] for w in after) / drafts if drafts else 1.0
        counted = [w for w in windows if w["forwards"] is not None]
        calls = sum(w["proposer_calls"] for w in counted)
        per_step = f"{sum(w['forwards'] for w in counted) / calls:.2f}" if counted and calls else "–"
        wall = sum(w["seconds"] for w in windows) / base
        lossless = "yes" if result["outputs"] == plain["outputs"] else "NO"
        cells = " | ".join(f"{tau(w):.2f}" for w in windows)
        lines.append(f"| {method} | {cells} | {after_tau:.3f} | {wall:.2f} | {per_step} | {lossless} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--window", type=int, default=4, help="requests per window (one batch)")
    parser.add_argument("--windows", type=int, nargs=3, default=(2, 4, 2), metavar=("STDLIB", "FOREIGN", "AGAIN"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=8, help="tokens drafted by ngram, suffix and graft")
    parser.add_argument("--drafter-depth", type=int, default=8, help="EAGLE-3's and SpecBlock's chain")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--smoke", action="store_true", help="one request per window, 8 tokens, windows 1 1 1")
    args = parser.parse_args()
    if args.smoke:
        args.window, args.windows, args.max_tokens = 1, (1, 1, 1), 8
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stdlib, foreign, again = args.windows
    n = args.window
    stream = prompts(n * max(stdlib + again, foreign))
    tok = AutoTokenizer.from_pretrained(TARGET)
    texts = {"stdlib": stream["stdlib"], "foreign": stream["foreign"]}
    order = ["stdlib"] * stdlib + ["foreign"] * foreign + ["stdlib"] * again
    used = {"stdlib": 0, "foreign": 0}
    windows = []
    for domain in order:
        batch = texts[domain][used[domain] : used[domain] + n]
        used[domain] += n
        windows.append([tok(t, add_special_tokens=False)["input_ids"] for t in batch])
    warm_up = tok(WARM_UP, add_special_tokens=False)["input_ids"]
    longest = max(len(p) for w in windows for p in w)
    max_model_len = max(512, 2 * (longest + args.max_tokens + args.depth + 1))
    results: dict[str, dict] = {}
    version_at_shift = None
    for method in args.methods:
        cfg = {"target": str(TARGET), "windows": windows, "shift": stdlib, "max_tokens": args.max_tokens,
               "max_model_len": max_model_len, "fresh": method == "graft", "warm_up": warm_up,
               "spec": speculative(method, out, args.depth, args.drafter_depth)}  # fmt: skip
        env: dict[str, str] = {}
        daemon = None
        logs = out / "logs" / method
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir(parents=True)
        if method == "graft":
            publish_dir = out / "adjacency"
            shutil.rmtree(publish_dir, ignore_errors=True)
            shutil.rmtree(out / "graft-state", ignore_errors=True)
            env = {"TRAINER_VLLM_WATCH": str(publish_dir), "TRAINER_VLLM_POLL_SECONDS": "0.2"}
            daemon = python_process(ADAPT, ["graft", "--logs", str(logs), "--target", str(TARGET),
                                            "--publish", str(publish_dir), "--state", str(out / "graft-state"),
                                            "--publish-seconds", "1", "--commit-seconds", "1", "--poll-seconds", "0.2",
                                            "--keep", "100000"],
                                    log=out / "graft-daemon.log")  # fmt: skip
        elif method == "graft-frozen":
            if version_at_shift is None:
                raise SystemExit("graft-frozen needs the graft run before it (the version it had at the shift)")
            freeze(out / "adjacency", version_at_shift, out / "adjacency-frozen")
            env = {"TRAINER_VLLM_WATCH": str(out / "adjacency-frozen"), "TRAINER_VLLM_GRAFT_LEARN": "0",
                   "TRAINER_VLLM_POLL_SECONDS": "0.2"}  # fmt: skip
            cfg["shift"] = 0  # wait for the frozen version before the first window
        start = time.time()
        try:
            results[method] = serve(method, cfg, out, logs, args.vllm_python, env)
        finally:
            if daemon is not None:
                daemon.send_signal(signal.SIGTERM)
                daemon.wait(timeout=120)
        if daemon is not None and daemon.returncode:
            raise SystemExit(f"the graft daemon exited with {daemon.returncode}; see {out / 'graft-daemon.log'}")
        if method == "graft":
            version_at_shift = results[method]["version_at_shift"]
            if version_at_shift is None:
                raise SystemExit(f"vLLM loaded no adjacency version by the shift; see {out / 'graft-daemon.log'}")
            current = read_current(out / "adjacency")
            results[method]["versions_published"] = None if current is None else current[0]
        taus = [f"{tau(w):.2f}" for w in results[method]["windows"]]
        print(f"{method}: τ per window {' '.join(taus)}; {time.time() - start:.0f} s; errors "
              f"{results[method]['errors']}", flush=True)  # fmt: skip
    command = "python benchmarks/vllm_methods.py " + " ".join(sys.argv[1:])
    table = report(results, order, stdlib, out, command)
    (out / "methods.md").write_text(table)
    (out / "methods.json").write_text(json.dumps(results, indent=1))
    print(table)
    if "graft" in results and "graft-frozen" in results:
        ratio = statistics.fmean(tau(w) for w in results["graft"]["windows"][stdlib:]) / statistics.fmean(
            tau(w) for w in results["graft-frozen"]["windows"][stdlib:]
        )
        print(f"graft / graft-frozen, mean window τ after the shift: {ratio:.3f}")


if __name__ == "__main__":
    main()
