"""benchmarks/bandit_trace.py's clock: what a served request and an update cost under each cost model, with
versions whose τ is known (no decoding). Its smoke run is in tests/test_benchmarks.py."""

import sys
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

from bandit_trace import SCHEDULE, Costs, Greedy, Policy, Served, Simulation, Version

SHIPPED = Version("v0", (), Path("shipped"))
BETTER = Version("v1", (("transformers", "full-16"),), Path("better"), train_seconds=1.0)


class KnownVersions:
    """The shipped drafter commits 4 tokens in 2 steps per request, the update 6 in 2, on every phase."""

    shipped = SHIPPED

    def heldout(self, v: Version, phase: str) -> list[list[int]]:
        return [[4, 2]] if v is SHIPPED else [[6, 2]]


class UpdateOnce(Policy):
    name = "once"

    def after(self, sim: Simulation, served: Served) -> tuple[Version, float] | None:
        return (BETTER, BETTER.train_seconds) if served.index == 99 else None


@pytest.mark.parametrize(
    ("model", "scale", "tokens", "device"),
    [
        # 100 requests of 0.02 s (400 tokens by 2 s); co-located, the update stalls serving 1 s (x scale), then
        # 6 tokens per 0.02 s for the rest of the 10 s.
        ("colocated", 1.0, 400 + 7 / 0.02 * 6, 0.0),
        ("colocated", 2.0, 400 + 6 / 0.02 * 6, 0.0),
        # On a separate device serving pays nothing; the device-seconds are counted.
        ("separate", 1.0, 400 + 8 / 0.02 * 6, 1.0),
        ("separate", 2.0, 400 + 8 / 0.02 * 6, 2.0),
    ],
)
def test_an_update_costs_serving_time_only_when_colocated(model, scale, tokens, device):
    costs = Costs(step_seconds=0.01, update_scale=scale, swap_seconds=0.0, source="test")
    run = Simulation(KnownVersions(), costs, model, duration=10.0, rate=None, seed=0).run(UpdateOnce())
    assert run["tokens"] == pytest.approx(tokens)
    assert run["device_seconds"] == pytest.approx(device)
    assert run["updates"] == 1 and run["final"] == "full-16@transformers"


def test_the_request_in_progress_at_the_end_counts_pro_rata_and_phases_follow_the_schedule():
    costs = Costs(step_seconds=0.01, update_scale=1.0, swap_seconds=0.0, source="test")
    sim = Simulation(KnownVersions(), costs, "colocated", duration=1.01, rate=None, seed=0)
    run = sim.run(UpdateOnce())
    assert run["tokens"] == pytest.approx(50 * 4 + 4 * 0.5)  # 50 whole requests, then half of one
    assert [sim.phase_at(share * sim.duration) for share, _ in SCHEDULE] == [phase for _, phase in SCHEDULE]
    assert [phase for _, phase, *_ in run["trace"]][:6] == ["stdlib"] * 6


def test_arrivals_at_a_rate_leave_the_server_idle_between_requests():
    costs = Costs(step_seconds=0.01, update_scale=1.0, swap_seconds=0.0, source="test")
    run = Simulation(KnownVersions(), costs, "colocated", duration=600.0, rate=2.0, seed=0).run(UpdateOnce())
    # About 2 requests a second for 600 s: far below the 50 a second the server could take.
    assert 1000 < run["requests"] < 1400
    assert run["tokens"] == pytest.approx(400 + 6 * (run["requests"] - 100))


def test_greedy_updates_when_the_window_falls_below_the_reference():
    class Sim:
        version = SHIPPED

        class versions:
            child = staticmethod(lambda v, phase, arm: BETTER)

    greedy = Greedy(window=8, drop=0.1)
    decisions = [greedy.after(Sim, Served(i, "stdlib", 4, 2, 0.0)) for i in range(8)]
    assert decisions == [None] * 8  # the reference: τ 2 over the first full window
    decisions = [greedy.after(Sim, Served(8 + i, "torch", 3, 2, 0.0)) for i in range(4)]
    # τ over the last 8 steps: 2 at first, (4 + 4 + 3 + 3) / 8 = 1.75 once two slower requests are in: below 1.8.
    assert decisions[:1] == [None] and decisions[1] == (BETTER, 1.0)
    assert decisions[2:] == [None, None] and greedy.ref is None  # a fresh window and reference after an update
