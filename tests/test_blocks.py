import math

import torch

from trainer.losses import forward_kl_topk, topk_coverage, tvd_topk, weighted_slot_mean
from trainer.training.blocks import (
    anchor_candidates,
    block_mask_rule,
    make_blocks,
    sample_anchors,
    slot_weights,
)

MASK = 99


def packed_batch():
    # Two packed samples: positions 0-5 (doc 1), 6-9 (doc 2), then padding.
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 0, 0]])
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0]])
    doc_ids = torch.tensor([[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 0]])
    return input_ids, loss_mask, position_ids, doc_ids


def test_anchor_candidates_need_two_masked_tokens_in_one_sample():
    _, loss_mask, _, doc_ids = packed_batch()
    cand = anchor_candidates(loss_mask, doc_ids)[0].nonzero().flatten().tolist()
    # 5→6 crosses samples, 7→8 has 8 unmasked, 9→10 is padding.
    assert cand == [1, 2, 3, 4, 6]


def test_sample_anchors_is_seeded_distinct_and_bounded():
    _, loss_mask, _, doc_ids = packed_batch()
    a1, v1 = sample_anchors(loss_mask, doc_ids, 3, torch.Generator().manual_seed(0))
    a2, _ = sample_anchors(loss_mask, doc_ids, 3, torch.Generator().manual_seed(0))
    assert torch.equal(a1, a2) and v1.all() and a1.shape == (1, 3)
    assert len(set(a1[0].tolist())) == 3 and set(a1[0].tolist()) <= {1, 2, 3, 4, 6}
    assert a1[0].tolist() == sorted(a1[0].tolist())
    all_a, valid = sample_anchors(loss_mask, doc_ids, 32)
    assert all_a[0].tolist() == [1, 2, 3, 4, 6] and valid.all()


def test_blocks_labels_positions_and_label_mask():
    input_ids, loss_mask, position_ids, doc_ids = packed_batch()
    anchors = torch.tensor([[3, 6, -1]])
    blocks = make_blocks(input_ids, loss_mask, position_ids, doc_ids, anchors, anchors >= 0, 4, MASK)
    assert blocks.tokens[0].tolist() == [[13, MASK, MASK, MASK], [20, MASK, MASK, MASK], [10, MASK, MASK, MASK]]
    assert blocks.positions[0, 0].tolist() == [3, 4, 5, 6] and blocks.positions[0, 1].tolist() == [0, 1, 2, 3]
    assert blocks.labels[0, 0, 1:].tolist() == [14, 15, 20]
    # Block at 3: slots 1, 2 in doc 1; slot 3 would be position 6 (doc 2) → no label.
    assert blocks.label_mask[0, 0].tolist() == [False, True, True, False]
    # Block at 6: slot 1 = pos 7 (masked in), slot 2 = pos 8 (loss_mask 0), slot 3 = pos 9.
    assert blocks.label_mask[0, 1].tolist() == [False, True, False, True]
    assert not blocks.label_mask[0, 2].any()
    # Teacher of slot k is the target distribution at a+k-1; teacher forcing feeds x_{a+k-1}.
    assert blocks.teacher_index[0, 0].tolist() == [2, 3, 4, 5]
    assert blocks.prev_tokens[0, 0, 1:].tolist() == [13, 14, 15]


def test_block_attention_mask():
    input_ids, loss_mask, position_ids, doc_ids = packed_batch()
    anchors = torch.tensor([[3, 7]])
    blocks = make_blocks(input_ids, loss_mask, position_ids, doc_ids, anchors, anchors >= 0, 2, MASK)
    allowed = block_mask_rule(doc_ids, blocks).dense()[0, 0]
    t = 12
    # Block 0 (anchor 3, doc 1): context 0..2 only; its own two slots; not block 1.
    for q in (0, 1):
        assert allowed[q, :t].nonzero().flatten().tolist() == [0, 1, 2]
        assert allowed[q, t:].tolist() == [True, True, False, False]
    # Block 1 (anchor 7, doc 2): context 6 only (doc 2 before 7), never doc 1.
    for q in (2, 3):
        assert allowed[q, :t].nonzero().flatten().tolist() == [6]
        assert allowed[q, t:].tolist() == [False, False, True, True]


def test_slot_weights():
    w = slot_weights(4, gamma=7.0)
    assert w[0] == 0 and w[1] == 1 and math.isclose(w[3].item(), math.exp(-2 / 7), rel_tol=1e-6)


def test_losses_on_known_distributions():
    teacher_ids = torch.tensor([[0, 1]])
    teacher_lp = torch.log(torch.tensor([[0.75, 0.25]]))
    exact = torch.log(torch.tensor([[0.75, 0.25, 1e-9]]))
    assert forward_kl_topk(exact, teacher_ids, teacher_lp).abs().item() < 1e-5
    uniform = torch.zeros(1, 3)
    expected_kl = 0.75 * math.log(0.75 * 3) + 0.25 * math.log(0.25 * 3)
    assert math.isclose(forward_kl_topk(uniform, teacher_ids, teacher_lp).item(), expected_kl, rel_tol=1e-5)
    # TVD(uniform over 3, (0.75, 0.25, 0)) = 0.5 * (|0.75-1/3| + |0.25-1/3| + |0-1/3|) = 0.4167
    assert math.isclose(
        tvd_topk(uniform, teacher_ids, teacher_lp).item(), 0.5 * (5 / 12 + 1 / 12 + 1 / 3), rel_tol=1e-5
    )
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0]])
    assert topk_coverage(logits, torch.tensor([2]), 1).item() == 0
    assert topk_coverage(logits, torch.tensor([2]), 2).item() == 1
    values = torch.tensor([[[0.0, 1.0, 3.0]]])
    mask = torch.tensor([[[False, True, True]]])
    assert math.isclose(
        weighted_slot_mean(values, mask, torch.tensor([0.0, 1.0, 0.5])).item(), (1 + 1.5) / 1.5, rel_tol=1e-6
    )
