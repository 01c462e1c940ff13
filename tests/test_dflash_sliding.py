"""DFlash drafters with sliding-window layers (``layer_types`` with ``sliding_attention``, as speculators writes
them): parity with speculators' DFlash model on its training masks, decoding equal to the training forward,
checkpoint and export round trips, bad layouts refused.

A config-built 8-layer Qwen3 target (hidden 32) and a 3-layer drafter (sliding, full, sliding; window 5) with
randomised weights, so a wrong window or causality shows in the outputs.
"""

import copy
import json

import pytest
import torch
from conftest import ROOT, TINY_TARGET, make_tiny_target, randomised
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, DynamicCache

from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.engine import generate
from trainer.drafters import load_drafter
from trainer.drafters.dflash import DFlashDraftModel, build_config
from trainer.errors import UserError
from trainer.export import speculators as speculators_format
from trainer.export import write_export
from trainer.training.blocks import block_mask_rule, make_blocks

BLOCK = 4
WINDOW = 5
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    make_tiny_target(out)
    return out


@pytest.fixture(scope="module")
def drafter(target_dir) -> DFlashDraftModel:
    from transformers import AutoConfig

    torch.manual_seed(0)
    config = build_config(
        AutoConfig.from_pretrained(target_dir),
        num_layers=3,
        block_size=BLOCK,
        mask_token_id=5,
        target_layer_ids=[1, 5],
        layer_types=LAYER_TYPES,
        sliding_window=WINDOW,
        use_sliding_window=True,
    )
    return randomised(DFlashDraftModel(config).eval())


def training_forward(drafter, noise, features, position_ids, doc_ids, anchors):
    """The training forward (blocks.block_hidden's call) of blocks at ``anchors``. Shape: (1, N·K, H)"""
    ones = torch.ones_like(doc_ids)
    blocks = make_blocks(ones, ones, position_ids, doc_ids, anchors, anchors >= 0, BLOCK, mask_token_id=0)
    positions = torch.cat([position_ids, blocks.positions.flatten(1)], dim=1)
    return drafter(noise, features, positions, attention_mask=block_mask_rule(doc_ids, blocks))


def speculators_model(path):
    models = pytest.importorskip("speculators.models")
    config = models.DFlashSpeculatorConfig.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"  # its default is flex attention
    model = models.DFlashDraftModel.from_pretrained(path, config=config)
    model.load_verifier_weights()
    return model.eval()


@torch.no_grad()
def test_training_forward_matches_speculators(drafter, target_dir, tmp_path):
    out = write_export(drafter, "speculators", tmp_path / "spec", verifier=str(target_dir))
    reference = speculators_model(out)
    assert reference.sliding_window_indices == [0, 2] and reference.sliding_window == WINDOW

    # Two packed samples; anchors near their starts (windows clipped by the sample) and deep inside (not).
    doc_ids = torch.tensor([[1] * 20 + [2] * 14])
    position_ids = torch.cat([torch.arange(20), torch.arange(14)])[None]
    anchors = torch.tensor([[2, 9, 17, 21, 28]])
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(1, anchors.numel() * BLOCK, 32, generator=g)
    features = torch.randn(1, doc_ids.shape[1], 64, generator=g)

    masks = [
        reference._create_attention_mask(doc_ids, doc_ids.shape[1], anchors[0], doc_ids.device, sliding_window=w)
        for w in (None, WINDOW)
    ]
    block_positions = (position_ids[0, anchors[0], None] + torch.arange(BLOCK)).flatten()[None]
    positions = torch.cat([position_ids, block_positions], dim=1)
    context = reference.hidden_norm(reference.fc(features))
    cos_sin = reference.rotary_emb(noise, positions)
    hidden = noise
    for i, layer in enumerate(reference.layers):
        hidden = layer(
            hidden_states=hidden,
            target_hidden=context,
            attention_mask=masks[i in reference.sliding_window_indices],
            position_ids=positions,
            position_embeddings=cos_sin,
        )
    theirs = reference.norm(hidden)

    for path in ("dense", "flex"):
        drafter.attention = path
        ours = training_forward(drafter, noise, features, position_ids, doc_ids, anchors)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5, msg=path)
    drafter.attention = "auto"
    # Without the window the outputs differ: the test sees the sliding layers.
    config = copy.deepcopy(drafter.config)
    config.layer_types = ["full_attention"] * 3
    full = DFlashDraftModel(config)
    full.load_state_dict(drafter.state_dict())
    wide = training_forward(full.eval(), noise, features, position_ids, doc_ids, anchors)
    assert (wide - theirs).abs().max() > 1e-3


