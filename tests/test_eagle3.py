import json

import lightning as L
import pytest
import torch
from conftest import fit_recording_losses, make_target_dirs, make_tiny_target, qwen3_config, text_data
from safetensors import safe_open
from transformers import Qwen3Config

from trainer.data.features import with_features
from trainer.drafters.eagle3 import Eagle3DraftModel, build_config
from trainer.drafters.vocab import DraftVocab
from trainer.errors import UserError
from trainer.losses import draft_teacher, soft_cross_entropy_and_kl
from trainer.training.eagle3 import Eagle3Training
from trainer.training.eagle3_losses import ttt_mask_rule, ttt_step

SGLANG_KEYS = {
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


def target_config(num_layers: int = 8) -> Qwen3Config:
    return qwen3_config(num_layers, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def drafter(draft_vocab_size: int = 40, seed: int = 0) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    return Eagle3DraftModel(build_config(target_config(), draft_vocab_size)).eval()


def random_inputs(t: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, t, 32, generator=g), torch.randn(1, t, 32, generator=g), torch.arange(t)[None]


def test_parameter_names_shapes_and_config_follow_sglang(tmp_path):
    model = drafter()
    assert set(model.state_dict()) == SGLANG_KEYS
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["midlayer.self_attn.q_proj.weight"] == (32, 64)  # q/k/v read concat[embedding, hidden]
    assert shapes["midlayer.self_attn.k_proj.weight"] == (16, 64)  # 2 kv heads x head_dim 8
    assert shapes["fc.weight"] == (32, 96)
    assert shapes["lm_head.weight"] == (40, 32)
    assert shapes["d2t"] == (40,) and shapes["t2d"] == (97,)
    # The outputs of layers [1, L//2 - 1, L - 4] of an 8-layer target = HF hidden_states [2, L//2, L-3].
    assert model.target_layer_ids == [1, 3, 4] and model.aux_layer_ids == [2, 4, 5]

    model.save_pretrained(tmp_path / "e3")
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 40
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}  # SGLang's convention
    assert config["rope_theta"] == 1e6  # the legacy key engines on transformers 4.x read
    with safe_open(str(tmp_path / "e3" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == SGLANG_KEYS


def test_bad_configs_are_clear_errors():
    with pytest.raises(UserError, match="draft_vocab_size"):
        build_config(target_config(), 98)
    with pytest.raises(UserError, match=r"within the target's layers 0\.\.7"):
        build_config(target_config(), 40, target_layer_ids=[1, 3, 8])
    with pytest.raises(UserError, match="three target layers"):
        build_config(target_config(), 40, target_layer_ids=[1, 3])
    with pytest.raises(UserError, match=r"EAGLE-3 reads .* at least 4 layers"):
        build_config(target_config(num_layers=3), 40)


def test_one_call_equals_two_calls_through_the_kv_cache():
    model = drafter()
    hidden, embeds, pos = random_inputs(9)
    with torch.no_grad():
        whole = model(hidden, embeds, pos)
        cache = model.make_cache()
        first = model(hidden[:, :5], embeds[:, :5], pos[:, :5], past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 5
        # Reading the cache without use_cache leaves it as it was (tree candidates that will be dropped).
        peek = model(hidden[:, 5:], embeds[:, 5:], pos[:, 5:], past_key_values=cache)
        assert cache.get_seq_length() == 5
        second = model(hidden[:, 5:], embeds[:, 5:], pos[:, 5:], past_key_values=cache, use_cache=True)
        assert cache.get_seq_length() == 9
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(peek, second, rtol=0, atol=0)


def test_causal_and_tree_masks_hide_what_they_should():
    model = drafter()
    hidden, embeds, pos = random_inputs(6)
    changed_hidden, changed_embeds = hidden.clone(), embeds.clone()
    changed_hidden[:, 4] += 1.0
    changed_embeds[:, 4] += 1.0
    with torch.no_grad():
        out = model(hidden, embeds, pos)
        out2 = model(changed_hidden, changed_embeds, pos)
    assert torch.equal(out[:, :4], out2[:, :4]) and not torch.allclose(out[:, 4:], out2[:, 4:])

    # A tree: 0-1-2 a path; 3 and 4 children of 1 (siblings); 5 child of 4. Node 5 must not see 2 or 3.
    parents = [-1, 0, 1, 1, 1, 4]
    allowed = torch.zeros(6, 6, dtype=torch.bool)
    for node, parent in enumerate(parents):
        allowed[node, node] = True
        while parent >= 0:
            allowed[node, parent] = True
            parent = parents[parent]
    mask = torch.zeros(6, 6).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
    depth_pos = torch.tensor([[0, 1, 2, 2, 2, 3]])
    for hidden_node in (2, 3):
        h2, e2 = hidden.clone(), embeds.clone()
        h2[:, hidden_node] += 1.0
        e2[:, hidden_node] += 1.0
        with torch.no_grad():
            a = model(hidden, embeds, depth_pos, attention_mask=mask)
            b = model(h2, e2, depth_pos, attention_mask=mask)
        assert torch.equal(a[:, 5], b[:, 5]) and torch.equal(a[:, 4], b[:, 4])
    with pytest.raises(ValueError, match="boolean"):
        model(hidden, embeds, depth_pos, attention_mask=allowed[None, None])


def test_unroll_steps_shift_inputs_labels_and_positions():
    # Token ids equal 100 + their index, so every gathered value names the index it came from.
    t = 12
    ids = 100 + torch.arange(t)[None]
    loss_mask = torch.ones(1, t, dtype=torch.long)
    position_ids = torch.arange(t)[None]
    doc_ids = torch.ones(1, t, dtype=torch.long)
    for i in range(4):
        step = ttt_step(ids, loss_mask, position_ids, doc_ids, i)
        assert step.tokens.shape == step.labels.shape == step.label_mask.shape == (1, t)
        for pos in range(t - 2 - i):
            assert step.tokens[0, pos] == 100 + pos + 1 + i  # fed x_{t+1+i}
            assert step.labels[0, pos] == 100 + pos + 2 + i  # predicts x_{t+2+i}
            assert step.teacher_index[0, pos] == pos + 1 + i  # the target's distribution over it
            assert step.positions[0, pos] == pos + i
        assert step.label_mask[0].tolist() == [p + 2 + i < t for p in range(t)]
        mask = ttt_mask_rule(doc_ids, i).dense()
        assert mask.shape == (1, 1, t, (i + 1) * t)


def test_unroll_respects_loss_mask_and_document_boundaries():
    # Two packed samples: positions 0-5 (loss on 3-5 only) and 6-9, then padding.
    doc_ids = torch.tensor([[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0]])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 0]])
    ids = torch.arange(12)[None]
    step0 = ttt_step(ids, loss_mask, position_ids, doc_ids, 0)
    assert step0.label_mask[0].nonzero().flatten().tolist() == [1, 2, 3, 6, 7]
    step1 = ttt_step(ids, loss_mask, position_ids, doc_ids, 1)
    assert step1.label_mask[0].nonzero().flatten().tolist() == [0, 1, 2, 6]
    assert step1.positions[0, 6] == 1  # positions restart per sample
    step2 = ttt_step(ids, loss_mask, position_ids, doc_ids, 2)
    assert step2.label_mask[0].nonzero().flatten().tolist() == [0, 1]

    allowed = ttt_mask_rule(doc_ids, 2).dense()[0, 0]
    t = 12
    # Step 0 keys: causal within the sample; steps 1..2: the query's own position only.
    assert allowed[7, :t].nonzero().flatten().tolist() == [6, 7]
    assert allowed[3, :t].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert allowed[7, t:].nonzero().flatten().tolist() == [7, t + 7]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    config = make_target_dirs(root, 12)
    torch.manual_seed(0)
    Eagle3DraftModel(build_config(config, 256)).save_pretrained(root / "drafter")
    return root


def packed_batch(vocab_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "input_ids": torch.randint(0, vocab_size, (1, 14), generator=g),
        "loss_mask": torch.ones(1, 14, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5]]),
        "doc_ids": torch.tensor([[1] * 8 + [2] * 6]),
    }


