"""The bandit drafter updater: verifier logs in, drafter versions out, updated only when it pays.

Run it next to a log directory whose step records carry the published version as ``drafter_version``
(``--device cpu`` runs it on the CPU; by default it takes the first GPU, where a second copy of the target in
``--dtype`` must fit beside the server's). A version is judged only on the steps its drafter drafted: a step
with ``drafter`` null (plain decoding, recycling), a ``drafter_version`` that is null, 0 (the drafter the server
started with) or not one published here, a version other than the one that drafted its request's first step, or
another drafter's name than the version's first steps carried does not enter any version's live τ, and
``ignored_steps`` in the metrics counts such steps per reason::

    trainer adapt bandit --logs runs/logs --drafter checkpoints/treeflash --publish runs/drafters --once

The rule (estimates in trainer/adapt/bandit.py): when the served version has a full window of live steps, (1) τ
collapsing raises the alarm (exit code 3, a log line, ``alarm`` in the metrics) after rolling back to the previous
version when there is one; (2) a version published by an earlier decision is judged: its live τ is the realised
outcome that updates the arm's live fit (shadow gain → live gain), and it is rolled back when it fell below the
previous version's τ by the margin; (3) otherwise every arm's expected net gain in the served version's context
(novelty, drift) is estimated and the best arm whose worst case fits the budget runs if its gain is positive: the
candidate, a copy of the served drafter, takes the arm's steps on replayed requests through the training-step API
(trainer/training/step.py), is shadow-evaluated beside the served drafter on the same held-back logged contexts
against their logged target top-k (the paired gain trains the arm's regression), and is published when the lower
confidence bound of its live gain beats the swap. A failed or non-finite update is logged and leaves the served
version as it is. Every action is held to the budget ledger (trainer/adapt/bandit.py, ``Ledger``): at every
decision the served tokens stay at least ``1 - alpha`` times never-update's, a served version whose worst case no
longer fits is replaced by never-update's drafter (kept in ``STATE/baseline``), and a published version's
judgement is a paired test sized to detect a regression of ``rollback_effect`` (docs/bandit.md, "The guarantee").

State (``STATE/state.json``, replaced atomically): read offsets, the replay buffer, live τ per version, what the
bandit learnt, the decision awaiting its outcome, and the lengths of ``STATE/quarantine.jsonl`` and
``STATE/decisions.jsonl`` (one JSON line per decision and per outcome). A version is published before the
state that names it is committed; a restart finds a published version the state does not know and adopts it
with the decision stored in its manifest, so a kill at any point loses nothing and publishes no torn snapshot
(``publish`` renames complete directories only).
"""

from __future__ import annotations

import copy
import json
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import torch
from rich.console import Console

from trainer.adapt.bandit import (
    DEFAULT_ARMS,
    SKIP,
    Arm,
    ArmStats,
    BanditConfig,
    Context,
    Ledger,
    LiveTau,
    Rates,
    Replay,
    acceptance,
    collapsed,
    combined,
    drift,
    expected_accepted,
    judged_ratio,
    judged_sd,
    keep_risk,
    live_bound,
    outcome_weight,
    paired_gain,
    plan,
    pooled_priors,
    rollback_power,
    rolled_back,
    should_publish,
    step_seconds,
    step_tokens,
    update_risk,
)
from trainer.adapt.journal import (
    METRICS,
    QUARANTINE,
    StateError,
    append_lines,
    lock_state_dir,
    quarantine,
    run_until_signalled,
    truncate_to,
)
from trainer.data.features import FEATURE_KEYS, with_features
from trainer.drafters import load_drafter
from trainer.drafters.families import family_of
from trainer.errors import UserError
from trainer.io import write_text_atomic
from trainer.paths import project_path
from trainer.runs import resolve_drafter
from trainer.snapshots import MANIFEST, publish, read_current, read_manifest, version_path
from trainer.target import Target, load_causal_lm
from trainer.training.step import (
    BlockStepOptions,
    Drafter,
    Eagle3StepOptions,
    NonFiniteStep,
    SpecBlockOptions,
    SpecBlockStepOptions,
    StepOptions,
    chain_depth,
    chain_logits,
    context_batch,
    train_step,
)
from trainer.vlog.reader import LogReader
from trainer.vlog.schema import RecordError

STATE_FILE = "state.json"
# Never-update's drafter: the version the daemon started from, kept beside the state (published versions are pruned).
BASELINE = "baseline"
DECISIONS = "decisions.jsonl"
ALARM_EXIT = 3
PENDING_REQUESTS = 512
DEFAULT_CONFIG = BanditConfig()
CPU = torch.device("cpu")
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def update_options(drafter: Drafter) -> StepOptions:
    """Update steps: teacher top-32 (the KL losses are over it); the block drafters and SpecBlock launch from 8
    anchors per replayed request (SpecBlock's recipe launches from every position, too slow for an update)."""
    return UPDATE_OPTIONS[family_of(drafter).name]


