"""The bandit drafter updater: the training-step API, gain/cost estimates, the decision rule, rollback, the
alarm, restart after SIGKILL."""

import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY_TARGET, make_run
from safetensors.torch import load_file

from trainer.adapt.bandit import (
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
    cost_tokens,
    drift,
    expected_accepted,
    gain_tokens,
    judged_ratio,
    judged_sd,
    keep_risk,
    live_bound,
    live_gain,
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
from trainer.adapt.bandit_daemon import ALARM_EXIT, BanditDaemon, DaemonState, PendingDecision
from trainer.adapt.journal import StateError
from trainer.data.features import with_features
from trainer.snapshots import publish, read_current, read_manifest
from trainer.training.blocks import blocks_at, dflash_loss, treeflash_loss
from trainer.training.dflash import DFlashTraining
from trainer.training.eagle3 import Eagle3Training
from trainer.training.eagle3_losses import eagle3_unroll
from trainer.training.specblock import SpecBlockTraining
from trainer.training.specblock_losses import SpecBlockOptions, specblock_unroll
from trainer.training.step import (
    BlockStepOptions,
    Eagle3StepOptions,
    NonFiniteStep,
    SpecBlockStepOptions,
    chain_depth,
    chain_logits,
    context_batch,
    train_step,
)
from trainer.training.treeflash import TreeFlashTraining
from trainer.vlog.schema import request_record, step_record

CHECKPOINTS = ROOT / "checkpoints"
DFLASH_TINY = CHECKPOINTS / "dflash_tiny"


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 200, (40,), generator=g).tolist(), torch.randint(5, 200, (28,), generator=g).tolist()]
    return context_batch(seqs, [10, 6], pad_id=0)


def _module_and_options(family: str):
    """The family's LightningModule from a shipped checkpoint and the step options of its arguments."""
    common = dict(target=str(TINY_TARGET), topk=8, seed=3)
    if family == "dflash":
        module = DFlashTraining(init_from=str(DFLASH_TINY), loss="kl", max_anchors=4, gamma=4.0, **common)
        options = BlockStepOptions(topk=8, max_anchors=4, gamma=4.0, seed=3, loss="kl")
    elif family == "treeflash":
        module = TreeFlashTraining(backbone=str(DFLASH_TINY), freeze_backbone=False, max_anchors=4, gamma=4.0, **common)
        options = BlockStepOptions(topk=8, max_anchors=4, gamma=4.0, seed=3)
    elif family == "eagle3":
        module = Eagle3Training(
            str(TINY_TARGET), init_from=str(CHECKPOINTS / "eagle3_tiny"), ttt_steps=3, step_decay=0.7, topk=8
        )
        options = Eagle3StepOptions(topk=8, ttt_steps=3, step_decay=0.7)
    else:
        module = SpecBlockTraining(init_from=str(CHECKPOINTS / "specblock_tiny"), num_blocks=2, max_anchors=3, **common)
        options = SpecBlockStepOptions(topk=8, loss=SpecBlockOptions(num_blocks=2, max_anchors=3, seed=3))
    module.configure_model()
    module.train()
    return module, options


@pytest.mark.parametrize("family", ["dflash", "treeflash", "eagle3", "specblock"])
def test_step_api_equals_one_lightning_training_step(family):
    """Same batch, same (seed, step): the API's loss and updated weights equal the LightningModule's step."""
    module, options = _module_and_options(family)
    start = copy.deepcopy(module.drafter)
    api_drafter = copy.deepcopy(module.drafter)
    batch = _batch()

    opt = torch.optim.SGD(module.trainable_parameters(), lr=0.5)
    loss = module.training_step(batch, 0)
    loss.backward()
    opt.step()

    params = [p for p in api_drafter.parameters() if p.requires_grad]
    api_loss = train_step(api_drafter, module.target, batch, torch.optim.SGD(params, lr=0.5), step=0, options=options)
    assert api_loss == pytest.approx(float(loss), rel=1e-6)
    for (name, a), b in zip(module.drafter.named_parameters(), api_drafter.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # A step that moved nothing would make the comparison vacuous.
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), api_drafter.parameters(), strict=True))
    with pytest.raises(TypeError, match="takes"):
        wrong = Eagle3StepOptions() if family != "eagle3" else BlockStepOptions()
        train_step(api_drafter, module.target, batch, torch.optim.SGD(params, lr=0.5), step=0, options=wrong)


@pytest.mark.parametrize("family", ["dflash", "treeflash", "eagle3", "specblock"])
def test_chain_logits_are_the_losses_distributions_at_the_root(family):
    """Depth d of the chain from root p is the distribution the family's loss trains to draft sequence[p + d]: the
    shadow evaluation scores exactly what training moves. Checked against each family's loss inputs by hand."""
    module, options = _module_and_options(family)
    module.eval()
    drafter, target = module.drafter, module.target
    seq = _batch()["input_ids"][0].tolist()
    roots = [5, 12, 20]
    logits = chain_logits(drafter, target, seq, roots, options)
    depth = chain_depth(drafter, options)
    assert logits.shape == (3, depth, target.lm_head.out_features)
    batch = with_features(context_batch([seq], [0], pad_id=0), target, options.topk)
    with torch.no_grad():
        if family == "eagle3":
            outputs, steps = eagle3_unroll(drafter, target, batch, depth)
            # Step i's label at origin p - 1 is x_{p+1+i}; its draft-vocabulary argmax maps to the same target id.
            for i, (hidden, step) in enumerate(zip(outputs, steps, strict=True)):
                assert step.labels[0, 4].item() == seq[5 + 1 + i]
                own = drafter.to_target(drafter.logits(hidden[0, torch.tensor(roots) - 1]).argmax(-1))
                assert torch.equal(logits[:, i].argmax(-1), own)
            assert torch.isinf(logits).any()  # outside the draft vocabulary
        elif family == "specblock":
            results = specblock_unroll(drafter, target, batch, SpecBlockOptions(num_blocks=1), None)
            r = results[0]
            rows = torch.tensor(roots) - drafter.token_shift
            assert torch.equal(r.start[0, rows], torch.tensor(roots))
            direct = drafter.logits(drafter.norm(r.hidden[0, rows]), target.lm_head)
            assert torch.equal(logits.argmax(-1), drafter.to_target(direct.argmax(-1)))
        else:
            anchors = torch.tensor([roots])
            blocks = blocks_at(drafter.model if family == "treeflash" else drafter, batch, anchors, anchors >= 0)
            assert torch.equal(
                blocks.labels[0, :, 1:], torch.tensor([[seq[p + d] for d in range(1, depth + 1)] for p in roots])
            )
            weights = torch.ones(depth + 1)
            if family == "treeflash":
                expected = treeflash_loss(drafter, target, batch, blocks, weights).logits
            else:
                expected = dflash_loss(drafter, target, batch, blocks, weights, "kl").logits
            torch.testing.assert_close(logits, expected[0, :, 1:])
    with pytest.raises(ValueError, match="root at position 0"):
        chain_logits(drafter, target, seq, [0], options)