@torch.no_grad()
def test_decoding_equals_the_training_forward(drafter):
    # Decoding one block (no mask; the context fed in two pieces through the cache) sees what training's block
    # at that anchor sees: the window and the causal block.
    g = torch.Generator().manual_seed(2)
    t, anchor = 16, 11
    features = torch.randn(1, t, 64, generator=g)
    noise = torch.randn(1, BLOCK, 32, generator=g)
    doc_ids = torch.ones(1, t, dtype=torch.long)
    trained = training_forward(drafter, noise, features, torch.arange(t)[None], doc_ids, torch.tensor([[anchor]]))

    cache = DynamicCache(config=drafter.cache_config)
    drafter(noise[:, :1], features[:, :6], torch.arange(7)[None], past_key_values=cache, use_cache=True)
    cache.crop(-1)
    decoded = drafter(
        noise, features[:, 6:anchor], torch.arange(6, anchor + BLOCK)[None], past_key_values=cache, use_cache=True
    )
    torch.testing.assert_close(decoded, trained, rtol=0, atol=1e-5)


def test_checkpoint_and_speculators_round_trips_keep_the_layout(drafter, target_dir, tmp_path):
    drafter.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["layer_types"], config["sliding_window"]) == (LAYER_TYPES, WINDOW)
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "hf").eval()
    assert loaded.layer_types == LAYER_TYPES

    out = write_export(drafter, "speculators", tmp_path / "spec", verifier=str(target_dir))
    layer = json.loads((out / "config.json").read_text())["transformer_layer_config"]
    assert (layer["layer_types"], layer["sliding_window"]) == (LAYER_TYPES, WINDOW)
    back = speculators_format.load(out)
    assert back.layer_types == LAYER_TYPES and back.config.sliding_window == WINDOW
    for name, value in load_file(out / "model.safetensors").items():
        assert torch.equal(back.state_dict()[name], value)

    # The treeflash format's model file has no windows: refused, and nothing is left behind.
    with pytest.raises(UserError, match="sliding-window layers"):
        write_export(drafter, "treeflash", tmp_path / "tf")
    assert not (tmp_path / "tf").exists()

    # A layout whose sliding layers are bidirectional in the block is one this class does not compute.
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "sliding_window_non_causal": True}))
    with pytest.raises(UserError, match="sliding_window_non_causal"):
        speculators_format.load(out)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked_attention"),
        ({"layer_types": ["full_attention"] * 2}, "must name 3"),
        ({"layer_types": LAYER_TYPES, "sliding_window": None}, "positive sliding_window"),
        ({"is_causal": True}, "is_causal"),
    ],
)
def test_unsupported_layouts_are_refused(drafter, fields, match):
    config = copy.deepcopy(drafter.config)
    for key, value in fields.items():
        setattr(config, key, value)
    with pytest.raises(UserError, match=match):
        DFlashDraftModel(config)


def test_engine_decoding_with_sliding_layers_is_lossless():
    # The shipped DFlash backbone with its first layer made a sliding one: drafts change, outputs must not.
    target = AutoModelForCausalLM.from_pretrained(TINY_TARGET, dtype=torch.float32).eval()
    config = copy.deepcopy(load_drafter(ROOT / "checkpoints" / "dflash_tiny").config)
    config.update({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8})
    drafter = DFlashDraftModel(config).eval()
    drafter.load_state_dict(load_drafter(ROOT / "checkpoints" / "dflash_tiny").state_dict())
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, target.config.vocab_size, (40,), generator=g)
    reference = target.generate(prompt[None], max_new_tokens=24, do_sample=False, eos_token_id=None)
    for tree, budget in (("chain", 16), ("ddtree", 16)):
        out = generate(target, make_session(tree, target, drafter), BUILDERS[tree], prompt, 24, budget=budget)
        assert out.tokens == reference[0, prompt.numel() :].tolist(), tree
