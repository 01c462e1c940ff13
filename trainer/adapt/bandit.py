"""The bandit's core: what the logs say, what an update is expected to gain and cost, and the decision.

Pure: no files, no models (the daemon, trainer/adapt/bandit_daemon.py, measures and trains). A candidate's gain is
predicted from the served version's context (novelty of the replay buffer, drift of live τ) by a per-arm Bayesian
regression (``Lift``) of shadow gains, used optimistically to choose what to train; a per-arm *live fit* (``Lift``
over ``(shadow gain, 1)``) learns from realised outcomes what a shadow gain is worth live, because the shadow scores
a chain, not the served tree. A candidate is published only when a lower confidence bound of its live gain clears
the swap, and every action is held to a conservative budget (``Ledger``): the served-token total stays at least
``1 - alpha`` times never-update's, training, swaps and realised regressions counted. Units, formulas, the guarantee
and its assumptions: docs/bandit.md ("The estimates", "The guarantee").
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from statistics import NormalDist
from typing import Literal

import torch

SKIP = "skip"


@dataclass(frozen=True)
class Arm:
    """An update variant: which parameters move (``approx``: TreeFlash's approximator; ``lora``: a LoRA on the
    backbone; ``full``: every drafter parameter) and for how many optimiser steps."""

    name: str
    params: str
    steps: int
    lr: float


# Learning rates from sweeps on the shipped tiny TreeFlash (benchmarks/bandit_sim.py's shift): τ on 16 held-out
# shifted prompts after 16 steps on 48 served requests (8 per step), a fresh AdamW each update. All weights at 1e-3:
# +6%; at 3e-3: +14% on one draw of the stream, +1% on another, and -1% to -16% with 4 requests per step; 1e-4
# moved nothing. The approximator alone gained 2% in 128 steps at 3e-3.
DEFAULT_ARMS = (
    Arm("approx-16", "approx", 16, 3e-3),
    Arm("lora-16", "lora", 16, 1e-3),
    Arm("full-16", "full", 16, 1e-3),
)


@dataclass(frozen=True)
class BanditConfig:
    """Decision parameters; see docs/bandit.md ("The estimates")."""

    horizon_requests: float = 128.0
    window_steps: int = 64
    # Differences of live τ within this many standard errors of the windows are noise (drift).
    noise_z: float = 2.0
    collapse_ratio: float = 0.5
    collapse_tau: float = 1.0
    ucb: float = 1.0
    # The mean gain of one update on a buffer of fresh traffic in the sweeps above (+1% to +14%).
    prior_lift: float = 0.05
    # A quarter of a drift recovered by one update: one oracle check of benchmarks/bandit_sim.py recovered most of
    # its drift, two others none.
    prior_recovery: float = 0.25
    shadow_noise: float = 0.05
    # The live fit's prior: slope 1 ± live_slope_sd, bias 0 ± live_bias_sd; an outcome's noise is at least live_noise.
    live_slope_sd: float = 0.5
    live_bias_sd: float = 0.05
    live_noise: float = 0.05
    lift_decay: float = 0.9
    prior_seconds_per_step: float = 0.5
    swap_seconds: float = 0.05
    # Serving seconds one second of an update costs: 1 co-located; a trainer device's exchange rate otherwise.
    update_cost_share: float = 1.0
    buffer_requests: int = 64
    holdout_every: int = 4
    # The budget: at every decision the served tokens stay >= (1 - alpha) x what never updating would have served.
    alpha: float = 0.01
    # One-sided z of every lower bound the rule acts on (the publish bound, a judged version's ratio): 95%.
    confidence_z: float = 1.645
    # The largest relative τ regression a published version is assumed to make before its judgement: the ledger
    # reserves it. The largest mean live loss an arm showed on the measured trace was 11.4% (docs/bandit.md).
    regress_max: float = 0.1
    # The rollback test detects a regression of rollback_effect (about what one update moves τ) with probability
    # rollback_power; it waits for that much evidence at most judge_windows windows.
    rollback_effect: float = 0.03
    rollback_power: float = 0.8
    judge_windows: int = 2
    # An update is budgeted at its arm's estimated seconds times this (measured seconds vary between updates).
    seconds_margin: float = 1.5
    # The share of served steps the logs hold (a server that logs one request in four: 0.25): the ledger counts
    # served tokens as the logged ones over it.
    log_share: float = 1.0
    shadow_acceptance: Literal["sampled", "greedy"] = "sampled"


@dataclass(frozen=True)
class Context:
    """What an update's gain is predicted from (docs/bandit.md, "The estimates")."""

    novelty: float
    drift: float

    @property
    def x(self) -> tuple[float, float]:
        return (self.novelty, self.drift)


