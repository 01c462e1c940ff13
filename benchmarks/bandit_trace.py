"""The bandit at production length: an hour of serving (or more) simulated from real drafter versions.

    OMP_NUM_THREADS=2 python benchmarks/bandit_trace.py --out runs/bandit_trace     # CPU, 2 cores: see docs/bandit.md
    python benchmarks/bandit_trace.py --smoke                                          # seconds: checks that it runs

Why a simulation: decoding every request of a long stream on a CPU gives a few thousand serving steps, while one
update costs a few hundred steps of serving, so no update can pay back within the stream (benchmarks/bandit_sim.py).
In production a shift lasts hours. Here the long stream is simulated and the drafters are real:

- **Versions.** The shipped TreeFlash drafter, and every candidate a policy asks for, exist as weights: a
  candidate is the daemon's own arm (trainer/adapt/bandit.py, ``DEFAULT_ARMS``) trained by ``BanditDaemon.train``
  from the version in service on ``--traffic`` logged requests of the current phase (a daemon's replay buffer);
  its seconds are measured. A candidate is a function of (version, phase, arm), so policies and seeds that ask for
  the same one share it. The n-th update of a lineage trains on part n (mod ``--slices``) of the phase's traffic
  prompts: fresh traffic, as a server's replay buffer would hold. Parts interleave over the whole text, so they
  are alike in difficulty.
- **Measurements.** Each version that serves a phase decodes ``--heldout`` held-out prompts of that phase (its τ:
  tokens and steps per request); a version whose logs a daemon reads also decodes ``--live`` traffic prompts
  with the verifier log on (the sample its logged requests are drawn from; the shipped drafter decodes all
  ``--traffic`` of a part, the training buffer). Decoding work grows with versions x sample sizes, not with the
  stream. (Training reads the logged requests' tokens only, the target's own greedy output whoever drafted, so a
  candidate trains on the shipped drafter's log of the same prompts.)
- **The clock.** Requests arrive at ``--rate`` per second (Poisson) or, by default, faster than any version serves
  them (a saturated server: served tokens then measure throughput). A request of the phase in effect at its
  arrival takes the (tokens, steps) of a random held-out request of that phase decoded by the version in service;
  its steps cost the median step seconds measured over every decode of this run (one drafter shape, so one
  figure for every version and policy; timing noise of a shared machine does not decide a comparison).
- **The bandit** is the daemon itself (``BanditDaemon``): one in ``--log-every`` served requests is logged (the
  step and request records of a random logged request of the version and phase in service, its version number
  the daemon's), and after each it reads, decides, and is charged what its decision measured: the candidate's
  training seconds (from the shared training above, through the daemon's clock) plus its own shadow evaluation.
- **Cost models.** ``colocated``: an update's seconds are taken from serving (the server stalls). ``separate``:
  a trainer device trains, serving pays only the swap; the update's device-seconds are reported, and the bandit
  prices them at ``--exchange-rate`` serving seconds per device-second (``BanditConfig.update_cost_share``).
  ``--costs`` picks the figures: measured on this machine, or a profile of benchmarks/bandit_costs.json (a GPU's
  measured step and training-step seconds; updates scale by training-step seconds, serving by step seconds).

The stream (default one hour): held-out standard-library prompts, a gentle shift to the Python of the installed
``transformers`` (modeling files), a hard one to the installed ``torch``'s own Python, and a shift back. The texts
are those of the installed packages, so runs on different installs differ.

Policies: never update; every N requests (``--every``, two N); the greedy rule (update when the live τ of the last
window fell ``--greedy-drop`` below the τ after the last update); the bandit; and the **oracle**: the best
schedule in hindsight, per seed, of a family of fixed schedules (never; every N for the ``--oracle-every`` values;
once, d requests after each shift, for the ``--oracle-after`` values: schedules that know when the shifts come).
Fixed schedules and the greedy rule train the ``full-16`` arm.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from bandit_sim import new_entries
from transformers import AutoTokenizer

from trainer.adapt.bandit import DEFAULT_ARMS, Arm, BanditConfig
from trainer.adapt.bandit_daemon import DECISIONS, BanditDaemon
from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.engine import generate
from trainer.drafters import load_drafter
from trainer.paths import project_path
from trainer.snapshots import read_manifest, version_path
from trainer.target import load_causal_lm
from trainer.vlog.reader import LogReader
from trainer.vlog.recorder import StepRecorder
from trainer.vlog.schema import RecordError
from trainer.vlog.writer import LogWriter

TARGET = "checkpoints/target_tiny"
DRAFTER = "checkpoints/treeflash_tiny"
TREE = "treeflash"
COSTS = Path(__file__).with_name("bandit_costs.json")
FULL = next(a for a in DEFAULT_ARMS if a.params == "full")
ARMS = {a.name: a for a in DEFAULT_ARMS}
# (start as a share of the duration, phase): the standard library, a gentle shift, a hard one, the shift back.
SCHEDULE = ((0.0, "stdlib"), (0.1, "transformers"), (0.4, "torch"), (0.85, "stdlib"))
PHASES = tuple(dict.fromkeys(phase for _, phase in SCHEDULE))


def phase_windows(tokenizer, phase: str, heldout: int, traffic: int, prompt_tokens: int) -> tuple[list, list]:
    """(held-out prompts, traffic prompts) of ``prompt_tokens`` tokens of a phase's text: disjoint, both spread
    over the whole text; the traffic cycles over what the held-out ones leave when the text is short."""
    if phase == "stdlib":
        rows = project_path("data/prompts/stdlib_heldout.jsonl").read_text().splitlines()
        windows = [tokenizer(json.loads(r)["prompt"])["input_ids"][-prompt_tokens:] for r in rows]
    else:
        package = __import__(phase)
        root = Path(package.__file__).parent
        files = sorted(root.glob("models/*/modeling_*.py") if phase == "transformers" else root.glob("**/*.py"))
        # Every k-th file: a spread of the package's styles, tokenized in seconds.
        files = files[:: max(1, len(files) // 120)]
        ids = [t for f in files for t in tokenizer(f.read_text(errors="replace"))["input_ids"]]
        stride = max(prompt_tokens, (len(ids) - prompt_tokens) // (heldout + traffic))
        windows = [ids[i : i + prompt_tokens] for i in range(0, len(ids) - prompt_tokens, stride)]
    if len(windows) <= heldout:
        raise SystemExit(f"the {phase} text gives {len(windows)} prompts, not more than --heldout {heldout}")
    # Every k-th window is held out: both sets span the whole text.
    every = len(windows) // heldout
    held = [w for i, w in enumerate(windows) if i % every == every - 1][:heldout]
    rest = [w for i, w in enumerate(windows) if i % every != every - 1 or i >= every * heldout]
    return held, [rest[i % len(rest)] for i in range(traffic)]


@dataclass
class Version:
    """A drafter that exists as weights: the shipped one, or a candidate trained from a parent."""

    name: str
    history: tuple[tuple[str, str], ...]  # (phase, arm) of each update from the shipped drafter
    path: Path
    train_seconds: float = 0.0
    heldout: dict[str, list[list[int]]] = field(default_factory=dict)  # phase -> [tokens, steps] per request


def spread(items: list, count: int) -> list:
    """``count`` of ``items`` evenly spaced from the first (all of them when ``count`` is ``len(items)``)."""
    return items[:: max(1, len(items) // count)][:count]


class Versions:
    """Every version of a run, what each measured, and its logged traffic; kept under ``OUT/versions`` so a rerun
    with the same settings reuses them."""

    def __init__(self, out: Path, args, target, tokenizer) -> None:
        self.root, self.args, self.target = out / "versions", args, target
        self.root.mkdir(parents=True, exist_ok=True)
        self.vocab_size = target.config.vocab_size
        n = args.traffic * args.slices
        self.windows = {p: phase_windows(tokenizer, p, args.heldout, n, args.prompt_tokens) for p in PHASES}
        self.step_seconds: list[float] = []
        self.models: dict[str, torch.nn.Module] = {}
        # Seconds here per second of the parent process (a worker has fewer cores): ``calibrate`` sets it.
        self.time_scale = 1.0
        self.logged: dict[tuple[str, str, int, int], list[list[dict]]] = {}
        index = self.root / "index.json"
        settings = {k: getattr(args, k) for k in ("heldout", "traffic", "live", "slices", "prompt_tokens",
                                                   "new_tokens", "budget")}  # fmt: skip
        settings["parts"] = "interleaved"
        saved = json.loads(index.read_text()) if index.is_file() else {}
        self.by_key: dict[tuple, Version] = {}
        if saved.get("settings") == settings:
            self.step_seconds = saved["step_seconds"]
            for v in saved["versions"]:
                version = Version(v["name"], tuple(map(tuple, v["history"])), Path(v["path"]), v["train_seconds"],
                                  v["heldout"])  # fmt: skip
                self.by_key[version.history] = version
        self.settings = settings
        if () not in self.by_key:
            self.by_key[()] = Version("v0", (), project_path(DRAFTER))

    def save(self) -> None:
        versions = [{"name": v.name, "history": v.history, "path": str(v.path), "train_seconds": v.train_seconds,
                     "heldout": v.heldout} for v in self.by_key.values()]  # fmt: skip
        body = {"settings": self.settings, "step_seconds": self.step_seconds, "versions": versions}
        (self.root / "index.json").write_text(json.dumps(body))

    @property
    def shipped(self) -> Version:
        return self.by_key[()]

    def model(self, v: Version) -> torch.nn.Module:
        if v.name not in self.models:
            self.models[v.name] = load_drafter(v.path).eval()
        return self.models[v.name]

    def _decode(self, v: Version, windows: list[list[int]], logs: Path | None, tag: str) -> list[list[int]]:
        """[tokens, steps] per prompt decoded greedily by ``v``; with ``logs``, each request's verifier log."""
        writer = LogWriter(logs, "pool", vocab_size=self.vocab_size) if logs is not None else None
        drafter, out = self.model(v), []
        for i, prompt in enumerate(windows):
            recorder = None
            if writer is not None:
                recorder = StepRecorder(writer, server="sim", request=f"{tag}-{i}", tenant=None, shareable=True,
                                        drafter="sim", drafter_version=None)  # fmt: skip
            g = generate(self.target, make_session(TREE, self.target, drafter), BUILDERS[TREE], torch.tensor(prompt),
                         self.args.new_tokens, self.args.budget, on_step=recorder,
                         step_topk=recorder.k if recorder else 0)  # fmt: skip
            if recorder is not None:
                recorder.finish(prompt, g.tokens)
            self.step_seconds += [sum(s.seconds.values()) for s in g.steps]
            out.append([len(g.tokens), len(g.steps)])
        if writer is not None:
            writer.close()
        return out

    def heldout(self, v: Version, phase: str) -> list[list[int]]:
        """[tokens, steps] of each held-out prompt of ``phase`` decoded by ``v`` (measured once)."""
        if phase not in v.heldout:
            v.heldout[phase] = self._decode(v, self.windows[phase][0], None, f"{v.name}-{phase}-h")
            self.save()
        return v.heldout[phase]

    def live(self, v: Version, phase: str) -> list[list[dict]]:
        """The sample a daemon's logs draw from while ``v`` serves ``phase``: ``--live`` requests spread over the
        lineage's next traffic part (not the one ``v`` trained on), decoded by ``v`` (the shipped drafter's are
        the same spread of the part it decoded whole as training traffic)."""
        part = len(v.history) % self.args.slices
        count = self.args.traffic if v is self.shipped else self.args.live
        return spread(self.traffic(v, phase, part, count), self.args.live)

    def traffic(self, v: Version, phase: str, part: int, count: int) -> list[list[dict]]:
        """``count`` logged requests spread over traffic part ``part`` of ``phase``, decoded by ``v``: per request
        its step records, then its request record. Part ``p`` is every ``--slices``-th traffic prompt from the
        ``p``-th, so every part spans the whole text: parts of contiguous text differ in difficulty by more than
        versions differ (shipped τ 1.67-1.76 over three contiguous thirds of torch), and a realised outcome that
        compares two versions' samples would measure the parts."""
        if (v.name, phase, part, count) in self.logged:
            return self.logged[v.name, phase, part, count]
        logs = self.root / v.name / f"traffic-{phase}-{part}-{count}"
        if not any(logs.glob("*.jsonl")):
            prompts = spread(self.windows[phase][1][part :: self.args.slices], count)
            self._decode(v, prompts, logs, f"{v.name}-{phase}")
            self.save()
        requests, steps = [], {}
        for item in LogReader(logs, {}, vocab_size=self.vocab_size):
            record = item.record
            if isinstance(record, RecordError):
                raise RuntimeError(f"{logs}: {record}")
            if record["kind"] == "step":
                steps.setdefault(record["request"], []).append(record)
            else:
                requests.append([*steps.pop(record["request"], []), record])
        # Parsed once: the bandit draws one of them for every logged request it serves.
        self.logged[v.name, phase, part, count] = requests
        return requests

    def train(self, parent: Version, phase: str, arm: Arm) -> tuple[torch.nn.Module, float]:
        """``arm`` trained from ``parent`` on its lineage's part of ``phase``'s traffic, and its seconds in the
        parent process's terms (``time_scale``)."""
        with tempfile.TemporaryDirectory() as tmp:
            logs = Path(tmp) / "logs"
            with LogWriter(logs, "traffic", vocab_size=self.vocab_size) as writer:
                # Training reads the requests' tokens only, the target's own greedy output whichever drafter
                # served them: the shipped drafter's decode of the lineage's part stands for the parent's.
                for request in self.traffic(self.shipped, phase, len(parent.history) % self.args.slices,
                                            self.args.traffic):  # fmt: skip
                    for record in request:
                        writer.write({**record, "drafter_version": 1} if record["kind"] == "step" else record)
            config = BanditConfig(shadow_acceptance="greedy")
            daemon = BanditDaemon(logs, parent.path, Path(tmp) / "drafters", Path(tmp) / "state", TARGET, config,
                                  console=_quiet())  # fmt: skip
            daemon.read()
            started = time.perf_counter()
            candidate = daemon.train(arm)
            seconds = (time.perf_counter() - started) * self.time_scale
            daemon.close()
        return candidate, seconds

    def calibrate(self, parent_seconds: float) -> None:
        """In a worker: time the parent's reference update (the full arm from the shipped drafter on the first
        shift) again, so its training and shadow seconds are charged at the parent's rate, not at this process's
        share of the cores."""
        self.time_scale = 1.0
        _, seconds = self.train(self.shipped, SCHEDULE[1][1], FULL)
        self.time_scale = parent_seconds / seconds
        print(f"  worker: the reference update took {seconds:.1f} s here, {parent_seconds:.1f} s in the parent: "
              f"seconds charged x{self.time_scale:.2f}", flush=True)  # fmt: skip

    def child(self, parent: Version, phase: str, arm: Arm) -> Version:
        """The candidate of ``arm`` trained from ``parent`` on its logged traffic of ``phase`` (trained once)."""
        key = (*parent.history, (phase, arm.name))
        if key in self.by_key:
            return self.by_key[key]
        name = f"v{len(self.by_key)}"
        candidate, seconds = self.train(parent, phase, arm)
        path = self.root / name / "drafter"
        candidate.save_pretrained(path)
        self.models[name] = candidate
        version = self.by_key[key] = Version(name, key, path, seconds)
        self.save()
        print(f"  trained {name} = {_label(key)} in {seconds:.1f} s", flush=True)
        return version


