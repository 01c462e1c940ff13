"""SpecBlock: masks, layer shift, rank classes, cache parity, the training unroll, a short fit, export."""

import itertools
import json

import pytest
import torch
from conftest import fit_recording_losses, make_target_dirs, make_tiny_target, qwen3_config, text_data
from safetensors import safe_open
from transformers import DynamicCache, Qwen3ForCausalLM

from trainer.drafters.specblock import (
    SpecBlockDraftModel,
    build_config,
    context_mask,
    eagle3_layer_ids,
    launch_mask,
    rank_class,
    token_rank,
)
from trainer.errors import UserError
from trainer.training.specblock import (
    SpecBlockTraining,
    choose_launch_slots,
    correct_through,
    ordinal_targets,
    valid_slots,
)

H, K = 32, 4


def drafter_for(num_target_layers: int = 8, seed: int = 0) -> SpecBlockDraftModel:
    torch.manual_seed(seed)
    model = SpecBlockDraftModel(build_config(qwen3_config(num_target_layers), num_layers=2, block_size=K)).eval()
    # Break the identity init of the shifts, so that the shifted half of S_l matters in these tests.
    with torch.no_grad():
        for layer in model.layers[1:]:
            layer.shift.weight.normal_(std=0.2)
    return model


def random_inputs(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(1, n, 3 * H, generator=g)
    tokens = torch.randn(1, n, H, generator=g)
    return features, tokens, torch.arange(n)[None]


# ---- layout and masks ---------------------------------------------------------------------------------------------
def test_layer_ids_are_eagle3s_and_parameter_names_are_checkpoint_keys():
    assert eagle3_layer_ids(8) == [1, 3, 4]
    assert eagle3_layer_ids(36) == [1, 17, 32]  # Qwen3-8B: HF hidden_states 2, 18, 33
    assert eagle3_layer_ids(32) == [1, 15, 28]  # Llama-3.1-8B: HF hidden_states 2, 16, 29
    with pytest.raises(UserError, match="at least 4 layers"):
        eagle3_layer_ids(3)
    model = drafter_for()
    assert model.target_layer_ids == [1, 3, 4] and model.block_size == K
    names = set(model.state_dict())
    assert {
        "condition_proj.weight",
        "condition_norm.weight",
        "token_norm.weight",
        "query_norm.weight",
        "slot_queries",
        "fuse.weight",
        "norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.q_norm.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.input_layernorm.weight",
        "layers.1.shift.weight",
        "rank_head.up.weight",
        "rank_head.out.bias",
    } <= names
    assert "layers.0.shift.weight" not in names  # the shift precedes layers l >= 1 only
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert model.condition_proj.weight.shape == (H, 3 * H) and model.fuse.weight.shape == (H, 3 * H)
    assert model.layers[1].shift.weight.shape == (H, 2 * H) and model.slot_queries.shape == (K, H)
    assert model.rank_head.out.out_features == 4
    fresh = SpecBlockDraftModel(model.config)
    assert torch.equal(fresh.layers[1].shift.weight, torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1))


def test_context_mask_exact_pattern():
    # Two positions of one sample, then one of a second sample, K = 2: slot-major per position.
    allowed = context_mask(torch.tensor([[1, 1, 2]]), 2)[0].int()
    expected = torch.tensor(
        [
            # keys: (0,0) (0,1) (1,0) (1,1) (2,0) (2,1)
            [1, 0, 0, 0, 0, 0],  # (0,0): itself
            [1, 1, 0, 0, 0, 0],  # (0,1): slots <= 1 of its position
            [1, 1, 1, 0, 0, 0],  # (1,0): every slot of position 0, then its own slot 0
            [1, 1, 1, 1, 0, 0],  # (1,1)
            [0, 0, 0, 0, 1, 0],  # (2,0): another sample, nothing of positions 0 and 1
            [0, 0, 0, 0, 1, 1],  # (2,1)
        ]
    )
    assert torch.equal(allowed, expected)
    # Padding sees only its own slots, causally.
    pad = context_mask(torch.tensor([[1, 0]]), 2)[0].int()
    assert torch.equal(pad[2:], torch.tensor([[0, 0, 1, 0], [0, 0, 1, 1]]))


