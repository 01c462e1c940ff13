"""The cost-aware controller against a simulated server: step costs and acceptance of every arm are known
to the test, not to the controller, which must end within a few percent of the best arm at each batch size."""

import itertools
import math
import random

import pytest
import torch

from trainer.decoding.batch import RowStep
from trainer.decoding.controller import Controller
from trainer.decoding.events import StepEvent
from trainer.decoding.tree import NestedTree, Tree, chain


def simulate(costs, accept, batch_sizes, steps=12000, seed=0, schedule=None, **options):
    """Run the controller; returns its tokens/s and every fixed arm's at each batch size. ``schedule``: the batch
    size of every step (default: drawn from ``batch_sizes``)."""
    rng = random.Random(seed)
    controller = Controller(list(costs), **options)
    made = {b: [0, 0.0] for b in batch_sizes}
    for step in range(steps):
        batch = schedule[step] if schedule else rng.choice(batch_sizes)
        tree_name, budget = controller.choose(batch)
        seconds = costs[tree_name, budget](batch)
        rows = []
        for _ in range(batch):
            depth = min(budget, 4)
            accepted = 0
            while accepted < depth and rng.random() < accept[tree_name]:
                accepted += 1
            tree = chain(0, torch.arange(1, depth + 1), depth) if depth else Tree.from_lists([0], [-1])
            event = StepEvent(0, 0, 0, tree, list(range(accepted + 1)), 0, torch.zeros(1), {}, budget, tree_name)
            rows.append(RowStep(None, event, [0] * (accepted + 1)))
            made[batch][0] += accepted + 1
        made[batch][1] += seconds
        controller.observe(tree_name, budget, batch, rows, seconds)
    mine = {b: tokens / seconds for b, (tokens, seconds) in made.items()}
    fixed = {}
    for arm, cost in costs.items():
        depth = min(arm[1], 4)
        p = accept[arm[0]]
        tau = sum(p**d for d in range(depth + 1))
        for b in batch_sizes:
            fixed[arm, b] = b * tau / cost(b)
    return controller, mine, fixed


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gpu_like", [False, True])
def test_the_controller_ends_near_the_best_arm_at_every_batch_size(gpu_like, seed):
    # CPU-like: verification cost grows with every token verified, drafter forwards cost ~ a dozen tokens.
    # GPU-like: verifying up to 64 tokens costs about one; a drafter forward is cheap.
    per_token = 0.0001 if gpu_like else 0.0006
    draft = 0.0003 if gpu_like else 0.004
    costs = {("none", 0): lambda b: 0.006 + per_token * b}
    for budget in (8, 16):
        costs["recycling", budget] = lambda b, n=budget: 0.006 + per_token * b * (n + 1) + 0.0002 * b
        costs["ddtree", budget] = lambda b, n=budget: 0.006 + per_token * b * (n + 1) + draft * b
    accept = {"none": 0.0, "recycling": 0.3, "ddtree": 0.6}
    controller, mine, fixed = simulate(costs, accept, [1, 4, 8], seed=seed)
    for b, rate in mine.items():
        best = max(v for (arm, bb), v in fixed.items() if bb == b)
        assert rate >= 0.93 * best, (b, rate, best)
    # The probes stayed inside their budget (the check precedes a step, so the last one may overrun it), and some
    # were made: a controller that never probed would pass the rate check above only by luck.
    overrun = max(cost(8) for cost in costs.values())
    assert 0 < controller.probe_seconds <= controller.probe_share * controller.recent_seconds + overrun


def test_a_load_ramping_up_finds_plain_decoding_best_at_the_new_batch_size():
    # Recycling wins at one request, plain decoding at eight, where its step costs 1.6x its step at one. Scaled
    # linearly from one request, plain decoding would look 8x slower at eight: recycling would win there too,
    # and probing plain decoding (estimated loss 58%) would not fit the budget.
    controller = Controller([("none", 0), ("recycling", 8)], probe_share=0.005, probe_grace=0.0)
    plain = StepEvent(0, 0, 0, Tree.from_lists([0], [-1]), [0], 0, torch.zeros(1), {}, 0, "none")
    drafted = StepEvent(0, 0, 0, chain(0, torch.arange(1, 9), 8), [0, 1, 2], 0, torch.zeros(1), {}, 8, "recycling")
    cost = {("none", 0): {1: 0.0066, 8: 0.0108}, ("recycling", 8): {1: 0.0116, 8: 0.0508}}
    row = {("none", 0): RowStep(None, plain, [0]), ("recycling", 8): RowStep(None, drafted, [0, 0, 0])}
    seen = {1: [], 8: []}
    for batch, steps in ((1, 40), (8, 40)):
        for _ in range(steps):
            arm = controller.choose(batch)
            seen[batch].append(arm)
            controller.observe(*arm, batch, [row[arm]] * batch, cost[arm][batch])
    # One request: 1 token / 6.6 ms = 152 tokens/s against 3 / 11.6 ms = 259; eight: 741 against 472.
    assert seen[1][-10:] == [("recycling", 8)] * 10
    assert seen[8][-10:] == [("none", 0)] * 10
    # Plain decoding is measured at the new size first; recycling's cost there is first estimated from plain
    # decoding's growth (optimistic: it is then tried, and measured).
    assert seen[8][: controller.min_samples] == [("none", 0)] * controller.min_samples