def _label(history: tuple) -> str:
    return " > ".join(f"{arm}@{phase}" for phase, arm in history) or "shipped"


def _quiet():
    from rich.console import Console

    return Console(quiet=True)


@dataclass(frozen=True)
class Costs:
    """Seconds the simulated clock charges: a verification step, and ``update_scale`` times an update's measured
    seconds (1: this machine; a profile's training-step seconds over this machine's)."""

    step_seconds: float
    update_scale: float
    swap_seconds: float
    source: str


@dataclass
class Served:
    """One served request as the policies see it."""

    index: int
    phase: str
    tokens: int
    steps: int
    end: float


class ChargedClock:
    """The daemon's clock: real seconds, plus what the simulation charges for work it did not redo (a shared
    candidate's training) or scales (a profile's update seconds)."""

    def __init__(self) -> None:
        self.charged = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.charged


class SimulatedDaemon(BanditDaemon):
    """The bandit daemon, its candidates taken from the run's shared versions (the same arm from the same version
    on the same phase's traffic), each charged the seconds its training measured."""

    def __init__(self, *a, versions: Versions, costs: Costs, clock: ChargedClock, **kw) -> None:
        super().__init__(*a, clock=clock, **kw)
        self.versions, self.costs, self.charged = versions, costs, clock
        self.phase, self.serving = "stdlib", versions.shipped
        self.trained: dict[int, Version] = {}

    def train(self, arm: Arm) -> torch.nn.Module:
        started = time.perf_counter()
        child = self.versions.child(self.serving, self.phase, arm)
        model = self.versions.model(child)
        # The clock advances by what the training measured (scaled), not by this call's time: a shared candidate
        # returns at once, a new one also decodes its traffic here.
        self.charged.charged += child.train_seconds * self.costs.update_scale - (time.perf_counter() - started)
        self.trained[id(model)] = child
        return model

    def shadow(self, drafter: torch.nn.Module) -> float:
        started = time.perf_counter()
        result = super().shadow(drafter)
        scale = self.costs.update_scale * self.versions.time_scale
        self.charged.charged += (time.perf_counter() - started) * (scale - 1.0)
        return result