def test_step_api_subset_and_non_finite_leave_weights():
    module = TreeFlashTraining(target=str(TINY_TARGET), backbone=str(DFLASH_TINY), topk=8, max_anchors=4)
    module.configure_model()
    drafter = module.drafter
    drafter.model.requires_grad_(True)
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    opt = torch.optim.SGD(drafter.ar_approximation.parameters(), lr=0.5)
    train_step(drafter, module.target, _batch(), opt, step=0, options=BlockStepOptions(topk=8, max_anchors=4))
    changed = {n for n, p in drafter.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("ar_approximation.") for n in changed), changed
    assert all(p.requires_grad for p in drafter.model.parameters())  # the subset's freezing is undone
    with torch.no_grad():
        next(drafter.ar_approximation.parameters()).fill_(float("nan"))
    snapshot = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    with pytest.raises(NonFiniteStep):
        train_step(drafter, module.target, _batch(), opt, step=1, options=BlockStepOptions(topk=8, max_anchors=4))
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(p, snapshot[n], equal_nan=True)


# ---- the bandit core: estimates with known answers ------------------------------------------------------------
def _step(request: str, version: int, pos: int, root: int, accepted: int, depth: int = 4, ms=(10.0, 5.0, 85.0)):
    """A chain step record: ``depth`` draft nodes, the first ``accepted`` of them accepted."""
    k = 8
    return step_record(
        server="s", request=request, tenant=None, shareable=True, step=0, drafter="d", drafter_version=version,
        tree="chain", budget=depth, pos=pos, root=root, tokens=[7 + i for i in range(depth)],
        parents=list(range(-1, depth - 1)), accepted=list(range(accepted)), bonus=5,
        topk_ids=[[10 + j for j in range(k)] for _ in range(depth + 1)],
        topk_logprobs=[[math.log(0.5)] + [math.log(0.5 / (k - 1))] * (k - 1) for _ in range(depth + 1)],
        ms=dict(zip(("draft", "tree", "verify"), ms, strict=True)),
    )  # fmt: skip


def test_step_tokens_seconds_and_rates_known_answers():
    record = _step("r", 1, 0, 0, accepted=2)
    assert step_tokens(record) == 3 and step_seconds(record) == pytest.approx(0.1)
    live = LiveTau(window=2)
    for accepted in (0, 3, 1):
        live.add(step_tokens(_step("r", 1, 0, 0, accepted)), 0.1)
    assert live.full and live.tau == pytest.approx(3.0) and live.steps == 3  # window: the last two steps (4, 2)
    assert live.se == pytest.approx(1.0)  # sd √2 over √2 steps
    # Drift counts only what exceeds the noise of two windows: τ 3 against a reference 4 is within 2·√2·1.
    assert drift(4.0, live, BanditConfig(noise_z=2.0)) == 0.0
    assert drift(4.0, live, BanditConfig(noise_z=0.0)) == pytest.approx(1 / 3)
    assert drift(3.0 + 2 * math.sqrt(2) + 0.3, live, BanditConfig(noise_z=2.0)) == pytest.approx(0.1)
    rates = Rates(tau=2.0, step_seconds=0.1, request_rate=0.5)
    config = BanditConfig(horizon_requests=10)
    # θ = 20 tok/s, horizon 10 / 0.5 = 20 s: 400 tokens; τ 2 → 3 serves half as many more.
    assert rates.throughput == pytest.approx(20.0) and rates.horizon_seconds(config) == pytest.approx(20.0)
    assert gain_tokens(rates, 3.0, config) == pytest.approx(200.0)
    assert gain_tokens(rates, 1.5, config) == pytest.approx(-100.0)
    assert cost_tokens(rates, 1.5) == pytest.approx(30.0)


def test_shadow_acceptance_and_expected_tokens_known_answers():
    ids = torch.tensor([[3, 4]])
    logprobs = torch.tensor([[math.log(0.6), math.log(0.3)]])
    same = torch.full((1, 6), -1e9)
    same[0, 3], same[0, 4], same[0, 5] = math.log(0.6), math.log(0.3), math.log(0.1)
    assert float(acceptance(same, ids, logprobs)) == pytest.approx(0.9)  # the target's top-2 mass
    elsewhere = torch.full((1, 6), -1e9)
    elsewhere[0, 0] = 0.0
    assert float(acceptance(elsewhere, ids, logprobs)) == pytest.approx(0.0, abs=1e-6)
    # Greedy decoding accepts exactly when the drafter's argmax is the target's top-1.
    assert float(acceptance(same, ids, logprobs, greedy=True)) == 1.0
    assert float(acceptance(elsewhere, ids, logprobs, greedy=True)) == 0.0
    alpha = torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 1.0]])
    # 1 + 0.5 + 0.25 (cut at depth 2); 1 + 1 + 1 + 1
    torch.testing.assert_close(expected_accepted(alpha, torch.tensor([2, 3])), torch.tensor([1.75, 4.0]))


FRESH = Context(novelty=1.0, drift=0.0)  # a buffer of traffic the served drafter never saw, no drift


def test_lift_regression_known_answers():
    """Posterior of ``y = w · x`` with prior N((0.1, 0.5), diag(0.1², 0.5²)) and noise 0.05, by hand."""
    lift = ArmStats.fresh(BanditConfig(prior_lift=0.1, prior_recovery=0.5, lift_decay=1.0)).lift
    assert lift.mean((1.0, 0.0)) == pytest.approx(0.1) and lift.upper((1.0, 0.0), 1.0) == pytest.approx(0.2)
    assert lift.mean((0.0, 0.2)) == pytest.approx(0.1) and lift.upper((0.0, 0.2), 2.0) == pytest.approx(0.3)
    lift.add((1.0, 0.0), 0.3)
    # Precision of w0: 1/0.01 + 1/0.0025 = 500; mean (10 + 120) / 500 = 0.26; sd sqrt(1/500).
    assert lift.mean((1.0, 0.0)) == pytest.approx(0.26)
    assert lift.upper((1.0, 0.0), 1.0) == pytest.approx(0.26 + math.sqrt(1 / 500))
    assert lift.mean((0.0, 1.0)) == pytest.approx(0.5)  # the drift weight saw nothing
    # With decay, an older observation counts less than a newer one: the mean follows the recent gains.
    decayed = ArmStats.fresh(BanditConfig(prior_lift=0.1, prior_recovery=0.5, lift_decay=0.5)).lift
    undecayed = ArmStats.fresh(BanditConfig(prior_lift=0.1, prior_recovery=0.5, lift_decay=1.0)).lift
    for y in (0.3, 0.3, 0.0, 0.0):
        decayed.add((1.0, 0.0), y)
        undecayed.add((1.0, 0.0), y)
    assert decayed.mean((1.0, 0.0)) < undecayed.mean((1.0, 0.0)) < 0.16
    # Pooling adds sufficient statistics: two arms' observations equal one arm's with both.
    plain = BanditConfig(prior_lift=0.1, prior_recovery=0.5, lift_decay=1.0)
    a, b, both = (ArmStats.fresh(plain).lift for _ in range(3))
    a.add((1.0, 0.2), 0.1)
    b.add((0.5, 0.0), 0.05)
    both.add((1.0, 0.2), 0.1)
    both.add((0.5, 0.0), 0.05)
    (mean, cov), (mean_both, cov_both) = a.pooled([a, b]).posterior(), both.posterior()
    assert mean == pytest.approx(mean_both) and cov == pytest.approx(cov_both)


