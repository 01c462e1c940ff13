"""The bandit's core: what the logs say, what an update is expected to gain and cost, and the decision.

Pure: no files, no models (the daemon, trainer/adapt/bandit_daemon.py, measures and trains). A candidate's gain is
predicted from the served version's context (novelty of the replay buffer, drift of live τ) by a per-arm Bayesian
regression (``Lift``) of shadow gains, used optimistically; a per-arm *live fit* (``Lift`` over ``(shadow gain,
1)``) learns from realised outcomes what a shadow gain is worth live, because the shadow scores a chain, not the
served tree. Gains and costs are in served tokens over a horizon; exploration spends at most ``explore_share`` of
the tokens served. Units, formulas and the measured figures behind the defaults: docs/bandit.md ("The estimates").
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
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
    rollback_margin: float = 0.05
    # Differences of live τ within this many standard errors of the windows are noise (drift, rollback).
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
    explore_share: float = 0.05
    # How the server decodes, so how shadow evaluation scores acceptance: "sampled" or "greedy".
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

    def upper(self, x: tuple[float, float], beta: float) -> float:
        """The predicted gain plus ``beta`` standard deviations of the prediction."""
        w, (c00, c01, c11) = self.posterior()
        var = c00 * x[0] * x[0] + 2 * c01 * x[0] * x[1] + c11 * x[1] * x[1]
        return w[0] * x[0] + w[1] * x[1] + beta * math.sqrt(max(var, 0.0))


def live_gain(fit: Lift, shadow: float) -> float:
    """The relative live τ gain the live fit (a ``Lift`` over ``(shadow gain, 1)``) predicts for a shadow gain: its
    slope (never negative: a larger shadow gain does not predict a smaller live one) times the gain, plus its bias."""
    (slope, bias), _ = fit.posterior()
    return max(0.0, slope) * shadow + bias


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
    """Served tokens over the horizon: ``gain`` from the optimistic prediction, ``mean_gain`` from the plain one."""

    arm: str
    tau_gain: float
    gain: float
    mean_gain: float
    cost: float
    # Shadow outcomes the prediction rests on (the arm's own, or the pooled ones it borrows).
    observed: int = 0

    @property
    def net(self) -> float:
        return self.gain - self.cost

    @property
    def exploring(self) -> bool:
        """Worth it only under the optimistic bound, or resting on the prior alone: an update no outcome has
        backed yet is a bet on the prior, and the exploration budget bounds what such bets may lose."""
        return self.observed == 0 or self.mean_gain - self.cost <= 0


def pooled_priors(arms: tuple[Arm, ...], stats: dict[str, ArmStats], config: BanditConfig) -> tuple[Lift, float]:
    """What an arm not yet tried borrows from the others: the prior regression with every tried arm's
    observations, and their measured seconds per optimiser step (``prior_seconds_per_step`` before any was
    measured)."""
    fresh = ArmStats.fresh(config).lift
    lift = fresh.pooled([stats[a.name].lift for a in arms if stats[a.name].lift.n])
    per_step = [stats[a.name].seconds / a.steps for a in arms if stats[a.name].seconds is not None]
    return lift, (sum(per_step) / len(per_step) if per_step else config.prior_seconds_per_step)


def plan(
    rates: Rates,
    context: Context,
    arms: tuple[Arm, ...],
    stats: dict[str, ArmStats],
    config: BanditConfig,
    explore_left: float = math.inf,
) -> tuple[str, list[ArmEstimate]]:
    """The arm with the largest expected net gain, or ``SKIP`` when none is positive or the best one is
    exploration costing more than ``explore_left`` served tokens, and every arm's estimate.

    Expected τ gain of an arm = τ × what its live fit makes of its regression's optimistic relative gain in
    ``context``; an arm not yet tried or measured starts from ``pooled_priors``.
    """
    pooled, seconds_per_step = pooled_priors(arms, stats, config)
    estimates = []
    for arm in arms:
        s = stats[arm.name]
        lift = s.lift if s.lift.n else pooled
        tau_gain = rates.tau * max(0.0, live_gain(s.live, max(0.0, lift.upper(context.x, config.ucb))))
        mean_gain = gain_tokens(rates, rates.tau * (1 + live_gain(s.live, max(0.0, lift.mean(context.x)))), config)
        seconds = s.seconds if s.seconds is not None else arm.steps * seconds_per_step
        cost = cost_tokens(rates, seconds * config.update_cost_share + config.swap_seconds)
        gain = gain_tokens(rates, rates.tau + tau_gain, config)
        estimates.append(ArmEstimate(arm.name, tau_gain, gain, mean_gain, cost, lift.n))
    best = max(estimates, key=lambda e: e.net, default=None)
    if best is None or best.net <= 0 or (best.exploring and best.cost > explore_left):
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


def should_publish(rates: Rates, tau_new: float, config: BanditConfig) -> bool:
    """A trained candidate is published when its predicted gain beats the swap (the update is already paid)."""
    return math.isfinite(tau_new) and gain_tokens(rates, tau_new, config) > cost_tokens(rates, config.swap_seconds)


def rolled_back(previous: float, new: float, config: BanditConfig, se: float = 0.0) -> bool:
    """The new version's windowed live τ fell below the previous one's by more than the margin plus ``noise_z``
    standard errors ``se`` of the difference."""
    return new < previous - config.rollback_margin - config.noise_z * se


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