class Policy:
    """Decides after each served request; returns (version now in service, update seconds spent) or None."""

    name: str

    def after(self, sim: Simulation, served: Served) -> tuple[Version, float] | None:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the policy holds."""


class Never(Policy):
    name = "never"

    def after(self, sim: Simulation, served: Served) -> None:
        return None


class Every(Policy):
    """Update every ``n`` requests."""

    def __init__(self, n: int) -> None:
        self.name, self.n = f"every-{n}", n

    def after(self, sim: Simulation, served: Served) -> tuple[Version, float] | None:
        if (served.index + 1) % self.n:
            return None
        child = sim.versions.child(sim.version, served.phase, FULL)
        return child, child.train_seconds


class AfterShift(Policy):
    """Update once, ``d`` requests after each shift (knows when shifts come: a schedule only hindsight gives)."""

    def __init__(self, d: int) -> None:
        self.name, self.d, self.n = f"after-shift-{d}", d, None
        self.phase, self.count = None, 0

    def after(self, sim: Simulation, served: Served) -> tuple[Version, float] | None:
        if served.phase != self.phase:
            self.phase, self.count = served.phase, 0
        self.count += 1
        if self.count != self.d or served.index < self.d:
            return None
        child = sim.versions.child(sim.version, served.phase, FULL)
        return child, child.train_seconds


class Greedy(Policy):
    """Update when the τ of the last ``window`` steps fell ``drop`` below the first full window after the last
    update (the τ-drop rule)."""

    name = "greedy"

    def __init__(self, window: int, drop: float) -> None:
        self.window, self.drop = window, drop
        self.recent: list[tuple[int, int]] = []
        self.ref: float | None = None

    def after(self, sim: Simulation, served: Served) -> tuple[Version, float] | None:
        self.recent.append((served.tokens, served.steps))
        while sum(s for _, s in self.recent[1:]) >= self.window:
            self.recent.pop(0)
        if sum(s for _, s in self.recent) < self.window:
            return None
        tau = sum(t for t, _ in self.recent) / sum(s for _, s in self.recent)
        if self.ref is None:
            self.ref = tau
            return None
        if tau >= self.ref * (1 - self.drop):
            return None
        self.ref, self.recent = None, []
        child = sim.versions.child(sim.version, served.phase, FULL)
        return child, child.train_seconds


class Bandit(Policy):
    """The bandit daemon on a sample of the served requests' logs."""

    name = "bandit"

    def __init__(self, root: Path, versions: Versions, costs: Costs, config: BanditConfig, log_every: int,
                 seed: int) -> None:  # fmt: skip
        self.logs, self.publish = root / "logs", root / "drafters"
        shutil.rmtree(root, ignore_errors=True)  # a fresh daemon: a rerun's policy starts from the shipped drafter
        self.logs.mkdir(parents=True)
        self.clock = ChargedClock()
        self.daemon = SimulatedDaemon(self.logs, versions.shipped.path, self.publish, root / "state", TARGET, config,
                                      seed=seed, console=_quiet(), versions=versions, costs=costs,
                                      clock=self.clock)  # fmt: skip
        self.writer = LogWriter(self.logs, "sim", vocab_size=versions.vocab_size)
        self.by_number = {self.daemon.state.version: versions.shipped}
        self.log_every, self.rng = log_every, random.Random(seed)
        self.decisions = root / "state" / DECISIONS

    def after(self, sim: Simulation, served: Served) -> tuple[Version, float] | None:
        if served.index % self.log_every:
            return None
        daemon = self.daemon
        request = self.rng.choice(sim.versions.live(sim.version, served.phase))
        number = daemon.state.version
        for record in request:
            fields = {"request": f"r{served.index}", "drafter_version": number if record["kind"] == "step" else None}
            self.writer.write({**record, **{k: v for k, v in fields.items() if k in record}})
        self.writer.flush()
        offset = self.decisions.stat().st_size if self.decisions.exists() else 0
        daemon.phase, daemon.serving = served.phase, sim.version
        daemon.read()
        daemon.decide()
        entries = new_entries(self.decisions, offset)
        seconds = sum(e.get("update_seconds", 0.0) for e in entries)
        now = daemon.state.version
        if now == number and not seconds:
            return None
        if now not in self.by_number:
            manifest = read_manifest(version_path(self.publish, now))
            origin = manifest.get("rollback_of")
            self.by_number[now] = self.by_number[origin] if origin else daemon.trained[id(daemon.drafter)]
        return self.by_number[now], seconds / self.daemon.costs.update_scale

    def close(self) -> None:
        self.writer.close()
        self.daemon.commit()
        self.daemon.close()


