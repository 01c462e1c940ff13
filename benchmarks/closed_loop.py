"""The closed adaptation loop end to end: serve, log, adapt, publish, hot-reload, and τ over time.

Starts ``trainer serve`` with the shipped DFlash drafter under Graft's hybrid tree (``graft-dflash`` at a fixed
budget: the drafter's tree, pruned, grafted from the shared adjacency; verifier logs to ``OUT/loop/logs``;
watching ``OUT/loop/publish`` and ``OUT/loop/drafters``), ``trainer adapt graft`` (reading the logs, publishing
adjacency snapshots to ``publish``; output in ``OUT/loop/daemon.log``) and ``trainer adapt bandit`` (reading the
same logs, publishing drafter versions to ``drafters`` when an update pays; output in ``OUT/loop/bandit.log``,
its decisions in ``OUT/loop/bandit-state/decisions.jsonl``), then sends a prompt stream that shifts domain:
held-out stdlib code (the tiny target's own domain), then the source of third-party packages installed next to
it (never in its training data). Afterwards all processes are stopped and τ per request is read back from the
verifier log (mean accepted drafts + 1 over the request's steps), with the adjacency and drafter versions the
server had loaded when each request ended (requests are sent one at a time). Then the same stream is served
again by a server alone (``OUT/control``: the shipped drafter and the server's own online adjacency, no
daemon): the outputs are the same (lossless, same seeds), so the τ columns differ only by what the daemons'
snapshots added. ``--drafter none`` serves drafter-free recycling with the graft daemon alone (τ then measures
the adjacency alone). ``--tree auto`` serves as the README's deployment setup does (the server's default: the
controller chooses plain decoding, recycling or the drafter's DDTree every step). Writes ``OUT/loop.md`` (the
table), ``OUT/loop.json`` and ``OUT/loop.png``::

    python benchmarks/closed_loop.py --out runs/loop [--requests 40] [--max-tokens 48] [--drafter none] [--tree auto]

``--engine vllm`` serves with vLLM's server instead (its own environment, ``.ci/vllm_env``; ``--vllm-python``):
the shipped EAGLE-3 drafter in the speculators layout, the plugin writing the verifier log and hot-loading the
bandit's versions; the drafter version of each request is read from its step records (the version that drafted
them). The graft daemon reads the same logs and publishes, which a drafter's proposer does not read, so the
report's adjacency column stays 0 and its note says so. ``--bandit-options`` passes the bandit daemon's
decision options (a long horizon makes its updates pay on this CPU; a short stream needs a larger exploration
share), so that an updated version is trained, published and hot-loaded::

    python benchmarks/closed_loop.py --out runs/loop-vllm --engine vllm --vllm-python .venv-vllm/bin/python \\
        --requests 20 --bandit-options '--horizon-requests 100000 --alpha 1'

``--engine vllm --drafter none`` serves vLLM's graft proposer instead (trainer/integrations/vllm/graft.py,
8-token chains from the adjacency, learning online): the graft daemon alone reads the log and vLLM switches its
versions in, the adjacency column names the version that drafted each request, and the control is the proposer
learning online without the daemon::

    python benchmarks/closed_loop.py --out runs/loop-vllm-graft --engine vllm --vllm-python .venv-vllm/bin/python \\
        --drafter none --requests 20 --temperature 0
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shlex
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from trainer.adapt.bandit import SKIP
from trainer.adapt.bandit_daemon import DECISIONS
from trainer.drafters import load_drafter
from trainer.drafters.families import family_of
from trainer.export import write_export
from trainer.integrations.vllm.parity import chain_length, method_of
from trainer.integrations.vllm.process import VllmServer
from trainer.paths import project_path
from trainer.serve.process import ServerProcess, python_process
from trainer.snapshots import read_current
from trainer.vlog.schema import validate

_ADAPT = "import sys; from trainer.adapt.cli import main; main(sys.argv[1:])"
DRAFTER = "checkpoints/dflash_tiny"
TARGET = "checkpoints/target_tiny"
# vLLM verifies chains; EAGLE-3 is the family whose vLLM chain drafts accept most on the tiny target.
VLLM_DRAFTER = "checkpoints/eagle3_tiny"
# vLLM's graft proposer (``--engine vllm --drafter none``) and the chain it drafts.
GRAFT = "trainer.integrations.vllm.graft.GraftProposer"
GRAFT_DEPTH = 8
# Third-party packages the toolkit depends on: their source is out of the tiny target's domain.
FOREIGN = ("httpx", "fastapi", "pydantic", "openai", "starlette", "uvicorn")


@dataclass
class Served:
    index: int
    domain: str
    request: str
    tau: float
    steps: int
    # Output tokens from its request record (0: none logged); a request whose first token (from prefill)
    # ends it has no verification steps.
    tokens: int
    # The published adjacency and drafter versions loaded when the request ended (0: none yet).
    version: int
    drafter_version: int = 0


def prompts(n: int, seed: int = 0) -> dict[str, list[str]]:
    """``n`` code prefixes per domain: ``stdlib`` (held-out modules) and ``foreign`` (installed packages)."""
    rng = random.Random(seed)
    lines = project_path("data/prompts/stdlib_heldout.jsonl").read_text().splitlines()
    stdlib = [json.loads(line)["prompt"][-600:] for line in lines if line.strip()]
    files = []
    for name in FOREIGN:
        module = __import__(name)
        files += sorted(Path(module.__file__).parent.rglob("*.py"))
    foreign = []
    for path in rng.sample(files, min(len(files), 4 * n)):
        text = path.read_text(errors="replace")
        if len(text) > 1000:
            cut = rng.randrange(600, len(text) - 200)
            foreign.append(text[cut - 600 : cut])
    return {"stdlib": [rng.choice(stdlib) for _ in range(n)], "foreign": foreign[:n]}


def wait_for_versions(server: ServerProcess, metrics: list[str], deadline: float) -> None:
    """Before the domain shift: wait until every daemon's first snapshot is in use (the graft daemon has read the
    stdlib phase; the bandit daemon has published the drafter it starts from)."""
    while min(server.metrics(*metrics)) < 1:
        if time.time() > deadline:
            raise RuntimeError(f"{metrics}: a daemon's first version was not loaded within 120 s")
        time.sleep(0.5)


def wait_for_publications(directories: list[Path], deadline: float) -> None:
    """The same wait beside vLLM, which has no gauge of ours: every daemon has published its first snapshot (vLLM's
    plugin swaps a published drafter in at its next step; which version drafted a step is in its step record)."""
    while any(read_current(d) is None for d in directories):
        if time.time() > deadline:
            raise RuntimeError(f"{directories}: a daemon published nothing within 120 s")
        time.sleep(0.5)


def wait_for_records(logs: Path, requests: list[str], deadline: float) -> None:
    """Before vLLM stops: its worker writes the log on a thread of its own and ends without exit handlers, so the
    last records must be on disk first (each request's record follows its last step record)."""
    while True:
        done = {r["request"].rsplit("-", 2)[0] for r in log_records(logs) if r["kind"] == "request"}
        if done >= set(requests):
            return
        if time.time() > deadline:
            raise RuntimeError(f"no request record of {sorted(set(requests) - done)[:3]} in {logs}")
        time.sleep(0.5)


def start_vllm(out: Path, python: str, drafter: str | None, logs: Path, watch: Path | None) -> VllmServer:
    """vLLM's server with the plugin: it serves ``drafter`` exported in the layout vLLM loads (EAGLE-3:
    speculators; DFlash: dflash; TreeFlash: treeflash, its chain), logs to ``logs`` and hot-loads the versions
    published to ``watch``; with ``drafter`` None, the graft proposer drafting :data:`GRAFT_DEPTH` tokens from
    the adjacency versions published to ``watch``, learning online."""
    plugin = {"TRAINER_VLLM_LOG_DIR": str(logs), "TRAINER_VLLM_LOG_PREFIX": "loop", "TRAINER_VLLM_POLL_SECONDS": "0.2"}
    if watch is not None:
        plugin["TRAINER_VLLM_WATCH"] = str(watch)
    if drafter is None:
        speculative = {"model": GRAFT, "method": "custom_class", "num_speculative_tokens": GRAFT_DEPTH}
    else:
        source = load_drafter(drafter)
        layout = {"eagle3": "speculators", "dflash": "dflash", "treeflash": "treeflash"}[family_of(source).name]
        served = write_export(source, layout, out / "export", str(project_path(TARGET)))
        speculative = {"model": str(served), "method": method_of(source),
                       "num_speculative_tokens": chain_length(source, None)}  # fmt: skip
    return VllmServer(python, project_path(TARGET), speculative, plugin, "target_tiny", log=out / "vllm.log")


def run_loop(
    out: Path,
    requests: int,
    max_tokens: int,
    temperature: float,
    publish_seconds: float,
    adapt: bool = True,
    drafter: str | None = DRAFTER,
    tree: str = "graft-dflash",
    vllm_python: str | None = None,
    bandit_options: tuple[str, ...] = (),
    foreign: int | None = None,
) -> list[Served]:
    """Serve ``requests`` stdlib prompts, wait for the daemons' first snapshots, then serve ``foreign`` (default
    ``2 * requests``)
    foreign ones. Without ``adapt``: the same stream with no daemon (the server's own online learning only).
    ``drafter`` None: drafter-free recycling and no bandit daemon. ``tree`` "auto": the server's default, the
    cost-aware controller choosing plain decoding, recycling or the drafter's DDTree every step (the README's
    deployment setup). ``vllm_python``: vLLM's server (that environment's Python) serves ``drafter`` instead of
    ``trainer serve``, with the plugin logging and hot-loading the bandit's versions (``drafter`` None: the graft
    proposer, switching in the graft daemon's versions). ``bandit_options``: extra arguments of
    ``trainer adapt bandit``."""
    logs, publish_dir, drafters = out / "logs", out / "publish", out / "drafters"
    publish_dir.mkdir(parents=True, exist_ok=True)
    if drafter is not None:
        drafters.mkdir(exist_ok=True)
    foreign = 2 * requests if foreign is None else foreign
    stream = prompts(max(requests, foreign))
    order = [("stdlib", p) for p in stream["stdlib"][:requests]] + [("foreign", p) for p in stream["foreign"][:foreign]]
    if drafter is None:
        serving = ["--drafter", "none", "--tree", "recycling"]
    else:
        serving = ["--drafter", drafter] + ([] if tree == "auto" else ["--tree", tree])
    watch = ["--watch", str(publish_dir)] + (["--watch", str(drafters)] if drafter is not None else [])
    server: ServerProcess | VllmServer
    if vllm_python is None:
        server = ServerProcess(
            [*serving, "--budget", "16", "--logs", str(logs), "--log-prefix", "loop", *(watch if adapt else [])]
        )
    else:
        watch = (publish_dir if drafter is None else drafters) if adapt else None
        server = start_vllm(out, vllm_python, drafter, logs, watch)
    target = str(project_path(TARGET))
    # Per daemon: its output file and the server's gauge of the version it published.
    files = {"graft": (out / "daemon.log", "trainer_adjacency_version")}
    if drafter is not None:
        files["bandit"] = (out / "bandit.log", "trainer_drafter_version")
    arguments = {
        "graft": ["--publish", str(publish_dir), "--publish-seconds", str(publish_seconds), "--commit-seconds", "1",
                  "--poll-seconds", "0.2"],
        "bandit": ["--drafter", str(drafter), "--publish", str(drafters), "--state", str(out / "bandit-state"),
                   "--poll-seconds", "0.5", *bandit_options],
    }  # fmt: skip
    daemons = {
        name: python_process(_ADAPT, [name, "--logs", str(logs), "--target", target, *arguments[name]], log=log)
        for name, (log, _) in files.items()
        if adapt
    }
    sent: list[tuple[str, str, int, int]] = []
    try:
        with httpx.Client(timeout=300) as http:
            for i, (domain, prompt) in enumerate(order):
                if i == requests and adapt:
                    if vllm_python is None:
                        wait_for_versions(server, [gauge for _, gauge in files.values()], time.time() + 120)
                    else:
                        wait_for_publications([publish_dir] + ([drafters] if drafter else []), time.time() + 120)
                body = {"model": "target_tiny", "prompt": prompt, "max_tokens": max_tokens,
                        "temperature": temperature, "seed": i}  # fmt: skip
                if vllm_python is not None:
                    body["vllm_xargs"] = {"tenant": domain, "shareable": 1}
                response = http.post(f"{server.url}/v1/completions", json=body)
                if response.status_code != 200:
                    raise RuntimeError(f"request {i} failed: {response.status_code} {response.text}")
                if vllm_python is None:
                    adjacency, drafter_version = server.metrics("trainer_adjacency_version", "trainer_drafter_version")
                else:
                    # The versions that drafted the request come from its step records below.
                    adjacency, drafter_version = 0, 0
                sent.append((domain, response.json()["id"], int(adjacency), int(drafter_version)))
        if vllm_python is not None:
            wait_for_records(logs, [rid for _, rid, _, _ in sent], time.time() + 60)
    finally:
        server.stop()
        for daemon in daemons.values():
            daemon.send_signal(signal.SIGTERM)
        for daemon in daemons.values():
            daemon.wait(timeout=120)
    for name, daemon in daemons.items():
        if daemon.returncode != 0:
            output = files[name][0].read_text()[-2000:]
            raise RuntimeError(f"the {name} daemon exited with {daemon.returncode}; the end of its output:\n{output}")
    steps: dict[str, list[dict]] = {}
    outputs: dict[str, int] = {}
    for record in log_records(logs):
        if record["kind"] == "step":
            steps.setdefault(record["request"], []).append(record)
        else:
            outputs[record["request"]] = len(record["output_ids"])
    served = []
    for i, (domain, rid, adjacency, drafter_version) in enumerate(sent):
        # vLLM's request ids in the log carry a suffix per sequence: "<completion id>-<n>-<hash>".
        key = rid if vllm_python is None else next((r for r in outputs if r.startswith(f"{rid}-")), rid)
        mine = steps.get(key, [])
        if vllm_python is not None:
            drafter_version = max((r["drafter_version"] or 0 for r in mine), default=0)
            adjacency = max((r.get("adjacency_version") or 0 for r in mine), default=0)
        tau = sum(len(r["accepted"]) + 1 for r in mine) / max(len(mine), 1)
        served.append(Served(i, domain, rid, tau, len(mine), outputs.get(key, 0), adjacency, drafter_version))
    return served


def log_records(logs: Path) -> list[dict]:
    """Every record of the verifier log, each through the validator; a segment a server left unfinished
    (``.part``: vLLM's worker ends without exit handlers) counts with its finished lines."""
    records = []
    for segment in sorted(logs.glob("*.jsonl*")):
        text = segment.read_text()
        if segment.suffix == ".part":
            text = text[: text.rfind("\n") + 1]
        records += [validate(json.loads(line)) for line in text.splitlines()]
    return records


def bandit_decisions(out: Path) -> list[dict]:
    """The bandit daemon's decisions in a loop's directory (``event`` "decision"; empty without the daemon)."""
    path = out / "bandit-state" / DECISIONS
    if not path.is_file():
        return []
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e for e in entries if e.get("event") == "decision"]