def test_live_fit_known_answers():
    config = BanditConfig(live_slope_sd=0.5, live_bias_sd=0.05, live_noise=0.05, lift_decay=1.0)
    fit = ArmStats.fresh(config).live
    assert live_gain(fit, 0.1) == pytest.approx(0.1)  # the prior: live = shadow
    # One outcome at the noise floor (precision 400): a publish whose shadow said +0.02 realised -0.2. Posterior
    # precision [[4 + 400·0.02², 400·0.02], [400·0.02, 400 + 400]], mean from [4 + 400·0.02·(-0.2), 400·(-0.2)].
    fit.add((0.02, 1.0), -0.2, outcome_weight(0.01, config))
    p00, p01, p11 = 4 + 400 * 0.02**2, 400 * 0.02, 800.0
    b0, b1 = 4 + 400 * 0.02 * -0.2, 400 * -0.2
    det = p00 * p11 - p01**2
    slope, bias = (p11 * b0 - p01 * b1) / det, (p00 * b1 - p01 * b0) / det
    assert live_gain(fit, 0.02) == pytest.approx(slope * 0.02 + bias)
    assert bias < -0.09  # the arm's bias, not its slope, takes the miss: its small shadow gains now predict losses
    assert live_gain(fit, 0.05) < 0
    # A window four times noisier than the floor weighs a sixteenth: the same miss barely moves a fresh fit.
    noisy = ArmStats.fresh(config).live
    noisy.add((0.02, 1.0), -0.2, outcome_weight(0.2, config))
    assert -0.02 < live_gain(noisy, 0.0) < 0


@pytest.mark.parametrize("seconds", [0.5, 2.0, 8.0, 40.0])
def test_plan_updates_exactly_when_expected_net_gain_is_positive(seconds):
    config = BanditConfig(prior_lift=0.1, prior_recovery=0.5, horizon_requests=10, swap_seconds=0.0)
    arms = (Arm("a", "full", 4, 1e-3),)
    stats = {"a": ArmStats.fresh(config)}
    stats["a"].measured(seconds)
    rates = Rates(tau=2.0, step_seconds=0.1, request_rate=0.5)
    choice, (estimate,) = plan(rates, FRESH, arms, stats, config)
    # Optimistic relative gain on fresh traffic (prior 0.1 + 1 sd 0.1) = 0.2: τ 2.4, 400 · 0.2 = 80 tokens over the
    # horizon; cost 20 tokens per second.
    assert estimate.tau_gain == pytest.approx(0.4)
    assert estimate.gain == pytest.approx(80.0) and estimate.cost == pytest.approx(20.0 * seconds)
    assert (choice == "a") == (estimate.net > 0) == (seconds < 4)
    assert plan(rates, Context(0.0, 0.0), arms, stats, config)[0] == SKIP  # nothing new, no drift: no update
    # Drift alone: τ 2 against a reference 3 is δ = 0.5; optimistic recovery 1.0 of it gains 200 tokens.
    _, (drifted,) = plan(rates, Context(0.0, 0.5), arms, stats, config)
    assert drifted.gain == pytest.approx(200.0)


def test_an_update_on_a_separate_device_costs_its_exchange_rate():
    # The update of the test above that costs 8 s: 160 tokens co-located, more than its 80-token gain; on a
    # trainer device whose second is worth a tenth of a serving second, 16 tokens plus the swap.
    arms = (Arm("a", "full", 4, 1e-3),)
    rates = Rates(tau=2.0, step_seconds=0.1, request_rate=0.5)
    for share, cost in [(1.0, 160.0 + 2.0), (0.1, 16.0 + 2.0), (0.0, 2.0)]:
        config = BanditConfig(prior_lift=0.1, prior_recovery=0.5, horizon_requests=10, update_cost_share=share,
                              swap_seconds=0.1)  # fmt: skip
        stats = {"a": ArmStats.fresh(config)}
        stats["a"].measured(8.0)
        choice, (estimate,) = plan(rates, FRESH, arms, stats, config)
        assert estimate.cost == pytest.approx(cost)
        assert (choice == "a") == (share < 1.0)


def test_plan_learns_from_shadow_outcomes():
    config = BanditConfig(prior_lift=0.1, prior_recovery=0.5, horizon_requests=10, swap_seconds=0.0)
    arms = (Arm("a", "full", 4, 1e-3), Arm("b", "lora", 4, 1e-3))
    stats = {"a": ArmStats.fresh(config), "b": ArmStats.fresh(config)}
    stats["a"].measured(1.0)
    stats["b"].measured(2.0)
    rates = Rates(tau=2.0, step_seconds=0.1, request_rate=0.5)
    assert plan(rates, FRESH, arms, stats, config)[0] == "a"  # same prior, cheaper
    for gain in (-0.01, 0.0, -0.02, 0.005):  # "a"'s candidates never beat the served drafter
        stats["a"].lift.add(FRESH.x, gain)
    # ... and "b", never tried, borrows that: no update pays on this traffic.
    assert plan(rates, FRESH, arms, stats, config)[0] == SKIP
    for gain in (0.25, 0.3):  # "b" once tried gains a lot: worth its double cost
        stats["b"].lift.add(FRESH.x, gain)
    assert plan(rates, FRESH, arms, stats, config)[0] == "b"
    # "b"'s publishes realising well below their shadow gains (bias learnt from live outcomes) stop it.
    for _ in range(3):
        stats["b"].live.add((0.25, 1.0), -0.1, outcome_weight(0.0, config))
    assert live_gain(stats["b"].live, 0.25) < 0
    assert plan(rates, FRESH, arms, stats, config)[0] == SKIP