class Simulation:
    """One policy over one seed's stream under one cost model."""

    def __init__(self, versions: Versions, costs: Costs, model: str, duration: float, rate: float | None,
                 seed: int) -> None:  # fmt: skip
        self.versions, self.costs, self.model, self.duration, self.rate = versions, costs, model, duration, rate
        self.rng = random.Random(seed)
        self.version = versions.shipped

    def phase_at(self, t: float) -> str:
        return [p for start, p in SCHEDULE if start * self.duration <= t][-1]

    def run(self, policy: Policy) -> dict:
        clock, arrival, tokens, device, updates, trace, i = 0.0, 0.0, 0.0, 0.0, 0, [], 0
        update_seconds = 0.0
        while clock < self.duration:
            if self.rate is not None:
                arrival += self.rng.expovariate(self.rate)
                clock = max(clock, arrival)
                if clock >= self.duration:
                    break
            phase = self.phase_at(arrival if self.rate is not None else clock)
            n, steps = self.rng.choice(self.versions.heldout(self.version, phase))
            seconds = steps * self.costs.step_seconds
            if clock + seconds > self.duration:
                tokens += n * (self.duration - clock) / seconds  # the request in progress when the stream ends
                break
            clock += seconds
            tokens += n
            trace.append((clock, phase, n, steps, self.version.name))
            decided = policy.after(self, Served(i, phase, n, steps, clock))
            i += 1
            if decided is None:
                continue
            version, spent = decided
            spent *= self.costs.update_scale
            update_seconds += spent
            swapped = version is not self.version
            if self.model == "colocated":
                clock += spent
            else:
                device += spent
            if swapped:
                clock += self.costs.swap_seconds
                updates += 1
                self.version = version
        policy.close()
        return {"tokens": tokens, "requests": i, "updates": updates, "update_seconds": update_seconds,
                "device_seconds": device, "trace": trace, "final": _label(self.version.history)}  # fmt: skip