@dataclass
class Lift:
    """Bayesian linear regression ``y = w · x`` of an update's relative τ gain ``y`` on its context ``x`` (2-d),
    prior ``w ~ N(prior, diag(prior_sd²))``, observation noise ``noise_sd``; kept as sufficient statistics
    (``Σ x xᵀ`` as ``xx = [xx00, xx01, xx11]`` and ``Σ x y``), so outcomes pool by adding them. Each new
    observation first discounts the earlier ones by ``decay``: the gains of a drafter that saturates on its
    traffic fall, and the regression follows the recent ones."""

    prior: tuple[float, float]
    prior_sd: tuple[float, float]
    noise_sd: float
    decay: float = 1.0
    xx: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    xy: list[float] = field(default_factory=lambda: [0.0, 0.0])
    n: int = 0

    def add(self, x: tuple[float, float], y: float, weight: float = 1.0) -> None:
        """One observation; ``weight`` scales its precision (``noise_sd² / its own variance``)."""
        d, w = self.decay, weight
        self.xx = [d * self.xx[0] + w * x[0] * x[0], d * self.xx[1] + w * x[0] * x[1], d * self.xx[2] + w * x[1] * x[1]]
        self.xy = [d * self.xy[0] + w * x[0] * y, d * self.xy[1] + w * x[1] * y]
        self.n += 1

    def pooled(self, others: list[Lift]) -> Lift:
        """This prior with every observation of ``others``."""
        xx = [sum(o.xx[i] for o in others) for i in range(3)]
        xy = [sum(o.xy[i] for o in others) for i in range(2)]
        return Lift(self.prior, self.prior_sd, self.noise_sd, self.decay, xx, xy, sum(o.n for o in others))

    def posterior(self) -> tuple[tuple[float, float], tuple[float, float, float]]:
        """Posterior mean of ``w`` and its covariance ``[c00, c01, c11]``."""
        v = self.noise_sd**2
        p00 = 1 / self.prior_sd[0] ** 2 + self.xx[0] / v
        p01 = self.xx[1] / v
        p11 = 1 / self.prior_sd[1] ** 2 + self.xx[2] / v
        b0 = self.prior[0] / self.prior_sd[0] ** 2 + self.xy[0] / v
        b1 = self.prior[1] / self.prior_sd[1] ** 2 + self.xy[1] / v
        det = p00 * p11 - p01 * p01
        c00, c01, c11 = p11 / det, -p01 / det, p00 / det
        return (c00 * b0 + c01 * b1, c01 * b0 + c11 * b1), (c00, c01, c11)

    def mean(self, x: tuple[float, float]) -> float:
        w, _ = self.posterior()
        return w[0] * x[0] + w[1] * x[1]

    def predictive(self, x: tuple[float, float]) -> tuple[float, float]:
        """Posterior mean of ``w · x`` and its variance ``xᵀ C x`` (the weights' uncertainty, not an outcome's
        noise)."""
        w, (c00, c01, c11) = self.posterior()
        var = c00 * x[0] * x[0] + 2 * c01 * x[0] * x[1] + c11 * x[1] * x[1]
        return w[0] * x[0] + w[1] * x[1], max(var, 0.0)

    def upper(self, x: tuple[float, float], beta: float) -> float:
        """The predicted gain plus ``beta`` standard deviations of the prediction."""
        mean, var = self.predictive(x)
        return mean + beta * math.sqrt(var)


