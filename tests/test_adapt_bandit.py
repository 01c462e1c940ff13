"""The bandit drafter updater: the training-step API, gain/cost estimates, the decision rule, rollback, the
alarm, restart after SIGKILL."""

import copy

import pytest
import torch
from conftest import ROOT, TINY_TARGET

from trainer.training.dflash import DFlashTraining
from trainer.training.step import BlockStepOptions, NonFiniteStep, context_batch, dflash_step, treeflash_step
from trainer.training.treeflash import TreeFlashTraining

DFLASH_TINY = ROOT / "checkpoints" / "dflash_tiny"


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 200, (40,), generator=g).tolist(), torch.randint(5, 200, (28,), generator=g).tolist()]
    return context_batch(seqs, [10, 6], pad_id=0)


@pytest.mark.parametrize("family", ["dflash", "treeflash"])
def test_step_api_equals_one_lightning_training_step(family):
    """Same batch, same (seed, step): the API's loss and updated weights equal the LightningModule's step."""
    common = dict(target=str(TINY_TARGET), topk=8, max_anchors=4, gamma=4.0, seed=3)
    if family == "dflash":
        module = DFlashTraining(init_from=str(DFLASH_TINY), loss="kl", **common)
        options, step_fn = BlockStepOptions(topk=8, max_anchors=4, gamma=4.0, seed=3, loss="kl"), dflash_step
    else:
        module = TreeFlashTraining(backbone=str(DFLASH_TINY), freeze_backbone=False, **common)
        options, step_fn = BlockStepOptions(topk=8, max_anchors=4, gamma=4.0, seed=3), treeflash_step
    module.configure_model()
    module.train()
    start = copy.deepcopy(module.drafter)
    api_drafter = copy.deepcopy(module.drafter)
    batch = _batch()

    opt = torch.optim.SGD(module.trainable_parameters(), lr=0.5)
    loss = module.training_step(batch, 0)
    loss.backward()
    opt.step()

    params = [p for p in api_drafter.parameters() if p.requires_grad]
    api_loss = step_fn(api_drafter, module.target, batch, torch.optim.SGD(params, lr=0.5), step=0, options=options)
    assert api_loss == pytest.approx(float(loss), rel=1e-6)
    for (name, a), b in zip(module.drafter.named_parameters(), api_drafter.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # A step that moved nothing would make the comparison vacuous.
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), api_drafter.parameters(), strict=True))


def test_step_api_subset_and_non_finite_leave_weights():
    module = TreeFlashTraining(target=str(TINY_TARGET), backbone=str(DFLASH_TINY), topk=8, max_anchors=4)
    module.configure_model()
    drafter = module.drafter
    drafter.model.requires_grad_(True)
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    opt = torch.optim.SGD(drafter.ar_approximation.parameters(), lr=0.5)
    treeflash_step(drafter, module.target, _batch(), opt, step=0, options=BlockStepOptions(topk=8, max_anchors=4))
    changed = {n for n, p in drafter.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.startswith("ar_approximation.") for n in changed), changed
    assert all(p.requires_grad for p in drafter.model.parameters())  # the subset's freezing is undone
    with torch.no_grad():
        next(drafter.ar_approximation.parameters()).fill_(float("nan"))
    snapshot = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    with pytest.raises(NonFiniteStep):
        treeflash_step(drafter, module.target, _batch(), opt, step=1, options=BlockStepOptions(topk=8, max_anchors=4))
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(p, snapshot[n], equal_nan=True)