def test_untried_arms_borrow_the_tried_arms_outcomes_and_costs():
    config = BanditConfig(prior_lift=0.1, prior_recovery=0.5, horizon_requests=10, swap_seconds=0.0, lift_decay=1.0)
    arms = (Arm("a", "approx", 4, 1e-3), Arm("b", "full", 8, 1e-3))
    stats = {"a": ArmStats.fresh(config), "b": ArmStats.fresh(config)}
    lift, live, per_step = pooled_priors(arms, stats, config)
    assert lift.n == 0 and live.n == 0 and per_step == config.prior_seconds_per_step
    stats["a"].measured(8.0)
    stats["a"].lift.add(FRESH.x, 0.3)
    lift, _, per_step = pooled_priors(arms, stats, config)
    assert lift.posterior() == stats["a"].lift.posterior() and per_step == 2.0  # 8 s over 4 steps
    rates = Rates(tau=2.0, step_seconds=0.1, request_rate=0.5)
    _, (_, b) = plan(rates, FRESH, arms, stats, config)
    # b: 8 steps at 2 s = 16 s, 320 tokens; its plain gain: 400 served tokens × 0.26 (a's posterior mean).
    assert b.cost == pytest.approx(320.0) and b.mean_gain == pytest.approx(400 * 0.26)
    # a's publishes realised less than their shadow said: b, without live outcomes of its own, borrows that too.
    stats["a"].live.add((0.3, 1.0), -0.1, outcome_weight(0.0, config))
    _, (_, borrowed) = plan(rates, FRESH, arms, stats, config)
    assert borrowed.mean_gain < b.mean_gain
    assert borrowed.mean_gain == pytest.approx(400 * live_gain(stats["a"].live, 0.26))


def test_plan_takes_only_updates_whose_worst_case_fits_the_budget():
    """An update's worst case (its stall and swaps at never-update's throughput, the judgement's windows at
    ``1 - regress_max``) must fit the ledger's slack, whatever its expected gain."""
    config = BanditConfig(prior_lift=0.1, prior_recovery=0.5, horizon_requests=10, swap_seconds=0.1, alpha=0.01,
                          window_steps=10, judge_windows=2, regress_max=0.1, seconds_margin=1.5)  # fmt: skip
    arms = (Arm("a", "full", 4, 1e-3),)
    stats = {"a": ArmStats.fresh(config)}
    stats["a"].measured(1.0)
    rates = Rates(tau=2.0, step_seconds=0.1, request_rate=0.5)
    # Stall: 0.99 · 20 tokens/s · (1.5 s + 2 · 0.1 s) = 33.66; judgement: 20 steps of τ 1.8 (36 tokens) each
    # adding 1 - 0.99 / 0.9 = -0.1 slack per token: 3.6.
    risk = update_risk(rates, 1.0, 1.0, config)
    assert risk == pytest.approx(33.66 + 3.6)
    choice, (estimate,) = plan(rates, FRESH, arms, stats, config, slack=risk - 0.01)
    assert estimate.risk == pytest.approx(risk) and estimate.net > 0 and choice == SKIP
    assert plan(rates, FRESH, arms, stats, config, slack=risk)[0] == "a"
    # Served at a lower bound of 0.95 of never-update's τ, the baseline serves 1/0.95 as fast: a larger stall.
    assert update_risk(rates, 0.95, 1.0, config) > risk
    # The served version's next window at its bound: 10 steps of τ 2 at 1 - 0.99 / 0.95 per token.
    assert keep_risk(rates, 0.95, config) == pytest.approx(-20 * (1 - 0.99 / 0.95))
    assert keep_risk(rates, 1.0, config) == pytest.approx(-20 * 0.01)  # never-update's drafter only adds slack


def test_ledger_known_answers():
    ledger = Ledger(alpha=0.01, ratio={"1": 1.0, "2": 0.9})
    ledger.serve("1", 1000.0)
    assert ledger.served == 1000.0 and ledger.baseline == 1000.0 and ledger.slack == pytest.approx(10.0)
    ledger.stalled(5.0)  # never-update served 5 tokens while the server trained
    assert ledger.slack == pytest.approx(1000.0 - 0.99 * 1005.0)
    ledger.serve("2", 90.0)  # 90 tokens at 0.9 of never-update's τ: never-update served 100 meanwhile
    assert ledger.baseline == pytest.approx(1105.0) and ledger.slack == pytest.approx(1090.0 - 0.99 * 1105.0)
    ledger.serve("", 10.0)  # steps of no version here count as never-update's
    assert ledger.baseline == pytest.approx(1115.0)
    assert Ledger.from_json(json.loads(json.dumps(ledger.to_json()))) == ledger


def test_paired_gain_and_the_publish_bound():
    # Two requests: the candidate's expected tokens are 10% above the served drafter's at every context.
    served = [torch.tensor(x, dtype=torch.float64) for x in ([2.0, 3.0], [1.5, 2.5, 4.0], [])]
    gain, se = paired_gain(served, [t * 1.1 for t in served])
    assert gain == pytest.approx(0.1) and se == pytest.approx(0.0, abs=1e-12)
    # Per-request sums a = (5, 8), b = (6, 8): gain 14/13 - 1; residuals b - (14/13) a.
    gain, se = paired_gain(served, [torch.tensor([3.0, 3.0]), torch.tensor([1.5, 2.5, 4.0]), torch.zeros(0)])
    r = [6 - 14 / 13 * 5, 8 - 14 / 13 * 8]
    assert gain == pytest.approx(1 / 13) and se == pytest.approx(math.sqrt(2 * (r[0] ** 2 + r[1] ** 2)) / 13)
    assert paired_gain(served[:1], served[:1])[1] == math.inf  # one request: no spread measured
    assert math.isnan(paired_gain([torch.zeros(0)], [torch.zeros(0)])[0])
    # The live fit's prior (slope 1 ± 0.5, bias 0 ± 0.05) at shadow 0.1 measured ± 0.02.
    config = BanditConfig()
    fit = ArmStats.fresh(config).live
    mean, sd = live_bound(fit, 0.1, 0.02)
    assert mean == pytest.approx(0.1) and sd == pytest.approx(math.sqrt(0.05**2 + 0.05**2 + 0.02**2))
    rates = Rates(tau=2.0, step_seconds=0.1, request_rate=0.5)  # 400 tokens over the horizon of 10 requests
    config = BanditConfig(horizon_requests=10, swap_seconds=0.1)  # a swap costs 2 tokens
    lower = mean - config.confidence_z * sd
    assert lower < 0 and not should_publish(rates, lower, config)  # the mean gains 40 tokens: not enough proof
    assert should_publish(rates, 0.006, config) and not should_publish(rates, 0.004, config)