def live_gain(fit: Lift, shadow: float) -> float:
    """The relative live τ gain the live fit (a ``Lift`` over ``(shadow gain, 1)``) predicts for a shadow gain: its
    slope (never negative: a larger shadow gain does not predict a smaller live one) times the gain, plus its bias."""
    (slope, bias), _ = fit.posterior()
    return max(0.0, slope) * shadow + bias


def live_bound(fit: Lift, shadow: float, shadow_se: float) -> tuple[float, float]:
    """The live gain a shadow gain measured with standard error ``shadow_se`` predicts, and the prediction's
    standard deviation: the live fit's own uncertainty at ``(shadow, 1)`` plus the shadow's, carried by the slope."""
    (slope, _), _ = fit.posterior()
    _, var = fit.predictive((shadow, 1.0))
    return live_gain(fit, shadow), math.sqrt(var + (max(0.0, slope) * shadow_se) ** 2)


def paired_gain(served: list[torch.Tensor], candidate: list[torch.Tensor]) -> tuple[float, float]:
    """The relative gain of ``candidate`` over ``served`` on the same held-back contexts, and its standard error:
    per request (the contexts of one request are not independent), the sums of expected tokens ``a_r`` (served)
    and ``b_r`` (candidate); gain ``Σ b / Σ a - 1``, its error the ratio estimator's over requests
    ``sqrt(R / (R - 1) · Σ (b_r - (1 + gain) a_r)²) / Σ a``. Paired: what makes one context hard makes it hard
    for both drafters, so only their difference is left in the error. NaN gain without contexts; an infinite
    error with fewer than two requests.

    Shape: served[r], candidate[r] (C_r,) expected tokens per context of request r
    """
    pairs = [(float(a.sum()), float(b.sum())) for a, b in zip(served, candidate, strict=True) if a.numel()]
    total_a, total_b = sum(a for a, _ in pairs), sum(b for _, b in pairs)
    if not pairs or not (math.isfinite(total_a) and math.isfinite(total_b)) or total_a <= 0:
        return math.nan, math.inf
    gain = total_b / total_a - 1.0
    if len(pairs) < 2:
        return gain, math.inf
    residual = sum((b - (1.0 + gain) * a) ** 2 for a, b in pairs)
    return gain, math.sqrt(len(pairs) / (len(pairs) - 1) * residual) / total_a


def outcome_weight(relative_se: float, config: BanditConfig) -> float:
    """The live fit's weight of one realised outcome whose relative standard error is ``relative_se``: its
    precision, the error taken as at least ``live_noise`` (a window's step-wise error misses that its requests are
    few and that traffic may shift between the two windows)."""
    return 1.0 / max(relative_se, config.live_noise) ** 2


@dataclass
class ArmStats:
    """What the bandit learnt about one arm: its shadow-gain regression, its live fit, measured seconds."""

    lift: Lift
    live: Lift
    seconds: float | None = None
    tried: int = 0

    @classmethod
    def fresh(cls, config: BanditConfig) -> ArmStats:
        # Prior spread = prior mean: a gain of 0 or twice the prior is one standard deviation away.
        prior = (config.prior_lift, config.prior_recovery)
        # The live fit's weights are precisions (outcome_weight), so its own noise_sd is 1.
        live = Lift((1.0, 0.0), (config.live_slope_sd, config.live_bias_sd), 1.0, config.lift_decay)
        return cls(Lift(prior, prior, config.shadow_noise, config.lift_decay), live)

    def measured(self, seconds: float) -> None:
        """Cost estimate: exponential average of the measured seconds (half weight on the newest)."""
        self.seconds = seconds if self.seconds is None else 0.5 * (self.seconds + seconds)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> ArmStats:
        lift, live = ({**obj[k], "prior": tuple(obj[k]["prior"]), "prior_sd": tuple(obj[k]["prior_sd"])}
                      for k in ("lift", "live"))  # fmt: skip
        return cls(Lift(**lift), Lift(**live), obj["seconds"], obj["tried"])


