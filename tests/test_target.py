import pytest
import torch
from conftest import TINY_TARGET

from trainer.errors import UserError
from trainer.target import Target


def manual_layer_outputs(model, input_ids):
    """Run Qwen3's stack by hand: embedding, then each decoder layer, recording every layer's output."""
    base = model.model
    h = base.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1])[None]
    cos_sin = base.rotary_emb(h, positions)
    outs = []
    for layer in base.layers:
        out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        h = out[0] if isinstance(out, tuple) else out
        outs.append(h)
    return outs, model.lm_head(base.norm(h))


def test_layer_ids_match_manual_forward_and_hf_convention(tiny_qwen3):
    ids = torch.randint(0, 97, (2, 11))
    target = Target(tiny_qwen3, [0, 2, 3])
    out = target(ids)
    manual, manual_logits = manual_layer_outputs(tiny_qwen3, ids)
    for lid, h in zip([0, 2, 3], out.hidden_states, strict=True):
        torch.testing.assert_close(h, manual[lid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, manual_logits, rtol=1e-5, atol=1e-5)
    hf = tiny_qwen3(input_ids=ids, output_hidden_states=True).hidden_states
    # HF convention: hidden_states[l + 1] is the output of layer l (the last entry is after the final norm).
    torch.testing.assert_close(out.hidden_states[0], hf[1])
    torch.testing.assert_close(out.hidden_states[1], hf[3])
    assert out.features.shape == (2, 11, 3 * 32)
    torch.testing.assert_close(out.features[..., 32:64], manual[2])


def test_order_duplicates_and_no_logits(tiny_qwen3):
    ids = torch.randint(0, 97, (1, 5))
    target = Target(tiny_qwen3, [3, 1, 3])
    out = target(ids, with_logits=False)
    assert out.logits is None
    manual, _ = manual_layer_outputs(tiny_qwen3, ids)
    torch.testing.assert_close(out.hidden_states[0], manual[3])
    torch.testing.assert_close(out.hidden_states[1], manual[1])
    torch.testing.assert_close(out.hidden_states[2], manual[3])


def test_target_is_frozen_and_stays_in_eval(tiny_qwen3):
    target = Target(tiny_qwen3, [1])
    assert not any(p.requires_grad for p in target.parameters())
    parent = torch.nn.ModuleDict({"target": target})
    parent.train()
    assert not target.training and not target.model.training
    out = target(torch.randint(0, 97, (1, 4)))
    assert not out.logits.requires_grad


def test_bad_layer_ids(tiny_qwen3):
    with pytest.raises(UserError, match=r"out of range: the target has layers 0..3"):
        Target(tiny_qwen3, [1, 4])


def test_shipped_target_loads_offline():
    target = Target.from_pretrained(str(TINY_TARGET), [1, 4, 7], dtype="float32")
    cfg = target.config
    assert cfg.model_type == "qwen3" and cfg.num_hidden_layers >= 8
    n_params = sum(p.numel() for p in target.model.parameters())
    assert 5e6 <= n_params <= 15e6
    ids = torch.tensor([[10, 20, 30, 40]])
    out = target(ids)
    assert out.features.shape == (1, 4, 3 * cfg.hidden_size)
    assert out.logits.shape == (1, 4, cfg.vocab_size)
    assert torch.isfinite(out.logits).all()


def test_missing_target_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="cannot load target"):
        Target.from_pretrained(str(tmp_path / "nope"), [0])


def test_grouped_sdpa_verifies_a_tree_as_sdpa_does_without_copying_the_cache(tiny_qwen3, monkeypatch):
    """A tree step on a cached prefix (several query tokens, an additive mask, 2 query heads per key/value head):
    the same logits bit for bit as transformers' ``sdpa``, and the cache is never copied per query head."""
    from transformers import DynamicCache
    from transformers.integrations import sdpa_attention

    from trainer.drafters.attention import additive_mask
    from trainer.target import GROUPED_SDPA

    copies = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda h, n: copies.append(n) or repeat_kv(h, n))
    prefix, tree = torch.randint(0, 97, (2, 9)), torch.randint(0, 97, (2, 4))
    # Node 0 is the root; 1 and 2 its children; 3 a child of 1. Every node sees the prefix.
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    visible = torch.cat([torch.ones(4, 9, dtype=torch.bool), ancestors], dim=1).expand(2, 1, 4, 13)
    positions = torch.tensor([9, 10, 10, 11]).expand(2, 4)
    logits = {}
    for name in ("sdpa", GROUPED_SDPA):
        tiny_qwen3.set_attn_implementation(name)
        copies.clear()
        cache = DynamicCache(config=tiny_qwen3.config)
        tiny_qwen3(input_ids=prefix, cache=cache, use_cache=True)
        mask = additive_mask(visible, torch.float32)
        logits[name] = tiny_qwen3(
            input_ids=tree, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True
        ).logits
        assert bool(copies) == (name == "sdpa")
    assert torch.equal(logits["sdpa"], logits[GROUPED_SDPA])