def test_an_unspent_probe_budget_does_not_pile_up():
    # An hour of steps on the best arm: the budget is a share of recent time, so what a quiet hour left unspent
    # cannot be lost all at once when the load changes (a cumulative one would allow 36 s here).
    controller = Controller([("none", 0), ("recycling", 8)])
    event = StepEvent(0, 0, 0, Tree.from_lists([0], [-1]), [0], 0, torch.zeros(1), {}, 0, "none")
    for _ in range(36000):
        controller.choose(4)
        controller.probing = False
        controller.observe("none", 0, 4, [RowStep(None, event, [0])], 0.1)
    window = controller.probe_half_life / math.log(2)
    assert controller.probe_left() == pytest.approx(controller.probe_share * window, rel=0.01)


@pytest.mark.parametrize(("recycling_seconds", "keeps_learning"), [(0.0205, True), (0.03, False)])
def test_drafting_state_keeps_learning_only_while_a_drafting_arm_is_nearly_best(recycling_seconds, keeps_learning):
    # No probing: after the measurements below the controller picks its best estimate, plain decoding.
    controller = Controller([("none", 0), ("recycling", 8)], probe_share=0.0, probe_grace=0.0)
    plain = StepEvent(0, 0, 0, Tree.from_lists([0], [-1]), [0], 0, torch.zeros(1), {}, 0, "none")
    drafted = StepEvent(0, 0, 0, chain(0, torch.arange(1, 9), 8), [0, 1], 0, torch.zeros(1), {}, 8, "recycling")
    for _ in range(5):
        controller.observe("none", 0, 4, [RowStep(None, plain, [0])] * 4, 0.01)
        controller.observe("recycling", 8, 4, [RowStep(None, drafted, [0, 0])] * 4, recycling_seconds)
    # Plain: 4 rows x 1 token / 0.01 s = 400 tokens/s; recycling: 4 x 2 / 0.0205 = 390 (within 5%) or / 0.03 = 267.
    assert controller.throughput(("none", 0), 4) == pytest.approx(400)
    assert controller.choose(4) == ("none", 0)
    assert controller.speculating() is keeps_learning


@pytest.mark.parametrize(("steps", "keeps_learning"), [(5, False), (60, True)])
def test_an_arm_measured_over_few_rows_is_kept_ready_only_once_its_acceptance_is_known(steps, keeps_learning):
    # Recycling's rows accept 0 or 2 drafts in turn: τ 2 with a spread of 1, 4 x 2 / 0.0205 = 390 tokens/s against
    # plain's 400, 2.4% behind. Over 20 rows τ's standard error is 11%, beyond what a full window of ~200 rows
    # leaves (3.5%): judged one such error lower, 13% behind, the arm is not kept learning; over 240 rows it is.
    controller = Controller([("none", 0), ("recycling", 8)], probe_share=0.0, probe_grace=0.0)
    plain = StepEvent(0, 0, 0, Tree.from_lists([0], [-1]), [0], 0, torch.zeros(1), {}, 0, "none")
    tree = chain(0, torch.arange(1, 9), 8)
    rows = [
        RowStep(None, StepEvent(0, 0, 0, tree, list(range(accepted + 1)), 0, torch.zeros(1), {}, 8, "recycling"),
                [0] * (accepted + 1))
        for accepted in (0, 2, 0, 2)
    ]  # fmt: skip
    for _ in range(steps):
        controller.observe("none", 0, 4, [RowStep(None, plain, [0])] * 4, 0.01)
        controller.observe("recycling", 8, 4, rows, 0.0205)
    assert controller.stats["recycling", 8].tau(4) == pytest.approx(2.0, abs=0.02)
    assert controller.choose(4) == ("none", 0)
    assert controller.speculating() is keeps_learning


