"""SpecBlock: masks, layer shift, rank classes, cache parity, the training unroll and each of its mechanisms
(alignment, launches, validity, rank-loss terms, own head), a short fit, export."""

import itertools
import json
import types

import pytest
import torch
from conftest import fit_recording_losses, make_target_dirs, make_tiny_target, qwen3_config, text_data
from safetensors import safe_open
from transformers import DynamicCache, Qwen3ForCausalLM

from trainer.data.features import with_features
from trainer.drafters.common import eagle3_layer_ids
from trainer.drafters.specblock import (
    SpecBlockDraftModel,
    build_config,
    context_mask,
    launch_mask,
    rank_class,
    token_rank,
)
from trainer.errors import UserError
from trainer.losses import draft_teacher, forward_kl_topk, soft_cross_entropy_and_kl
from trainer.training.specblock import SpecBlockTraining
from trainer.training.specblock_losses import (
    asymmetric_ordinal_targets,
    choose_launch_slots,
    class_balance_weights,
    correct_through,
    distance_weights,
    ordinal_targets,
    uniform_launch_slots,
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
    assert eagle3_layer_ids(8, "SpecBlock") == [1, 3, 4]
    assert eagle3_layer_ids(36, "SpecBlock") == [1, 17, 32]  # Qwen3-8B: HF hidden_states 2, 18, 33
    assert eagle3_layer_ids(32, "SpecBlock") == [1, 15, 28]  # Llama-3.1-8B: HF hidden_states 2, 16, 29
    with pytest.raises(UserError, match=r"SpecBlock reads .* at least 4 layers"):
        eagle3_layer_ids(3, "SpecBlock")
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
    # With a draft vocabulary the drafter owns its head and EAGLE-3's d2t / t2d buffers.
    own = SpecBlockDraftModel(build_config(qwen3_config(8), draft_vocab_size=40))
    assert own.lm_head.weight.shape == (40, H) and own.d2t.shape == (40,) and own.t2d.shape == (97,)
    assert {"lm_head.weight", "d2t", "t2d"} <= set(own.state_dict())
    with pytest.raises(UserError, match="alignment"):
        build_config(qwen3_config(8), alignment="previous")


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


def test_first_layer_input_is_fuse_of_condition_token_and_slot_query():
    """Slot k of a block enters the layers as ``fuse(concat[condition_norm(c), token_norm(E[x]), query_norm(q_k)])``
    (the forward computes it as three per-part maps broadcast over slots)."""
    model = drafter_for()
    features, tokens, positions = random_inputs(3)
    condition = model.project_features(features)
    seen = []
    model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    model(condition, tokens, positions)
    parts = [
        model.condition_norm(condition)[:, :, None].expand(1, 3, K, H),
        model.token_norm(tokens)[:, :, None].expand(1, 3, K, H),
        model.query_norm(model.slot_queries)[None, None].expand(1, 3, K, H),
    ]
    assert torch.allclose(seen[0], model.fuse(torch.cat(parts, dim=-1)), atol=1e-6)


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


def test_asymmetric_smoothing_leans_towards_higher_classes():
    soft = asymmetric_ordinal_targets(torch.tensor([0, 1, 3]), 4)
    assert torch.allclose(soft.sum(-1), torch.ones(3))
    # t = 0: kernel 1, 1/4, 1/9, 1/16 (only classes above); t = 3: 1/49, 1/25, 1/9, 1 (classes below, steeper).
    raw0 = torch.tensor([1, 1 / 4, 1 / 9, 1 / 16])
    raw3 = torch.tensor([1 / 49, 1 / 25, 1 / 9, 1])
    assert torch.allclose(soft[0], raw0 / raw0.sum()) and torch.allclose(soft[2], raw3 / raw3.sum())
    # From class 1, the class above gets more mass than the class below at the same distance.
    assert soft[1, 2] > soft[1, 0] and soft[1].argmax() == 1


def test_distance_weight_costs_under_prediction_more():
    predicted = torch.tensor([1, 0, 2, 3, 1])
    true = torch.tensor([1, 2, 0, 0, 3])
    assert distance_weights(predicted, true).tolist() == [1.0, 5.0, 3.0, 4.0, 5.0]


def test_class_balance_caps_frequent_classes_per_slot():
    # Slot 0: 20 of class 0, 2 of class 3; slot 1: 4 of class 0 (a separate count); one masked-out sample.
    slot = torch.tensor([0] * 22 + [1] * 4 + [0])
    classes = torch.tensor([0] * 20 + [3] * 2 + [0] * 4 + [0])
    mask = torch.tensor([True] * 26 + [False])
    w = class_balance_weights(slot, classes, mask, budget=10, num_slots=2, num_classes=4)
    assert torch.allclose(w[:20], torch.full((20,), 0.5)) and torch.allclose(w[20:26], torch.ones(6))
    assert w[26] == 0


def test_uniform_launch_slots_cover_every_slot():
    g = torch.Generator().manual_seed(0)
    slots = uniform_launch_slots(torch.Size([50, 40]), K, g)
    counts = torch.bincount(slots.flatten(), minlength=K)
    assert counts.sum() == 2000 and (counts > 400).all()


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


def training_module(dirs, **kwargs) -> tuple[SpecBlockTraining, dict]:
    """A configured module (its draft vocabulary from the text data when it has one) and a training batch."""
    module = SpecBlockTraining(target=str(dirs / "target"), **{"draft_vocab_size": None, **kwargs})
    data = text_data(dirs, max_length=96)
    data.setup("fit")
    module._trainer = types.SimpleNamespace(datamodule=data)
    module.configure_model()
    module._trainer = None
    return module, next(iter(data.train_dataloader()))


def fixed_drafts(module: SpecBlockTraining, token: int, rank_class_of: int = 0) -> None:
    """Make the drafter's argmax ``token`` at every slot and its rank head predict ``rank_class_of``."""
    drafter = module.drafter
    v = drafter.lm_head.out_features if drafter.lm_head is not None else module.target.config.vocab_size

    def logits(normed, head):
        out = torch.zeros(*normed.shape[:-1], v) + 0 * normed.sum(-1, keepdim=True)
        out[..., token] = 10.0
        return out

    def rank_logits(normed, logprobs):
        out = torch.zeros(*normed.shape[:-1], 4)
        out[..., rank_class_of] = 5.0
        return out + 0 * normed.sum(-1, keepdim=True)

    drafter.logits = logits
    drafter.rank_logits = rank_logits


def test_unroll_shapes_and_teacher_launches(dirs, monkeypatch):
    module, batch = training_module(dirs)
    b, t = batch["input_ids"].shape
    embedded = []
    embed = module.target.embed_tokens

    def recording(ids):
        embedded.append(ids)
        return embed(ids)

    monkeypatch.setattr(type(module.target), "embed_tokens", property(lambda self: recording))
    results = module.unroll(batch)
    assert len(results) == 3
    v = module.target.config.vocab_size
    rows = torch.arange(t).expand(b, t)
    # Block-1 alignment: the context block of row i drafts from token x_{i+1}.
    assert torch.equal(results[0].start, rows + 1)
    assert torch.equal(embedded[0], batch["input_ids"].gather(1, (rows + 1).clamp(max=t - 1)))
    for parent, child, tokens in zip(results, results[1:], embedded[1:], strict=False):
        # Every position launches, from a slot j: the new block's token sits at the label row of slot j, and it
        # is the data token there (teacher forcing), not the drafter's argmax.
        assert child.hidden.shape == (b, t, K, H)
        j = child.start - parent.start - 1
        assert ((j >= 0) & (j < K)).all() and len(set(j.flatten().tolist())) == K
        assert torch.equal(tokens, batch["input_ids"].gather(1, child.start.clamp(max=t - 1)))
    for r in results:
        m = int(r.counted.sum())
        assert r.logits.shape == (m, v) and r.rank_logits.shape == (m, 4) and r.kl.shape == (m,)
        assert torch.equal(r.kl_mask, r.valid[r.counted.nonzero(as_tuple=True)])
    # No filter between blocks: slot 0 of a launched block counts whatever the chain before it drafted.
    for r in results:
        assert torch.equal(r.valid[..., 0], r.counted[..., 0])
    out = module.losses(results)
    assert out.loss.requires_grad and torch.isfinite(out.loss)


def test_draft_launches_carry_the_chain(dirs):
    module, batch = training_module(dirs, launch="draft", max_anchors=5, alignment="same", validity="data")
    b, t = batch["input_ids"].shape
    results = module.unroll(batch)
    assert torch.equal(results[0].start, torch.arange(t).expand(b, t))
    for r in results[1:]:
        assert r.hidden.shape == (b, 5, K, H) and r.draft.shape == r.valid.shape == r.through.shape == (b, 5, K)
    # Slot 0 of every counted context block is valid: nothing comes before it in its chain.
    assert torch.equal(results[0].valid[..., 0], results[0].counted[..., 0])
    # Unrolled blocks continue their chain: a block's valid slots need a chain correct before it.
    for parent, child in itertools.pairwise(results[1:]):
        assert not (child.valid[..., 0] & ~parent.through.any(-1)).any()


@pytest.mark.parametrize("validity", ["teacher", "data"])
def test_validity_compares_with_the_teachers_argmax_or_the_data(dirs, validity):
    module, batch = training_module(dirs, validity=validity, num_blocks=1)
    batch = with_features(batch, module.target, 32)
    # The teacher's argmax is token 7 everywhere, the data never is; the drafter always drafts 7.
    batch["teacher_topk_ids"][..., 0] = 7
    batch["input_ids"] = torch.where(batch["input_ids"] == 7, 8, batch["input_ids"])
    fixed_drafts(module, 7)
    r = module.unroll(batch)[0]
    if validity == "teacher":
        assert torch.equal(r.valid, r.counted)  # every draft is the token the target would accept
    else:
        assert torch.equal(r.valid[..., 0], r.counted[..., 0]) and not r.valid[..., 1:].any()


def test_rank_chain_runs_to_the_first_misprediction(dirs):
    module, batch = training_module(dirs, num_blocks=1)
    batch = with_features(batch, module.target, 32)
    # The drafter drafts 7 with the rank head saying class 0 (rank 1). The teacher's token is 7 (class 0) at
    # slots whose teacher row is even and 8 (rank 2: class 1) at odd rows, so the head is wrong at odd rows.
    t = batch["input_ids"].shape[1]
    batch["teacher_topk_ids"][..., 0] = torch.where(torch.arange(t) % 2 == 0, 7, 8)
    fixed_drafts(module, 7)
    r = module.unroll(batch)[0]
    where = r.counted.nonzero(as_tuple=True)
    assert torch.equal(r.rank_target, (r.start[..., None] + torch.arange(K))[where] % 2)
    dense = torch.zeros_like(r.counted)
    dense[where] = r.rank_mask
    # Context block at row i, slot k has teacher row i+1+k: the first wrong slot is included, later ones are not.
    wrong_first = (r.start[..., None] + torch.arange(K)) % 2 == 1
    expected = r.counted & ~(torch.cumsum(wrong_first.long(), -1) - wrong_first.long()).bool()
    assert torch.equal(dense, expected)
    module.rank_chain = False
    r = module.unroll(batch)[0]
    assert torch.equal(r.rank_mask, r.kl_mask)


def test_rank_loss_terms(dirs):
    module, batch = training_module(dirs, num_blocks=1)
    r = module.unroll(batch)[0]
    # All four terms off: the mean symmetric-smoothed cross-entropy over the valid slots.
    module.rank_smoothing, module.rank_distance_weight, module.rank_class_budget, module.rank_chain = (
        0.1,
        False,
        0,
        False,
    )
    r = module.unroll(batch)[0]
    ce = -(ordinal_targets(r.rank_target, 4, 0.1) * r.rank_logits.log_softmax(-1)).sum(-1)
    assert torch.allclose(module.rank_loss(r), ce[r.rank_mask].mean())
    # The distance weight multiplies each sample by its under-/over-prediction weight.
    module.rank_distance_weight = True
    w = distance_weights(r.rank_logits.argmax(-1), r.rank_target)
    assert torch.allclose(module.rank_loss(r), (ce * w)[r.rank_mask].mean())
    # Class balancing weighs each sample by its (slot, class) count in the block.
    module.rank_distance_weight, module.rank_class_budget, module.rank_smoothing = False, 3, "asymmetric"
    soft = asymmetric_ordinal_targets(r.rank_target, 4)
    ce = -(soft * r.rank_logits.log_softmax(-1)).sum(-1)
    bal = class_balance_weights(r.slot, r.rank_target, r.rank_mask, 3, K, 4)
    assert torch.allclose(module.rank_loss(r), (ce * bal).sum() / bal.sum())


def test_own_head_starts_from_the_targets_rows_and_restricts_the_teacher(dirs):
    module, batch = training_module(dirs, draft_vocab_size=48)
    drafter = module.drafter
    rows = drafter.to_target(torch.arange(48))
    assert torch.equal(drafter.lm_head.weight, module.target.lm_head.weight[rows])
    assert int(drafter.t2d.sum()) == 48 and not torch.equal(drafter.d2t, torch.zeros(48, dtype=torch.long))
    batch = with_features(batch, module.target, 32)
    results = module.unroll(batch)
    for r in results:
        assert r.logits.shape[-1] == 48
        # A slot whose teacher's top token has no draft id carries no loss.
        t = batch["input_ids"].shape[1]
        teacher_row = (r.start[..., None] + torch.arange(K)).clamp(max=t - 1)
        top = batch["teacher_topk_ids"][..., 0].gather(1, teacher_row.flatten(1)).view(teacher_row.shape)
        assert not (r.counted & ~drafter.t2d[top]).any()
    assert torch.isfinite(module.losses(results).loss)


def assert_same_gradients(first: tuple, second: tuple) -> None:
    """The same parameters got a gradient (``None``: unused) and the gradients agree."""
    for a, b in zip(first, second, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("draft_vocab_size", [None, 48])
def test_head_gradient_from_valid_slots_equals_the_full_heads(dirs, draft_vocab_size):
    """The unroll runs the LM head with gradient on the valid slots only; its KL (M,) must equal, in value and in
    gradient, the KL of a head run with gradient on all M slots and masked to the valid ones."""
    module, batch = training_module(dirs, draft_vocab_size=draft_vocab_size)
    drafter = module.drafter
    torch.manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = with_features(batch, module.target, module.topk)
    results = module.unroll(batch)
    assert any(not r.kl_mask.all() and r.kl_mask.any() for r in results)
    params = [p for p in drafter.parameters() if p.requires_grad]
    kept, full = [], []
    for r in results:
        # Every counted slot is headed: under teacher launches no chain is dropped between blocks.
        where = r.counted.nonzero(as_tuple=True)
        assert r.kl_mask.numel() == where[0].numel()
        logits = drafter.logits(drafter.norm(r.hidden[where]), module.target.lm_head)
        assert torch.allclose(logits.detach(), r.logits, atol=1e-5)
        t = batch["input_ids"].shape[1]
        # The teacher of slot k sits one row before its label x_{start+1+k}.
        rows = (r.start[..., None] + torch.arange(K)).clamp(max=t - 1)[where]
        ids, lp = batch["teacher_topk_ids"][where[0], rows], batch["teacher_topk_logprobs"][where[0], rows]
        if drafter.lm_head is None:
            kl = forward_kl_topk(logits, ids, lp)
        else:
            kl = soft_cross_entropy_and_kl(logits, *draft_teacher(ids, lp, drafter.draft_vocab))[1]
        assert torch.allclose(kl.detach(), r.kl.detach(), atol=1e-5)
        kept.append((r.kl * r.kl_mask).sum())
        full.append((kl * r.kl_mask).sum())
    fast = torch.autograd.grad(sum(kept), params, allow_unused=True, retain_graph=True)
    slow = torch.autograd.grad(sum(full), params, allow_unused=True)
    assert_same_gradients(fast, slow)


@pytest.mark.parametrize(("launch", "max_anchors"), [("teacher", None), ("draft", 5)])
def test_chunked_launches_equal_one_forward(dirs, launch, max_anchors):
    """Launching in chunks of anchors, each over the keys its anchors can see, gives the losses and gradients of
    one forward over all keys."""
    module, batch = training_module(dirs, launch=launch, max_anchors=max_anchors, launch_chunks=1)
    batch = with_features(batch, module.target, module.topk)
    params = [p for p in module.drafter.parameters() if p.requires_grad]
    outs = []
    for chunks in (1, 3):
        module.launch_chunks = chunks
        results = module.unroll(batch)
        loss = module.losses(results).loss
        outs.append((loss, [r.valid for r in results], torch.autograd.grad(loss, params, allow_unused=True)))
    (loss_1, valid_1, grads_1), (loss_3, valid_3, grads_3) = outs
    assert torch.allclose(loss_1, loss_3, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(valid_1, valid_3, strict=True))
    assert_same_gradients(grads_1, grads_3)


def test_short_fit_learns_and_exports(dirs, tmp_path):
    module = SpecBlockTraining(
        target=str(dirs / "target"),
        draft_vocab_size=64,
        max_anchors=16,
        lr=3e-3,
        warmup_steps=1,
        export_dir=str(tmp_path / "hf"),
    )
    # The valid prefix grows as the drafts improve and lets harder slots into the KL mean, so the KL of slot 0 of
    # the context blocks (always valid, the same slots at every step) is what must fall.
    kl: list[float] = []
    losses_of = module.losses

    def recording(results):
        out = losses_of(results)
        if module.training:
            first = results[0]
            kl.append(float(first.kl[(first.slot == 0) & first.kl_mask].mean().detach()))
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
    # Slot 0 of every block has an empty chain before it (the chain restarts in every block).
    assert all(row[0] == 1.0 for row in table["valid"])

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
        "alignment": "next",
        "draft_vocab_size": 64,
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
    model = SpecBlockDraftModel(build_config(target.config, draft_vocab_size=50)).eval()
    ids = torch.randint(0, 97, (1, 10))
    hidden = target(ids, output_hidden_states=True).hidden_states
    feats = torch.cat([hidden[i + 1] for i in model.target_layer_ids], dim=-1)[:, :9]
    embed = target.get_input_embeddings()
    cache = DynamicCache(config=model.config)
    # `next` alignment: f_i pairs with x_{i+1}, so the last context block (f_8, x_9 = the root) is the root block.
    ctx = model(model.project_features(feats), embed(ids[:, 1:]), torch.arange(1, 10)[None], past_key_values=cache)
    normed = model.norm(ctx[:, -1])
    logprobs = torch.log_softmax(model.logits(normed, target.lm_head), dim=-1)
    assert logprobs.shape == (1, K, 50)
    assert model.rank_logits(normed, logprobs).shape == (1, K, 4)
    visible = torch.zeros(1, 1, 9 * K, dtype=torch.bool)
    visible[..., : 8 * K + 2] = True
    block = model(ctx[:, 8:9, 1], embed(ids[:, 9:10]), torch.tensor([[11]]), launch_mask(visible, K), cache)
    assert block.shape == (1, 1, K, H)
