"""DFlash drafter: parity with the reference `dflash` package, checkpoint format, layer rule, masks, KV cache.

Everything runs on a config-built 8-layer Qwen3 target config and a 2-layer drafter with randomised weights
(norm weights included), so attention is far from uniform and a wrong mask or position shows.
"""

import json

import pytest
import torch
from conftest import qwen3_config, randomised, reference_dflash_model
from safetensors.torch import load_file
from transformers import DynamicCache, Qwen3Config

from trainer.drafters.dflash import (
    DFlashDraftModel,
    build_config,
    default_target_layer_ids,
)
from trainer.errors import UserError
from trainer.training.blocks import block_mask_rule, make_blocks

HIDDEN = 32
BLOCK = 4
MASK_ID = 100
LAYER_IDS = [1, 5]  # the spread rule for 8 target layers and 2 drafter layers

WEIGHT_NAMES = {
    *(
        f"layers.{i}.{name}.weight"
        for i in range(2)
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        )
    ),
    "fc.weight",
    "hidden_norm.weight",
    "norm.weight",
}


@pytest.fixture(scope="module")
def target_config() -> Qwen3Config:
    return qwen3_config(vocab_size=101)


@pytest.fixture(scope="module")
def drafter(target_config) -> DFlashDraftModel:
    torch.manual_seed(0)
    config = build_config(target_config, num_layers=2, block_size=BLOCK, mask_token_id=MASK_ID, intermediate_size=48)
    return randomised(DFlashDraftModel(config).eval())


def reference_class():
    return reference_dflash_model().DFlashDraftModel


def reference_copy(drafter: DFlashDraftModel):
    reference = reference_class()(drafter.config).eval()
    reference.load_state_dict(drafter.state_dict(), strict=True)
    return reference


def inputs(batch: int, ctx: int, q: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch, q, HIDDEN, generator=g)
    features = torch.randn(batch, ctx, len(LAYER_IDS) * HIDDEN, generator=g)
    return noise, features


def packed_layout(anchors: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor):
    """Positions and mask of the training batch builder (trainer.training.blocks) for the given anchors."""
    ones = torch.ones_like(doc_ids)
    blocks = make_blocks(ones, ones, position_ids, doc_ids, anchors, anchors >= 0, BLOCK, mask_token_id=0)
    positions = torch.cat([position_ids, blocks.positions.flatten(1)], dim=1)
    return positions, block_mask_rule(doc_ids, blocks).build("dense", torch.float32)


def training_layout(anchors: torch.Tensor, ctx: int):
    """Positions and mask for N blocks after a context at positions 0..ctx-1."""
    b = anchors.shape[0]
    return packed_layout(anchors, torch.arange(ctx).expand(b, -1), torch.ones(b, ctx, dtype=torch.long))


@torch.no_grad()
def test_forward_matches_reference(drafter):
    reference = reference_copy(drafter)

    # Inference: one block after its context, no mask.
    noise, features = inputs(2, 7, BLOCK)
    positions = torch.arange(7 + BLOCK).expand(2, -1)
    ours = drafter(noise, features, positions)
    theirs = reference(position_ids=positions, noise_embedding=noise, target_hidden=features)
    assert ours.shape == (2, BLOCK, HIDDEN)
    prenorm = drafter(noise, features, positions, return_prenorm=True)
    torch.testing.assert_close(drafter.norm(prenorm), ours, rtol=0, atol=0)
    diff_plain = (ours - theirs).abs().max().item()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)

    # Training: three blocks in one forward with the block mask.
    anchors = torch.tensor([[2, 6, 9], [4, 5, 11]])
    noise, features = inputs(2, 12, 3 * BLOCK, seed=2)
    positions, mask = training_layout(anchors, 12)
    ours = drafter(noise, features, positions, attention_mask=mask)
    theirs = reference(position_ids=positions, attention_mask=mask, noise_embedding=noise, target_hidden=features)
    diff_masked = (ours - theirs).abs().max().item()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    print(f"parity max-abs-diff: no mask {diff_plain:.2e}, block mask {diff_masked:.2e}")


