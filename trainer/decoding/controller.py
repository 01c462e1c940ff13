"""The cost-aware controller: per step, the builder and budget (down to no speculation) that maximise the
batch's expected tokens per second, from costs and acceptance measured live.

An arm is a (builder, budget) pair: plain decoding, drafter-free retrieval and the neural drafter's builder at a
few budgets. Expected throughput of an arm at batch size ``B`` is ``B · τ(arm, B) / cost(arm, B)``: τ from the
live acceptance by depth, cost from measured step times scaled by the machine's current speed. Every step takes
the best estimate, except probes of stale arms paid from a budget of lost throughput; a drafter's sessions ride
on new requests only while one of its arms is within a margin of the best. Nothing is assumed about the hardware.
The rules, why each is there and the measurements behind them: docs/controller.md. On CPU::

    python -c "from trainer.decoding.controller import Controller; c = Controller(Controller.arms('ddtree')); \\
        print(c.choose(1))"
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from trainer.decoding.batch import Fixed, Policy, RowStep
from trainer.decoding.tree import NestedTree, Tree


class TreeArm(NamedTuple):
    """An option of the controller: a tree builder at a budget (``("none", 0)``: plain decoding)."""

    tree: str
    budget: int


class Plan(NamedTuple):
    """A choice held for the next steps: made at ``batch_size`` with ``available`` builders, good until step
    ``until``."""

    batch_size: int
    available: frozenset[str] | None
    until: int
    arm: TreeArm


PLAIN = TreeArm("none", 0)
RECYCLING_BUDGETS = (8, 16, 32)
NEURAL_BUDGETS = (4, 8, 16)


@dataclass
class ReachEstimate:
    # reach[d - 1]: EMA of P(accepted path reaches depth d), over `rows` row-steps.
    reach: list[float] = field(default_factory=list)
    rows: int = 0
    # 1 + Σ reach, kept with it (read for every arm at every choice).
    tau: float = 1.0
    # EMA of the square of a row's accepted length + 1 (over the same rows): the spread of τ's rows.
    square: float = 1.0

    def doubt(self, decay: float) -> float:
        """How optimistic ``tau`` may be for want of rows: its standard error as a share of it, as far as that
        exceeds the error of an average over the whole window (an EMA of rate ``decay`` weighs about
        ``2 / decay`` rows); 0 from a full window on."""
        excess = (1 / self.rows if self.rows else 0.0) - decay / (2 - decay)
        if excess <= 0:
            return 0.0
        return math.sqrt(max(self.square - self.tau**2, 0.0) * excess) / self.tau


@dataclass
class CostCell:
    """An arm's step seconds at one batch size, at speed 1 (``Controller.cost`` multiplies by the current speed)."""

    # exp(median of ``samples``).
    seconds: float = 0.0
    # The controller's step counter when last measured (-1: never).
    last_step: int = 0
    measurements: int = 0
    # log seconds at speed 1 of the last ``cost_window`` measurements, each divided by the machine's speed around it.
    samples: deque[float] = field(default_factory=deque)

    def add(self, log_seconds: float, window: int) -> None:
        """Take one measurement (log seconds at speed 1) into the last ``window``."""
        self.samples.append(log_seconds)
        while len(self.samples) > window:
            self.samples.popleft()
        self.seconds = math.exp(statistics.median(self.samples))


class Pending(NamedTuple):
    """A measurement of an arm whose figure rests on less than a full window, held until the steps after it tell
    the machine's speed around it."""

    cell: CostCell
    log_seconds: float
    # ``Controller.observed`` when it was taken, and the speed (log) then: its reference if no established
    # figure's step falls around it.
    at: int
    drift: float