def test_rollback_test_and_ledger_ratio_rules():
    config = BanditConfig(rollback_effect=0.03, rollback_power=0.8, regress_max=0.1, confidence_z=1.645)
    # The estimate's sd at which a 3% regression is caught 80% of the time: 0.03 / z(0.8).
    assert judged_sd(config) == pytest.approx(0.03 / 0.8416, rel=1e-3)
    assert rollback_power(judged_sd(config), config) == pytest.approx(0.8)
    assert rollback_power(0.06, config) == pytest.approx(0.6915, abs=1e-4)  # two live windows alone: a coin flip
    assert rolled_back(-0.001) and not rolled_back(0.0) and rolled_back(math.nan)
    # Independent estimates combine by precision; a missing one is left out.
    assert combined([(0.1, 0.05), (-0.05, 0.05)]) == pytest.approx((0.025, 0.05 / math.sqrt(2)))
    assert combined([(0.1, 0.05), (math.nan, math.inf)]) == pytest.approx((0.1, 0.05))
    # A judged version's ratio: its parent's times the gain's lower bound, never below the reserved worst case.
    assert judged_ratio(0.95, 0.2, 0.05, config) == pytest.approx(0.95 * (1.2 - 1.645 * 0.05))
    assert judged_ratio(0.95, -0.3, 0.05, config) == pytest.approx(0.95 * 0.9)
    config = BanditConfig(collapse_ratio=0.5, collapse_tau=1.0)
    assert collapsed(1.0, 1.2, config) and collapsed(1.4, 3.0, config)
    assert not collapsed(2.0, 3.0, config) and not collapsed(1.05, 1.2, config)


# ---- the daemon: rollback, alarm, failed update, restart after SIGKILL --------------------------------------------
def _write_log(logs: Path, name: str, version: int, accepted: list[int], requests: int = 4, bad: int = 0) -> None:
    """A finished segment: ``requests`` requests whose steps accept ``accepted`` (cycled) draft nodes."""
    g = torch.Generator().manual_seed(len(name))
    lines, a = [], 0
    for r in range(requests):
        prompt = torch.randint(10, 8000, (16,), generator=g).tolist()
        output = torch.randint(10, 8000, (24,), generator=g).tolist()
        seq = prompt + output
        for pos in range(len(prompt) - 1, len(seq) - 6, 5):
            lines.append(_step(f"{name}-{r}", version, pos, seq[pos], accepted[a % len(accepted)]))
            a += 1
        lines.append(request_record(server="s", request=f"{name}-{r}", tenant=None, shareable=True,
                                    prompt_ids=prompt, output_ids=output))  # fmt: skip
    text = "".join(json.dumps(x) + "\n" for x in lines) + "".join(f'{{"v": 1, "broken {i}\n' for i in range(bad))
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"{name}.jsonl").write_text(text)


def _daemon(tmp_path: Path, **config) -> BanditDaemon:
    arms = (Arm("full-1", "full", 1, 1e-4),)
    return BanditDaemon(tmp_path / "logs", DFLASH_TINY, tmp_path / "pub", tmp_path / "state", TINY_TARGET,
                        BanditConfig(window_steps=8, **config), arms=arms)  # fmt: skip


def _journal(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "state" / "decisions.jsonl").read_text().splitlines()]


def test_rollback_when_the_new_version_is_worse(tmp_path):
    (tmp_path / "logs").mkdir()
    daemon = _daemon(tmp_path)
    assert daemon.state.version == 1
    pending = PendingDecision(decision=1, arm="full-1", tau_before=3.0, tau_before_se=0.0, tau_new=3.5,
                              shadow_gain=0.2, shadow_se=0.01, lower=0.1, seen=0, ratio_parent=1.0)  # fmt: skip
    v2 = publish(tmp_path / "pub", daemon.drafter.save_pretrained, {"kind": "drafter", "decision": pending.to_json()})
    daemon.close()
    _write_log(tmp_path / "logs", "seg-000001-1000", v2, accepted=[1])  # τ 2 < 3 - margin
    restarted = _daemon(tmp_path, judge_windows=1)  # adopts v2 and its pending decision from the manifest
    assert restarted.state.version == v2 and restarted.state.pending == pending
    assert restarted.run(once=True) == 0
    version, path = read_current(tmp_path / "pub")
    assert version == v2 + 1 and read_manifest(path)["rollback_of"] == 1
    (outcome,) = _journal(tmp_path)
    assert outcome["event"] == "outcome" and outcome["rolled_back_to"] == version
    assert outcome["realised_gain"] == pytest.approx(-1.0)
    # The live outcome (-1/3 relative) against the shadow's +0.2 enters the arm's live fit: +0.2 now predicts a loss.
    fit = ArmStats.from_json(restarted.state.arms["full-1"]).live
    assert fit.n == 1 and fit.xy[1] < 0 and live_gain(fit, 0.2) < 0


def test_a_state_file_of_another_version_is_refused_by_name(tmp_path):
    (tmp_path / "logs").mkdir()
    daemon = _daemon(tmp_path)
    daemon.commit()
    daemon.close()
    path = tmp_path / "state" / "state.json"
    saved = json.loads(path.read_text())
    assert saved["version"] == 1 and saved["replay"] == daemon.state.replay
    path.write_text(json.dumps({**saved, "arm_table": {}}))
    with pytest.raises(StateError, match=r"unknown keys \['arm_table'\] and lacks \[\]"):
        _daemon(tmp_path)
    # Arm statistics of another version (a shadow→live scale where the live fit now is) are refused by arm name.
    old_arm = {k: v for k, v in saved["arms"]["full-1"].items() if k != "live"} | {"scale": {"prior": 1.0}}
    path.write_text(json.dumps({**saved, "arms": {"full-1": old_arm}}))
    with pytest.raises(StateError, match=r"arm statistics \['full-1'\] without the keys"):
        _daemon(tmp_path)
    # A key with a default in ArmStats is still one the saved statistics must hold.
    short_arm = {k: v for k, v in saved["arms"]["full-1"].items() if k != "tried"}
    path.write_text(json.dumps({**saved, "arms": {"full-1": short_arm}}))
    with pytest.raises(StateError, match=r"arm statistics \['full-1'\] without the keys"):
        _daemon(tmp_path)
    # The pending decision is a record of its own: it reads back as written, and a key short is refused.
    pending = PendingDecision(decision=3, arm="full-1", tau_before=3.0, tau_before_se=0.1, tau_new=3.4,
                              shadow_gain=0.2, shadow_se=0.01, lower=0.1, seen=9, ratio_parent=0.95)  # fmt: skip
    with_pending = json.loads(json.dumps({**saved, "pending": pending.to_json()}))
    assert DaemonState.from_json(with_pending, path).pending == pending
    del with_pending["pending"]["seen"]
    with pytest.raises(StateError, match=r"pending decision with keys .* not \['arm', 'decision'"):
        DaemonState.from_json(with_pending, path)
    del saved["version"]
    path.write_text(json.dumps(saved))
    with pytest.raises(StateError, match=r"lacks \['version'\]"):
        _daemon(tmp_path)


def test_the_drafter_of_a_training_run_is_published_first(tmp_path):
    """``--drafter`` takes a training run as ``trainer eval`` does: its HF export is the first version."""
    (tmp_path / "logs").mkdir()
    run = make_run(tmp_path / "run", DFLASH_TINY)
    daemon = BanditDaemon(tmp_path / "logs", run, tmp_path / "pub", tmp_path / "state", TINY_TARGET)
    daemon.close()
    version, directory = read_current(tmp_path / "pub")
    assert version == 1 and read_manifest(directory)["source"] == str(run / "lightning_logs" / "version_0" / "hf")
    published, shipped = (load_file(d / "model.safetensors") for d in (directory, DFLASH_TINY))
    assert published.keys() == shipped.keys() and all(torch.equal(published[k], shipped[k]) for k in shipped)