@torch.no_grad()
def test_cached_drafting_matches_reference(drafter):
    reference = reference_copy(drafter)
    noise1, feats = inputs(1, 9, BLOCK, seed=3)
    noise2, _ = inputs(1, 1, BLOCK, seed=4)
    outs = []
    for model in (drafter, reference):
        cache = DynamicCache(config=drafter.config)
        first = model(
            noise_embedding=noise1, target_hidden=feats[:, :6], position_ids=torch.arange(10)[None], **cached(cache)
        )
        cache.crop(-BLOCK)
        second = model(
            noise_embedding=noise2, target_hidden=feats[:, 6:], position_ids=torch.arange(6, 13)[None], **cached(cache)
        )
        outs.append((first, second))
    for ours, theirs in zip(*outs, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def cached(cache: DynamicCache) -> dict:
    return {"past_key_values": cache, "use_cache": True}


@torch.no_grad()
def test_checkpoint_directories_interchange_with_reference(drafter, tmp_path):
    Reference = reference_class()
    noise, features = inputs(1, 5, BLOCK, seed=5)
    positions = torch.arange(5 + BLOCK)[None]
    expected = drafter(noise, features, positions)

    drafter.save_pretrained(tmp_path / "ours")
    reference, info = Reference.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not any(info.values()), info
    assert (reference.target_layer_ids, reference.block_size, reference.mask_token_id) == (LAYER_IDS, BLOCK, MASK_ID)
    theirs = reference.eval()(position_ids=positions, noise_embedding=noise, target_hidden=features)
    torch.testing.assert_close(theirs, expected, rtol=0, atol=1e-5)

    reference.save_pretrained(tmp_path / "theirs")
    back, info = DFlashDraftModel.from_pretrained(tmp_path / "theirs", output_loading_info=True)
    assert not any(info.values()), info
    assert (back.target_layer_ids, back.block_size, back.mask_token_id) == (LAYER_IDS, BLOCK, MASK_ID)
    torch.testing.assert_close(back.eval()(noise, features, positions), expected, rtol=0, atol=1e-5)


@torch.no_grad()
def test_save_load_round_trip(drafter, tmp_path):
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == BLOCK
    assert config["num_target_layers"] == 8
    assert config["num_hidden_layers"] == 2
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": LAYER_IDS}
    assert (config["hidden_size"], config["intermediate_size"], config["head_dim"]) == (HIDDEN, 48, 8)

    weights = load_file(tmp_path / "model.safetensors")
    assert set(weights) == WEIGHT_NAMES
    assert weights["fc.weight"].shape == (HIDDEN, len(LAYER_IDS) * HIDDEN)

    loaded, info = DFlashDraftModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    for name, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    noise, features = inputs(1, 5, BLOCK, seed=6)
    positions = torch.arange(5 + BLOCK)[None]
    torch.testing.assert_close(loaded.eval()(noise, features, positions), drafter(noise, features, positions))


def test_target_layer_ids_rule(target_config):
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(8, 2) == LAYER_IDS
    assert default_target_layer_ids(8, 3) == [1, 3, 5]

    config = build_config(target_config, num_layers=3, block_size=16, mask_token_id=MASK_ID)
    assert config.dflash_config["target_layer_ids"] == [1, 3, 5]
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (HIDDEN, 64, 101)
    assert config.rope_parameters == target_config.rope_parameters
    explicit = build_config(target_config, 1, 16, MASK_ID, target_layer_ids=[2, 7])
    assert explicit.dflash_config["target_layer_ids"] == [2, 7]
    with pytest.raises(UserError, match="within the target's layers"):
        build_config(target_config, 1, 16, MASK_ID, target_layer_ids=[8])
    with pytest.raises(UserError, match="hidden_size must equal"):
        build_config(target_config, 1, 16, MASK_ID, hidden_size=64)


@torch.no_grad()
def test_block_mask_semantics(drafter):
    anchors = torch.tensor([[3, 7, 10]])
    ctx = 12
    noise, features = inputs(1, ctx, 3 * BLOCK, seed=7)
    positions, mask = training_layout(anchors, ctx)
    base = drafter(noise, features, positions, attention_mask=mask)
    block = [slice(b * BLOCK, (b + 1) * BLOCK) for b in range(3)]

    def run(noise=noise, features=features):
        return drafter(noise, features, positions, attention_mask=mask)

    def bumped(t: torch.Tensor, index) -> torch.Tensor:
        t = t.clone()
        t[index] += 1.0
        return t

    # Context at or after block 1's anchor (7): invisible to block 1, visible to block 2 (anchor 10).
    for j in (7, 9):
        out = run(features=bumped(features, (0, j)))
        torch.testing.assert_close(out[:, block[1]], base[:, block[1]], rtol=0, atol=1e-6)
        assert (out[:, block[2]] - base[:, block[2]]).abs().max() > 1e-3
    # Context before the anchor: visible.
    out = run(features=bumped(features, (0, 6)))
    assert (out[:, block[1]] - base[:, block[1]]).abs().max() > 1e-3
    # Another block's tokens: invisible; its own tokens: visible (bidirectionally, slot 3 moves slot 0).
    out = run(noise=bumped(noise, (0, block[0].start + 3)))
    torch.testing.assert_close(out[:, block[1]], base[:, block[1]], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[:, block[2]], base[:, block[2]], rtol=0, atol=1e-6)
    assert (out[:, block[0].start] - base[:, block[0].start]).abs().max() > 1e-3

    # Each masked block equals inference on that block alone after the context before its anchor.
    for b, a in enumerate(anchors[0].tolist()):
        alone = drafter(noise[:, block[b]], features[:, :a], torch.arange(a + BLOCK)[None])
        torch.testing.assert_close(base[:, block[b]], alone, rtol=0, atol=1e-5)

    # A boolean mask (True = attend) means the same as the additive one.
    torch.testing.assert_close(drafter(noise, features, positions, attention_mask=mask == 0), base)


@torch.no_grad()
def test_block_mask_respects_packed_samples(drafter):
    # Two samples packed in one row: positions restart at 5; block anchored at index 8 sees indices 5..7 only.
    doc_ids = torch.tensor([[1] * 5 + [2] * 5])
    row_positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])
    anchors = torch.tensor([[8]])
    noise, features = inputs(1, 10, BLOCK, seed=8)
    positions, mask = packed_layout(anchors, row_positions, doc_ids)
    assert positions[0, 10:].tolist() == [3, 4, 5, 6]
    packed = drafter(noise, features, positions, attention_mask=mask)
    alone = drafter(noise, features[:, 5:8], torch.arange(3 + BLOCK)[None])
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


