"""The ``treeflash-chain`` builder: TreeFlash's chain, each depth's argmax given the token drafted before it (what
vLLM serves of a ``--format treeflash`` export; trainer/integrations/vllm/treeflash.py)."""

import pytest
import torch
from conftest import qwen3_config
from transformers import Qwen3ForCausalLM

from trainer.decoding.builders import BUILDERS, make_session
from trainer.decoding.engine import generate
from trainer.drafters.dflash import DFlashDraftModel, build_config
from trainer.drafters.treeflash import TreeFlashDraftModel
from trainer.errors import UserError
from trainer.evaluate import build_parser

VOCAB = 12


@pytest.fixture(scope="module")
def models():
    """A random target over 12 tokens with peaked distributions, a DFlash drafter of block 6 and a TreeFlash
    drafter over that backbone with a non-zero approximator."""
    torch.manual_seed(5)
    config = qwen3_config(4, vocab_size=VOCAB, tie_word_embeddings=False)
    target = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)
    dflash = DFlashDraftModel(build_config(config, 1, 6, mask_token_id=11)).eval()
    treeflash = TreeFlashDraftModel.from_dflash(dflash).eval()
    torch.nn.init.normal_(treeflash.ar_approximation.d.weight, std=0.5)
    return target, dflash, treeflash


def started(target, drafter, tree: str, prompt: torch.Tensor):
    """A fresh session of ``tree`` after ``prompt``'s prefill, and the prefill's next token (the root)."""
    session = make_session(tree, target, drafter)
    with torch.no_grad():
        out = target(input_ids=prompt[None], output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1][0] for i in session.layer_ids], dim=-1)
    session.start(prompt, features, out.logits[0])
    return session, int(out.logits[0, -1].argmax())


@torch.no_grad()
def test_each_depth_is_the_argmax_given_the_token_drafted_before_it(models):
    """Checked against TreeFlash's stage-two tables, computed batched for every (depth, previous token) pair by
    another code path: with the whole vocabulary as candidates, the chain's token at depth d is the top
    transition of depth d from the chain's token at d - 1 (depth 1: from the root). For every root."""
    target, _, treeflash = models
    prompt = torch.tensor([1, 5, 7, 2, 9, 4, 3, 8])
    session, _ = started(target, treeflash, "treeflash-chain", prompt)
    tables_session, _ = started(target, treeflash, "treeflash", prompt)
    wiring_shows = 0
    for root in range(treeflash.mask_token_id):
        drafted = session.chain(root, 5).tolist()
        tables = tables_session.transitions(root, 5, top_m=VOCAB, top_k=1)
        normed = treeflash.backbone(**_block_inputs(target, treeflash, prompt, root, 5))[1][0]
        # Shape: (D + 1, V) every slot's tokens in the marginals' order: slot d's are depth d + 1's table rows.
        marginal_top = target.lm_head(normed).topk(VOCAB, dim=-1).indices.tolist()
        expected, previous = [], root
        for d in range(5):
            previous = int(tables.tokens[d, marginal_top[d].index(previous) if d else 0, 0])
            expected.append(previous)
        assert drafted == expected, root
        # Wrong wirings: every depth conditioned on the root, or DFlash's marginal argmax.
        on_root = [int(tables.tokens[d, marginal_top[d].index(root) if d else 0, 0]) for d in range(5)]
        wiring_shows += drafted != on_root and drafted != target.lm_head(normed[1:]).argmax(-1).tolist()
    assert wiring_shows >= 3, "the drafters would not tell a wrong previous-token wiring apart"


def _block_inputs(target, treeflash, prompt: torch.Tensor, root: int, depth: int) -> dict:
    """The backbone's inputs for the block ``[root, MASK x depth]`` after ``prompt``, without a cache."""
    with torch.no_grad():
        out = target(input_ids=prompt[None], output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1][0] for i in treeflash.target_layer_ids], dim=-1)
    block = torch.full((1, depth + 1), treeflash.mask_token_id)
    block[0, 0] = root
    return {
        "noise_embedding": target.get_input_embeddings()(block),
        "target_hidden": features[None],
        "position_ids": torch.arange(prompt.numel() + depth + 1)[None],
    }


@torch.no_grad()
def test_the_chain_decodes_like_the_target_and_differs_from_dflash_s(models):
    target, dflash, treeflash = models
    prompt = torch.tensor([1, 5, 7, 2, 9, 4, 3, 8])
    plain = generate(target, make_session("none", target, None), BUILDERS["none"], prompt, 24, 0).tokens
    ours = generate(target, make_session("treeflash-chain", target, treeflash), BUILDERS["treeflash-chain"], prompt,
                    24, 5)  # fmt: skip
    backbone = generate(target, make_session("chain", target, dflash), BUILDERS["chain"], prompt, 24, 5)
    assert ours.tokens == plain == backbone.tokens
    assert all(s.tree_size <= 5 for s in ours.steps)
    assert [s.accepted for s in ours.steps] != [s.accepted for s in backbone.steps]
    # With a zero approximator TreeFlash's chain is DFlash's.
    identity = TreeFlashDraftModel.from_dflash(dflash).eval()
    same = generate(target, make_session("treeflash-chain", target, identity), BUILDERS["treeflash-chain"], prompt,
                    24, 5)  # fmt: skip
    assert [s.accepted for s in same.steps] == [s.accepted for s in backbone.steps]


def test_eval_lists_the_builder_and_it_needs_a_treeflash_drafter(models):
    target, dflash, _ = models
    assert "treeflash-chain" in build_parser().format_help()
    with pytest.raises(UserError, match="needs a TreeFlash drafter"):
        make_session("treeflash-chain", target, dflash)