def loaded_module(dirs, ttt_steps: int = 4) -> Eagle3Training:
    module = Eagle3Training(target=str(dirs / "target"), init_from=str(dirs / "drafter"), ttt_steps=ttt_steps)
    module.configure_model()
    return module.eval()


def test_unroll_equals_chain_drafting_through_the_cache(dirs):
    """Step i at origin t equals drafting i tokens ahead at inference: prefix 0..t on target features, then a
    chain of the drafter's own outputs with the true next tokens, each appended to the cache."""
    module = loaded_module(dirs)
    model = module.drafter
    batch = with_features(packed_batch(model.config.vocab_size), module.target, 4)
    with torch.no_grad():
        outputs, _ = module.unroll(batch)
        for origin in (3, 9):
            start = 0 if origin < 8 else 8
            span = slice(start, origin + 1)
            ids = batch["input_ids"]
            cache = model.make_cache()
            hidden = model(
                model.fuse(batch["features"][:, span]),
                module.target.embed_tokens(ids[:, start + 1 : origin + 2]),
                batch["position_ids"][:, span],
                past_key_values=cache,
                use_cache=True,
            )[:, -1:]
            torch.testing.assert_close(hidden[:, 0], outputs[0][:, origin], rtol=1e-5, atol=1e-5)
            for i in range(1, 4):
                if origin + 2 + i >= (8 if origin < 8 else 14):
                    break
                embeds = module.target.embed_tokens(ids[:, origin + 1 + i : origin + 2 + i])
                position = batch["position_ids"][:, origin : origin + 1] + i
                hidden = model(hidden, embeds, position, past_key_values=cache, use_cache=True)
                torch.testing.assert_close(hidden[:, 0], outputs[i][:, origin], rtol=1e-5, atol=1e-5)