def test_launch_mask_pattern():
    visible = torch.tensor([[[1, 0, 1], [0, 1, 0]]], dtype=torch.bool)
    allowed = launch_mask(visible, 2)[0, 0].int()
    expected = torch.tensor(
        [
            [1, 0, 1, 1, 0, 0, 0],
            [1, 0, 1, 1, 1, 0, 0],
            [0, 1, 0, 0, 0, 1, 0],
            [0, 1, 0, 0, 0, 1, 1],
        ]
    )
    assert torch.equal(allowed, expected)


def test_a_later_position_never_influences_an_earlier_one():
    model = drafter_for()
    features, tokens, positions = random_inputs(6)
    base = model(model.project_features(features), tokens, positions)
    features2, tokens2 = features.clone(), tokens.clone()
    features2[:, 4:] += 1.0
    tokens2[:, 4:] -= 1.0
    moved = model(model.project_features(features2), tokens2, positions)
    assert torch.allclose(base[:, :4], moved[:, :4], atol=1e-6)
    assert not torch.allclose(base[:, 4:], moved[:, 4:], atol=1e-3)


def test_layer_shift_carries_earlier_slots_forward_only():
    model = drafter_for()
    features, tokens, positions = random_inputs(3)
    condition = model.project_features(features)

    def slot_change(k: int, mask: torch.Tensor | None) -> torch.Tensor:
        """How much each slot of position 0 moves when slot k's query moves (max over channels). Shape: (K,)"""
        base = model(condition, tokens, positions, attention_mask=mask)
        with torch.no_grad():
            model.slot_queries[k] += 3.0
        moved = model(condition, tokens, positions, attention_mask=mask)
        with torch.no_grad():
            model.slot_queries[k] -= 3.0
        return (moved - base)[0, 0].abs().amax(-1)

    # The full model: slot k moves itself and the later slots, never an earlier one.
    for k in range(K):
        change = slot_change(k, None)
        assert (change[:k] < 1e-6).all() and (change[k:] > 1e-4).all(), (k, change)

    # Attention restricted to each slot itself: only the layer shift links the slots of a block. Two layers have
    # one shift (before layer 1), so slot k reaches slot k+1 and no further, and never slot k-1.
    isolated = torch.eye(3 * K, dtype=torch.bool)[None, None]
    for k in range(K):
        change = slot_change(k, isolated)
        expected = torch.zeros(K, dtype=torch.bool)
        expected[k : k + 2] = True
        assert torch.equal(change > 1e-4, expected), (k, change)
        assert (change[~expected] == 0).all()
    # With the shifted half of S_1 at zero the slots are independent.
    with torch.no_grad():
        model.layers[1].shift.weight[:, H:] = 0
    change = slot_change(1, isolated)
    assert torch.equal(change > 0, torch.tensor([False, True, False, False]))


def test_context_in_two_calls_through_the_cache_equals_one_call():
    model = drafter_for()
    features, tokens, positions = random_inputs(7)
    condition = model.project_features(features)
    whole = model(condition, tokens, positions)
    cache = DynamicCache(config=model.config)
    first = model(condition[:, :4], tokens[:, :4], positions[:, :4], past_key_values=cache)
    assert cache.get_seq_length(0) == 4 * K
    second = model(condition[:, 4:], tokens[:, 4:], positions[:, 4:], past_key_values=cache)
    assert torch.allclose(torch.cat([first, second], dim=1), whole, atol=1e-5)

    # A block launched from slot 1 of position 6 through the cache equals the same block without one.
    visible = torch.zeros(1, 1, 7 * K, dtype=torch.bool)
    visible[..., : 6 * K + 2] = True
    launch = (whole[:, 6:7, 1], torch.randn(1, 1, H), torch.tensor([[8]]))
    cached = model(*launch, attention_mask=launch_mask(visible, K), past_key_values=cache)
    assert cache.get_seq_length(0) == 8 * K
    cache.crop(-K)
    assert cache.get_seq_length(0) == 7 * K
    # The same keys computed anew: the context then the block in one uncached pass of an explicit mask.
    full = DynamicCache(config=model.config)
    model(condition, tokens, positions, past_key_values=full)
    again = model(*launch, attention_mask=launch_mask(visible, K), past_key_values=full)
    assert torch.allclose(cached, again, atol=1e-5)