def windows(served: list[Served], size: int) -> list[dict]:
    """τ per window of at most ``size`` consecutive requests of one domain (steps-weighted); a window never spans
    the shift, so every request is in one."""
    chunks: list[list[Served]] = []
    for s in served:
        if not chunks or len(chunks[-1]) == size or chunks[-1][0].domain != s.domain:
            chunks.append([])
        chunks[-1].append(s)
    rows = []
    for chunk in chunks:
        steps = sum(s.steps for s in chunk)
        rows.append({
            "requests": f"{chunk[0].index}-{chunk[-1].index}",
            "domain": chunk[0].domain,
            "versions": sorted({s.version for s in chunk}),
            "drafter_versions": sorted({s.drafter_version for s in chunk}),
            "tau": sum(s.tau * s.steps for s in chunk) / max(steps, 1),
        })  # fmt: skip
    return rows


def write_report(
    out: Path, served: list[Served], size: int, control: list[Served] | None = None, note: str | None = None
) -> list[dict]:
    """``loop.md``, ``loop.json`` and ``loop.png``; with ``control`` (the same stream served without the
    daemons), its τ per window beside the loop's; ``note`` is printed under the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = windows(served, size)
    if control is not None:
        for row, other in zip(rows, windows(control, size), strict=True):
            row["tau_without_daemons"] = other["tau"]
    lines = [
        "| requests | domain | adjacency versions | drafter versions | τ | τ without daemons |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        without = f"{r['tau_without_daemons']:.3f}" if "tau_without_daemons" in r else ""
        cells = [r["requests"], r["domain"], r["versions"], r["drafter_versions"], f"{r['tau']:.3f}", without]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    if note:
        lines += ["", note]
    (out / "loop.md").write_text("\n".join(lines) + "\n")
    record = {"requests": [asdict(s) for s in served], "windows": rows, "note": note}
    (out / "loop.json").write_text(json.dumps(record, indent=1))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for domain, color in (("stdlib", "tab:blue"), ("foreign", "tab:orange")):
        mine = [s for s in served if s.domain == domain and s.steps]
        ax.plot([s.index for s in mine], [s.tau for s in mine], ".", color=color, alpha=0.5, label=domain)
    centers = [sum(map(int, r["requests"].split("-"))) / 2 for r in rows]
    ax.plot(centers, [r["tau"] for r in rows], "k-", label=f"τ per {size} requests")
    if control is not None:
        ax.plot(centers, [r["tau_without_daemons"] for r in rows], "k--", label="the same without the daemons")
    changes = [
        s.index
        for prev, s in itertools.pairwise(served)
        if (s.version, s.drafter_version) != (prev.version, prev.drafter_version)
    ]
    for x in changes:
        ax.axvline(x, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("request (dotted: a newly published adjacency or drafter in use)")
    ax.set_ylabel("τ (tokens per verification)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out / "loop.png", dpi=120)
    plt.close(fig)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--requests", type=int, default=40, help="stdlib requests")
    p.add_argument("--foreign", type=int, default=None, help="foreign requests that follow (default: 2 x --requests)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--publish-seconds", type=float, default=5.0)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--drafter", default=None, help=f"the served drafter the bandit updates (default {DRAFTER}; "
                   f"vLLM: {VLLM_DRAFTER}); 'none': recycling alone")  # fmt: skip
    p.add_argument("--tree", default="graft-dflash", help="the server's --tree: graft-dflash, or auto (the controller)")
    p.add_argument("--engine", choices=("trainer", "vllm"), default="trainer", help="trainer serve, or vLLM's server")
    p.add_argument("--vllm-python", default=os.environ.get("TRAINER_VLLM_PYTHON"),
                   help="vLLM's environment's Python (.ci/vllm_env; default $TRAINER_VLLM_PYTHON)")  # fmt: skip
    p.add_argument("--bandit-options", default="", help="extra arguments of trainer adapt bandit, e.g. "
                   "'--horizon-requests 100000 --alpha 1': a long horizon makes an update pay, and a short "
                   "stream has served too few tokens for the default exploration budget")  # fmt: skip
    p.add_argument("--no-control", action="store_true", help="skip serving the stream again without the daemons")
    args = p.parse_args()
    start = time.time()
    vllm_python = None
    if args.engine == "vllm":
        if not args.vllm_python:
            p.error("--engine vllm needs --vllm-python or TRAINER_VLLM_PYTHON (vLLM's environment, .ci/vllm_env)")
        vllm_python = args.vllm_python
    default = VLLM_DRAFTER if vllm_python else DRAFTER
    drafter = None if args.drafter == "none" else (args.drafter or default)
    bandit = tuple(shlex.split(args.bandit_options))
    run = (args.requests, args.max_tokens, args.temperature, args.publish_seconds)
    served = run_loop(args.out / "loop", *run, drafter=drafter, tree=args.tree, vllm_python=vllm_python,
                      bandit_options=bandit, foreign=args.foreign)  # fmt: skip
    control = None
    if not args.no_control:
        control = run_loop(args.out / "control", *run, adapt=False, drafter=drafter, tree=args.tree,
                           vllm_python=vllm_python, foreign=args.foreign)  # fmt: skip
    note = None
    if vllm_python and drafter is not None:
        published = read_current(args.out / "loop" / "publish")
        note = (f"vLLM served {drafter} with the plugin; the graft daemon read the same logs and published adjacency "
                f"version {published[0] if published else 0}, which a drafter's proposer does not read (`--drafter "
                "none` serves the graft proposer): the adjacency column stays 0.")  # fmt: skip
    rows = write_report(args.out, served, args.window, control, note)
    print((args.out / "loop.md").read_text())
    foreign = [r for r in rows if r["domain"] == "foreign"]
    print(f"foreign τ: first window {foreign[0]['tau']:.3f} (versions {foreign[0]['versions']}, drafter "
          f"{foreign[0]['drafter_versions']}), last {foreign[-1]['tau']:.3f} (versions {foreign[-1]['versions']}, "
          f"drafter {foreign[-1]['drafter_versions']}); {time.time() - start:.0f} s")  # fmt: skip
    if drafter is not None:
        decisions = bandit_decisions(args.out / "loop")
        published = [d["published"] for d in decisions if d.get("published")]
        print(f"bandit: {len(decisions)} decisions, {sum(d['arm'] != SKIP for d in decisions)} updates trained, "
              f"published versions {published}")  # fmt: skip


if __name__ == "__main__":
    main()