# Per drafter family (trainer.drafters.families).
UPDATE_OPTIONS: dict[str, StepOptions] = {
    "dflash": BlockStepOptions(topk=32, max_anchors=8),
    "treeflash": BlockStepOptions(topk=32, max_anchors=8),
    "eagle3": Eagle3StepOptions(topk=32),
    "specblock": SpecBlockStepOptions(topk=32, loss=SpecBlockOptions(max_anchors=8)),
}


def broken(drafter: torch.nn.Module) -> str | None:
    """Why a drafter cannot be serving anything useful (non-finite or all-zero weights), else None."""
    params = list(drafter.parameters())
    if any(not torch.isfinite(p).all() for p in params):
        return "non-finite weights"
    if all(not p.any() for p in params if p.dim() > 1):
        return "all weight matrices are zero"
    return None


@dataclass
class PendingDecision:
    """A published update awaiting its outcome: stored in ``state.json`` and in the version's manifest
    (``decision``), so a restart that adopts the version judges it the same way."""

    decision: int  # its number in the decision log
    arm: str
    # Live τ of the version it replaced and that τ's standard error; the τ the decision predicted.
    tau_before: float
    tau_before_se: float
    tau_new: float
    # The paired shadow gain, its standard error, and the lower bound of the live gain it was published on.
    shadow_gain: float
    shadow_se: float
    lower: float
    seen: int  # requests the replay had seen when the candidate was trained
    # The replaced version's lower bound over never-update (the ledger's ratio).
    ratio_parent: float
    # Live evidence of the new version gathered over its judgement's windows so far: steps, Σ tokens, Σ tokens².
    windows: int = 0
    steps: int = 0
    tokens: float = 0.0
    tokens_sq: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: object, path: Path) -> PendingDecision:
        """The pending decision stored in ``path``; a StateError when its keys are not exactly the fields."""
        keys = {f.name for f in fields(cls)}
        if not isinstance(obj, dict) or set(obj) != keys:
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise StateError(
                f"{path} holds a pending decision with keys {got}, not {sorted(keys)}: another version of the "
                "bandit daemon wrote it"
            )
        return cls(**obj)


def _adopted(version_dir: Path) -> tuple[int | None, PendingDecision | None]:
    """A published version's parent and the decision that published it (None for a first or rolled-back
    version), from its manifest."""
    manifest = read_manifest(version_dir)
    decision = manifest.get("decision")
    pending = None if decision is None else PendingDecision.from_json(decision, version_dir / MANIFEST)
    return manifest.get("parent"), pending


@dataclass
class DaemonState:
    """What ``STATE/state.json`` holds: everything a restart needs to go on where the last commit left off. Keys of
    the per-version maps are version numbers as strings (JSON object keys)."""

    version: int
    previous: int | None
    # The decision whose version is being judged, or None.
    pending: PendingDecision | None
    # Per version: how many requests the replay had seen when its drafter was trained (novelty).
    trained_at: dict[str, int]
    replay: dict  # Replay.to_json()
    offsets: dict[str, int] = field(default_factory=dict)
    quarantine_bytes: int = 0
    decisions_bytes: int = 0
    live: dict[str, dict] = field(default_factory=dict)  # LiveTau.to_json() per version
    ref: dict[str, float] = field(default_factory=dict)  # the reference τ per version
    arms: dict[str, dict] = field(default_factory=dict)  # ArmStats.to_json() per arm
    pending_steps: dict[str, list] = field(default_factory=dict)  # step records of unfinished requests
    requests: int = 0
    serving_seconds: float = 0.0
    served_tokens: int = 0
    # The budget (Ledger.to_json()) and the published number of never-update's drafter.
    ledger: dict = field(default_factory=dict)
    baseline_version: int = 1
    decisions: int = 0
    updates: int = 0
    rollbacks: int = 0
    quarantined: int = 0
    # Steps kept out of every live τ, per reason; per version, the drafter name its steps carry.
    ignored: dict[str, int] = field(default_factory=dict)
    drafters: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: object, path: Path) -> DaemonState:
        """The state read from ``path``; a StateError names what is missing or foreign."""
        if not isinstance(obj, dict):
            raise StateError(f"the bandit state {path} is not a JSON object; move it away to start afresh")
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        unknown, missing = set(obj) - {f.name for f in fields(cls)}, required - set(obj)
        if unknown or missing:
            raise StateError(
                f"the bandit state {path} has unknown keys {sorted(unknown)} and lacks {sorted(missing)}: another "
                "version wrote it; move it away to start afresh"
            )
        arm_keys = {f.name for f in fields(ArmStats)}
        arms = obj.get("arms", {})
        foreign = sorted(n for n, arm in arms.items() if not isinstance(arm, dict) or set(arm) != arm_keys)
        if foreign:
            raise StateError(
                f"the bandit state {path} holds arm statistics {foreign} without the keys {sorted(arm_keys)}: another "
                "version wrote it; move it away to start afresh"
            )
        pending = obj["pending"]
        return cls(**{**obj, "pending": None if pending is None else PendingDecision.from_json(pending, path)})