def test_a_slower_machine_does_not_make_an_arm_measured_earlier_look_better():
    # Plain 4 / 0.01 = 400 tokens/s, recycling 4 x 2 / 0.0227 = 352: 12% behind, outside the 5% ready margin.
    # Measured as a server would have: plain decoding every step, recycling now and then.
    controller = Controller([("none", 0), ("recycling", 8)], probe_share=0.0, probe_grace=0.0)
    for step in range(500):
        _measure(controller, ("none", 0), 0.01)
        if step % 100 == 0:
            _measure(controller, ("recycling", 8), 0.0227)
    assert controller.choose(4) == ("none", 0) and not controller.speculating()
    # The CPU slows by 15% while only plain decoding runs: recycling would slow alike, so it stays 12% behind
    # (compared with its figure from before the slowdown, it would look as fast as plain decoding).
    for _ in range(200):
        _measure(controller, ("none", 0), 0.0115)
        assert controller.choose(4) == ("none", 0)
        assert not controller.speculating()
    assert controller.cost(("none", 0), 4) == pytest.approx(0.0115)
    assert controller.cost(("recycling", 8), 4) == pytest.approx(0.0227 * 1.15, rel=0.01)


def test_a_drafter_far_behind_gets_no_sessions_until_it_is_due_for_a_measurement():
    controller = Controller([("none", 0), ("ddtree", 8)], probe_share=0.0, probe_grace=0.0, refresh=5.0)
    plain = StepEvent(0, 0, 0, Tree.from_lists([0], [-1]), [0], 0, torch.zeros(1), {}, 0, "none")
    drafted = StepEvent(0, 0, 0, chain(0, torch.arange(1, 9), 8), [0, 1], 0, torch.zeros(1), {}, 8, "ddtree")
    # Never measured: its sessions are kept so that it can be.
    assert controller.ready("ddtree")
    for _ in range(controller.min_samples):
        controller.observe("ddtree", 8, 4, [RowStep(None, drafted, [0, 0])] * 4, 0.05)
        controller.observe("none", 0, 4, [RowStep(None, plain, [0])] * 4, 0.01)
    # 4 x 2 / 0.05 = 160 tokens/s against plain's 400: far outside the ready margin.
    assert controller.choose(4) == ("none", 0)
    assert not controller.ready("ddtree")
    # Not available (some row lacks the session): never chosen, and nothing is charged to probing for it.
    for step in range(1, 6011):
        assert controller.choose(4, frozenset({"none"})) == ("none", 0)
        assert not controller.probing
        controller.observe("none", 0, 4, [RowStep(None, plain, [0])] * 4, 0.01)
        if step in (490, 5990):
            assert not controller.ready("ddtree")
    # Due again once the refresh (5 s) divided by what a look is worth has passed: 60% behind against a 5%
    # margin, worth 1/12, so after 60 s of steps. New requests get its sessions.
    assert controller.ready("ddtree")


def test_a_probe_is_charged_the_throughput_it_realised_not_its_estimate():
    controller = Controller([("none", 0), ("recycling", 8)], probe_share=0.5, probe_grace=0.0, replan=1)
    plain = StepEvent(0, 0, 0, Tree.from_lists([0], [-1]), [0], 0, torch.zeros(1), {}, 0, "none")
    drafted = StepEvent(0, 0, 0, chain(0, torch.arange(1, 9), 8), [0, 1], 0, torch.zeros(1), {}, 8, "recycling")
    for _ in range(5):
        controller.observe("recycling", 8, 4, [RowStep(None, drafted, [0, 0])] * 4, 0.022)
        controller.observe("none", 0, 4, [RowStep(None, plain, [0])] * 4, 0.01)
    assert controller.choose(4) == ("none", 0)
    controller.observe("none", 0, 4, [RowStep(None, plain, [0])] * 4, 0.01)
    assert controller.probe_seconds == 0.0
    # Recycling's figure is now the stalest and the budget is ample: a probe. Estimated at 4 x 2 / 0.022 = 364
    # tokens/s against plain's 400 (a loss of 0.002 s), it commits one token per row: 0.022 - 4 / 400 = 0.012 s lost.
    assert controller.choose(4) == ("recycling", 8)
    miss = StepEvent(0, 0, 0, chain(0, torch.arange(1, 9), 8), [0], 0, torch.zeros(1), {}, 8, "recycling")
    controller.observe("recycling", 8, 4, [RowStep(None, miss, [0])] * 4, 0.022)
    assert controller.probe_seconds == pytest.approx(0.012)