def test_an_updates_version_inherits_the_reference_tau(tmp_path):
    """The headroom of a version an update published stays measured from its parent's reference τ."""
    (tmp_path / "logs").mkdir()
    daemon = _daemon(tmp_path)
    daemon.state.ref["1"] = 4.5
    daemon.commit()
    pending = PendingDecision(decision=1, arm="full-1", tau_before=3.5, tau_before_se=0.0, tau_new=4.2,
                              shadow_gain=0.2, shadow_se=0.01, lower=0.1, seen=0, ratio_parent=1.0)  # fmt: skip
    manifest = {"kind": "drafter", "parent": 1, "decision": pending.to_json()}
    v2 = publish(tmp_path / "pub", daemon.drafter.save_pretrained, manifest)
    daemon.close()
    _write_log(tmp_path / "logs", "seg-000001-1000", v2, accepted=[3])  # τ 4
    restarted = _daemon(tmp_path, judge_windows=1)
    restarted.read()
    restarted.decide()
    assert restarted.state.ref[str(v2)] == pytest.approx(4.5)  # not its own 4
    (outcome,) = _journal(tmp_path)
    assert outcome["event"] == "outcome" and outcome["realised_gain"] == pytest.approx(0.5)
    fit = ArmStats.from_json(restarted.state.arms["full-1"]).live
    # One window of 8 steps that all committed 4 tokens: no step-wise error, so the outcome weighs the noise floor.
    weight = outcome_weight(0.0, restarted.config)
    assert fit.xy == pytest.approx([weight * 0.2 * 0.5 / 3.5, weight * 0.5 / 3.5])
    restarted.close()