def test_additive_and_boolean_masks_agree():
    model = drafter_for()
    features, tokens, positions = random_inputs(3)
    condition = model.project_features(features)
    allowed = context_mask(torch.ones(1, 3, dtype=torch.long), K)[:, None]
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out_bool = model(condition, tokens, positions, attention_mask=allowed)
    out_float = model(condition, tokens, positions, attention_mask=additive)
    assert torch.allclose(out_bool, out_float) and torch.allclose(out_bool, model(condition, tokens, positions))


# ---- ranks and chains ---------------------------------------------------------------------------------------------
def test_rank_classes_on_constructed_distributions():
    # Token 0's logit placed below r-1 others: rank r.
    ranks = [1, 2, 4, 5, 10, 11, 30]
    logits = torch.stack([torch.cat([torch.tensor([0.0]), torch.ones(r - 1), -torch.ones(40 - r)]) for r in ranks])
    got = token_rank(logits, torch.zeros(len(ranks), dtype=torch.long))
    assert got.tolist() == ranks
    assert rank_class(got).tolist() == [0, 1, 1, 2, 2, 3, 3]
    assert rank_class(torch.tensor([3, 6, 9, 12])).tolist() == [1, 2, 2, 3]


def test_ordinal_targets():
    soft = ordinal_targets(torch.tensor([0, 1, 3]), 4, 0.2)
    assert torch.allclose(soft[0], torch.tensor([0.8, 0.2, 0.0, 0.0]))
    assert torch.allclose(soft[1], torch.tensor([0.1, 0.8, 0.1, 0.0]))
    assert torch.allclose(soft[2], torch.tensor([0.0, 0.0, 0.2, 0.8]))


def test_valid_prefix_mask_zeroes_later_slots_of_a_wrong_chain_only():
    # Two chains (rows) of three blocks; row 0 has slot 1 of block 1 wrong, row 1 is right throughout.
    match1 = torch.tensor([[[1, 0, 1, 1]], [[1, 1, 1, 1]]], dtype=torch.bool)
    ok = torch.ones(2, 1, dtype=torch.bool)
    valid1 = valid_slots(ok, match1)
    assert valid1[0, 0].tolist() == [True, True, False, False]  # the wrong slot keeps its loss; later ones lose
    assert valid1[1, 0].all()
    through1 = correct_through(ok, match1)
    # Row 0: a block launched from slot 0 continues a correct chain; from slot 1 (wrong) or later it does not.
    for launch, expect in ((0, True), (1, False), (3, False)):
        prefix = through1[0, 0, launch]
        assert bool(prefix) == expect
        match2 = torch.ones(1, 1, K, dtype=torch.bool)
        assert valid_slots(prefix.view(1, 1), match2).all() == expect
    # Block 2 of row 1 is wrong at slot 2: block 3 from slot 2 or later is zeroed, from slot 1 it is not.
    match2 = torch.tensor([[[1, 1, 0, 1]]], dtype=torch.bool)
    through2 = correct_through(through1[1:, :, 3], match2)
    assert valid_slots(through1[1:, :, 3], match2)[0, 0].tolist() == [True, True, True, False]
    assert through2[0, 0].tolist() == [True, True, False, False]
    # Launches are drawn among the slots still correct through themselves.
    g = torch.Generator().manual_seed(0)
    picks = torch.stack([choose_launch_slots(through2, g) for _ in range(50)])
    assert set(picks.flatten().tolist()) == {0, 1}


# ---- training -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("specblock")
    make_target_dirs(root, 12)
    return root