@dataclass
class LiveTau:
    """Steps of one drafter version: totals and the latest ``window`` steps (tokens, seconds)."""

    window: int
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    recent: deque = field(default_factory=deque)

    def add(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds
        self.recent.append((tokens, seconds))
        while len(self.recent) > self.window:
            self.recent.popleft()

    @property
    def full(self) -> bool:
        return len(self.recent) >= self.window

    @property
    def tau(self) -> float:
        """τ over the window (NaN without steps)."""
        return sum(t for t, _ in self.recent) / len(self.recent) if self.recent else math.nan

    @property
    def se(self) -> float:
        """Standard error of ``tau`` (0 with fewer than two steps): steps commit 1 to budget + 1 tokens, so a
        window's τ carries noise that a difference of two windows must exceed to mean anything."""
        n = len(self.recent)
        if n < 2:
            return 0.0
        mean = self.tau
        return math.sqrt(sum((t - mean) ** 2 for t, _ in self.recent) / (n - 1) / n)

    @property
    def step_seconds(self) -> float:
        return sum(s for _, s in self.recent) / len(self.recent) if self.recent else math.nan

    def to_json(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "recent"}, "recent": list(self.recent)}

    @classmethod
    def from_json(cls, obj: dict) -> LiveTau:
        live = cls(**{k: v for k, v in obj.items() if k != "recent"})
        live.recent.extend(tuple(x) for x in obj["recent"])
        return live


def step_tokens(record: dict) -> int:
    """Tokens a step committed: the accepted draft nodes plus the bonus token."""
    return len(record["accepted"]) + 1


def step_seconds(record: dict) -> float:
    ms = record["ms"]
    return (ms["draft"] + ms["tree"] + ms["verify"]) / 1000.0


@dataclass(frozen=True)
class Rates:
    """The served version's live figures the estimates are made from."""

    tau: float
    step_seconds: float
    request_rate: float

    @property
    def throughput(self) -> float:
        """θ: served tokens per second while serving."""
        return self.tau / self.step_seconds

    def horizon_seconds(self, config: BanditConfig) -> float:
        return config.horizon_requests / self.request_rate


def gain_tokens(rates: Rates, tau_new: float, config: BanditConfig) -> float:
    """Served tokens gained over the horizon by a version with live τ ``tau_new`` instead of ``rates.tau``."""
    return rates.throughput * rates.horizon_seconds(config) * (tau_new / rates.tau - 1.0)


def cost_tokens(rates: Rates, seconds: float) -> float:
    """Served tokens forgone while the server spends ``seconds`` on an update and swap instead of serving."""
    return rates.throughput * seconds


@dataclass(frozen=True)
class ArmEstimate:
    """Served tokens over the horizon: ``gain`` from the optimistic prediction, ``mean_gain`` from the plain one;
    ``cost`` the update's expected cost, ``risk`` the budget slack it may consume at worst (``update_risk``)."""

    arm: str
    tau_gain: float
    gain: float
    mean_gain: float
    cost: float
    risk: float = 0.0
    # Shadow outcomes the prediction rests on (the arm's own, or the pooled ones it borrows).
    observed: int = 0

    @property
    def net(self) -> float:
        return self.gain - self.cost


def pooled_priors(
    arms: tuple[Arm, ...], stats: dict[str, ArmStats], config: BanditConfig
) -> tuple[Lift, Lift, float]:
    """What an arm not yet tried borrows from the others: the prior regression with every tried arm's shadow
    observations, the live fit with every tried arm's realised outcomes (the correction of their shadow gains),
    and their measured seconds per optimiser step (``prior_seconds_per_step`` before any was measured)."""
    fresh = ArmStats.fresh(config)
    lift = fresh.lift.pooled([stats[a.name].lift for a in arms if stats[a.name].lift.n])
    live = fresh.live.pooled([stats[a.name].live for a in arms if stats[a.name].live.n])
    per_step = [stats[a.name].seconds / a.steps for a in arms if stats[a.name].seconds is not None]
    return lift, live, (sum(per_step) / len(per_step) if per_step else config.prior_seconds_per_step)