def measured_costs(versions: Versions) -> dict:
    """This machine's figures: median step seconds of every decode, the full arm's training seconds, a swap."""
    started = time.perf_counter()
    load_drafter(versions.shipped.path)
    swap = time.perf_counter() - started
    trained = [v.train_seconds for v in versions.by_key.values() if v.history and v.history[-1][1] == FULL.name]
    return {"step_seconds": statistics.median(versions.step_seconds), "swap_seconds": swap,
            "update_seconds_full16": statistics.median(trained) if trained else None,
            "train_step_seconds": statistics.median(trained) / FULL.steps if trained else None}  # fmt: skip


def choose_costs(name: str, here: dict) -> Costs:
    if name == "measured":
        return Costs(here["step_seconds"], 1.0, here["swap_seconds"], "measured here")
    profiles = json.loads(COSTS.read_text())["profiles"]
    if name not in profiles:
        raise SystemExit(f"--costs {name}: not a profile of {COSTS} ({', '.join(profiles)}) nor 'measured'")
    p = profiles[name]
    if here["train_step_seconds"] is None:
        raise SystemExit("--costs with a profile needs one measured full-arm update here first (the scale)")
    scale = p["train_step_seconds"] / here["train_step_seconds"]
    return Costs(p["step_seconds"], scale, p["swap_seconds"], f"{name}: {p['source']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bandit_trace")
    p.add_argument("--minutes", type=float, default=60.0, help="simulated duration of the stream")
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (default: a saturated server)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--models", default="colocated,separate", help="cost models: colocated, separate")
    p.add_argument("--exchange-rate", type=float, default=0.25, help="serving seconds per trainer device-second")
    p.add_argument("--costs", default="measured", help="'measured' here, or a profile of bandit_costs.json")
    p.add_argument("--heldout", type=int, default=12, help="held-out prompts per (version, phase): its τ")
    p.add_argument("--traffic", type=int, default=64, help="logged requests per (version, phase): a daemon's buffer")
    p.add_argument("--live", type=int, default=32, help="logged requests per (version, phase) a daemon's log samples")
    p.add_argument("--slices", type=int, default=3, help="traffic parts per phase (successive updates' data)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--log-every", type=int, default=4, help="one in this many served requests reaches the daemon")
    p.add_argument("--horizon-minutes", type=float, default=15.0, help="the bandit's horizon, in minutes of traffic")
    p.add_argument("--every", default="1000,3000", help="the two fixed schedules shown, in requests")
    p.add_argument("--oracle-every", default="1000,2000,3000", help="every-N schedules of the oracle family")
    p.add_argument("--oracle-after", default="100,400", help="after-shift schedules of the oracle family")
    # The daemon's --window-steps at production length: a window of ~50 logged requests. The default 64 steps (3
    # requests of this stream) is so noisy that the realised outcome of an update is noise.
    p.add_argument("--window", type=int, default=1024, help="the bandit's live window, in logged steps")
    p.add_argument("--greedy-drop", type=float, default=0.1, help="greedy rule: update when τ drops this much")
    # A window of ~50 requests: τ of one request varies so much that a shorter window's 10% drops are noise.
    p.add_argument("--greedy-window", type=int, default=1024, help="greedy rule: its window of steps")
    p.add_argument("--jobs", type=int, default=1, help="worker processes the streams are split over")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="seconds, tiny sizes: checks that the script runs")
    args = p.parse_args()
    smoke_dir = None
    if args.smoke:
        smoke_dir = tempfile.TemporaryDirectory()  # removed when main returns
        args.out, args.minutes, args.seeds, args.heldout, args.traffic, args.slices = smoke_dir.name, 0.5, 1, 2, 4, 1
        args.live = 2
        args.prompt_tokens, args.new_tokens, args.every, args.oracle_every = 16, 6, "150,300", "300"
        args.oracle_after = "50"
        args.log_every, args.horizon_minutes, args.window, args.jobs = 1, 0.25, 64, 2
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(project_path(TARGET)))
    target = load_causal_lm(str(project_path(TARGET)), "float32")
    if args.worker is not None:
        # A worker starts from the parent's versions (the shipped drafter measured, one update trained) and its
        # measured costs, so every worker charges the same figures.
        work = out / f"w{args.worker}"
        if not (work / "versions").exists():
            shutil.copytree(out / "versions", work / "versions")
        here = json.loads((out / "costs.json").read_text())["here"]
        versions = Versions(work, args, target, tokenizer)
        versions.calibrate(here["update_seconds_full16"])
        results = simulate(units(args)[args.worker :: args.jobs], versions, choose_costs(args.costs, here), work, args)
        (work / "results-full.json").write_text(json.dumps(results))
        return
    versions = Versions(out, args, target, tokenizer)
    # The shipped drafter on every phase, and one full-arm update: this machine's step and update seconds.
    for phase in PHASES:
        versions.heldout(versions.shipped, phase)
    versions.child(versions.shipped, SCHEDULE[1][1], FULL)
    here = measured_costs(versions)
    costs = choose_costs(args.costs, here)
    (out / "costs.json").write_text(json.dumps({"here": here, "charged": costs.__dict__}, indent=1))
    tau0 = {ph: _tau(versions.heldout(versions.shipped, ph)) for ph in PHASES}
    print(f"costs ({costs.source}): step {costs.step_seconds * 1000:.1f} ms, update x{costs.update_scale:.3f} of "
          f"measured, swap {costs.swap_seconds * 1000:.0f} ms; full-16 update here "
          f"{here['update_seconds_full16']:.1f} s; shipped τ " + ", ".join(f"{k} {v:.3f}" for k, v in tau0.items()),
          flush=True)  # fmt: skip
    if args.jobs == 1:
        results = simulate(units(args), versions, costs, out, args)
        measured = list(versions.by_key.values())
    else:
        results, measured = parallel(out, args, target, tokenizer)
    _write(out, results, here, costs, args)
    report(results, args, out)
    ceiling(versions.shipped, measured, args)
    print(f"wall {time.perf_counter() - started:.0f} s", flush=True)