def test_a_probe_of_an_arm_far_behind_does_not_keep_drafting_state_learning():
    # Requests admitted after a probe would pay for their prompt's logits (an LM head over the prompt) for an arm
    # that is a third slower: the probe's own step learns its nodes, nothing more.
    controller = Controller([("none", 0), ("recycling", 8)], probe_share=0.5, probe_grace=1.0, replan=1)
    plain = StepEvent(0, 0, 0, Tree.from_lists([0], [-1]), [0], 0, torch.zeros(1), {}, 0, "none")
    drafted = StepEvent(0, 0, 0, chain(0, torch.arange(1, 9), 8), [0, 1], 0, torch.zeros(1), {}, 8, "recycling")
    for _ in range(controller.min_samples):
        controller.observe("recycling", 8, 4, [RowStep(None, drafted, [0, 0])] * 4, 0.03)
        controller.observe("none", 0, 4, [RowStep(None, plain, [0])] * 4, 0.01)
    assert controller.choose(4) == ("none", 0)
    controller.observe("none", 0, 4, [RowStep(None, plain, [0])] * 4, 0.01)
    assert controller.choose(4) == ("recycling", 8)
    assert controller.probing and not controller.speculating()


def test_a_held_choice_is_dropped_when_the_batch_changes_and_a_due_probe_waits_at_most_replan_steps():
    # Recycling wins at one request (1 x 3 / 0.012 = 250 tokens/s against 1 / 0.006 = 167), plain decoding at
    # eight (8 / 0.012 = 667 against 8 x 3 / 0.05 = 480).
    controller = Controller([("none", 0), ("recycling", 8)], probe_share=0.0, probe_grace=0.0, replan=8)
    for _ in range(controller.min_samples):
        for batch, plain, drafted in ((1, 0.006, 0.012), (8, 0.012, 0.05)):
            _measure(controller, ("none", 0), plain, batch=batch)
            _measure(controller, ("recycling", 8), drafted, accepted=2, batch=batch)
    for batch, best in ((1, ("recycling", 8)), (8, ("none", 0)), (1, ("recycling", 8)), (8, ("none", 0))):
        # The first step at a new batch size is chosen afresh, not taken from the plan made at the other size.
        assert controller.choose(batch) == best
        _measure(controller, best, 0.012, accepted=2 if best[1] else 0, batch=batch)
    # At eight requests recycling's figure goes stale while plain decoding runs; with an ample budget its probe
    # comes, once, within the `replan` steps a held choice lasts.
    controller.probe_share = 0.5
    chosen = []
    for _ in range(24):
        arm = controller.choose(8)
        chosen.append(arm)
        _measure(controller, arm, 0.012 if arm == ("none", 0) else 0.05, accepted=0 if arm[1] == 0 else 2, batch=8)
    probes = [i for i, arm in enumerate(chosen) if arm == ("recycling", 8)]
    assert probes and probes[0] < controller.replan
    assert all(b - a > 1 for a, b in itertools.pairwise(probes))


def test_acceptance_measured_at_one_batch_size_is_not_carried_to_another_where_it_was_measured():
    # Recycling at one request: 1 x 4 / 0.012 = 333 tokens/s against plain's 167. At four, where concurrent
    # requests overwrite each other's rows, it accepts less (τ 2 over 84 rows there): with one request's rows
    # counted as 16 of them, τ (16 x 4 + 84 x 2) / 100 = 2.32 and 4 x 2.32 / 0.027 = 344 tokens/s against 400, 14%
    # behind, outside the ready margin. Pooled over both sizes (τ 2.75: 407) or carried over whole (τ 4: 593) it
    # would be chosen.
    controller = Controller([("none", 0), ("recycling", 8)], probe_share=0.0, probe_grace=0.0)
    for _ in range(50):
        _measure(controller, ("recycling", 8), 0.012, accepted=3, batch=1)
        _measure(controller, ("none", 0), 0.006, batch=1)
    for _ in range(21):
        _measure(controller, ("recycling", 8), 0.027, accepted=1, batch=4)
        _measure(controller, ("none", 0), 0.01, batch=4)
    stats = controller.stats["recycling", 8]
    assert stats.tau(4) == pytest.approx(2.32) and stats.tau(1) == pytest.approx(4.0)
    assert controller.choose(4) == ("none", 0)
    assert not controller.speculating()
    assert controller.choose(1) == ("recycling", 8)
    # At eight requests, never measured, the arm's acceptance is that of the nearest size measured.
    assert stats.tau(8) == stats.tau(4)


