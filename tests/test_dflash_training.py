import json

import pytest
import torch
from conftest import TINY_TARGET, fit_recording_losses, make_target_dirs, text_data
from transformers import AutoTokenizer

from trainer.drafters.dflash import DFlashDraftModel
from trainer.training.dflash import DFlashTraining


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash_train")
    make_target_dirs(root, 12)
    return root


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_dflash_fit_learns_and_exports_reference_format(dirs, tmp_path, loss):
    module = DFlashTraining(
        target=str(dirs / "target"),
        num_layers=2,
        block_size=8,
        max_anchors=8,
        loss=loss,
        lr=3e-3,
        warmup_steps=1,
        export_dir=str(tmp_path / "hf"),
    )
    losses = fit_recording_losses(module, text_data(dirs), max_steps=15)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    # The drafter reads target layers by §1's rule (8 target layers, 2 drafter layers → [1, 5]).
    assert module.target.layer_ids == [1, 5]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    assert config["dflash_config"] == {
        "mask_token_id": AutoTokenizer.from_pretrained(TINY_TARGET).mask_token_id,
        "target_layer_ids": [1, 5],
    }
    exported = DFlashDraftModel.from_pretrained(str(tmp_path / "hf"))
    assert torch.equal(exported.fc.weight, module.drafter.fc.weight)
    # The frozen target never trains and is not part of the checkpoint.
    assert not any(p.requires_grad for p in module.target.parameters())
    assert not any(k.startswith("target.") for k in module.state_dict())