def units(args) -> list[tuple[str, int]]:
    """(cost model, seed) of each simulated stream: a seed runs every policy."""
    return [(model, seed) for model in args.models.split(",") for seed in range(args.seeds)]


def oracle_schedules(args) -> list[Policy]:
    """The oracle's fixed schedules."""
    return [*(Every(int(n)) for n in args.oracle_every.split(",")), *(AfterShift(int(d)) for d in
            args.oracle_after.split(","))]  # fmt: skip


def simulate(todo: list[tuple[str, int]], versions: Versions, costs: Costs, out: Path, args) -> dict:
    """Every policy on each (cost model, seed) stream: results[model][policy] = one run per seed, seed order."""
    duration = args.minutes * 60
    # The bandit's horizon in requests: the minutes asked for at the shipped drafter's rate on the first phase.
    per_request = statistics.mean(s for _, s in versions.heldout(versions.shipped, "stdlib")) * costs.step_seconds
    horizon = args.horizon_minutes * 60 / per_request
    shown = [int(n) for n in args.every.split(",")]
    results: dict = {}
    for model, seed in todo:
        config = BanditConfig(horizon_requests=horizon, window_steps=args.window, shadow_acceptance="greedy",
                              swap_seconds=costs.swap_seconds,
                              update_cost_share=1.0 if model == "colocated" else args.exchange_rate,
                              log_share=1.0 / args.log_every)  # fmt: skip
        bandit = Bandit(out / "runs" / f"{model}-{seed}", versions, costs, config, args.log_every, seed)
        greedy = Greedy(args.greedy_window, args.greedy_drop)
        policies = [Never(), *(Every(n) for n in shown), greedy, bandit]
        policies += [q for q in oracle_schedules(args) if not (isinstance(q, Every) and q.n in shown)]
        for policy in policies:
            tick = time.perf_counter()
            run = Simulation(versions, costs, model, duration, args.rate, seed).run(policy)
            results.setdefault(model, {}).setdefault(policy.name, []).append({**run, "seed": seed})
            print(f"{model:>9} seed {seed} {policy.name:>14}: {run['tokens']:10.0f} tokens, {run['updates']:3d} "
                  f"updates ({run['update_seconds']:6.1f} s) [{time.perf_counter() - tick:.0f} s wall]",
                  flush=True)  # fmt: skip
    return results


