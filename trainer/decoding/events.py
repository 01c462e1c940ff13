"""What a decoding step reports: the clock of its phases, a step's figures (``Step``), the verifier's view of it
for the log hook (``StepEvent``) and a request's result (``Generation``). Shared by the single-request loop
(trainer/decoding/engine.py) and the batch engine (trainer/decoding/batch.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from trainer.decoding.tree import Tree
from trainer.decoding.verify import Verdict


class Clock:
    """Wall time per phase. On CUDA every reading synchronises the device first, so time lands where the work
    is spent, not where the host next waits for it. ``now`` reads seconds: ``time.perf_counter`` unless a
    caller (a test's simulated clock) passes its own."""

    def __init__(self, device: torch.device, now: Callable[[], float] = time.perf_counter) -> None:
        self.device = device
        self._now = now
        self.seconds: dict[str, float] = {}

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self._now()

    @contextmanager
    def __call__(self, phase: str):
        start = self.now()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + self.now() - start


@dataclass
class Step:
    accepted: int
    committed: int
    tree_size: int
    tree_depth: int
    forwards: int
    seconds: dict[str, float]


@dataclass(frozen=True)
class StepEvent:
    """What one verification step saw, handed to ``generate``'s ``on_step`` hook (the verifier log's source)."""

    step: int
    # Position of the root: the context length before this step.
    pos: int
    root: int
    tree: Tree
    # Accepted engine node indices from the root (node 0) down; draft node i is tree node i + 1.
    path: list[int]
    bonus: int
    # Shape: (N + 1, V) float; the target's logits at every tree node, root first. Not to be modified.
    logits: torch.Tensor
    # Milliseconds per phase of this step: draft, tree, verify.
    ms: dict[str, float]
    budget: int
    builder: str
    # Shape: (N + 1, step_topk): ``top_rows`` of ``logits``, when greedy verification found them (its choice is
    # their first column); None otherwise. Saves the hook that logs the top-k a second pass over the logits.
    top_ids: torch.Tensor | None = None


@dataclass
class Generation:
    # The new tokens, the prefill's first token included.
    tokens: list[int]
    steps: list[Step] = field(default_factory=list)
    prefill_seconds: float = 0.0
    # Time after the first token: every verification step with its drafting and bookkeeping.
    decode_seconds: float = 0.0

    @property
    def tau(self) -> float | None:
        """Tokens committed per verification forward, bonus included; None when the answer ended at its first
        token (no verification step: nothing to divide, and 0 would drag a mean over prompts down)."""
        return sum(s.committed for s in self.steps) / len(self.steps) if self.steps else None


def step_of(verdict: Verdict, tree: Tree, depth: int, forwards: int, seconds: dict[str, float]) -> Step:
    """The figures of a step that verified ``tree`` (``depth``: its deepest node's) and committed ``verdict``."""
    return Step(verdict.acceptance.accepted, len(verdict.new), tree.size, depth, forwards, dict(seconds))


def event_of(
    step: int, pos: int, tree: Tree, verdict: Verdict, logits: torch.Tensor, seconds: dict[str, float],
    budget: int, builder: str,
) -> StepEvent:  # fmt: skip
    """The hook's view of a step that verified ``tree`` at context length ``pos``."""
    ms = {phase: 1000 * seconds.get(phase, 0.0) for phase in ("draft", "tree", "verify")}
    acceptance = verdict.acceptance
    return StepEvent(step, pos, int(tree.tokens[0]), tree, acceptance.path, acceptance.bonus, logits, ms, budget,
                     builder, verdict.top_ids)  # fmt: skip
