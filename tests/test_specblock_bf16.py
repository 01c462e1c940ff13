"""SpecBlock's losses under ``precision: bf16-true``, where Lightning makes bfloat16 the default dtype during the
step: the class-balance counts stay float32 (a default-dtype buffer made ``index_add`` refuse its float source,
and ``specblock_qwen3_8b`` failed at its first step; its validation's per-slot sums likewise)."""

import types

import torch

from trainer.training.frozen_target import MetricSums
from trainer.training.specblock import SpecBlockTraining
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


def test_depth_metrics_under_a_bfloat16_default_dtype():
    # One block of one chain, K = 2 slots both headed: slot 0 valid and right, slot 1 valid and wrong.
    result = types.SimpleNamespace(
        counted=torch.ones(1, 1, 2, dtype=torch.bool),
        valid=torch.ones(1, 1, 2, dtype=torch.bool),
        slot=torch.tensor([0, 1]),
        kl_mask=torch.tensor([1.0, 1.0]),
        top1=torch.tensor([True, False]),
        tvd=torch.tensor([0.25, 0.5]),
        rank_logits=torch.tensor([[0.0, 1.0], [1.0, 0.0]]),
        rank_target=torch.tensor([1, 1]),
    )
    module = types.SimpleNamespace(
        drafter=types.SimpleNamespace(block_size=2, rank_class_bounds=[4]), val_sums=MetricSums()
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        SpecBlockTraining.accumulate_depth_metrics(module, [result])
    finally:
        torch.set_default_dtype(previous)
    sums = module.val_sums
    assert sums["top1"].dtype == torch.float32
    assert sums["top1"].tolist() == [[1.0, 0.0]] and sums["tvd"].tolist() == [[0.25, 0.5]]
    assert sums["stop"].tolist() == [[1.0, 0.0]] and sums["rank_acc"].tolist() == [[1.0, 0.0]]