@torch.no_grad()
def test_kv_cache_crop_then_more_context_matches_full_forward(drafter):
    c1, c2 = 6, 3
    noise1, features = inputs(2, c1 + c2, BLOCK, seed=9)
    noise2, _ = inputs(2, 1, BLOCK, seed=10)
    cache = DynamicCache(config=drafter.config)

    first = drafter(noise1, features[:, :c1], torch.arange(c1 + BLOCK).expand(2, -1), **cached(cache))
    torch.testing.assert_close(first, drafter(noise1, features[:, :c1], torch.arange(c1 + BLOCK).expand(2, -1)))
    assert cache.get_seq_length() == c1 + BLOCK
    cache.crop(-BLOCK)  # keep the context keys, drop the drafted block's
    assert cache.get_seq_length() == c1

    second = drafter(noise2, features[:, c1:], torch.arange(c1, c1 + c2 + BLOCK).expand(2, -1), **cached(cache))
    full = drafter(noise2, features, torch.arange(c1 + c2 + BLOCK).expand(2, -1))
    torch.testing.assert_close(second, full, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == c1 + c2 + BLOCK

    with pytest.raises(ValueError, match="needs a DynamicCache"):
        drafter(noise2, features, torch.arange(c1 + c2 + BLOCK)[None], use_cache=True)


def test_gradients_reach_every_weight_with_checkpointing(target_config):
    torch.manual_seed(0)
    model = DFlashDraftModel(build_config(target_config, num_layers=2, block_size=BLOCK, mask_token_id=MASK_ID))
    anchors = torch.tensor([[2, 5]])
    noise, features = inputs(1, 8, 2 * BLOCK, seed=11)
    positions, mask = training_layout(anchors, 8)

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(noise, features, positions, attention_mask=mask).pow(2).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    model.train()
    plain = grads()
    assert set(plain) == WEIGHT_NAMES
    assert all(grad.abs().sum() > 0 for grad in plain.values())
    # Reentrant checkpointing drops parameter gradients of a layer none of whose positional inputs need grad;
    # the context (fc output) always does, even though the block embeddings come from the frozen target.
    for reentrant in (False, True):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        checkpointed = grads()
        for name, grad in plain.items():
            torch.testing.assert_close(checkpointed[name], grad, msg=f"{name} (use_reentrant={reentrant})")