def plan(
    rates: Rates,
    context: Context,
    arms: tuple[Arm, ...],
    stats: dict[str, ArmStats],
    config: BanditConfig,
    slack: float = math.inf,
    ratio: float = 1.0,
) -> tuple[str, list[ArmEstimate]]:
    """The arm with the largest expected net gain among those whose worst case fits the budget's ``slack``
    (``update_risk`` from the served version's ``ratio``), or ``SKIP`` when none is positive; and every arm's
    estimate.

    Expected τ gain of an arm = τ × what its live fit makes of its regression's optimistic relative gain in
    ``context``; an arm without shadow outcomes borrows the pooled regression, one without live outcomes the
    pooled live fit, one not yet measured the pooled seconds per step (``pooled_priors``).
    """
    pooled, pooled_live, seconds_per_step = pooled_priors(arms, stats, config)
    estimates = []
    for arm in arms:
        s = stats[arm.name]
        lift = s.lift if s.lift.n else pooled
        live = s.live if s.live.n else pooled_live
        tau_gain = rates.tau * max(0.0, live_gain(live, max(0.0, lift.upper(context.x, config.ucb))))
        mean_gain = gain_tokens(rates, rates.tau * (1 + live_gain(live, max(0.0, lift.mean(context.x)))), config)
        seconds = s.seconds if s.seconds is not None else arm.steps * seconds_per_step
        cost = cost_tokens(rates, seconds * config.update_cost_share + config.swap_seconds)
        gain = gain_tokens(rates, rates.tau + tau_gain, config)
        risk = update_risk(rates, ratio, seconds, config)
        estimates.append(ArmEstimate(arm.name, tau_gain, gain, mean_gain, cost, risk, lift.n))
    best = max((e for e in estimates if e.risk <= slack), key=lambda e: e.net, default=None)
    if best is None or best.net <= 0:
        return SKIP, estimates
    return best.arm, estimates


def shadow_gain(served: float, candidate: float) -> float:
    """The relative gain the shadow evaluation measured: expected tokens per step on the same held-back contexts
    (NaN when either is not finite or the served one is not positive)."""
    if not (math.isfinite(served) and math.isfinite(candidate)) or served <= 0:
        return math.nan
    return candidate / served - 1.0


def shadow_tau(rates: Rates, gain: float, live: Lift) -> float:
    """Live τ predicted for a candidate whose shadow gain is ``gain``: the served version's live τ times one plus
    what the arm's live fit makes of the gain."""
    return rates.tau * (1.0 + live_gain(live, gain))


def should_publish(rates: Rates, lower: float, config: BanditConfig) -> bool:
    """A trained candidate is published when the lower confidence bound ``lower`` of its relative live gain gains
    more served tokens over the horizon than the swap costs (the update itself is already paid)."""
    return math.isfinite(lower) and gain_tokens(rates, rates.tau * (1.0 + lower), config) > cost_tokens(
        rates, config.swap_seconds
    )


def combined(estimates: list[tuple[float, float]]) -> tuple[float, float]:
    """Inverse-variance combination of independent (mean, sd) estimates of one gain; the finite ones only
    ((NaN, inf) when none is)."""
    finite = [(m, sd) for m, sd in estimates if math.isfinite(m) and math.isfinite(sd) and sd > 0]
    if not finite:
        return math.nan, math.inf
    precision = sum(1.0 / sd**2 for _, sd in finite)
    return sum(m / sd**2 for m, sd in finite) / precision, math.sqrt(1.0 / precision)


def judged_sd(config: BanditConfig) -> float:
    """The standard deviation of a judgement's gain estimate at which the rollback test (roll back when the
    estimate is below 0) detects a regression of ``rollback_effect`` with probability ``rollback_power``."""
    return config.rollback_effect / NormalDist().inv_cdf(config.rollback_power)