def parallel(out: Path, args, target, tokenizer) -> tuple[dict, list[Version]]:
    """The streams split over ``--jobs`` worker processes (this script with ``--worker i``), each with a copy of
    the parent's versions and ``OMP_NUM_THREADS`` cores divided among them; their results merged in seed order,
    and every version any worker measured."""
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)) // args.jobs)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    # Every setting explicitly (a smoke run's sizes and directory included).
    skip = ("smoke", "worker")
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in skip and v is not None]
    workers = [subprocess.Popen([sys.executable, __file__, *argv, "--worker", str(i)], env=env)
               for i in range(args.jobs)]  # fmt: skip
    failed = [i for i, w in enumerate(workers) if w.wait()]
    if failed:
        raise SystemExit(f"bandit_trace: worker(s) {failed} failed (their output is above)")
    results: dict = {}
    measured: list[Version] = []
    for i in range(args.jobs):
        work = out / f"w{i}"
        for model, by in json.loads((work / "results-full.json").read_text()).items():
            for name, runs in by.items():
                results.setdefault(model, {}).setdefault(name, []).extend(runs)
        measured += Versions(work, args, target, tokenizer).by_key.values()
    for by in results.values():
        for runs in by.values():
            runs.sort(key=lambda r: r["seed"])
    return results, measured


def _tau(rows: list[list[int]]) -> float:
    return sum(t for t, _ in rows) / sum(s for _, s in rows)


def _write(out: Path, results: dict, here: dict, costs: Costs, args) -> None:
    slim = {m: {n: [{k: v for k, v in r.items() if k != "trace"} for r in runs] for n, runs in by.items()}
            for m, by in results.items()}  # fmt: skip
    body = {"args": vars(args), "here": here, "charged": costs.__dict__, "results": slim}
    (out / "results.json").write_text(json.dumps(body, indent=1))