def test_a_version_is_judged_only_on_the_steps_its_drafter_drafted(tmp_path):
    """Plain and recycling steps (``drafter`` null), unversioned or foreign versions and another drafter's steps
    stay out of every live τ: the version's τ is its own drafter's (4 here, where the rest accepted nothing), no
    alarm follows, and the metrics say how many steps were ignored and why."""
    (tmp_path / "logs").mkdir()
    daemon = _daemon(tmp_path)
    assert daemon.state.version == 1
    lines = []
    for i in range(12):
        lines.append(_step(f"r{i}", 1, 0, 1, accepted=3))  # drafted by version 1: τ 4
        free = _step(f"r{i}", 1, 5, 1, accepted=0)
        lines.append({**free, "drafter": None, "tree": "none"})  # a plain step logged with a version
        lines.append({**free, "drafter": None, "drafter_version": None, "adjacency_version": 1, "tree": "recycling"})
        lines.append({**free, "drafter_version": None})
        lines.append({**free, "drafter_version": 7})  # never published here
        lines.append({**free, "drafter": "other"})
    (tmp_path / "logs" / "seg-000001-1000.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert daemon.run(once=True) == 0 and daemon.alarm is None
    live = daemon._live(1)
    assert live.full and live.tau == pytest.approx(4.0)
    assert set(daemon.state.live) == {"1"}
    ignored = json.loads((tmp_path / "state" / "metrics.json").read_text())["ignored_steps"]
    assert ignored == {"no drafter": 24, "unversioned": 12, "unknown version": 12, "other drafter": 12}
    daemon.close()


def test_a_version_is_judged_only_on_requests_whose_first_step_it_drafted(tmp_path):
    """vLLM's requests share one drafter: a swap to version 2 drafts the running requests' next steps over state
    version 1 computed. Those steps judge neither version (version 2's τ is its own requests' 2, not the mixed
    steps' 5); steps of the drafter vLLM started with (version 0) judge none either."""
    (tmp_path / "logs").mkdir()
    daemon = _daemon(tmp_path)
    assert publish(tmp_path / "pub", daemon.drafter.save_pretrained, {"kind": "drafter"}) == 2
    lines = []
    for i in range(8):
        lines.append(_step(f"old{i}", 1, 0, 1, accepted=3))  # admitted under version 1
        lines.append(_step(f"old{i}", 2, 5, 1, accepted=4))  # drafted by version 2 after the swap: mixed
        lines.append(_step(f"new{i}", 2, 0, 1, accepted=1))  # admitted under version 2
        lines.append(_step(f"new{i}", 2, 3, 1, accepted=1))
        lines.append(_step(f"boot{i}", 0, 0, 1, accepted=4))  # the drafter the server started with
    (tmp_path / "logs" / "seg-000001-1000.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    daemon.read()
    assert daemon._live(2).tau == pytest.approx(2.0) and daemon._live(1).tau == pytest.approx(4.0)
    assert daemon.state.ignored == {"admitted under another version": 8, "startup drafter": 8}
    daemon.close()


def test_alarm_on_a_zeroed_drafter_and_on_collapsed_tau(tmp_path):
    (tmp_path / "logs").mkdir()
    daemon = _daemon(tmp_path)
    zeroed = copy.deepcopy(daemon.drafter)
    with torch.no_grad():
        for p in zeroed.parameters():
            p.zero_()
    publish(tmp_path / "pub", zeroed.save_pretrained, {"kind": "drafter"})
    daemon.close()
    restarted = _daemon(tmp_path)
    assert restarted.run(once=True) == ALARM_EXIT
    assert json.loads((tmp_path / "state" / "metrics.json").read_text())["alarm"]
    assert _journal(tmp_path)[-1]["event"] == "alarm"
    # A drafter that serves but whose steps accept nothing: τ = 1 raises the alarm and rolls back to version 1.
    other = tmp_path / "b"
    (other / "logs").mkdir(parents=True)
    daemon = _daemon(other)
    v2 = publish(other / "pub", daemon.drafter.save_pretrained, {"kind": "drafter"})
    daemon.close()
    _write_log(other / "logs", "seg-000001-1000", v2, accepted=[0])
    restarted = _daemon(other)
    assert restarted.run(once=True) == ALARM_EXIT
    alarm = _journal(other)[-1]
    assert alarm["event"] == "alarm" and alarm["tau"] == pytest.approx(1.0) and alarm["rolled_back_to"] == v2 + 1
    assert read_manifest(read_current(other / "pub")[1])["rollback_of"] == 1


def test_failed_update_leaves_the_served_version(tmp_path):
    _write_log(tmp_path / "logs", "seg-000001-1000", 1, accepted=[3])
    # A first update rests on the prior: exploration, given a budget here.
    daemon = _daemon(tmp_path, horizon_requests=1e6, alpha=1.0)
    daemon.state.ref["1"] = 4.5  # τ fell from 4.5 to 4: worth an update
    daemon.arms = (Arm("full-1", "full", 1, 1e39),)  # overflows the weights to inf
    assert daemon.run(once=True) == 0
    decision = _journal(tmp_path)[-1]
    assert decision["arm"] == "full-1" and decision["published"] is None and "failed" in decision
    assert read_current(tmp_path / "pub")[0] == 1 and daemon.state.version == 1


def test_restart_after_sigkill_loses_nothing(tmp_path):
    """Kill the daemon between publishing and committing, restart it; the end state counts every line exactly
    once, and no version is published twice."""
    logs = tmp_path / "logs"
    for i in range(3):
        _write_log(logs, f"seg-{i:06d}-{1000 + i}", 1, accepted=[2, 3], requests=3, bad=2)
    # The adapt CLI's own entry (``trainer adapt`` minus the top-level CLI, which imports Lightning).
    entry = "import sys; from trainer.adapt.cli import main; main(sys.argv[1:])"
    command = [sys.executable, "-c", entry, "bandit", "--logs", str(logs), "--drafter",
               str(DFLASH_TINY), "--publish", str(tmp_path / "pub"), "--once", "--window-steps", "1000"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    # Killed right after the first version is published, before any state is committed: the restart adopts it.
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while read_current(tmp_path / "pub") is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (read_current(tmp_path / "pub")[1] / "config.json").is_file()
    config = BanditConfig(window_steps=1000)
    for _ in range(2):  # the restart, then a run with nothing new to count
        daemon = BanditDaemon(logs, DFLASH_TINY, tmp_path / "pub", tmp_path / "pub" / ".state", TINY_TARGET, config)
        assert daemon.run(once=True) == 0
        daemon.close()
    state = json.loads((tmp_path / "pub" / ".state" / "state.json").read_text())
    assert state["requests"] == 9 and state["quarantined"] == 6
    quarantine = (tmp_path / "pub" / ".state" / "quarantine.jsonl").read_text().splitlines()
    assert len(quarantine) == 6 and all("reason" in json.loads(q) for q in quarantine)
    assert len(state["live"]["1"]["recent"]) == state["live"]["1"]["steps"] == 3 * 3 * 4
    assert read_current(tmp_path / "pub")[0] == 1


@pytest.mark.parametrize("name", ["eagle3_tiny", "specblock_tiny"])
def test_daemon_updates_eagle3_and_specblock_drafters(tmp_path, name):
    """The LoRA and full arms train EAGLE-3 and SpecBlock drafters through the step API and shadow-evaluate
    them; TreeFlash's approximator arm is not offered."""
    _write_log(tmp_path / "logs", "seg-000001-1000", 1, accepted=[3])
    arms = (Arm("approx-1", "approx", 1, 1e-3), Arm("lora-1", "lora", 1, 1e-2), Arm("full-1", "full", 1, 1e-3))
    daemon = BanditDaemon(tmp_path / "logs", CHECKPOINTS / name, tmp_path / "pub", tmp_path / "state", TINY_TARGET,
                          BanditConfig(window_steps=8, horizon_requests=1e6, alpha=1.0), arms=arms)  # fmt: skip
    assert [a.name for a in daemon.arms] == ["lora-1", "full-1"]
    daemon.read()
    served = {n: p.clone() for n, p in daemon.drafter.state_dict().items()}
    lora = daemon.train(arms[1])
    # The adapters are merged: the candidate is the family's model with the served drafter's tensors, moved.
    assert type(lora) is type(daemon.drafter) and lora.state_dict().keys() == served.keys()
    assert any(not torch.equal(lora.state_dict()[n], v) for n, v in served.items())
    assert all(torch.equal(daemon.drafter.state_dict()[n], v) for n, v in served.items())
    daemon.state.ref["1"] = 4.5  # τ fell from 4.5 to 4: worth an update
    assert daemon.run(once=True) == 0
    decision = _journal(tmp_path)[-1]
    assert decision["arm"] in ("lora-1", "full-1") and "failed" not in decision
    assert math.isfinite(decision["shadow_served"]) and math.isfinite(decision["shadow_candidate"])
    daemon.close()


def test_context_novelty_drift_and_cached_features(tmp_path):
    """Novelty counts the requests since the served version's training; drift its τ below the reference; the
    training batches carry each replayed request's target features, computed once, as the target gives them."""
    _write_log(tmp_path / "logs", "seg-000001-1000", 1, accepted=[3])  # 4 requests, τ 4
    daemon = _daemon(tmp_path)
    daemon.read()
    daemon.state.ref["1"] = 5.0
    context = daemon.context(daemon._live(1))
    assert context.novelty == pytest.approx(4 / 64) and context.drift == pytest.approx((5.0 - 4.0) / 4.0)
    daemon.state.trained_at["1"] = 4  # trained on everything seen so far
    assert daemon.context(daemon._live(1)).novelty == 0.0
    replay = Replay.from_json(daemon.state.replay)
    batch = daemon._batch(replay)
    online = with_features({k: batch[k] for k in ("input_ids", "loss_mask", "position_ids", "doc_ids")},
                           daemon.target, daemon.options.topk)  # fmt: skip
    inside = batch["doc_ids"] > 0
    torch.testing.assert_close(batch["features"][inside], online["features"][inside], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batch["teacher_topk_logprobs"][inside], online["teacher_topk_logprobs"][inside],
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    # One entry per distinct replayed request: drawing more batches adds none beyond the buffer's requests.
    train = {tuple(r["prompt"] + r["output"]) for r in replay.train}
    for _ in range(20):
        daemon._batch(replay)
    assert set(daemon._feature_cache) == train
    # Once every request is cached (a first shadow evaluation caches the held-back ones), batches and shadow
    # evaluations need no target forward at all.
    first = daemon.shadow(daemon.drafter)
    # One tensor per held-back request, one expected-token count per logged step of it.
    assert [len(t) for t in first] == [len(r["steps"]) for r in replay.holdout] and len(first) == 1
    forwards = []
    daemon.target.register_forward_hook(lambda *_: forwards.append(1))
    daemon._batch(replay)
    torch.testing.assert_close(daemon.shadow(daemon.drafter), first)
    assert forwards == []
    daemon.close()


def test_daemon_features_in_bfloat16_drafter_trains_in_float32(tmp_path):
    """``--dtype bfloat16``: the target that computes features holds bf16 weights and its features are bf16; the
    served drafter and its candidates keep float32 weights and train and are shadow-evaluated on those features
    under autocast (a float32 drafter fed bf16 features through the bf16 target head fails without it)."""
    _write_log(tmp_path / "logs", "seg-000001-1000", 1, accepted=[3])
    arms = (Arm("full-1", "full", 1, 1e-3),)
    daemon = BanditDaemon(tmp_path / "logs", DFLASH_TINY, tmp_path / "pub", tmp_path / "state", TINY_TARGET,
                          BanditConfig(window_steps=8, horizon_requests=1e6, alpha=1.0), arms=arms,
                          device=torch.device("cpu"), dtype=torch.bfloat16)  # fmt: skip
    assert {p.dtype for p in daemon.target.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in daemon.drafter.parameters()} == {torch.float32}
    daemon.read()
    batch = daemon._batch(Replay.from_json(daemon.state.replay))
    assert batch["features"].dtype == torch.bfloat16
    candidate = daemon.train(arms[0])
    assert {p.dtype for p in candidate.parameters()} == {torch.float32}
    assert all(torch.isfinite(t).all() for t in daemon.shadow(candidate))
    daemon.state.ref["1"] = 4.5  # τ fell from 4.5 to 4: worth an update
    assert daemon.run(once=True) == 0
    decision = _journal(tmp_path)[-1]
    assert decision["arm"] == "full-1" and "failed" not in decision
    assert math.isfinite(decision["shadow_served"]) and math.isfinite(decision["shadow_candidate"])
    daemon.close()


# ---- the budget holds by construction: the daemon against a synthetic server -------------------------------------
class _StubDaemon(BanditDaemon):
    """The daemon with a synthetic trainer: a candidate is a copy of the served drafter (no optimiser step) whose
    true live τ and shadow expected tokens are its parent's times ``1 + true_gain(parent's factor, update)`` and
    ``1 + shadow_gain``; an update's clock advances by ``train_seconds``."""

    def __init__(self, *a, true_gain, shadow_gain: float, train_seconds: float, **kw) -> None:
        self.now = 0.0
        super().__init__(*a, clock=lambda: self.now, **kw)
        self.true_gain, self.shadow_gain, self.train_seconds = true_gain, shadow_gain, train_seconds
        self.factors = {id(self.drafter): (1.0, 1.0)}  # (true τ factor, shadow factor) per drafter

    def train(self, arm: Arm) -> torch.nn.Module:
        self.now += self.train_seconds
        true, shadow = self.factors[id(self.drafter)]
        candidate = copy.deepcopy(self.drafter)
        gain = self.true_gain(true, len(self.factors) - 1)
        self.factors[id(candidate)] = (true * (1 + gain), shadow * (1 + self.shadow_gain))
        return candidate

    def shadow(self, drafter: torch.nn.Module) -> list[torch.Tensor]:
        # Per held-back context: a difficulty of its own times the drafter's shadow factor, with 1% noise of its own.
        factor = self.factors[id(drafter)][1]
        g = torch.Generator().manual_seed(len(self.factors))
        out = []
        for r, request in enumerate(Replay.from_json(self.state.replay).holdout):
            n = len(request["steps"])
            base = 1.5 + 0.1 * torch.arange(n, dtype=torch.float64) + 0.2 * (r % 3)
            out.append(base * factor * (1 + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)))
        return out

    def _load_drafter(self, directory: Path) -> torch.nn.Module:
        model = super()._load_drafter(directory)
        # Only never-update's drafter is loaded in one process (the first version; rollbacks republish the parent
        # the daemon holds): any other load would serve a drafter of unknown factors.
        assert Path(directory).name in ("baseline", "v000001")
        if hasattr(self, "factors"):
            self.factors[id(model)] = (1.0, 1.0)
        return model


def _serve_against_never(tmp_path: Path, rounds: int, true_gain, shadow_gain: float) -> tuple[list, list, list]:
    """Serve ``rounds`` windows of 64 steps (0.1 s each; never-update's drafter commits τ 3) with whatever the stub
    daemon publishes, the daemon deciding after each; the stall of its updates (co-located) and swaps is time no
    token is served. Returns the served-token total over never-update's at each decision, the ledger's pessimistic
    count of never-update's tokens minus the true one at each, and the decision journal."""
    config = BanditConfig(window_steps=64, horizon_requests=1e5, swap_seconds=0.05)
    assert config.alpha == 0.01 and config.update_cost_share == 1.0
    (tmp_path / "logs").mkdir()
    daemon = _StubDaemon(tmp_path / "logs", DFLASH_TINY, tmp_path / "pub", tmp_path / "state", TINY_TARGET, config,
                         arms=(Arm("full-1", "full", 1, 1e-4),), true_gain=true_gain, shadow_gain=shadow_gain,
                         train_seconds=0.2)  # fmt: skip
    served = elapsed = 0.0
    ratios, pessimism = [], []
    for i in range(rounds):
        tau = min(4.9, 3.0 * daemon.factors[id(daemon.drafter)][0])
        # 64 steps whose accepted counts average tau - 1: the window's τ is the version's true τ.
        low = int(tau - 1)
        accepted = [low + 1] * round((tau - 1 - low) * 64) + [low] * (64 - round((tau - 1 - low) * 64))
        _write_log(tmp_path / "logs", f"seg-{i:06d}-{1000 + i}", daemon.state.version, accepted, requests=16)
        served += sum(a + 1 for a in accepted)
        elapsed += 64 * 0.1
        now, swaps = daemon.now, daemon.state.updates + daemon.state.rollbacks
        daemon.read()
        daemon.decide()
        elapsed += daemon.now - now + (daemon.state.updates + daemon.state.rollbacks - swaps) * config.swap_seconds
        never = 3.0 * elapsed / 0.1
        ratios.append(served / never)
        pessimism.append(daemon._budget()["baseline"] - never)
    daemon.close()
    return ratios, pessimism, _journal(tmp_path)


def test_budget_holds_when_every_update_realises_a_loss(tmp_path):
    """Adversarial outcomes: every candidate's shadow gain is +15%, every published version serves 10% (the
    reserved worst case), 3% or 6% less than its parent. At every decision the served tokens stay >= 99% of
    never-update's, the ledger never counts fewer never-update tokens than the truth, and an update did publish."""
    losses = (0.1, 0.03, 0.06)
    ratios, pessimism, journal = _serve_against_never(tmp_path, 150, lambda _, n: -losses[n % 3], 0.15)
    published = [e for e in journal if e.get("published")]
    assert published
    assert min(ratios) >= 0.99
    assert min(pessimism) >= -1e-6
    # Each published version was judged and rolled back or, kept, replaced by never-update's drafter in time.
    outcomes = [e for e in journal if e["event"] == "outcome"]
    assert len(outcomes) >= len(published) - 1
    assert all("rolled_back_to" in e or e["ratio"] < 1 for e in outcomes)


def test_updates_that_pay_are_published_and_kept(tmp_path):
    """When updates truly pay (+15% live, as the shadow says, until τ is 40% above never-update's), the rule
    publishes, keeps them, and serves more than never-update, its budget held at every decision."""
    ratios, pessimism, journal = _serve_against_never(tmp_path, 120, lambda true, _: 0.15 if true < 1.4 else 0.0,
                                                      0.15)  # fmt: skip
    kept = [e for e in journal if e["event"] == "outcome" and "rolled_back_to" not in e]
    assert kept and all(e["ratio"] > 1 for e in kept[:1])
    assert min(ratios) >= 0.99 and min(pessimism) >= -1e-6
    assert ratios[-1] > 1.05