def test_unroll_shapes_and_chains(dirs):
    module = SpecBlockTraining(target=str(dirs / "target"), max_anchors=5)
    module.configure_model()
    data = text_data(dirs, max_length=96)
    batch = next(iter(data.train_dataloader()))
    b, t = batch["input_ids"].shape
    results = module.unroll(batch)
    assert len(results) == 3
    v = module.target.config.vocab_size
    assert results[0].hidden.shape == (b, t, K, H) and results[0].draft.shape == (b, t, K)
    for r in results[1:]:
        assert r.hidden.shape == (b, 5, K, H) and r.draft.shape == r.valid.shape == r.through.shape == (b, 5, K)
    for r in results:
        m = int(r.valid.sum())
        assert r.logits.shape == (m, v) and r.rank_logits.shape == (m, 4) and r.teacher_ids.shape == (m, 32)
        assert torch.equal(r.slot, r.valid.nonzero()[:, 2])
    # Slot 0 of every counted context block is valid: nothing comes before it in its chain.
    assert torch.equal(results[0].valid[..., 0], results[0].counted[..., 0])
    # Unrolled blocks continue their chain: a block's valid slots need a chain correct before it.
    for parent, child in itertools.pairwise(results[1:]):
        assert not (child.valid[..., 0] & ~parent.through.any(-1)).any()
    out = module.losses(results)
    assert out["loss"].requires_grad and torch.isfinite(out["loss"])


def test_short_fit_learns_and_exports(dirs, tmp_path):
    module = SpecBlockTraining(
        target=str(dirs / "target"), max_anchors=8, lr=3e-3, warmup_steps=1, export_dir=str(tmp_path / "hf")
    )
    # The rank part of the loss grows harder as the drafts improve (the target's token moves out of the >10
    # class), so the distillation part is what must fall.
    kl: list[float] = []
    losses_of = module.losses

    def recording(results):
        out = losses_of(results)
        if module.training:
            kl.append(float(out["kl"].detach()))
        return out

    module.losses = recording
    losses = fit_recording_losses(module, text_data(dirs, max_length=96), max_steps=15)
    assert len(losses) == len(kl) == 15 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(kl[-3:]) / 3 < sum(kl[:3]) / 3
    module.eval()
    module.on_validation_epoch_start()
    with torch.no_grad():
        module.accumulate_depth_metrics(module.unroll(next(iter(module.trainer.datamodule.val_dataloader()))))
    table = module.depth_table()
    assert len(table["valid"]) == 3 and len(table["valid"][0]) == K
    assert table["valid"][0][0] == 1.0  # slot 0 of a context block has an empty chain before it

    assert module.target.layer_ids == [1, 3, 4]
    assert not any(p.requires_grad for p in module.target.parameters())
    assert not any(k.startswith("target.") for k in module.state_dict())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["SpecBlockDraftModel"]
    assert config["specblock_config"] == {
        "block_size": K,
        "target_layer_ids": [1, 3, 4],
        "rank_class_bounds": [1, 4, 10],
        "rank_hidden_size": 256,
    }
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(module.drafter.state_dict())
    loaded = SpecBlockDraftModel.from_pretrained(str(tmp_path / "hf"))
    for (k, v), (k2, v2) in zip(module.drafter.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2), k


def test_target_too_shallow_is_a_clear_error(tmp_path):
    make_tiny_target(tmp_path / "small", num_layers=2)
    with pytest.raises(UserError, match="at least 4 layers"):
        SpecBlockTraining(target=str(tmp_path / "small")).configure_model()


def test_forward_drafts_for_a_real_target_end_to_end():
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(qwen3_config()).eval()
    model = SpecBlockDraftModel(build_config(target.config)).eval()
    ids = torch.randint(0, 97, (1, 10))
    hidden = target(ids, output_hidden_states=True).hidden_states
    feats = torch.cat([hidden[i + 1] for i in model.target_layer_ids], dim=-1)[:, :9]
    embed = target.get_input_embeddings()
    cache = DynamicCache(config=model.config)
    ctx = model(model.project_features(feats), embed(ids[:, :9]), torch.arange(9)[None], past_key_values=cache)
    visible = torch.zeros(1, 1, 9 * K, dtype=torch.bool)
    visible[..., : 8 * K + 1] = True
    block = model(
        ctx[:, 8:9, 0], embed(ids[:, 9:10]), torch.tensor([[9]]), launch_mask(visible, K), past_key_values=cache
    )
    normed = model.norm(block)
    logprobs = torch.log_softmax(target.lm_head(normed), dim=-1)
    assert logprobs.shape == (1, 1, K, 97)
    assert model.rank_logits(normed, logprobs).shape == (1, 1, K, 4)
