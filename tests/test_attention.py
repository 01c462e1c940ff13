"""The training masks' two paths (trainer/drafters/attention.py): flex attention block masks against dense SDPA masks.

torch's flex attention has no backward on CPU, so losses are compared through its public forward, and gradients
through torch's own eager reference of the flex attention operator (the one the compiled kernel is checked
against), given the block masks the drafters build.
"""

import copy

import pytest
import torch
import yaml
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_op

from trainer.cli import main
from trainer.drafters import attention, load_drafter
from trainer.drafters.attention import (
    block_rule,
    dense_attention,
    describe_4b,
    mask_bytes,
    resolve_path,
    window_rule,
)
from trainer.drafters.common import SdpaDrafter
from trainer.drafters.dflash import DFlashDraftModel
from trainer.errors import UserError
from trainer.paths import project_path
from trainer.target import Target, load_causal_lm
from trainer.training.step import context_batch, default_options, step_loss

# "+sliding": the shipped DFlash backbone with its first layer a sliding-window one (window 8).
FAMILIES = ("dflash_tiny", "dflash_tiny+sliding", "treeflash_tiny", "specblock_tiny", "eagle3_tiny")


def set_path(drafter: torch.nn.Module, path: str) -> None:
    for module in drafter.modules():
        if isinstance(module, SdpaDrafter):
            module.attention = path


def differentiable_flex(device: torch.device):
    """torch's eager flex attention operator, which has a backward on CPU."""

    def run(query, key, value, block_mask, scale, enable_gqa):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out, *_ = flex_attention_op(query, key, value, lambda s, b, h, q, k: s, block_mask.as_tuple(), scale, {})
        return out

    return run


@pytest.fixture(scope="module")
def target_model():
    return load_causal_lm(str(project_path("checkpoints/target_tiny")), "float32")


def batch_of(vocab: int) -> dict[str, torch.Tensor]:
    """Two logged contexts of different lengths (the shorter is padded): anchors, samples and padding vary."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (48, 33)]
    return context_batch(ids, [6, 4], pad_id=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_flex_loss_and_gradients_equal_dense(name, target_model, monkeypatch):
    drafter = load_drafter(project_path(f"checkpoints/{name.removesuffix('+sliding')}")).train()
    if name.endswith("+sliding"):
        config = copy.deepcopy(drafter.config)
        config.update({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8})
        sliding = DFlashDraftModel(config).train()
        sliding.load_state_dict(drafter.state_dict())
        drafter = sliding
    target = Target(target_model, list(drafter.target_layer_ids))
    batch = batch_of(target_model.config.vocab_size)
    options = default_options(drafter)

    set_path(drafter, "dense")
    dense = step_loss(drafter, target, batch, 3, options)
    dense.backward()
    dense_grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad()

    set_path(drafter, "flex")
    with torch.no_grad():
        torch.testing.assert_close(step_loss(drafter, target, batch, 3, options), dense, rtol=1e-5, atol=1e-6)
    # Training through flex on CPU is refused with what to do, not torch's NotImplementedError.
    with pytest.raises(UserError, match="attention: dense"):
        step_loss(drafter, target, batch, 3, options)

    monkeypatch.setattr(attention, "flex_kernel", differentiable_flex)
    flex = step_loss(drafter, target, batch, 3, options)
    flex.backward()
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-6)
    flex_grads = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
    assert flex_grads.keys() == dense_grads.keys() and dense_grads
    for n, grad in flex_grads.items():
        torch.testing.assert_close(grad, dense_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_block_mask_covers_what_the_dense_mask_allows():
    # A block mask's tiles must hold every allowed (query, key) pair: its dense form equals the rule's.
    doc_ids = torch.tensor([[1] * 150 + [2] * 90 + [0] * 20])
    anchors = torch.tensor([[3, 40, 149, 151, 200, -1]])
    rule = block_rule(doc_ids, anchors, anchors >= 0, 16)
    block = rule.block_mask()
    dense = rule.dense()
    assert torch.equal(block.to_dense().bool(), tiles_touched(dense[0, 0], 128)[None, None])
    assert block.shape == (1, 1, rule.q_len, rule.kv_len)


def tiles_touched(allowed: torch.Tensor, tile: int) -> torch.Tensor:
    """Shape: (Q, KV) bool → (⌈Q/tile⌉, ⌈KV/tile⌉) bool: tiles with any allowed pair."""
    q, kv = allowed.shape
    padded = torch.zeros(-(-q // tile) * tile, -(-kv // tile) * tile, dtype=torch.bool)
    padded[:q, :kv] = allowed
    return padded.view(padded.shape[0] // tile, tile, -1, tile).any(dim=(1, 3))


def test_window_counts_from_the_anchor_and_is_causal_in_the_block():
    # One block of 4 anchored at position 10 with keys at positions 0..13 (context 0..9, then the block).
    query_positions = torch.arange(10, 14)[None]
    key_positions = torch.arange(14)[None]
    allowed = window_rule(query_positions, key_positions, 4, 3).dense()[0, 0]
    for slot in range(4):
        assert allowed[slot].nonzero().flatten().tolist() == [7, 8, 9, *range(10, 11 + slot)]


def test_paths_resolve_and_mask_sizes_at_the_4b_recipe():
    assert resolve_path("auto", torch.device("cpu")) == "dense"
    assert resolve_path("auto", torch.device("cuda")) == "flex"
    with pytest.raises(UserError, match="auto, flex, dense"):
        resolve_path("sparse", torch.device("cpu"))
    # A FLOP-counting step runs densely whatever the path; outside the block the path is back.
    with dense_attention():
        assert resolve_path("flex", torch.device("cuda")) == "dense"
        with dense_attention():
            pass
        assert resolve_path("auto", torch.device("cuda")) == "dense"
    assert resolve_path("flex", torch.device("cuda")) == "flex"
    assert mask_bytes(None) == 0
    # dflash_qwen3_4b: 512 blocks of 16 over 3072 tokens; a float32 mask of (8192, 11264) per row.
    sizes = describe_4b()
    assert "float32: 369.10 MB" in sizes and "bfloat16: 184.55 MB" in sizes
    flex_mb = float(sizes.rpartition("flex block mask: ")[2].split()[0])
    assert 0 < flex_mb < 1


@pytest.mark.parametrize("recipe", ["dflash_qwen3_4b", "eagle3_tiny"])
def test_recipe_key_selects_the_path(recipe, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--recipe", recipe, "--model.attention", "dense", "--print_config"])
    assert exc.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["attention"] == "dense"
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--recipe", recipe, "--model.attention", "sparse", "--print_config"])
    assert exc.value.code != 0
    assert "'auto', 'flex', 'dense'" in capsys.readouterr().err