def _measure(controller, arm, seconds, accepted=1, batch=4):
    tree = Tree.from_lists([0], [-1]) if arm[1] == 0 else chain(0, torch.arange(1, arm[1] + 1), arm[1])
    event = StepEvent(0, 0, 0, tree, list(range(accepted + 1 if arm[1] else 1)), 0, torch.zeros(1), {}, *arm[::-1])
    controller.observe(*arm, batch, [RowStep(None, event, [0] * len(event.path))] * batch, seconds)


def test_probes_take_turns_and_an_expensive_arm_is_not_starved_by_cheap_ones():
    # Plain 400 tokens/s; recycling 4 x 2 / 0.022 = 364 (a probe loses 0.002 s); ddtree 4 x 2 / 0.08 = 100 (a
    # probe loses 0.06 s). A probe of whatever fits would spend the refilling budget on recycling forever.
    controller = Controller([("none", 0), ("recycling", 8), ("ddtree", 8)], probe_share=0.01, probe_grace=0.0)
    arms = {("none", 0): 0.01, ("recycling", 8): 0.022, ("ddtree", 8): 0.08}
    for _ in range(controller.min_samples):
        for arm, seconds in arms.items():
            _measure(controller, arm, seconds)
    chosen = []
    for _ in range(3000):
        arm = controller.choose(4)
        chosen.append(arm)
        _measure(controller, arm, arms[arm])
    probes = [a for a in chosen if a != ("none", 0)]
    # In turn: every recycling probe after the first waits for a ddtree probe in between, and the other way round.
    assert probes.count(("ddtree", 8)) >= 2
    assert all(a != b for a, b in itertools.pairwise(probes))
    # Within the budget: 1% of 30 s of plain steps is 0.3 s, a few ddtree probes.
    assert probes.count(("ddtree", 8)) <= 6


def test_a_due_drafter_is_probed_at_once_when_every_row_carries_its_sessions():
    controller = Controller([("none", 0), ("ddtree", 4), ("ddtree", 8)], probe_share=0.0, probe_grace=0.0, refresh=1.0)
    for _ in range(controller.min_samples):
        for arm in controller.arms:
            _measure(controller, arm, 0.05 if arm[1] else 0.01)
    while not controller.due("ddtree"):
        assert controller.choose(4, frozenset({"none"})) == ("none", 0)
        _measure(controller, ("none", 0), 0.01)
    assert controller.ready("ddtree")
    # No budget at all, yet every row now holds the sessions: the builder's stalest arm goes now.
    first = controller.choose(4, frozenset({"none", "ddtree"}))
    assert first[0] == "ddtree" and controller.probing
    _measure(controller, first, 0.05)
    # One arm measured refreshes the builder: no more sessions for new requests, and plain decoding again.
    assert not controller.due("ddtree") and not controller.ready("ddtree")
    assert controller.choose(4, frozenset({"none", "ddtree"})) == ("none", 0)


