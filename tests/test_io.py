"""Atomic writes (trainer.io), the additive mask (trainer.drafters.attention) and the nucleus filter (trainer.sampling).

PYTHONPATH=$PWD python -m pytest tests/test_io.py -q
"""

import pytest
import torch

from trainer.drafters.attention import additive_mask
from trainer.io import atomic_path, partial_path, swap_in, write_dir_atomic, write_text_atomic
from trainer.sampling import nucleus


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "sub" / "manifest.json"
    write_text_atomic(path, "old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old"
    assert sorted(p.name for p in path.parent.iterdir()) == ["manifest.json"]
    write_text_atomic(path, "new")
    assert path.read_text() == "new" and sorted(p.name for p in path.parent.iterdir()) == ["manifest.json"]


def test_a_directory_is_swapped_whole(tmp_path):
    out = tmp_path / "hf"
    write_dir_atomic(out, lambda d: (d.mkdir(), (d / "a").write_text("1")))

    def failing(d):
        d.mkdir()
        (d / "b").write_text("2")
        raise RuntimeError("killed mid-export")

    with pytest.raises(RuntimeError):
        write_dir_atomic(out, failing)
    assert [p.name for p in out.iterdir()] == ["a"]
    write_dir_atomic(out, lambda d: (d.mkdir(), (d / "b").write_text("2")))
    assert [p.name for p in out.iterdir()] == ["b"]
    # The failed export's leftovers and the old directory are gone.
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_a_sharded_directory_replaces_a_single_file_checkpoint(tmp_path):
    # Every rank writes its shard into the partial directory; one rank swaps it in once all have finished.
    out = tmp_path / "last.ckpt"
    out.write_text("single file")
    partial_path(out).mkdir()
    for rank in range(2):
        (partial_path(out) / f"__{rank}_0.distcp").write_text(str(rank))
    swap_in(out)
    assert sorted(p.name for p in out.iterdir()) == ["__0_0.distcp", "__1_0.distcp"]
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_additive_mask_from_bool_and_float():
    allowed = torch.tensor([[True, False], [True, True]])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        mask = additive_mask(allowed, dtype)
        assert mask.dtype == dtype and mask[0, 0] == 0 and mask[0, 1] == torch.finfo(dtype).min
        # A float32 mask moved into float16 stays finite (finfo(float32).min would overflow to -inf).
        assert torch.isfinite(additive_mask(additive_mask(allowed, torch.float32), dtype)).all()


def test_nucleus_keeps_the_smallest_head_reaching_top_p():
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    # 0.5 + 0.25 = 0.75 < 0.8, so the token that crosses 0.8 (0.15) is kept too.
    torch.testing.assert_close(nucleus(probs, 0.8), torch.tensor([[0.0, 0.5, 0.15, 0.25]]) / 0.9)
    torch.testing.assert_close(nucleus(probs, 0.5), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    assert nucleus(probs, 1.0) is probs