class BanditDaemon:
    """Reads ``logs`` from the committed offsets, decides, publishes drafter versions to ``publish_dir``."""

    def __init__(
        self,
        logs: Path,
        drafter: Path,
        publish_dir: Path,
        state_dir: Path,
        target: str | Path,
        config: BanditConfig = DEFAULT_CONFIG,
        arms: tuple[Arm, ...] = DEFAULT_ARMS,
        options: StepOptions | None = None,
        batch_requests: int = 8,
        max_length: int = 256,
        keep: int = 5,
        seed: int = 0,
        console: Console | None = None,
        device: torch.device = CPU,
        dtype: torch.dtype = torch.float32,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if config.shadow_acceptance not in ("sampled", "greedy"):
            raise UserError(f"--shadow-acceptance must be 'sampled' or 'greedy', got {config.shadow_acceptance!r}")
        if not Path(logs).is_dir():
            raise UserError(f"--logs {logs} is not a directory (a server or `trainer eval --logs` writes one)")
        self.logs, self.publish_dir, self.state_dir = Path(logs), Path(publish_dir), Path(state_dir)
        self.config, self.keep = config, keep
        self.batch_requests, self.max_length = batch_requests, max_length
        self.console = console or Console(highlight=False)
        self.rng = random.Random(seed)
        # What an update's seconds are read from: a simulation replaying a trained candidate charges the seconds
        # its training measured (benchmarks/bandit_trace.py).
        self.clock = clock
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot create the state directory {self.state_dir}: {e.strerror}") from e
        self._lock = lock_state_dir(self.state_dir, "bandit")
        # A daemon that cannot start (an unreadable state, a missing drafter) leaves the directory to the next.
        try:
            # The target in ``dtype`` on ``device`` computes features; the drafters keep float32 weights beside it and
            # compute in ``dtype`` under autocast (a recipe's bf16-mixed precision).
            self.device, self.dtype = device, dtype
            model = load_causal_lm(str(project_path(target)), dtype, device=device)
            self.vocab_size = model.config.vocab_size
            self.state = self._load_state() or self._fresh_state(Path(drafter))
            self._published: set[int] = set()
            self.drafter = self._served_drafter()
            if not (self.state_dir / BASELINE).is_dir():
                # A fresh state: the drafter served now is never-update's, the ledger's baseline.
                partial = self.state_dir / f"{BASELINE}.partial"
                self.drafter.save_pretrained(partial)
                partial.rename(self.state_dir / BASELINE)
            self.options = options or update_options(self.drafter)
            has_approx = family_of(self.drafter).approximator is not None
            self.arms = tuple(a for a in arms if a.params != "approx" or has_approx)
            for arm in self.arms:
                self.state.arms.setdefault(arm.name, ArmStats.fresh(config).to_json())
            self.target = Target(model, list(self.drafter.target_layer_ids))
            truncate_to(self.state_dir / QUARANTINE, self.state.quarantine_bytes)
            truncate_to(self.state_dir / DECISIONS, self.state.decisions_bytes)
            self.reader = LogReader(self.logs, self.state.offsets, vocab_size=self.vocab_size)
        except BaseException:
            self._lock.close()
            raise
        self.stop = threading.Event()
        self.alarm: str | None = None
        # The drafter a pending version replaced, while this process holds it (else loaded from its version).
        self._parent: torch.nn.Module | None = None
        self._feature_cache: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}

    def close(self) -> None:
        """Release the state directory."""
        self._lock.close()

    # ---- state -------------------------------------------------------------------------------------------
    def _fresh_state(self, drafter_dir: Path) -> DaemonState:
        """Publish ``--drafter`` (an HF directory or a training run, ``trainer.runs``) as the first version unless
        one is current, and start counting from it."""
        current = read_current(self.publish_dir)
        previous, pending = None, None
        if current is None:
            hf, _ = resolve_drafter(drafter_dir)
            model = load_drafter(hf)
            if reason := broken(model):
                raise UserError(f"--drafter {drafter_dir}: {reason}")
            version = publish(self.publish_dir, model.save_pretrained, {"kind": "drafter", "source": str(hf)})
        else:
            # Served already (a state directory lost or moved): resume from the version and its decision.
            version = current[0]
            previous, pending = _adopted(current[1])
        # A lost state restarts the budget from the drafter served now: it is never-update's from here on.
        ledger = Ledger(self.config.alpha, ratio={str(version): 1.0})
        if pending is not None:
            ledger.ratio[str(version)] = pending.ratio_parent * (1.0 - self.config.regress_max)
        return DaemonState(
            version=version,
            previous=previous,
            pending=pending,
            trained_at={str(version): pending.seen if pending else 0},
            replay=Replay(self.config.buffer_requests, self.config.holdout_every).to_json(),
            ledger=ledger.to_json(),
            baseline_version=version,
        )

    def _load_state(self) -> DaemonState | None:
        path = self.state_dir / STATE_FILE
        if not path.exists():
            return None
        try:
            state = DaemonState.from_json(json.loads(path.read_text()), path)
        except (OSError, json.JSONDecodeError) as e:
            raise StateError(f"cannot read the bandit state {path}: {e}; move it away to start afresh") from e
        current = read_current(self.publish_dir)
        if current is not None and current[0] != state.version:
            # Published after the last commit: adopt the version with the decision its manifest carries.
            parent, state.pending = _adopted(current[1])
            state.previous, state.version = parent, current[0]
            state.trained_at[str(current[0])] = state.pending.seen if state.pending else state.replay["seen"]
            # Its ratio as the publish or republish set it: the reserved worst case, or the source's.
            source = read_manifest(current[1]).get("rollback_of")
            ratios = state.ledger["ratio"]
            ratios[str(current[0])] = (
                state.pending.ratio_parent * (1.0 - self.config.regress_max)
                if state.pending
                else ratios.get(str(source), 1.0)
            )
        state.ledger["alpha"] = self.config.alpha
        return state

    def commit(self) -> None:
        self.state.offsets = dict(self.reader.offsets)
        try:
            write_text_atomic(self.state_dir / STATE_FILE, json.dumps(asdict(self.state)))
            write_text_atomic(self.state_dir / METRICS, json.dumps(self.metrics(), indent=1))
        except OSError as e:
            raise StateError(f"cannot write the bandit state into {self.state_dir}: {e.strerror}") from e

    def metrics(self) -> dict:
        live = self._live(self.state.version)
        keys = ("version", "previous", "decisions", "updates", "rollbacks", "quarantined", "requests")
        return {
            **{k: getattr(self.state, k) for k in keys},
            "tau": live.tau if live.recent else None,
            "alarm": self.alarm,
            "budget": self._budget(),
            "ignored_steps": dict(self.state.ignored),
        }

    def _budget(self) -> dict:
        """The ledger's figures: served tokens, never-update's pessimistic count, the slack and its share."""
        ledger = Ledger.from_json(self.state.ledger)
        baseline = ledger.baseline
        ratio = ledger.served / baseline if baseline > 0 else None
        return {"alpha": ledger.alpha, "served": ledger.served, "baseline": baseline, "slack": ledger.slack,
                "ratio": ratio, "stall": ledger.stall}  # fmt: skip

    def _served_drafter(self) -> torch.nn.Module:
        current = read_current(self.publish_dir)
        if current is None:
            raise UserError(f"nothing is published under {self.publish_dir}")
        return self._load_drafter(current[1])

    def _load_drafter(self, directory: Path) -> torch.nn.Module:
        """A published version's drafter on the daemon's device (float32 weights; its compute runs under autocast)."""
        return load_drafter(directory).to(self.device)

    def _live(self, version: int | None) -> LiveTau:
        obj = self.state.live.get(str(version))
        return LiveTau.from_json(obj) if obj else LiveTau(self.config.window_steps)

    def _log(self, entry: dict) -> None:
        self.state.decisions_bytes = append_lines(self.state_dir / DECISIONS, [{"time": time.time(), **entry}])

    # ---- reading -----------------------------------------------------------------------------------------
    def read(self) -> int:
        """Apply every log line readable now; returns how many."""
        live: dict[str, LiveTau] = {}
        ledger = Ledger.from_json(self.state.ledger)
        replay = Replay.from_json(self.state.replay)
        pending = self.state.pending_steps
        errors, n = [], 0
        for item in self.reader:
            n += 1
            record = item.record
            if isinstance(record, RecordError):
                errors.append(record)
                continue
            if record["kind"] == "step":
                earlier = pending.get(record["request"])
                admitted = earlier[0]["drafter_version"] if earlier else record["drafter_version"]
                ignored = self._ignored(record, admitted)
                if ignored is None:
                    key = str(record["drafter_version"])
                    if key not in live:
                        live[key] = self._live(key)
                    live[key].add(step_tokens(record), step_seconds(record))
                else:
                    self.state.ignored[ignored] = self.state.ignored.get(ignored, 0) + 1
                # Steps of a version here count at its ratio; the rest (no drafter, another drafter, the server's
                # startup drafter) as never-update's: an update changes none of them. A logged step stands for
                # 1 / log_share served ones.
                drafted = str(record["drafter_version"]) if ignored in (None, "admitted under another version") else ""
                ledger.serve(drafted, step_tokens(record) / self.config.log_share)
                self.state.serving_seconds += step_seconds(record)
                self.state.served_tokens += step_tokens(record)
                pending.setdefault(record["request"], []).append(record)
                while len(pending) > PENDING_REQUESTS:
                    pending.pop(next(iter(pending)))
            else:
                steps = pending.pop(record["request"], [])
                seq = record["prompt_ids"] + record["output_ids"]
                steps = [s for s in steps if s["pos"] < len(seq) and seq[s["pos"]] == s["root"]]
                replay.add(record["prompt_ids"], record["output_ids"], steps)
                self.state.requests += 1
        if errors:
            self.state.quarantine_bytes = quarantine(self.state_dir, errors)
            self.state.quarantined += len(errors)
        for key, value in live.items():
            self.state.live[key] = value.to_json()
        self.state.replay = replay.to_json()
        self.state.ledger = ledger.to_json()
        return n

    def _ignored(self, record: dict, admitted: object) -> str | None:
        """Why a step record says nothing about a version's drafter, or None when it was drafted by the drafter
        of a version published here, for a request whose first step that version drafted (``admitted``: the
        version of the request's first step). A server whose requests share one drafter (vLLM) drafts a running
        request with a new version from the swap on, over drafter state the old one computed; such steps judge
        neither version. Our server keeps a request on its admission version, so there the rule never fires."""
        version = record["drafter_version"]
        if record["drafter"] is None:
            return "no drafter"
        if version is None:
            return "unversioned"
        if version == 0:
            return "startup drafter"
        if type(version) is not int or not self._is_published(version):
            return "unknown version"
        name = self.state.drafters.setdefault(str(version), record["drafter"])
        if name != record["drafter"]:
            return "other drafter"
        return None if version == admitted else "admitted under another version"

    def _is_published(self, version: int) -> bool:
        if version not in self._published and version >= 1 and version_path(self.publish_dir, version).is_dir():
            self._published.add(version)
        return version in self._published

    # ---- deciding ----------------------------------------------------------------------------------------
    def rates(self) -> Rates:
        live = self._live(self.state.version)
        rate = self.state.requests / max(self.state.serving_seconds, 1e-9)
        return Rates(live.tau, live.step_seconds, rate)

    def context(self, live: LiveTau) -> Context:
        """The served version's novelty and drift (trainer/adapt/bandit.py), ``live`` its live τ."""
        version = str(self.state.version)
        seen = self.state.replay["seen"] - self.state.trained_at.get(version, 0)
        novelty = min(1.0, max(0, seen) / self.config.buffer_requests)
        return Context(novelty, drift(self.state.ref[version], live, self.config))

    def decide(self) -> None:
        """One decision if the served version has a full live window (see the module docstring)."""
        version = self.state.version
        live = self._live(version)
        if not live.full or self.state.requests == 0:
            return
        if str(version) not in self.state.ref:
            # An update's version inherits its parent's reference: the drift stays measured from the τ before it
            # until updates recover it (or the learnt regression says they cannot).
            parent = self.state.ref.get(str(self.state.previous), 0.0) if self.state.pending else 0.0
            self.state.ref[str(version)] = max(live.tau, parent)
        best = max(self.state.ref.values())
        if collapsed(live.tau, best, self.config):
            self._raise_alarm(live.tau, best)
            return
        if self.state.pending is not None:
            self._judge(live)
            return
        if self._over_budget():
            return
        self._choose(live)

    def _ledger(self) -> Ledger:
        return Ledger.from_json(self.state.ledger)

    def _ratio(self, version: int | None) -> float:
        return self._ledger().ratio.get(str(version), 1.0)

    def _stall(self, rates: Rates, seconds: float) -> float:
        """Charge the ledger for ``seconds`` the server did not serve: never-update's throughput (the served
        throughput over the served version's lower bound) times them; returns the tokens charged."""
        ledger = self._ledger()
        tokens = rates.throughput / ledger.ratio.get(str(self.state.version), 1.0) * seconds
        ledger.stalled(tokens)
        self.state.ledger = ledger.to_json()
        return tokens

    def _over_budget(self) -> bool:
        """The conservative fallback: when the served version's next window at its lower bound, and the swap back,
        would take the slack below 0, never-update's drafter is served again (its tokens only add slack)."""
        ratio = self._ratio(self.state.version)
        if ratio >= 1.0:
            return False
        rates = self.rates()
        ledger = self._ledger()
        swap = (1.0 - self.config.alpha) * rates.throughput / ratio * self.config.swap_seconds
        if ledger.slack - keep_risk(rates, ratio, self.config) - swap >= 0:
            return False
        entry = {"event": "budget", "version": self.state.version, "ratio": ratio, "slack": ledger.slack}
        self._stall(rates, self.config.swap_seconds)
        entry["rolled_back_to"] = self._republish_baseline()
        self._log(entry)
        self._reset_window(self.state.version)
        return True

    def _raise_alarm(self, tau: float, best: float) -> None:
        self.alarm = f"live tau {tau:.3f} of version {self.state.version} collapsed (best {best:.3f})"
        entry = {"event": "alarm", "version": self.state.version, "tau": tau, "best_tau": best}
        previous = self.state.previous
        if previous is not None and version_path(self.publish_dir, previous).is_dir():
            entry["rolled_back_to"] = self._republish(previous, "alarm")
        self._log(entry)
        self.console.print(f"[bold red]ALARM[/] {self.alarm}", soft_wrap=True)

    def _republish(self, version: int, why: str, model: torch.nn.Module | None = None) -> int:
        """Publish the drafter of an earlier version again, as a new version (``model``: that drafter, when this
        process holds it); it keeps that version's ratio in the ledger."""
        model = model if model is not None else self._load_drafter(version_path(self.publish_dir, version))
        new = publish(self.publish_dir, model.save_pretrained, {"kind": "drafter", "rollback_of": version, "why": why})
        self.state.trained_at[str(new)] = self.state.trained_at.get(str(version), 0)
        ledger = self._ledger()
        ledger.ratio[str(new)] = ledger.ratio.get(str(version), 1.0)
        self.state.ledger = ledger.to_json()
        self.state.previous, self.state.version = None, new
        self.state.pending = None
        self.state.rollbacks += 1
        self.drafter, self._parent = model, None
        return new

    def _republish_baseline(self) -> int:
        """Serve never-update's drafter again (ratio 1 by definition)."""
        model = self._load_drafter(self.state_dir / BASELINE)
        new = self._republish(self.state.baseline_version, "budget", model)
        ledger = self._ledger()
        ledger.ratio[str(new)] = 1.0
        self.state.ledger = ledger.to_json()
        return new

    def _post_publish_holdout(self, seen: int) -> list[int]:
        """Indices of the held-back requests that finished after the replay had seen ``seen`` requests."""
        replay = self.state.replay
        newer = max(0, (replay["seen"] - seen) // replay["holdout_every"])
        count = len(replay["holdout"])
        return list(range(count - min(newer, count), count))

    def _judge(self, live: LiveTau) -> None:
        """The rollback test of the last published update: its live gain judged from the paired shadow gain over
        its parent on the held-back contexts logged since the publish (through the arm's live fit) and from its
        live τ against the parent's, combined; deferred while that estimate is too uncertain to catch a
        regression of ``rollback_effect`` with ``rollback_power``, at most ``judge_windows`` windows; rolled back
        when the estimate is below 0. The ledger's ratio of the version becomes the lower bound of its live gain
        alone."""
        pending = self.state.pending
        config = self.config
        pending.windows += 1
        for tokens, _ in live.recent:
            pending.steps += 1
            pending.tokens += tokens
            pending.tokens_sq += tokens * tokens
        tau = pending.tokens / pending.steps
        var = max(0.0, pending.tokens_sq / pending.steps - tau * tau) * pending.steps / max(1, pending.steps - 1)
        se = math.hypot(pending.tau_before_se, math.sqrt(var / pending.steps))
        realised = tau - pending.tau_before
        live_sd = max(se / pending.tau_before, config.live_noise)
        stats = {name: ArmStats.from_json(obj) for name, obj in self.state.arms.items()}
        arm = stats[pending.arm]
        fit = arm.live if arm.live.n else pooled_priors(self.arms, stats, config)[1]
        rates = self.rates()
        started = self.clock()
        paired, paired_se, paired_live, paired_sd = math.nan, math.inf, math.nan, math.inf
        parent = self._parent
        if parent is None and self.state.previous is not None:
            path = version_path(self.publish_dir, self.state.previous)
            parent = self._load_drafter(path) if path.is_dir() else None
        held = self._post_publish_holdout(pending.seen)
        if parent is not None and held:
            try:
                served, current = self.shadow(parent), self.shadow(self.drafter)
                paired, paired_se = paired_gain([served[i] for i in held], [current[i] for i in held])
            except (RuntimeError, ValueError):
                paired, paired_se = math.nan, math.inf
            if math.isfinite(paired):
                paired_live, paired_sd = live_bound(fit, paired, paired_se)
        seconds = self.clock() - started
        self._stall(rates, seconds * config.update_cost_share)
        gain, sd = combined([(realised / pending.tau_before, live_sd), (paired_live, paired_sd)])
        entry = {"event": "outcome", "decision": pending.decision, "arm": pending.arm, "tau": tau}
        entry |= {"tau_before": pending.tau_before, "realised_gain": realised, "predicted": pending.tau_new}
        entry |= {"paired_gain": paired, "paired_se": paired_se, "judged_gain": gain, "judged_sd": sd}
        entry |= {"power": rollback_power(sd, config), "windows": pending.windows, "update_seconds": seconds}
        if sd > judged_sd(config) and pending.windows < config.judge_windows:
            entry["event"] = "deferred"
            self._log(entry)
            self._reset_window(self.state.version)
            return
        arm.live.add((pending.shadow_gain, 1.0), realised / pending.tau_before, outcome_weight(live_sd, config))
        self.state.arms[pending.arm] = arm.to_json()
        # The ledger rests on the live evidence alone (the shadow's mapping to live gains is a model; the budget
        # must not depend on it).
        ledger = self._ledger()
        ratio = judged_ratio(pending.ratio_parent, realised / pending.tau_before, live_sd, config)
        ledger.ratio[str(self.state.version)] = entry["ratio"] = ratio
        self.state.ledger = ledger.to_json()
        self.state.pending = None
        if rolled_back(gain) and self.state.previous is not None:
            self._stall(rates, config.swap_seconds)
            entry["rolled_back_to"] = self._republish(self.state.previous, "rollback", parent)
        self._parent = None
        self._log(entry)
        self._reset_window(self.state.version)

    def _choose(self, live: LiveTau) -> None:
        rates = self.rates()
        version = self.state.version
        config = self.config
        stats = {name: ArmStats.from_json(obj) for name, obj in self.state.arms.items()}
        ratio = self._ratio(version)
        replay = Replay.from_json(self.state.replay)
        context = self.context(live)
        arm_name, estimates = plan(rates, context, self.arms, stats, config, self._ledger().slack, ratio)
        if not any(r["steps"] for r in replay.holdout) or not replay.train:
            # A candidate could be neither trained nor judged: spending the update would buy nothing.
            arm_name = SKIP
        self.state.decisions += 1
        entry = {"event": "decision", "decision": self.state.decisions, "version": version, "tau": rates.tau}
        entry |= {"tau_ref": self.state.ref[str(version)], "step_seconds": rates.step_seconds}
        entry |= {"novelty": context.novelty, "drift": context.drift}
        entry |= {"request_rate": rates.request_rate, "horizon_s": rates.horizon_seconds(config)}
        entry |= {"estimates": [asdict(e) | {"net": e.net} for e in estimates]}
        entry |= {"arm": arm_name, "budget": self._budget()}
        entry["holdout_requests"] = sum(1 for r in replay.holdout if r["steps"])
        if arm_name == SKIP:
            self._log(entry)
            # A fresh window before the next look, so one stale window is not decided on twice.
            self._reset_window(version)
            return
        arm = next(a for a in self.arms if a.name == arm_name)
        started = self.clock()
        try:
            candidate = self.train(arm)
            served_shadow, cand_shadow = self.shadow(self.drafter), self.shadow(candidate)
            gain, gain_se = paired_gain(served_shadow, cand_shadow)
        except (NonFiniteStep, RuntimeError, ValueError) as e:
            # An update that fails (non-finite loss, an optimiser overflow, a shape error) is logged; the served
            # version stays.
            candidate, served_shadow, cand_shadow, entry["failed"] = None, [], [], f"{type(e).__name__}: {e}"
            gain, gain_se = math.nan, math.inf
        seconds = self.clock() - started
        self._stall(rates, seconds * config.update_cost_share)
        stats[arm_name].measured(seconds)
        stats[arm_name].tried += 1
        if math.isfinite(gain):
            stats[arm_name].lift.add(context.x, gain)
        self.state.arms[arm_name] = stats[arm_name].to_json()
        fit = stats[arm_name].live if stats[arm_name].live.n else pooled_priors(self.arms, stats, config)[1]
        live_mean, live_sd = live_bound(fit, gain, gain_se) if math.isfinite(gain) else (math.nan, math.inf)
        lower = live_mean - config.confidence_z * live_sd
        # What the judgement may still cost: the publish's swap, a rollback's, the version's worst case until judged.
        risk = update_risk(rates, ratio, 0.0, config)
        slack = self._ledger().slack
        tau_new = rates.tau * (1.0 + live_mean)
        entry |= {"update_seconds": seconds, "shadow_served": _mean(served_shadow)}
        entry |= {"shadow_candidate": _mean(cand_shadow), "shadow_gain": gain, "shadow_se": gain_se}
        entry |= {"live_gain": live_mean, "live_sd": live_sd, "lower": lower, "tau_new": tau_new}
        entry |= {"risk": risk, "slack": slack, "published": None}
        if candidate is not None and (reason := broken(candidate)) is not None:
            entry["failed"] = reason
        elif candidate is not None and should_publish(rates, lower, config) and risk <= slack:
            pending = PendingDecision(
                self.state.decisions, arm_name, rates.tau, live.se, tau_new, gain, gain_se, lower, replay.seen, ratio
            )
            manifest = {"kind": "drafter", "parent": version, "decision": pending.to_json()}
            self._stall(rates, config.swap_seconds)
            new = publish(self.publish_dir, candidate.save_pretrained, manifest, keep=self.keep)
            self.state.trained_at[str(new)] = replay.seen
            ledger = self._ledger()
            ledger.ratio[str(new)] = ratio * (1.0 - config.regress_max)
            self.state.ledger = ledger.to_json()
            entry["published"] = new
            self.state.previous, self.state.version, self.state.pending = version, new, pending
            self.state.updates += 1
            self._parent, self.drafter = self.drafter, candidate
        self._log(entry)
        self._reset_window(version)

    def _reset_window(self, version: int) -> None:
        live = self._live(version)
        live.recent.clear()
        self.state.live[str(version)] = live.to_json()

    # ---- updating ----------------------------------------------------------------------------------------
    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def _batch(self, replay: Replay) -> dict[str, torch.Tensor]:
        picks = [self.rng.choice(replay.train) for _ in range(self.batch_requests)]
        seqs = [(r["prompt"] + r["output"])[: self.max_length] for r in picks]
        starts = [min(len(r["prompt"]), len(s) - 1) for r, s in zip(picks, seqs, strict=True)]
        return context_batch(seqs, starts, 0, [self._features(seq) for seq in seqs], self.device)

    def _features(self, seq: list[int]) -> dict[str, torch.Tensor]:
        """The target's features of one replayed sequence, computed once: every update step that draws it again,
        both shadow evaluations of an update, and every later update while it stays in the buffer reuse them.
        Bounded: the least recently computed go first beyond twice the buffer."""
        key = tuple(seq)
        row = self._feature_cache.get(key)
        if row is None:
            batch = with_features(context_batch([seq], [0], 0, device=self.device), self.target, self.options.topk)
            row = self._feature_cache[key] = {k: batch[k][0] for k in FEATURE_KEYS}
            while len(self._feature_cache) > 2 * self.config.buffer_requests:
                self._feature_cache.pop(next(iter(self._feature_cache)))
        return row

    def train(self, arm: Arm) -> torch.nn.Module:
        """A candidate: a copy of the served drafter after the arm's steps on replayed requests."""
        replay = Replay.from_json(self.state.replay)
        if not replay.train:
            raise NonFiniteStep("no replayed requests to train on")
        candidate = copy.deepcopy(self.drafter)
        family = family_of(candidate)
        lora = None
        if arm.params == "lora":
            from peft import LoraConfig, get_peft_model

            # peft injects the adapters into the module in place: the candidate's own forward runs through them.
            lora = get_peft_model(family.core(candidate), LoraConfig(r=8, lora_alpha=16, target_modules=LORA_MODULES))
            params = [p for p in lora.parameters() if p.requires_grad]
        else:
            params = family.parameters(candidate, arm.params)
        optimizer = torch.optim.AdamW(params, lr=arm.lr, weight_decay=0.0)
        for i in range(arm.steps):
            step = self.state.updates * 1000 + i
            with self._autocast():
                train_step(candidate, self.target, self._batch(replay), optimizer, step, self.options)
        if lora is not None:
            candidate = family.with_core(candidate, lora.merge_and_unload())
        candidate.eval()
        return candidate

    @torch.no_grad()
    def shadow(self, drafter: torch.nn.Module) -> list[torch.Tensor]:
        """Expected tokens per step of ``drafter`` at each held-back logged context (a chain of the family's depths
        against the logged target top-k along each step's accepted path), one tensor per held-back request in the
        replay's order (empty for a request without steps), so that two drafters pair context by context.

        Shape: [(C_r,)] per held-back request r
        """
        replay = Replay.from_json(self.state.replay)
        depth = chain_depth(drafter, self.options)
        totals = []
        for request in replay.holdout:
            steps = request["steps"]
            if not steps:
                totals.append(torch.zeros(0))
                continue
            seq = request["prompt"] + request["output"]
            # Shape: (C, D, V) the drafter's distributions of depths 1..D at each logged root
            roots = [s["pos"] for s in steps]
            with self._autocast():
                logits = chain_logits(drafter, self.target, seq, roots, self.options, self._features(seq)).float()
            k = len(steps[0]["topk_ids"][0])
            ids = torch.zeros(len(steps), depth, k, dtype=torch.long)
            logprobs = torch.full((len(steps), depth, k), -math.inf)
            depths = torch.tensor([min(len(s["topk_ids"]), depth) for s in steps])
            for c, s in enumerate(steps):
                d = depths[c]
                ids[c, :d] = torch.tensor(s["topk_ids"][:d])
                logprobs[c, :d] = torch.tensor(s["topk_logprobs"][:d])
            ids, logprobs, depths = ids.to(self.device), logprobs.to(self.device), depths.to(self.device)
            alpha = acceptance(logits, ids, logprobs, greedy=self.config.shadow_acceptance == "greedy")
            totals.append(expected_accepted(alpha, depths).cpu())
        return totals

    # ---- running -----------------------------------------------------------------------------------------
    def run(self, once: bool, poll_seconds: float = 1.0) -> int:
        """Read, decide, commit until drained (``once``) or stopped; ``ALARM_EXIT`` after an alarm, else 0."""
        if reason := broken(self.drafter):
            self.alarm = f"served version {self.state.version}: {reason}"
            self._log({"event": "alarm", "version": self.state.version, "reason": reason})
            self.console.print(f"[bold red]ALARM[/] {self.alarm}", soft_wrap=True)
            self.commit()
            return ALARM_EXIT
        while True:
            n = self.read()
            self.decide()
            self.commit()
            if self.alarm is not None:
                return ALARM_EXIT
            if once or self.stop.is_set():
                return 0
            if n == 0:
                self.stop.wait(poll_seconds)


def _mean(contexts: list[torch.Tensor]) -> float:
    """Mean expected tokens per step over every context of a shadow evaluation (NaN without any)."""
    flat = torch.cat([torch.zeros(0), *contexts])
    return float(flat.mean()) if flat.numel() else math.nan


def run_bandit(
    logs: Path,
    drafter: Path,
    publish_dir: Path,
    state_dir: Path | None = None,
    once: bool = False,
    target: str | Path = "checkpoints/target_tiny",
    config: BanditConfig = DEFAULT_CONFIG,
    poll_seconds: float = 1.0,
    device: torch.device = CPU,
    dtype: torch.dtype = torch.float32,
) -> int:
    """The ``trainer adapt bandit`` command: SIGTERM/SIGINT finish the current decision, commit, exit 0."""
    state = state_dir or Path(publish_dir) / ".state"
    daemon = BanditDaemon(logs, drafter, publish_dir, state, target, config, device=device, dtype=dtype)
    try:
        return run_until_signalled(daemon.stop, lambda: daemon.run(once, poll_seconds))
    finally:
        daemon.close()