@pytest.mark.parametrize("recheck", [25, 10**9])
def test_an_inflated_figure_of_plain_decoding_is_measured_again(recheck):
    """Plain decoding's first two steps at four requests ran 1.6x its cost (as the steps after a batch grows can),
    so recycling looks best there; the probes go to the stalest arm and save up for the expensive drafter, so
    plain decoding would wait behind them. It is measured again every ``recheck`` steps (divided by what a look is
    worth) and wins back the batch size: with the re-check the controller ends within 5% of plain decoding, without
    it (``recheck`` never) it stays on recycling, 11% behind, and measures plain decoding once in 3000 steps."""
    plain_steps = [0]

    def plain(b):
        plain_steps[0] += 1
        return 0.021 if plain_steps[0] <= 2 else 0.013

    costs = {("none", 0): plain}
    for budget in (8, 16, 32):
        costs["recycling", budget] = lambda b, n=budget: 0.02 + 0.0003 * n
        costs["ddtree", budget // 2] = lambda b: 0.2
    accept = {"none": 0.0, "recycling": 0.35, "ddtree": 0.6}
    steps = 3000
    controller, mine, fixed = simulate(
        costs, accept, [4], steps=steps, schedule=[4] * steps, probe_grace=0.0, recheck=recheck
    )
    best = max(fixed.values())
    assert best == fixed[("none", 0), 4]
    if recheck < steps:
        assert controller.choose(4) == ("none", 0) and mine[4] >= 0.95 * best
    else:
        assert controller.choose(4) == ("recycling", 8) and mine[4] < 0.9 * best and plain_steps[0] <= 3


def test_a_nested_tree_step_also_measures_every_smaller_budget_of_its_builder():
    # A chain of four draft nodes whose ranks in the retrieval order are 1, 5, 9 and 12: recycling@8's tree holds
    # the first two, @16's all four. Every row accepts three nodes.
    tree = NestedTree(torch.arange(5), torch.arange(-1, 4), torch.tensor([0, 1, 5, 9, 12]))
    event = StepEvent(0, 0, 0, tree, [0, 1, 2, 3], 0, torch.zeros(1), {}, 16, "recycling")
    arms = [("none", 0), ("recycling", 8), ("recycling", 16), ("recycling", 32)]
    controller = Controller(arms)
    for _ in range(30):
        controller.observe("recycling", 16, 2, [RowStep(None, event, [0] * 4)] * 2, 0.01)
    # @8 would have accepted its whole tree (two nodes, depth 2): τ 3; @16 itself three of four: τ 4.
    assert controller.stats["recycling", 8].accept[2].tau == pytest.approx(3.0)
    assert controller.stats["recycling", 8].accept[2].rows == 60
    assert controller.stats["recycling", 16].accept[2].tau == pytest.approx(4.0)
    # A larger budget's tree is not inside this one: nothing is learnt for it, nor any cost for the others.
    assert not controller.stats["recycling", 32].accept
    assert not controller.stats["recycling", 8].cost


def _nested_step(controller, budget, path, seconds):
    """One step at one request of recycling@``budget`` over a chain whose draft nodes have retrieval ranks 1, 5,
    9 and 12: @8's tree holds the first two, @16's all four; the row accepts ``path``."""
    ranks = [0, 1, 5, 9, 12][: 3 if budget == 8 else 5]
    tree = NestedTree(torch.arange(len(ranks)), torch.arange(-1, len(ranks) - 1), torch.tensor(ranks))
    event = StepEvent(0, 0, 0, tree, path, 0, torch.zeros(1), {}, budget, "recycling")
    controller.observe("recycling", budget, 1, [RowStep(None, event, [0] * len(path))], seconds)


def test_a_nested_builder_bounds_its_budgets_by_each_other():
    controller = Controller([("none", 0), ("recycling", 8), ("recycling", 16)])
    for _ in range(10):
        _nested_step(controller, 16, [0], 0.02)
    for _ in range(30):
        _nested_step(controller, 8, [0, 1, 2], 0.03)
    r8, r16 = ("recycling", 8), ("recycling", 16)
    # @16's own rows accepted nothing, but its tree holds @8's: it accepts at least what @8 did on the same tokens.
    assert controller.stats[r16].tau(1) == 1.0 and controller.stats[r8].tau(1) == pytest.approx(2.5)
    assert controller.tau(r16, 1) == pytest.approx(2.5) and controller.tau(r8, 1) == pytest.approx(2.5)
    # @8's own figure says 0.03 s, but a step of @8 verifies a part of @16's tree: no dearer than @16's 0.02 s.
    assert controller.cost(r8, 1) == pytest.approx(0.02) and controller.cost(r16, 1) == pytest.approx(0.02)
    # A builder whose trees were not seen nested is not bounded.
    plain_tree = Controller([("none", 0), ("ddtree", 4), ("ddtree", 8)])
    for budget, seconds in ((8, 0.02), (4, 0.03)):
        _measure(plain_tree, ("ddtree", budget), seconds)
    assert plain_tree.cost(("ddtree", 4), 4) == pytest.approx(0.03)


def test_a_smaller_nested_budget_with_a_stale_cost_is_measured_again_and_wins():
    """@8's only figure is from its first steps (0.03 s, inflated); it costs 0.012 s now, @16 0.02 s. @16's steps
    measure @8's acceptance (τ 3 against @16's 4), not its cost: on the stale figure @8 looks 25% behind. With no
    probing budget at all, the re-check of a smaller budget of the best arm's nested builder measures it every
    ``recheck`` steps, and once its new measurements are half its window the median is theirs: the controller
    moves to @8 (without the re-check it would never measure @8 again)."""
    controller = Controller([("none", 0), ("recycling", 8), ("recycling", 16)], probe_share=0.0, probe_grace=0.0)
    cost = {("none", 0): 0.015, ("recycling", 8): 0.012, ("recycling", 16): 0.02}
    for _ in range(2):
        _measure(controller, ("none", 0), cost["none", 0], batch=1)
    for _ in range(20):
        _nested_step(controller, 8, [0, 1, 2], 0.03)
    # 300 steps of @16 (a step counts when chosen; these are imposed).
    for _ in range(300):
        controller.steps += 1
        _nested_step(controller, 16, [0, 1, 2, 3], 0.02)
    r8, r16 = ("recycling", 8), ("recycling", 16)
    assert controller.throughput(r8, 1) < 0.8 * controller.throughput(r16, 1)
    chosen = []
    for _ in range(controller.recheck * controller.cost_window + 100):
        arm = controller.choose(1)
        chosen.append(arm)
        if arm == ("none", 0):
            _measure(controller, arm, cost[arm], batch=1)
        else:
            _nested_step(controller, arm[1], [0, 1, 2] if arm[1] == 8 else [0, 1, 2, 3], cost[arm])
    assert r8 in chosen[: controller.recheck]
    assert chosen[-100:].count(r8) >= 95


@pytest.mark.parametrize("speed_window", [9, 1])
def test_a_few_slow_steps_do_not_make_plain_decoding_look_dearer_than_an_arm_measured_after_them(speed_window):
    """Plain decoding at four requests costs 0.019 s (210 tokens/s), recycling 0.042 s for τ 2 (190, 10% behind).
    Three plain steps run 2.6 times slower (as when a server's load turn ended), then recycling is measured for the
    first time. Taken as the machine's speed at once (a window of one step), those steps raise it by 160%,
    recycling's young figure is learnt at that speed, plain decoding keeps its figure from before and looks 2.6
    times dearer than it is: the controller runs recycling until re-checks of plain decoding wear the error down.
    The median of nine steps does not move."""
    plain, recycling = ("none", 0), ("recycling", 8)
    cost = {plain: 0.019, recycling: 0.042}
    controller = Controller([plain, recycling], probe_share=0.0, probe_grace=0.0, speed_window=speed_window)
    for _ in range(100):
        _measure(controller, plain, cost[plain])
    for _ in range(3):
        _measure(controller, plain, 0.05)
    speed = controller.speed
    for _ in range(2):
        _measure(controller, recycling, cost[recycling], accepted=1)
    chosen = []
    for _ in range(600):
        arm = controller.choose(4)
        chosen.append(arm)
        _measure(controller, arm, cost[arm], accepted=1)
    if speed_window > 1:
        assert speed == pytest.approx(1.0)
        assert chosen.count(plain) >= 0.95 * len(chosen)
    else:
        assert speed > 2.5
        assert chosen.count(plain) < 0.6 * len(chosen)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_preempted_steps_do_not_keep_the_controller_on_a_slower_arm(seed):
    """A machine shared with other jobs: one step in five is preempted and runs 2-3 times its cost, and plain
    decoding's first two steps at the size cost 2.5 times its steady step. Plain decoding (400 tokens/s) beats
    recycling (4 x 1.8 / 0.021 = 343, 14% behind). Taken as means against a speed taken as a median (a clipped
    average), every figure learnt from single steps carried the tail (a fifth more here), and plain decoding's
    inflated first figure spaced its re-checks by the loss it made: the controller ran recycling for a sixth to a
    third of its steps, 4-8% behind plain decoding. Compared as medians, and re-checked every ``recheck`` steps
    until its figure rests on a full window, plain decoding keeps the batch size."""
    rng = random.Random(seed)
    plain, recycling = ("none", 0), ("recycling", 8)
    controller = Controller([plain, recycling], probe_grace=0.0)
    cost = {plain: 0.010, recycling: 0.021}
    plain_steps, tokens, seconds = 0, 0, 0.0
    for _ in range(3000):
        arm = controller.choose(4)
        step = cost[arm]
        if arm == plain:
            plain_steps += 1
            step *= 2.5 if plain_steps <= 2 else 1.0
        noise = rng.uniform(2, 3) if rng.random() < 0.2 else math.exp(rng.gauss(0, 0.05))
        accepted = [rng.choice([0, 0, 1, 1, 2]) if arm == recycling else 0 for _ in range(4)]
        tree = Tree.from_lists([0], [-1]) if arm == plain else chain(0, torch.arange(1, 9), 8)
        rows = [
            RowStep(None, StepEvent(0, 0, 0, tree, list(range(a + 1)), 0, torch.zeros(1), {}, arm[1], arm[0]),
                    [0] * (a + 1))
            for a in accepted
        ]  # fmt: skip
        controller.observe(*arm, 4, rows, step * noise)
        # Throughput at the machine's steady speed: what the choices cost, not the draw of preempted steps.
        tokens += sum(a + 1 for a in accepted)
        seconds += step
    assert tokens / seconds >= 0.97 * 4 / cost[plain]


def test_an_arm_best_only_on_a_cost_scaled_from_another_batch_size_runs_once_there():
    """The drafter was measured at one request only (0.012 s for τ 2, ahead of plain decoding's 0.01 s); plain
    decoding costs twice as much at eight as at one, so the drafter's cost there is estimated at 0.024 s and it is
    chosen. It costs 0.08 s there: after that one step the controller returns to plain decoding, not holding the
    choice for ``replan`` steps."""
    plain, drafter = ("none", 0), ("ddtree", 8)
    controller = Controller([plain, drafter], probe_share=0.0, probe_grace=0.0)
    for _ in range(2):
        _measure(controller, plain, 0.01, batch=1)
        _measure(controller, plain, 0.02, batch=8)
        _measure(controller, drafter, 0.012, batch=1)
    assert controller.choose(8) == drafter
    _measure(controller, drafter, 0.08, batch=8)
    assert [controller.choose(8) for _ in range(controller.replan)] == [plain] * controller.replan


def test_a_drafters_acceptance_is_one_figure_for_every_batch_size():
    """A neural drafter's row drafts from its own context, so what it accepts at four requests is what it accepts
    at one. Its first rows at one request accepted nothing (τ 1 on 6 rows, where it accepts 3 tokens a row at
    four): kept per size, that figure stays until a probe at one request corrects it, and the drafter, 40% ahead
    of plain decoding, looks 60% behind. Pooled, 200 rows at four set its τ at one."""
    plain, drafter = ("none", 0), ("ddtree", 8)
    controller = Controller([plain, drafter], probe_share=0.0, probe_grace=0.0)
    for _ in range(controller.min_samples):
        _measure(controller, plain, 0.01, batch=1)
    for _ in range(6):
        _measure(controller, drafter, 0.028, accepted=0, batch=1)
    for _ in range(50):
        _measure(controller, drafter, 0.04, accepted=3, batch=4)
    assert controller.tau(drafter, 1) == controller.tau(drafter, 4) == pytest.approx(4.0, abs=0.1)
    assert controller.choose(1) == drafter


def test_a_nested_budget_is_not_bounded_by_a_larger_ones_cost_scaled_from_another_batch_size():
    """Recycling@32 was measured at one request only (0.012 s against plain decoding's 0.010 s there); at four its
    cost is estimated from plain decoding's growth, 0.012 x 0.015 / 0.010 = 0.018 s, optimistic for a larger tree
    (so that it gets tried). Recycling@8, measured at four, costs 0.034 s for τ 2: 4 x 2 / 0.034 = 235 tokens/s
    against plain decoding's 267, 12% behind. Bounded by @32's estimate (a nested builder's smaller budget costs no
    more than a larger one), it would look like 444 tokens/s, as good as @32's guess, and hold the batch size in
    place of plain decoding; only a larger budget's cost measured at the size bounds it. @32 is tried there once
    (best on its scaled cost alone), costs 0.06 s, and plain decoding runs."""
    plain, r8, r32 = ("none", 0), ("recycling", 8), ("recycling", 32)
    controller = Controller([plain, r8, r32], probe_share=0.0, probe_grace=0.0)
    cost = {plain: 0.015, r8: 0.034, r32: 0.06}

    def step(arm, batch, seconds):
        if arm == plain:
            _measure(controller, plain, seconds, batch=batch)
            return
        ranks = {8: [0, 1, 5], 32: [0, 1, 5, 9, 20]}[arm[1]]
        tree = NestedTree(torch.arange(len(ranks)), torch.arange(-1, len(ranks) - 1), torch.tensor(ranks))
        event = StepEvent(0, 0, 0, tree, [0, 1], 0, torch.zeros(1), {}, arm[1], arm[0])
        controller.observe(*arm, batch, [RowStep(None, event, [0, 0])] * batch, seconds)

    for _ in range(controller.min_samples):
        step(plain, 1, 0.010)
        step(r32, 1, 0.012)
    for _ in range(20):
        step(plain, 4, cost[plain])
        step(r8, 4, cost[r8])
    assert controller.cost(r32, 4) == pytest.approx(0.018)
    assert controller.cost(r8, 4) == pytest.approx(0.034)
    assert controller.throughput(r8, 4) < 0.9 * controller.throughput(plain, 4)
    chosen = []
    for _ in range(50):
        arm = controller.choose(4)
        chosen.append(arm)
        step(arm, 4, cost[arm])
    assert chosen[0] == r32 and chosen[1:] == [plain] * 49