def report(results: dict, args, out: Path) -> None:
    """Per cost model: served tokens (mean ± sd over seeds) per policy, ratio to never, and the oracle."""
    schedule_names = [q.name for q in oracle_schedules(args)]
    shown = [int(n) for n in args.every.split(",")]
    for model, by in results.items():
        seeds = len(by["never"])
        never = [r["tokens"] for r in by["never"]]
        # The oracle: per seed, the family's best schedule on that seed's trace.
        oracle = [max(["never", *schedule_names], key=lambda n, s=s: by[n][s]["tokens"]) for s in range(seeds)]
        rows = {n: by[n] for n in ["never", *(f"every-{n}" for n in shown), "greedy", "bandit"]}
        rows[f"oracle ({', '.join(dict.fromkeys(oracle))})"] = [by[o][s] for s, o in enumerate(oracle)]
        print(f"\n{model}: {args.minutes:.0f} min, {seeds} seeds; served tokens mean ± sd; ratio to never per seed")
        print(f"{'policy':>30} | {'served tokens':>17} | {'vs never':>15} | updates | update s | device s | τ by phase")
        for name, runs in rows.items():
            tokens = [r["tokens"] for r in runs]
            ratios = [t / b for t, b in zip(tokens, never, strict=True)]
            taus = _phase_taus(runs)
            print(f"{name:>30} | {_spread(tokens, '.0f'):>17} | {_spread(ratios, '.3f'):>15} | "
                  f"{statistics.mean(r['updates'] for r in runs):7.1f} | "
                  f"{statistics.mean(r['update_seconds'] for r in runs):8.1f} | "
                  f"{statistics.mean(r['device_seconds'] for r in runs):8.1f} | "
                  + " ".join(f"{k} {v:.3f}" for k, v in taus.items()))  # fmt: skip
        if model == "separate":
            gain = _overall_tau(by["bandit"]) / _overall_tau(by["never"]) - 1
            spent = statistics.mean(r["device_seconds"] for r in by["bandit"])
            if gain > 0:
                print(f"bandit: {spent:.0f} device-s for τ +{100 * gain:.1f}% over never: "
                      f"{spent / (100 * gain):.1f} device-s per point (1%) of τ")  # fmt: skip
            else:
                print(f"bandit: {spent:.0f} device-s, τ {100 * gain:+.1f}% against never: no point of τ gained")
    plot(results, out, args)


def ceiling(shipped: Version, measured: list[Version], args) -> None:
    """What any policy could gain at most with the versions that exist: per phase the shipped drafter's τ and the
    best version's on the held-out prompts, and the served-token ratio of serving, in every phase, its best version
    from the phase's first request, for free (saturated serving: tokens at a fixed step cost are proportional
    to τ)."""
    shares = {phase: 0.0 for phase in PHASES}
    for (start, phase), (end, _) in zip(SCHEDULE, [*SCHEDULE[1:], (1.0, "")], strict=True):
        shares[phase] += end - start
    measured = list({str(v.path): v for v in measured}.values())  # a worker's copies of the parent's versions once
    print(f"\nversions measured: {len(measured)}; τ on each phase's {args.heldout} held-out prompts")
    ratio = 0.0
    for phase in PHASES:
        taus = [(_tau(v.heldout[phase]), v) for v in measured if phase in v.heldout]
        best, v = max(taus, key=lambda m: m[0])
        first = _tau(shipped.heldout[phase])
        ratio += shares[phase] * best / first
        print(f"{phase:>13}: shipped {first:.3f}, best {best:.3f} ({v.name}: {_label(v.history)}) of "
              f"{len(taus)} versions")  # fmt: skip
    print(f"ceiling: the best version of each phase from its first request, for free: {ratio:.3f}x never")


def _spread(values: list[float], fmt: str) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{format(statistics.mean(values), fmt)} ± {format(sd, fmt)}"


def _phase_taus(runs: list[dict]) -> dict[str, float]:
    totals: dict[str, list[int]] = {}
    for r in runs:
        for _, phase, n, steps, _ in r["trace"]:
            t = totals.setdefault(phase, [0, 0])
            t[0] += n
            t[1] += steps
    return {k: t / s for k, (t, s) in totals.items()}


def _overall_tau(runs: list[dict]) -> float:
    return sum(n for r in runs for _, _, n, _, _ in r["trace"]) / sum(s for r in runs for _, _, _, s, _ in r["trace"])


def plot(results: dict, out: Path, args) -> None:
    """τ over time (one-minute bins) of seed 0, per policy, for the first cost model; shifts shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = next(iter(results))
    fig, ax = plt.subplots(figsize=(9, 4))
    bin_s = max(args.minutes * 60 / 60, 1.0)
    for name, runs in results[model].items():
        if name.startswith(("after-shift", "every-")) and name not in {f"every-{n}" for n in args.every.split(",")}:
            continue
        bins: dict[int, list[int]] = {}
        for end, _, n, steps, _ in runs[0]["trace"]:
            b = bins.setdefault(int(end // bin_s), [0, 0])
            b[0] += n
            b[1] += steps
        xs = sorted(bins)
        ax.plot([(x + 0.5) * bin_s / 60 for x in xs], [bins[x][0] / bins[x][1] for x in xs], label=name, lw=1.1)
    for (start, phase), (end, _) in zip(SCHEDULE, [*SCHEDULE[1:], (1.0, "")], strict=True):
        ax.axvspan(start * args.minutes, end * args.minutes, alpha=0.08 if phase == "stdlib" else 0.16,
                   color="grey" if phase == "stdlib" else "tab:orange")  # fmt: skip
        ax.text((start + 0.01) * args.minutes, 0.02, phase, transform=ax.get_xaxis_transform(), fontsize=8)
    ax.set_xlabel("simulated minutes")
    ax.set_ylabel("τ (tokens per step, 1-minute bins)")
    ax.set_title(f"{model}, seed 0")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(out / "tau.png", dpi=100)
    print(f"τ over time -> {out / 'tau.png'}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
