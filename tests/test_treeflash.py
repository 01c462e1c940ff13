import json

import pytest
import torch
from conftest import fit_recording_losses, make_drafter_dirs, make_tiny_target, text_data
from safetensors import safe_open

from trainer.drafters.dflash import DFlashDraftModel
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.training.treeflash import TreeFlashTraining


@pytest.fixture(scope="module")
def setup_dirs(tmp_path_factory):
    """A config-built 8-layer target (with the project tokenizer), a random DFlash backbone, and text data."""
    return make_drafter_dirs(tmp_path_factory.mktemp("tf"), n_modules=12)


def treeflash_of(setup_dirs) -> TreeFlashDraftModel:
    return TreeFlashDraftModel.from_dflash(str(setup_dirs / "dflash"))


def test_step0_logits_equal_backbone_exactly(setup_dirs):
    model = treeflash_of(setup_dirs)
    backbone = DFlashDraftModel.from_pretrained(str(setup_dirs / "dflash"))
    h = model.config.hidden_size
    torch.manual_seed(1)
    noise, ctx = torch.randn(2, 8, h), torch.randn(2, 5, h)
    pos = torch.arange(13).expand(2, 13)
    hidden, normed = model.backbone(noise_embedding=noise, target_hidden=ctx, position_ids=pos)
    reference = backbone(noise_embedding=noise, target_hidden=ctx, position_ids=pos)
    assert torch.equal(normed, reference)
    corrected = model.correct(hidden, normed, torch.randn(2, 8, h))
    assert torch.equal(corrected, reference)  # d is zero: exactly the backbone, not approximately
    assert torch.count_nonzero(model.ar_approximation.d.weight) == 0


def test_reference_format_keys_and_round_trip(setup_dirs, tmp_path):
    model = treeflash_of(setup_dirs)
    with torch.no_grad():
        model.ar_approximation.d.weight.normal_()
    model.save_pretrained(tmp_path / "tf")
    config = json.loads((tmp_path / "tf" / "config.json").read_text())
    assert config["architectures"] == ["TreeFlashDraftModel"]
    assert config["treeflash_config"]["ar_approximation"] == "swiglu"
    assert config["treeflash_config"]["candidate_tokens"] == 16
    assert config["dflash_config"]["mask_token_id"] == model.mask_token_id and config["block_size"] == 8
    with safe_open(str(tmp_path / "tf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {
        "ar_approximation.ug.weight",
        "ar_approximation.ug.bias",
        "ar_approximation.d.weight",
        "ar_approximation.norm.weight",
        "model.fc.weight",
        "model.hidden_norm.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
    } <= keys
    assert all(k.startswith(("model.", "ar_approximation.")) for k in keys)
    loaded = TreeFlashDraftModel.from_pretrained(str(tmp_path / "tf"))
    for (k, v), (k2, v2) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2), k


def run_fit(setup_dirs, tmp_path, freeze: bool, steps: int = 12):
    data = text_data(setup_dirs)
    module = TreeFlashTraining(
        target=str(setup_dirs / "target"),
        backbone=str(setup_dirs / "dflash"),
        freeze_backbone=freeze,
        max_anchors=8,
        lr=3e-3,
        warmup_steps=1,
        export_dir=str(tmp_path / "hf"),
    )
    module.configure_model()
    before = {k: v.clone() for k, v in module.drafter.state_dict().items()}
    losses = fit_recording_losses(module, data, steps, limit_val_batches=2)
    return module, before, losses


def test_frozen_backbone_trains_only_the_approximator_and_loss_falls(setup_dirs, tmp_path):
    module, before, losses = run_fit(setup_dirs, tmp_path, freeze=True)
    after = module.drafter.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed and all(k.startswith("ar_approximation.") for k in changed), changed
    assert "ar_approximation.d.weight" in changed
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    exported = TreeFlashDraftModel.from_pretrained(str(tmp_path / "hf"))
    assert torch.equal(exported.ar_approximation.d.weight, module.drafter.ar_approximation.d.weight)


def test_unfrozen_backbone_changes_too(setup_dirs, tmp_path):
    module, before, _ = run_fit(setup_dirs, tmp_path, freeze=False, steps=3)
    after = module.drafter.state_dict()
    assert not torch.equal(after["model.fc.weight"], before["model.fc.weight"])


def test_backbone_of_another_target_is_a_clear_error(setup_dirs, tmp_path):

    from trainer.errors import UserError

    make_tiny_target(tmp_path / "small", num_layers=2)
    module = TreeFlashTraining(target=str(tmp_path / "small"), backbone=str(setup_dirs / "dflash"))
    with pytest.raises(UserError, match=r"does not fit the target .*layers"):
        module.configure_model()
