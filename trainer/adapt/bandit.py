"""The bandit's core: what the logs say, what an update is expected to gain and cost, and the decision.

Pure: no files, no models (the daemon, trainer/adapt/bandit_daemon.py, measures and trains). Units:

- τ: tokens committed per verification step (``len(accepted) + 1``), live per drafter version from step
  records (``LiveTau``, a window of the latest steps);
- step seconds ``s``: ``(ms.draft + ms.tree + ms.verify) / 1000`` per step; serving throughput ``θ = τ / s``;
- horizon: ``horizon_requests`` future requests at the observed request rate ``λ = requests / serving
  seconds`` (the logged ``ms`` of their steps), i.e. ``H = horizon_requests / λ`` seconds, in which
  ``θ · H`` tokens are served;
- gain of a candidate with τ' (same drafter shape, so same ``s``): ``θ · H · (τ'/τ - 1)`` served tokens;
- cost of an update: its measured seconds (target forwards for features, optimiser steps, shadow evaluation)
  plus the swap, times ``θ``: the tokens the server would have served meanwhile.

Before an update is paid for, its τ gain is predicted as a learned fraction of the *headroom*
``max(0, τ_ref - τ)``, where ``τ_ref`` is the served version's live τ right after it went live, or its parent's
reference when an update published it and that is higher: drift shows as τ falling below it, and the headroom
stays measured from before the drift until updates recover it. After a candidate is trained, a shadow evaluation
(``expected_accepted``) on held-back logged contexts gives its τ against the served drafter's on the same
contexts; a per-arm multiplicative correction learnt from realised outcomes (live τ after publishing vs. the
shadow estimate) scales it. Both learnt factors are used optimistically (upper confidence bound), so an arm that
was never tried is tried when the headroom is large enough, and one that disappoints is tried less.

An arm not yet tried starts from what the tried ones showed (their pooled recovery and measured seconds per
step), so one arm's disappointment on a drift no update can fix makes the next arm an exploration, not a sure
bet. Exploration is bounded: an update whose expected net gain is positive only under the optimistic bound (not
under the plain estimate) is exploration, and exploration may spend at most ``explore_share`` of the tokens
served so far (its cost in served tokens forgone); beyond that the bandit skips until its estimates, or the
served total, say otherwise.
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


# Learning rates from a sweep on the shipped tiny drafters (benchmarks/bandit_sim.py's shift): a fresh AdamW moves
# every weight by about ``lr`` per step, and 1e-3 on all weights (3e-3 on the approximator) lowered τ.
DEFAULT_ARMS = (
    Arm("approx-16", "approx", 16, 3e-4),
    Arm("lora-16", "lora", 16, 1e-3),
    Arm("full-16", "full", 16, 1e-4),
)


@dataclass(frozen=True)
class BanditConfig:
    """Decision parameters; see the module docstring."""

    horizon_requests: float = 64.0
    window_steps: int = 64
    rollback_margin: float = 0.05
    collapse_ratio: float = 0.5
    collapse_tau: float = 1.0
    ucb: float = 1.0
    prior_recovery: float = 0.5
    prior_seconds_per_step: float = 0.5
    swap_seconds: float = 0.05
    buffer_requests: int = 64
    holdout_every: int = 4
    explore_share: float = 0.05
    # How the server decodes, so how shadow evaluation scores acceptance: "sampled" or "greedy".
    shadow_acceptance: Literal["sampled", "greedy"] = "sampled"


@dataclass
class Running:
    """Mean and variance of observations (Welford) with a prior counted as ``prior_n`` observations."""

    prior: float
    prior_sd: float
    prior_n: float = 1.0
    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    @property
    def estimate(self) -> float:
        return (self.prior * self.prior_n + self.mean * self.n) / (self.prior_n + self.n)

    def upper(self, beta: float) -> float:
        """The estimate plus ``beta`` standard errors (prior spread while few observations)."""
        sd = math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else self.prior_sd
        return self.estimate + beta * sd / math.sqrt(self.prior_n + self.n)


@dataclass
class ArmStats:
    """What the bandit learnt about one arm: fraction of headroom recovered, shadow→live correction, seconds."""

    recovery: Running
    correction: Running
    seconds: float | None = None
    tried: int = 0

    @classmethod
    def fresh(cls, config: BanditConfig) -> ArmStats:
        return cls(Running(config.prior_recovery, 0.5), Running(1.0, 0.5))

    def measured(self, seconds: float) -> None:
        """Cost estimate: exponential average of the measured seconds (half weight on the newest)."""
        self.seconds = seconds if self.seconds is None else 0.5 * (self.seconds + seconds)


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
    """Served tokens over the horizon: ``gain`` from the optimistic recovery, ``mean_gain`` from the plain one."""

    arm: str
    tau_gain: float
    gain: float
    mean_gain: float
    cost: float

    @property
    def net(self) -> float:
        return self.gain - self.cost

    @property
    def exploring(self) -> bool:
        """Worth it only under the optimistic bound."""
        return self.mean_gain - self.cost <= 0


def pooled_priors(arms: tuple[Arm, ...], stats: dict[str, ArmStats], config: BanditConfig) -> tuple[float, float]:
    """What an arm not yet judged or measured borrows from the others: the recovery fraction the judged arms
    realised, pooled with ``prior_recovery`` counted as one outcome, and their measured seconds per optimiser
    step (``prior_seconds_per_step`` before any was measured)."""
    judged = [stats[a.name].recovery for a in arms if stats[a.name].recovery.n]
    outcomes = sum(r.n for r in judged)
    recovery = (config.prior_recovery + sum(r.mean * r.n for r in judged)) / (1 + outcomes)
    per_step = [stats[a.name].seconds / a.steps for a in arms if stats[a.name].seconds is not None]
    return recovery, (sum(per_step) / len(per_step) if per_step else config.prior_seconds_per_step)


def plan(
    rates: Rates,
    tau_ref: float,
    arms: tuple[Arm, ...],
    stats: dict[str, ArmStats],
    config: BanditConfig,
    explore_left: float = math.inf,
) -> tuple[str, list[ArmEstimate]]:
    """The arm with the largest expected net gain, or ``SKIP`` when none is positive or the best one is
    exploration costing more than ``explore_left`` served tokens, and every arm's estimate.

    Expected τ gain of an arm = its optimistic recovery fraction × headroom ``max(0, tau_ref - τ)``; an arm not
    yet judged or measured starts from ``pooled_priors``.
    """
    headroom = max(0.0, tau_ref - rates.tau)
    recovery_prior, seconds_per_step = pooled_priors(arms, stats, config)
    estimates = []
    for arm in arms:
        s = stats[arm.name]
        recovery = s.recovery if s.recovery.n else Running(recovery_prior, s.recovery.prior_sd)
        tau_gain = max(0.0, recovery.upper(config.ucb)) * headroom
        mean_gain = gain_tokens(rates, rates.tau + max(0.0, recovery.estimate) * headroom, config)
        seconds = s.seconds if s.seconds is not None else arm.steps * seconds_per_step
        cost = cost_tokens(rates, seconds + config.swap_seconds)
        gain = gain_tokens(rates, rates.tau + tau_gain, config)
        estimates.append(ArmEstimate(arm.name, tau_gain, gain, mean_gain, cost))
    best = max(estimates, key=lambda e: e.net, default=None)
    if best is None or best.net <= 0 or (best.exploring and best.cost > explore_left):
        return SKIP, estimates
    return best.arm, estimates


def shadow_tau(rates: Rates, served: float, candidate: float, correction: float) -> float:
    """Live τ predicted for a candidate from the shadow evaluation: the served version's live τ plus the
    corrected shadow difference (expected tokens per step on the same held-back contexts)."""
    return rates.tau + correction * (candidate - served)


def should_publish(rates: Rates, tau_new: float, config: BanditConfig) -> bool:
    """A trained candidate is published when its predicted gain beats the swap (the update is already paid)."""
    return math.isfinite(tau_new) and gain_tokens(rates, tau_new, config) > cost_tokens(rates, config.swap_seconds)


def rolled_back(previous: float, new: float, config: BanditConfig) -> bool:
    """The new version's windowed live τ fell below the previous one's by more than the margin."""
    return new < previous - config.rollback_margin


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
