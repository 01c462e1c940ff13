import pytest
import torch

from trainer.data.pack import collate, pack, packed_attention_mask
from trainer.data.render import Rendered
from trainer.errors import UserError


def sample(ids, mask=None):
    return Rendered(list(ids), list(mask or [1] * len(ids)), "")


def test_greedy_packing_positions_and_docs():
    rows = pack([sample(range(1, 4)), sample(range(10, 15)), sample(range(20, 28))], max_length=8)
    assert len(rows) == 2
    assert rows[0].input_ids == [1, 2, 3, 10, 11, 12, 13, 14]
    assert rows[0].position_ids == [0, 1, 2, 0, 1, 2, 3, 4]
    assert rows[0].doc_ids == [1, 1, 1, 2, 2, 2, 2, 2]
    assert rows[1].doc_ids == [1] * 8
    unpacked = pack([sample(range(1, 4)), sample(range(10, 15))], max_length=8, packing=False)
    assert len(unpacked) == 2


def test_samples_without_loss_tokens_are_dropped_and_long_ones_refused():
    assert pack([sample([1, 2, 3], [1, 0, 0])], 8) == []
    with pytest.raises(UserError, match="exceeds max_length"):
        pack([sample(range(9))], 8)


def test_mask_blocks_cross_document_attention():
    doc_ids = torch.tensor([[1, 1, 2, 2, 2, 0]])
    m = packed_attention_mask(doc_ids)[0, 0]
    allowed = m == 0
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, expected)
    assert m.min() == torch.finfo(torch.float32).min


def test_packed_forward_equals_separate_forwards(tiny_qwen3):
    a, b = torch.randint(0, 97, (5,)), torch.randint(0, 97, (7,))
    rows = pack([sample(a.tolist()), sample(b.tolist())], max_length=16)
    batch = collate([vars(r) for r in rows], pad_id=0)
    for impl in ("eager", "sdpa"):
        tiny_qwen3.config._attn_implementation = impl
        mask = packed_attention_mask(batch["doc_ids"])
        logits = tiny_qwen3(
            input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"]
        ).logits[0]
        torch.testing.assert_close(logits[:5], tiny_qwen3(input_ids=a[None]).logits[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(logits[5:], tiny_qwen3(input_ids=b[None]).logits[0], rtol=1e-4, atol=1e-5)


def test_collate_pads_right():
    rows = pack([sample([1, 2, 3])], 8) + pack([sample([4, 5])], 8)
    batch = collate([vars(r) for r in rows], pad_id=99)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 99]]
    assert batch["doc_ids"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["loss_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