def rollback_power(sd: float, config: BanditConfig) -> float:
    """The probability that the rollback test catches a regression of ``rollback_effect`` when its estimate has
    standard deviation ``sd`` (and, alike, that it rolls back a version that gains that much)."""
    return NormalDist().cdf(config.rollback_effect / sd) if sd > 0 else 1.0


def rolled_back(gain: float) -> bool:
    """The rollback test: the judged live gain (``combined`` evidence) says the new version serves less."""
    return not gain >= 0.0


def judged_ratio(parent: float, gain: float, sd: float, config: BanditConfig) -> float:
    """A judged version's lower bound of its τ over never-update's: the parent's times one plus the gain's lower
    confidence bound, never below the reserved worst case ``1 - regress_max`` (the assumption the ledger rests on)."""
    lower = gain - config.confidence_z * sd if math.isfinite(gain) and math.isfinite(sd) else -math.inf
    return parent * max(1.0 - config.regress_max, 1.0 + lower)


def update_risk(rates: Rates, ratio: float, seconds: float, config: BanditConfig) -> float:
    """The budget slack an update may consume at worst, in served tokens (``Ledger.slack`` units): the stall of
    ``seconds`` of training (times ``seconds_margin`` and ``update_cost_share``) and two swaps (the publish and a
    rollback) at never-update's throughput, and the new version serving ``judge_windows`` windows (every served
    step, logged or not) at ``1 - regress_max`` of the served version's τ before its judgement can roll it back.
    ``ratio`` is the served version's lower bound over never-update; a negative risk is slack gained."""
    baseline_rate = rates.throughput / ratio
    stall_seconds = seconds * config.seconds_margin * config.update_cost_share + 2 * config.swap_seconds
    stall = (1.0 - config.alpha) * baseline_rate * stall_seconds
    steps = config.judge_windows * config.window_steps / config.log_share
    return stall - steps * rates.tau * (1.0 - config.regress_max) * Ledger.margin(
        ratio * (1.0 - config.regress_max), config.alpha
    )


def keep_risk(rates: Rates, ratio: float, config: BanditConfig) -> float:
    """The slack the served version may consume over its next window at its lower bound ``ratio``."""
    return -config.window_steps / config.log_share * rates.tau * Ledger.margin(ratio, config.alpha)


@dataclass
class Ledger:
    """The conservative budget (Wu et al. 2016, "Conservative Bandits", with never-update as the baseline arm): the
    served tokens, per drafter version, and a pessimistic count of what never updating would have served in the
    same time. A version's tokens count ``tokens / ratio`` baseline tokens, ``ratio`` a lower bound of its τ over
    never-update's (1 for the never-update drafter and for steps of no version here; the worst case reserved
    while a version awaits its judgement; the judged lower bound after it); a stall (an update's training on the
    serving device, a shadow evaluation, a swap) counts the baseline's throughput times its seconds and serves
    nothing. ``slack = served - (1 - alpha) · baseline`` >= 0 is the guarantee; it grows by ``alpha`` per token
    of a version as good as never-update's and by more with realised gains (docs/bandit.md, "The guarantee")."""

    alpha: float
    stall: float = 0.0
    tokens: dict[str, float] = field(default_factory=dict)
    ratio: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def margin(ratio: float, alpha: float) -> float:
        """Slack one served token of a version with ``ratio`` adds: ``1 - (1 - alpha) / ratio``."""
        return 1.0 - (1.0 - alpha) / ratio

    @property
    def served(self) -> float:
        return sum(self.tokens.values())

    @property
    def baseline(self) -> float:
        return self.stall + sum(t / self.ratio.get(v, 1.0) for v, t in self.tokens.items())

    @property
    def slack(self) -> float:
        return self.served - (1.0 - self.alpha) * self.baseline

    def serve(self, version: str, tokens: float) -> None:
        self.tokens[version] = self.tokens.get(version, 0.0) + tokens

    def stalled(self, baseline_tokens: float) -> None:
        """Never-update would have served ``baseline_tokens`` while the server stalled."""
        self.stall += baseline_tokens

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> Ledger:
        return cls(**obj)


