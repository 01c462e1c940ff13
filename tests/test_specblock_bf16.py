"""SpecBlock's losses under ``precision: bf16-true``, where Lightning makes bfloat16 the default dtype during the
step: the class-balance counts stay float32 (a default-dtype buffer made ``index_add`` refuse its float source,
and ``specblock_qwen3_8b`` failed at its first step)."""

import torch

from trainer.training.specblock_losses import class_balance_weights


def test_class_balance_weights_under_a_bfloat16_default_dtype():
    slot = torch.tensor([0, 0, 1, 1, 1])
    classes = torch.tensor([2, 2, 0, 0, 1])
    mask = torch.tensor([True, True, True, False, True])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        weights = class_balance_weights(slot, classes, mask, budget=1, num_slots=2, num_classes=3)
    finally:
        torch.set_default_dtype(previous)
    # (slot 0, class 2) holds two masked samples: 1/2 each; the others one each; the unmasked sample 0.
    assert weights.dtype == torch.float32
    assert weights.tolist() == [0.5, 0.5, 1.0, 0.0, 1.0]