@dataclass
class TreeArmStats:
    # Batch size → acceptance of the arm's steps at that size; with ``pooled`` one entry (key 0) for every size.
    accept: dict[int, ReachEstimate] = field(default_factory=dict)
    # Batch size → the arm's step seconds there.
    cost: dict[int, CostCell] = field(default_factory=dict)
    # One acceptance for every batch size: a neural drafter's rows draft each from their own context, so what a
    # row accepts does not depend on the rows beside it (retrieval's rows share the adjacency they learn).
    pooled: bool = False

    def key(self, batch_size: int) -> int:
        """The ``accept`` key of ``batch_size``."""
        return 0 if self.pooled else batch_size

    def acceptance(self, batch_size: int) -> ReachEstimate | None:
        """The acceptance at ``batch_size``, or at the nearest size where the arm was measured (None: never)."""
        batch_size = self.key(batch_size)
        if batch_size in self.accept or not self.accept:
            return self.accept.get(batch_size)
        return self.accept[min(self.accept, key=lambda b: abs(b - batch_size))]

    def tau(self, batch_size: int) -> float:
        """τ at ``batch_size``, or at the nearest size where the arm was measured (1.0: never)."""
        accept = self.acceptance(batch_size)
        return 1.0 if accept is None else accept.tau


def _depth(tree: Tree) -> int:
    return int(tree.depths().max()) if tree.size else 0


def _losses(rates: dict[TreeArm, float]) -> dict[TreeArm, float]:
    """Per arm, the share of its step lost against the best of ``rates`` (tokens per second)."""
    top = max(rates.values())
    return {a: 1.0 - r / top if top > 0 else 0.0 for a, r in rates.items()}