def drift(tau_ref: float, live: LiveTau, config: BanditConfig) -> float:
    """Relative drift ``max(0, τ_ref - τ - noise_z · se) / τ``: the reference is one window too, so the difference
    of the two carries about √2 times one window's standard error; only what exceeds that counts."""
    gap = tau_ref - live.tau - config.noise_z * math.sqrt(2) * live.se
    return max(0.0, gap) / live.tau


def collapsed(tau: float, best: float, config: BanditConfig) -> bool:
    """τ collapsed: at most ``collapse_tau`` (1: nothing accepted in the whole window, what a zeroed or
    corrupted drafter gives), or under ``collapse_ratio`` of the best version's τ."""
    return tau <= config.collapse_tau or tau < config.collapse_ratio * best


def acceptance(
    draft_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, greedy: bool = False
) -> torch.Tensor:
    """Per-depth acceptance probability of a drafter's distribution against the logged target top-k:
    ``Σ_x min(p(x), q(x))`` over the target's top-k tokens (a lower bound of the sampling acceptance rate;
    the mass outside the logged top-k is left out for every drafter alike); under ``greedy`` decoding, whether
    the drafter's argmax is the target's (the logged top-1).

    Shape: draft_logits (..., V), topk_ids / topk_logprobs (..., k) → (...)
    """
    if greedy:
        return (draft_logits.argmax(-1) == topk_ids[..., 0]).float()
    q = draft_logits.float().softmax(-1).gather(-1, topk_ids)
    return torch.minimum(q, topk_logprobs.float().exp()).sum(-1)


def expected_accepted(alpha: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """Expected tokens per step of a chain, ``1 + Σ_{d≤D} Π_{j≤d} α_j``, cut at each context's observed depth
    ``D`` (the logged target distributions cover the accepted path and the bonus only).

    Shape: alpha (C, K) per depth 1..K, depths (C,) long → (C,)
    """
    keep = torch.arange(1, alpha.shape[1] + 1, device=alpha.device)[None, :] <= depths[:, None]
    return 1.0 + (alpha.cumprod(-1) * keep).sum(-1)


@dataclass
class Replay:
    """Bounded replay of finished requests (prompt + output ids): training data, and held-back contexts for
    shadow evaluation (every ``holdout_every``-th request, with its step records)."""

    limit: int
    holdout_every: int
    train: deque = field(default_factory=deque)
    holdout: deque = field(default_factory=deque)
    seen: int = 0

    def add(self, prompt: list[int], output: list[int], steps: list[dict]) -> None:
        self.seen += 1
        if self.seen % self.holdout_every == 0:
            self.holdout.append({"prompt": prompt, "output": output, "steps": [_shadow_step(s) for s in steps]})
            while len(self.holdout) > max(1, self.limit // self.holdout_every):
                self.holdout.popleft()
        else:
            self.train.append({"prompt": prompt, "output": output})
            while len(self.train) > self.limit:
                self.train.popleft()

    def to_json(self) -> dict:
        return {**asdict(self), "train": list(self.train), "holdout": list(self.holdout)}

    @classmethod
    def from_json(cls, obj: dict) -> Replay:
        return cls(obj["limit"], obj["holdout_every"], deque(obj["train"]), deque(obj["holdout"]), obj["seen"])


def _shadow_step(record: dict) -> dict:
    """What shadow evaluation keeps of a step record: the root position and the logged target top-k along the
    accepted path (root row first, then one row per accepted node: the distributions of depths 1..D)."""
    rows = [0] + [node + 1 for node in record["accepted"]]
    return {
        "pos": record["pos"],
        "root": record["root"],
        "topk_ids": [record["topk_ids"][r] for r in rows],
        "topk_logprobs": [record["topk_logprobs"][r] for r in rows],
    }