def test_valid_positions_ignore_the_other_packed_sample(dirs):
    module = loaded_module(dirs)
    batch = packed_batch(module.drafter.config.vocab_size)
    other = {**batch, "input_ids": batch["input_ids"].clone()}
    other["input_ids"][:, 8:] = (other["input_ids"][:, 8:] + 5) % module.drafter.config.vocab_size
    with torch.no_grad():
        a, steps = module.unroll(with_features(batch, module.target, 4))
        b, _ = module.unroll(with_features(other, module.target, 4))
    for out_a, out_b, step in zip(a, b, steps, strict=True):
        first = step.label_mask[0, :8]
        assert first.any()
        torch.testing.assert_close(out_a[0, :8][first], out_b[0, :8][first], rtol=0, atol=0)


def test_restricted_teacher_renormalises_over_the_draft_vocabulary():
    vocab = DraftVocab.from_counts(torch.tensor([0, 5, 9, 0, 7, 1]), 3)  # target ids 1, 2, 4
    teacher_ids = torch.tensor([[2, 3, 4]])
    teacher_lp = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    draft_ids, logp, in_vocab = draft_teacher(teacher_ids, teacher_lp, vocab)
    assert in_vocab.tolist() == [[True, False, True]]
    assert draft_ids[0, [0, 2]].tolist() == [1, 2]
    torch.testing.assert_close(logp.exp()[0, [0, 2]], torch.tensor([5 / 7, 2 / 7]))
    # A student equal to the restricted teacher: KL 0, cross-entropy = the teacher's entropy.
    student = torch.log(torch.tensor([[1e-9, 5 / 7, 2 / 7]]))
    ce, kl = soft_cross_entropy_and_kl(student, draft_ids, logp, in_vocab)
    entropy = -(5 / 7 * torch.log(torch.tensor(5 / 7)) + 2 / 7 * torch.log(torch.tensor(2 / 7)))
    torch.testing.assert_close(kl, torch.zeros(1), atol=1e-6, rtol=0)
    torch.testing.assert_close(ce, entropy[None], atol=1e-5, rtol=0)


def test_fit_learns_builds_the_vocabulary_and_exports_sglang_layout(dirs, tmp_path, capsys):
    module = Eagle3Training(
        target=str(dirs / "target"),
        draft_vocab_size=512,
        ttt_steps=3,
        lr=3e-3,
        warmup_steps=1,
        export_dir=str(tmp_path / "hf"),
    )
    data = text_data(dirs)
    losses = fit_recording_losses(module, data, max_steps=15, limit_val_batches=2)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    assert module.target.layer_ids == [1, 3, 4]
    # Validation fills the per-step table (3 unrolled steps) and prints it.
    L.Trainer(accelerator="cpu", logger=False, limit_val_batches=1, enable_progress_bar=False).validate(module, data)
    table = module.step_table()
    assert len(table["top1"]) == len(table["kl"]) == 3 and table["count"][0] > 0
    assert "per-step agreement" in capsys.readouterr().out

    # The draft vocabulary: the 512 most frequent loss-masked training tokens, in target-id order.
    counts = torch.zeros(module.drafter.config.vocab_size, dtype=torch.long)
    for row in data.train_dataloader().dataset:
        ids = torch.tensor(row["input_ids"])[torch.tensor(row["loss_mask"], dtype=torch.bool)]
        counts += torch.bincount(ids, minlength=counts.numel())
    vocab = module.drafter.draft_vocab
    assert int(vocab.t2d.sum()) == 512 and torch.equal(vocab.t2d, DraftVocab.from_counts(counts, 512).t2d)
    assert torch.equal(module.drafter.to_target(torch.arange(512)), vocab.t2d.nonzero().flatten())

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 512
    exported = Eagle3DraftModel.from_pretrained(str(tmp_path / "hf")).eval()
    for (k, v), (k2, v2) in zip(module.drafter.state_dict().items(), exported.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2), k
    hidden, embeds, pos = random_inputs(7)
    with torch.no_grad():
        assert torch.equal(
            exported.logits(exported(hidden, embeds, pos)), module.drafter.logits(module.drafter(hidden, embeds, pos))
        )
    assert not any(k.startswith("target.") for k in module.state_dict())


def test_drafter_of_another_target_is_a_clear_error(dirs, tmp_path):
    make_tiny_target(tmp_path / "small", num_layers=4)
    module = Eagle3Training(target=str(tmp_path / "small"), init_from=str(dirs / "drafter"))
    with pytest.raises(UserError, match=r"does not fit the target .*layers"):
        module.configure_model()


def test_a_new_drafter_needs_training_data_for_its_vocabulary(dirs):
    module = Eagle3Training(target=str(dirs / "target"), draft_vocab_size=64)
    with pytest.raises(UserError, match="draft vocabulary"):
        module.configure_model()