class Controller:
    """Chooses each step's arm from live measurements; see the module docstring for the rule."""

    def __init__(
        self,
        arms: list[TreeArm],
        probe_share: float = 0.005,
        probe_grace: float = 0.2,
        probe_half_life: float = 30.0,
        ready_margin: float = 0.05,
        refresh: float = 30.0,
        tau_decay: float = 0.01,
        tau_prior: int = 16,
        cost_window: int = 15,
        speed_window: int = 9,
        pair_steps: int = 3,
        min_samples: int = 2,
        replan: int = 8,
        recheck: int = 25,
    ) -> None:
        self.arms = [TreeArm(*a) for a in arms]
        # Builders whose trees were seen nested (retrieval's): a budget's tree holds every smaller budget's.
        self.nested: set[str] = set()
        # Builders whose sessions a request gets only while ``ready`` (a drafter's; not retrieval's).
        self.neural = {tree for tree, _ in self.arms} - {PLAIN.tree, "recycling"}
        self.stats = {arm: TreeArmStats(pooled=arm.tree in self.neural) for arm in self.arms}
        self.probe_share = probe_share
        self.probe_grace = probe_grace
        self.probe_half_life = probe_half_life
        self.ready_margin = ready_margin
        self.refresh = refresh
        self.tau_decay = tau_decay
        self.tau_prior = tau_prior
        self.cost_window = cost_window
        self.speed_window = speed_window
        self.pair_steps = pair_steps
        # log of the machine's speed factor (0: as when the figures started); ``speed`` = exp(drift): the median of
        # ``surprises``, the last ``speed_window`` steps' log seconds over their arm's figure, counted only for
        # arms whose figure at the step's batch size rests on a full window (``_known``).
        self.drift = 0.0
        self.speed = 1.0
        self.surprises: deque[float] = deque(maxlen=speed_window)
        # (``observed`` at the step, its surprise) of the last established steps: the speed around a pending one.
        self.marks: deque[tuple[int, float]] = deque(maxlen=2 * pair_steps + 1)
        self.pending: list[Pending] = []
        # Steps observed so far.
        self.observed = 0
        self.min_samples = min_samples
        self.replan = replan
        self.recheck = recheck
        # (batch size, available builders, last step it holds for, arm): the best estimate, reused without
        # recomputing while the batch and its builders stay the same (see ``choose``).
        self.plan: Plan | None = None
        self.steps = 0
        self.last: TreeArm = self.arms[0]
        # ``speculating()``, decided with each choice; a controller that has measured nothing keeps every option ready.
        self.keep_ready = True
        # Whether the chosen arm is not the best estimate (a probe, or an arm's first try), and the best
        # estimate's tokens per second at the step's batch size.
        self.probing = False
        self.best_rate = 0.0
        # Batch size of recent steps, exponentially weighted over about 20 steps: what a request admitted now
        # will mostly run at, so readiness is judged there, not at the dip of a step after a request left.
        self.load: float | None = None
        # Per arm, its loss against the best estimate at the recent batch size (empty: nothing chosen yet).
        self.losses: dict[TreeArm, float] = {}
        # Per arm, ``seconds`` when it was last measured.
        self.measured_at: dict[TreeArm, float] = {}
        # Step seconds so far; and exponentially weighted (half-life ``probe_half_life``): step seconds, and
        # seconds of throughput lost to probing.
        self.seconds = 0.0
        self.recent_seconds = 0.0
        self.probe_seconds = 0.0

    @staticmethod
    def arms(neural_tree: str | None) -> list[TreeArm]:
        """Plain decoding, recycling at a few budgets, and the neural builder at a few budgets if there is one."""
        arms = [PLAIN] + [TreeArm("recycling", b) for b in RECYCLING_BUDGETS]
        if neural_tree is not None and neural_tree not in ("none", "recycling"):
            arms += [TreeArm(neural_tree, b) for b in NEURAL_BUDGETS]
        return arms

    def cost(self, arm: TreeArm, batch_size: int) -> float | None:
        """Estimated seconds of a step with ``arm`` at ``batch_size``; None if the arm was never measured. A builder
        whose trees are nested costs no more at a budget than at any larger one measured at ``batch_size`` (see
        ``tau``). Not than a larger one's cost scaled from another size: that estimate is optimistic on purpose (so
        that the arm gets tried), and as a bound it made every smaller budget as cheap (at four requests
        recycling@32, measured only at one request, was estimated at 1.5 times its cost there where it costs 4
        times; recycling@8 and @16, bounded by it, looked as fast as plain decoding, 15% and 30% faster than they
        ran, and the controller stayed on them through re-checks of plain decoding)."""
        own, (tree, budget) = self._cost(arm, batch_size), arm
        if own is None or tree not in self.nested:
            return own
        larger = (
            self._cost(a, batch_size)
            for a in self.arms
            if a.tree == tree and a.budget > budget and batch_size in self.stats[a].cost
        )
        return min([own, *(c for c in larger if c is not None)])

    def tau(self, arm: TreeArm, batch_size: int) -> float:
        """The arm's τ at ``batch_size`` (1.0: never measured). A nested builder's tree at a budget contains its tree
        at every smaller one, and verification walks the same sampled tokens down both, so it accepts at least as
        much: its τ is at least theirs, and its step costs no more than a larger budget's. Each arm's own figures
        are measured only when it runs, while a nested step measures the acceptance of every smaller budget
        (``observe``): without the bounds, at one request a controller that ran recycling@8 kept @16's τ from ~30
        early rows (1.52, where it realised 1.85 later) and probed it a few times a minute for looking 15% behind;
        one that ran @16 kept @8's cost from its first 20 steps, 50% above what @8 realised, and ran @16 for 94% of
        its steps."""
        own, (tree, budget) = self.stats[arm].tau(batch_size), arm
        if tree not in self.nested:
            return own
        smaller = (self.stats[a].tau(batch_size) for a in self.arms if a.tree == tree and a.budget < budget)
        return max([own, *smaller])

    def _cost(self, arm: TreeArm, batch_size: int) -> float | None:
        """The arm's own cost figure at ``batch_size`` (scaled from another size where not measured there)."""
        cells = self.stats[arm].cost
        if batch_size in cells:
            return cells[batch_size].seconds * self.speed
        if not cells:
            return None
        plain = self.stats[PLAIN].cost if PLAIN in self.stats else {}
        common = [b for b in cells if b in plain]
        if batch_size in plain and common:
            near = min(common, key=lambda b: abs(b - batch_size))
            return cells[near].seconds * plain[batch_size].seconds / plain[near].seconds * self.speed
        near = min(cells, key=lambda b: abs(b - batch_size))
        return cells[near].seconds * batch_size / near * self.speed

    def throughput(self, arm: TreeArm, batch_size: int, cost: float | None = None) -> float:
        """Expected tokens per second of ``arm`` at ``batch_size`` (0 if never measured); ``cost``: its
        ``cost(arm, batch_size)`` when the caller has it."""
        cost = self.cost(arm, batch_size) if cost is None else cost
        return 0.0 if cost is None else batch_size * self.tau(arm, batch_size) / cost

    def choose(self, batch_size: int, available: frozenset[str] | None = None) -> TreeArm:
        """The arm of the next step at ``batch_size``, among the builders in ``available`` (None: all)."""
        self.steps += 1
        self.load = batch_size if self.load is None else self.load + 0.05 * (batch_size - self.load)
        # The estimates of every arm, the probe and readiness decisions are recomputed every ``replan`` steps, or
        # sooner when the batch size or its builders change; in between the best estimate runs again. A figure is
        # the median of a window of measurements and the machine's speed scales every arm alike, so a choice holds
        # over a few steps. Recomputed every step in Python it cost 0.06 ms, half of the 0.12 ms by
        # which the controller's plain steps at eight requests exceeded a plain engine's 11.4 ms (measured in process).
        plan = self.plan
        if (
            plan is not None
            and plan.batch_size == batch_size
            and plan.available == available
            and self.steps <= plan.until
        ):
            self.last, self.probing = plan.arm, False
            return self.last
        arms = self.arms if available is None else [a for a in self.arms if a.tree in available]
        # Each arm's estimated cost and throughput once per choice (its Python is overhead on a step).
        costs = {a: self.cost(a, batch_size) for a in arms}
        rates = {a: self.throughput(a, batch_size, c) for a, c in costs.items()}
        loss = _losses(rates)
        # At the recent batch size and against every arm, for readiness: an arm that is best but not available
        # now is what readiness brings back. Usually the same figures as the step's (computed once then).
        typical = self._typical()
        if typical == batch_size and len(arms) == len(self.arms):
            self.losses = loss
        else:
            self.losses = _losses({a: self.throughput(a, typical) for a in self.arms})
        best = min(arms, key=loss.__getitem__)
        self.best_rate = rates[best]
        untried = [
            a
            for a in arms
            if not self.stats[a].cost
            or (a == PLAIN and self.stats[a].cost.get(batch_size, CostCell()).measurements < self.min_samples)
        ]
        if untried:
            self.last = untried[0]
        else:
            # The stalest arm, among the available ones and those a request admitted now is made ready for, is
            # probed once its estimated loss fits in what is left of the budget; until then the best estimate
            # runs and the budget saves up. Cheaper probes of fresher arms do not jump the queue: spending the
            # budget as it refilled, they starved an expensive arm whose sessions every row carried meanwhile
            # (at eight requests, drafter sessions on every row cost 3.5% of a plain step).
            stalest = lambda a: self._measured_step(a, batch_size)  # noqa: E731
            # A due neural builder whose sessions every row now carries is probed at once, on credit: waiting
            # for the budget would cost those sessions on every step meanwhile.
            due_trees = {tree for tree in self.neural if self.due(tree)}
            ridden = [a for a in arms if a.tree in due_trees]
            if ridden:
                self.last = min(ridden, key=stalest)
            elif (recheck := self._recheck(best, loss, batch_size)) is not None:
                self.last = recheck
            else:
                # Builders some row lacks the sessions of, whose sessions requests admitted now get.
                missing = {tree for tree, _ in self.arms} - {tree for tree, _ in arms}
                ready = {tree for tree in missing if self.ready(tree)}
                due = min((a for a in self.arms if a in costs or a.tree in ready), key=stalest)
                worth = self._worth(loss[a] for a in arms if a != best)
                fits = due in costs and (costs[due] or 0.0) * loss[due] <= self.probe_left(worth)
                self.last = due if fits else best
        self.probing = bool(untried) or loss[self.last] > 0.0
        self.keep_ready = any(self._near_best(a) for a in arms if a.tree != "none")
        # Only a best estimate measured at this batch size is reused: a probe or a first try runs once, and so does
        # an arm that is best only on a cost scaled from another size (optimistic for a drafting arm on a CPU: held,
        # the drafter's arms ran 8 steps each at eight requests, at 2.5-4 times a plain step, whenever it came due).
        held = not untried and self.last == best and batch_size in self.stats[best].cost
        self.plan = Plan(batch_size, available, self.steps + self.replan - 1, best) if held else None
        return self.last

    def _recheck(self, best: TreeArm, loss: dict[TreeArm, float], batch_size: int) -> TreeArm | None:
        """Plain decoding, after ``recheck`` steps divided by what looking at it is worth, or a smaller budget of the
        best estimate's nested builder, after ``recheck`` steps, without a measurement at ``batch_size`` (the
        stalest such); it is then measured on credit (its realised loss charged as a probe's). None: nothing is
        due."""
        # Plain decoding's interval grows with its loss once its figure at the size rests on a full window; a
        # smaller nested budget's does not: its figure against the best estimate's rests on its cost alone, and a
        # stale cost is what makes it look far behind. A figure of fewer measurements, the first steps at the size
        # among them (they can cost 1.6 times a steady step, and a machine shared with other jobs preempts one step
        # in ten), is not known well enough to be judged far behind: grown with the loss its first two steps made,
        # the interval let that figure stand for hundreds of steps (at four requests plain decoding's first steps
        # cost 2.5 times its steady step, it was re-checked once in 200 steps, and the controller ran recycling@8,
        # 15% behind).
        due = [
            a
            for a, share in loss.items()
            if a != best
            and (a == PLAIN or (a.tree == best.tree in self.nested and a.budget < best.budget))
            and self.steps - self._measured_step(a, batch_size)
            >= self.recheck / (self._worth([share]) if a == PLAIN and self._known(a, batch_size) else 1)
        ]
        return min(due, key=lambda a: self._measured_step(a, batch_size)) if due else None

    def _known(self, arm: TreeArm, batch_size: int) -> bool:
        """Whether the arm's cost figure at ``batch_size`` rests on a full window of measurements."""
        cell = self.stats[arm].cost.get(batch_size)
        return cell is not None and len(cell.samples) >= self.cost_window

    def _measured_step(self, arm: TreeArm, batch_size: int) -> int:
        """The step at which ``arm`` was last measured at ``batch_size`` (-1: never)."""
        return self.stats[arm].cost.get(batch_size, CostCell(last_step=-1)).last_step

    def _typical(self) -> int:
        """The recent batch size, rounded (1 before any step)."""
        return max(1, round(self.load or 1))

    def _near_best(self, arm: TreeArm) -> bool:
        """Never measured, the best estimate, or within ``ready_margin`` of it at the recent batch size with its τ
        one standard error lower."""
        loss = self.losses.get(arm, 0.0)
        if arm not in self.measured_at or loss == 0.0:
            return True
        if loss > self.ready_margin:
            return False
        accept = self.stats[arm].acceptance(self._typical())
        doubt = 0.0 if accept is None else accept.doubt(self.tau_decay)
        return 1.0 - (1.0 - loss) * (1.0 - doubt) <= self.ready_margin

    def _worth(self, losses: Iterable[float]) -> float:
        """What looking at arms with these ``losses`` against the best estimate is worth, as a share of the probing
        budget or of the refresh rate: 1 while the nearest is within ``ready_margin``, else ``ready_margin`` / its
        loss (an arm a third behind needs a large change before it could win: it is looked at less often)."""
        nearest = min(losses, default=0.0)
        return 1.0 if nearest <= self.ready_margin else self.ready_margin / nearest

    def due(self, tree: str) -> bool:
        """``tree`` was measured before, but none of its arms for ``refresh`` seconds of step time, divided by
        what looking at them is worth at the recent batch size."""
        times = [self.measured_at[a] for a in self.arms if a.tree == tree and a in self.measured_at]
        if not times:
            return False
        worth = self._worth(self.losses.get(a, 0.0) for a in self.arms if a.tree == tree)
        return self.seconds - max(times) >= self.refresh / worth

    def ready(self, tree: str) -> bool:
        """Whether a request admitted now gets ``tree``'s drafting session: one of its arms was never measured
        or is within ``ready_margin`` of the best estimate at the recent batch size, or the builder is ``due``."""
        return self.due(tree) or any(self._near_best(a) for a in self.arms if a.tree == tree)

    def probe_left(self, worth: float = 1.0) -> float:
        """Seconds of throughput that probing may still lose now (negative: overspent), with the budget's share
        scaled by ``worth``."""
        grace = self.probe_grace * 0.5 ** (self.seconds / self.probe_half_life)
        return worth * self.probe_share * self.recent_seconds + grace - self.probe_seconds

    def speculating(self) -> bool:
        """Whether a drafting arm is within ``ready_margin`` of the best estimate at the recent batch size, or was
        never measured. Then the engine keeps drafting state learning on plain steps too (recycling's adjacency,
        every admitted prompt's logits); otherwise it saves that work. The margin keeps an arm that is nearly
        best from going stale for want of learning and then measuring worse than it is. A probe does not turn
        it on (its own step learns its nodes: the engine learns on every step that drafts): with probes
        counted, the prompt logits of the requests admitted after them, an LM head over each prompt that the
        probe budget does not see, were the largest cost of probing at eight requests (in the server 0.97x
        plain decoding with, 0.995x without)."""
        return self.keep_ready

    def observe(self, tree: str, budget: int, batch_size: int, rows: list[RowStep], seconds: float) -> None:
        self.seconds += seconds
        fade = 0.5 ** (seconds / self.probe_half_life)
        self.recent_seconds = self.recent_seconds * fade + seconds
        # A probe is charged what it realised: its seconds less those the best estimate would have needed for
        # the tokens it committed. Charged its estimated loss instead, probes right after stretches of plain
        # decoding (recycling's adjacency stale, its first tree slow) lost 2.6% at four requests for 1% budgeted.
        self.probe_seconds *= fade
        if self.probing:
            tokens = sum(len(row.new) for row in rows)
            self.probe_seconds += max(0.0, seconds - tokens / self.best_rate) if self.best_rate > 0 else seconds
        stats = self.stats.get((tree, budget))
        if stats is None:
            return
        self.measured_at[tree, budget] = self.seconds
        self.observed += 1
        cell = stats.cost.setdefault(batch_size, CostCell())
        cell.measurements += 1
        log_seconds = math.log(max(seconds, 1e-9))
        # Costs are compared as medians, the machine's speed and every figure alike: this machine's step times
        # have a long right tail (a step preempted by another job runs 2-3 times its cost, 10% of steps), and a
        # mean where the speed takes a median (a clipped average) inflated every figure learnt from single
        # steps by the tail's weight, ~10% on a 2-core machine shared with other jobs: plain decoding, re-checked
        # one step at a time while recycling@8 ran, looked as dear as recycling though 15% cheaper, and the
        # running arm's figure crept up against the others' at every step (its mean rose while the speed fell).
        if self._known((tree, budget), batch_size):
            # An established figure tells the machine's speed: a young one's surprise is mostly its own error (a
            # first step's one-time costs). A median of the last few: one preempted step moves it by nothing, a
            # machine that slows moves it within half a window.
            surprise = log_seconds - math.log(cell.seconds)
            self.surprises.append(surprise)
            self.marks.append((self.observed, surprise))
            self.drift = statistics.median(self.surprises)
            self.speed = math.exp(self.drift)
            cell.add(log_seconds - self.drift, self.cost_window)
        elif not cell.samples:
            cell.add(log_seconds - self.drift, self.cost_window)
        else:
            # Divided by the speed around the step, the steps before and after it, once those have run: the speed
            # of the steps before alone lags a machine that slows or recovers by a few steps, and a probe or a
            # re-check that fell there took the error whole (the arm's figure rests on a few such measurements).
            self.pending.append(Pending(cell, log_seconds, self.observed, self.drift))
        self._pair()
        cell.last_step = self.steps
        if (tree, budget) == PLAIN:
            # No draft node verified: plain decoding's τ is 1, nothing to learn per row.
            return
        self._learn(stats, batch_size, [(len(r.event.path), _depth(r.event.tree)) for r in rows])
        # Nested trees (retrieval's) tell every smaller budget's acceptance on the same rows: arms a few percent
        # apart are then compared on one sample, not on windows taken at different times, each as noisy as
        # their difference (a 100-row window's τ has a standard error of ~6%; at one request the controller
        # split its steps between recycling@8 and @16, and ran 4% behind a fixed recycling@8 in process).
        nested = [r.event.tree for r in rows if isinstance(r.event.tree, NestedTree)]
        if rows and len(nested) == len(rows):
            self.nested.add(tree)
            for smaller in [a for a in self.arms if a.tree == tree and a.budget < budget]:
                cut = [t.within(r.event.path, smaller[1]) for t, r in zip(nested, rows, strict=True)]
                self._learn(self.stats[smaller], batch_size, cut)

    def _pair(self) -> None:
        """Take in the pending measurements taken ``pair_steps`` steps ago, each divided by the median speed of the
        established steps from ``pair_steps`` before it to as many after (or by the speed when it was taken, if
        none ran there)."""
        ripe = [p for p in self.pending if self.observed - p.at >= self.pair_steps]
        if not ripe:
            return
        self.pending = [p for p in self.pending if self.observed - p.at < self.pair_steps]
        for cell, log_seconds, at, drift in ripe:
            around = [surprise for step, surprise in self.marks if abs(step - at) <= self.pair_steps]
            cell.add(log_seconds - (statistics.median(around) if around else drift), self.cost_window)

    def _learn(self, stats: TreeArmStats, batch_size: int, rows: list[tuple[int, int]]) -> None:
        """Fold rows of (accepted path length with the root, the tree's depth) into the arm's acceptance at
        ``batch_size``."""
        accept = stats.accept.get(stats.key(batch_size))
        if accept is None:
            # A new size starts from the nearest size's acceptance, weighted as ``tau_prior`` rows: at one request a
            # cell sees a row a step, and started empty, one probe's row (accepted 0 to the whole tree) made an arm
            # look best or worthless there for the next hundred steps.
            near = stats.acceptance(batch_size)
            prior = min(near.rows, self.tau_prior) if near is not None else 0
            accept = ReachEstimate() if near is None else replace(near, reach=list(near.reach), rows=prior)
            stats.accept[stats.key(batch_size)] = accept
        for length, depth in rows:
            accept.reach += [0.0] * (depth - len(accept.reach))
            accept.rows += 1
            rate = max(self.tau_decay, 1 / accept.rows)
            # A depth this tree did not reach counts as not reached: τ is what the arm's trees deliver.
            for d, reach in enumerate(accept.reach, 1):
                accept.reach[d - 1] = reach + rate * (float(length > d) - reach)
            accept.square += rate * (min(length, len(accept.reach) + 1) ** 2 - accept.square)
        accept.tau = 1.0 + sum(accept.reach)

    def taus(self) -> dict[str, float]:
        """The τ estimate of every arm at the recent batch size, keyed ``"tree@budget"`` (for /metrics)."""
        typical = self._typical()
        return {f"{tree}@{budget}": self.tau((tree, budget), typical) for tree, budget in self.stats}


def policy_for(tree: str, budget: int, neural_tree: str | None) -> tuple[Policy, tuple[str, ...]]:
    """The policy of an engine serving ``tree`` and the builders its requests need sessions for: ``"auto"`` is
    the controller over plain decoding, recycling and ``neural_tree`` (None: no drafter); a builder's name is
    that builder at ``budget``."""
    if tree == "auto":
        policy = Controller(Controller.arms(neural_tree))
        return policy, tuple(name for name, _ in policy.arms)
    return Fixed(tree, budget), (tree,)
